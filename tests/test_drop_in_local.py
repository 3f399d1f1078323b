"""An unmodified torchrun script under `ckptsup launch` (local mode, real torchrun and gloo): no
hello, so it is supervised at the process level, and its own `step N` lines are progress lines.
Faults come from outside, as on a cluster: SIGKILL and SIGSTOP of a rank process."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ckptsup.events import read_events

from hooks_helpers import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
STEP_LINE = re.compile(rb"step (\d+) loss")


def named(events, name):
    return [e for e in events if e["event"] == name]


def ranks_of(ckpt_dir: Path) -> dict[int, psutil.Process]:
    """The script's rank processes of this test (by their checkpoint dir), by global rank."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if str(SCRIPT) in cmd and str(ckpt_dir) in cmd and "torch.distributed.run" not in " ".join(cmd):
            try:
                rank = p.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and "LOCAL_RANK" in p.environ():
                out[int(rank)] = p
    return out


def newest_step(run: Path) -> int:
    logs = sorted(run.glob("attempt-*/ranks-*.log"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not logs:
        return -1
    found = STEP_LINE.findall(logs[-1].read_bytes())
    return int(found[-1]) if found else -1


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def reference(tmp_path: Path, steps: int) -> dict:
    """The same script, uninterrupted, under plain torchrun."""
    out = tmp_path / "ref.pt"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(tmp_path / "ref-ckpt"), "--out", str(out), "--step-s", "0"]
    subprocess.run(argv, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    return torch.load(out)


def test_an_unmodified_ddp_script_survives_three_rank_sigkills_and_a_sigstop(tmp_path):
    """init_timeout_s = 2: the script says no hello, and is not killed for it. SIGKILL of rank 1
    at steps 15, 30 and 45 (crash, fast path, resume from the script's own checkpoint), SIGSTOP
    of rank 1 at step 60 (a hang, seen from rank 0's progress lines): rc 0, and the final model
    equals an uninterrupted run's."""
    steps = 80
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 2.0\nheartbeat_interval_s = 0.5\nhang_min_s = 8.0\n")
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
            str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "final.pt")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        for at, sig in ((15, signal.SIGKILL), (30, signal.SIGKILL), (45, signal.SIGKILL), (60, signal.SIGSTOP)):
            wait_for(lambda: newest_step(run) >= at, 120, f"step {at}")
            victim = ranks_of(ckpt)[1]
            victim.send_signal(sig)
            launches = len(named(read_events(run), "launch"))
            wait_for(lambda: len(named(read_events(run), "launch")) > launches, 60, f"the restart after step {at}")
        console, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console.decode()[-3000:]
    failures = named(events, "failure_detected")
    assert [f["kind"] for f in failures] == ["crash", "crash", "crash", "hang"], failures
    assert all(f["step"] is None or f["step"] > 0 for f in failures)   # only steps that were seen
    assert "process stopped" in failures[-1]["detail"] and failures[-1]["rank"] == 1
    assert not named(events, "give_up") and named(events, "run_complete")
    # each attempt: process level once the 2 s init allowance passed, progress level from its first line
    final_level = {e["attempt"]: e["level"] for e in named(events, "supervision_level")}
    assert final_level == {a: "progress" for a in range(5)}, final_level
    # the console of `ckptsup launch` shows rank 0's own lines
    assert b"step 80 loss" in console and b"resumed from step" in console
    final, ref = torch.load(tmp_path / "final.pt"), reference(tmp_path, steps)
    assert final.keys() == ref.keys() and all(torch.equal(final[k], ref[k]) for k in ref)
