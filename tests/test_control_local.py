"""`ckptsup save-now`, `ckptsup status` and `ckptsup stop` from another shell against a real `ckptsup launch`
(local mode: the real supervisor, agent, torchrun and 2 gloo ranks of examples/train.py, which
saves nothing on its own here): save-now commits a checkpoint at the next step boundary; stop
checkpoints, stops, exits 8 (CANCELLED) with the run cancelled; then the run is not live and a
request is one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hooks_helpers import base_env
from run_helpers import run_named, wait_for

from ckptsup.env import ExitStatus
from ckptsup.rundir import RunDir, RunStatus

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


def control(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CKPTSUP, *args], capture_output=True, text=True, timeout=60, env=base_env())


def test_save_now_status_then_stop_from_another_shell(tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    prom = tmp_path / "textfile" / "ckptsup-{job_id}.prom"
    prom.parent.mkdir()
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\n[checkpoint]\nadaptive_interval = false\n"
                   f"[report]\nprom_textfile = \"{prom}\"\n")
    launch = subprocess.Popen([*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
                               str(ROOT / "examples" / "train.py"), "--steps", "3000", "--step-sleep-s", "0.05",
                               "--out", str(tmp_path / "out")], cwd=tmp_path, env=base_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: run_named(run, "first_step"), 120, "the first step", launch)
        time.sleep(1.0)
        assert not run_named(run, "checkpoint_committed")   # nothing saves on its own in this run
        asked = control("save-now", str(run))
        assert asked.returncode == 0, asked.stdout + asked.stderr
        [ack] = run_named(run, "control")
        assert ack["outcome"] == "accepted" and f"(at step {ack['step']})" in asked.stdout
        [saved] = wait_for(lambda: run_named(run, "checkpoint_committed"), 120, "a checkpoint", launch)
        # the next step boundary the ranks agree on: after the step the supervisor had seen, within a second of steps
        assert ack["step"] <= saved["step"] <= ack["step"] + 20
        time.sleep(2.5)   # past one STATUS_EVERY_S: the status has the commit
        shown = control("status", "--json", str(run))
        assert shown.returncode == 0, shown.stderr
        st = json.loads(shown.stdout)
        node = st["active"][0]
        assert st["status"] == "running" and st["attempt"] == 0 and st["level"] == "hooks" and st["spares"] == []
        assert st["nodes"][node]["agent"] is True and st["nodes"][node]["ranks_alive"] == [0, 1]
        assert st["nodes"][node]["heartbeat_age_s"] < 5 and st["nodes"][node]["step"] >= saved["step"]
        assert st["nodes"][node]["step_p50_s"] >= 0.05   # each step sleeps 50 ms
        assert st["checkpoints"]["committed"]["step"] == saved["step"]
        assert "hang_min_s" in st["hang_why"] and st["hang_timeout_s"] > 0
        assert 0 < st["goodput"] <= 1 and st["next_save_in_s"] > 0
        live = (tmp_path / "textfile" / "ckptsup-local.prom").read_text()   # the live Prometheus textfile
        sample = re.compile(r'^ckptsup_[a-z_]+\{job_id="local"(,[a-z]+="[^"]*")*\} -?[0-9.e+-]+$')
        assert all(line.startswith("# ") or sample.match(line) for line in live.splitlines()), live
        assert re.search(r'^ckptsup_run_running\{job_id="local"\} 1$', live, re.M)
        assert re.search(r'^ckptsup_checkpoint_step\{job_id="local",tier="committed"\} ' + str(saved["step"]) + "$",
                         live, re.M)
        assert 0 < float(re.search(r"^ckptsup_goodput_ratio\{[^}]*\} (\S+)$", live, re.M).group(1)) <= 1
        table = control("status", str(run))
        assert table.returncode == 0 and "attempt 0" in table.stdout and node in table.stdout
        stopped = control("stop", str(run))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        output, _ = launch.communicate(timeout=120)
    finally:
        launch.kill()
    assert launch.returncode == ExitStatus.CANCELLED, output[-3000:]
    [cancelled] = run_named(run, "run_cancelled")
    last = run_named(run, "checkpoint_committed")[-1]
    # the stop's checkpoint resumes at the step after the last one run: nothing lost
    assert cancelled["saved"] is True and last["step"] > saved["step"] and last["step"] == cancelled["step"] + 1
    assert RunDir(path=run).load_state().status is RunStatus.CANCELLED
    assert not run_named(run, "requeue") and not run_named(run, "run_complete")
    ended = (tmp_path / "textfile" / "ckptsup-local.prom").read_text()   # the last one says the run ended
    assert re.search(r'^ckptsup_run_running\{job_id="local"\} 0$', ended, re.M)
    again = control("save-now", str(run))
    assert again.returncode != 0
    [line] = [x for x in again.stderr.splitlines() if x.strip()]
    assert "is not live (status cancelled)" in line
