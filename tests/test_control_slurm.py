"""`ckptsup save-now` and `ckptsup stop` against a job on the real dev cluster, submitted through
the sbatch template: save-now commits a checkpoint at the next step boundary; stop checkpoints,
stops, and the job ends — the supervisor exits 8 (CANCELLED), the template does not requeue, the
watchdog stands down, nothing is pending afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest


from run_helpers import run_named

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


def test_save_now_then_stop_end_the_job_without_a_requeue(dev_cluster, tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\n[checkpoint]\nadaptive_interval = false\n"
                   "keep_daily_days = 0\ntest_load_every = 0\n")
    sub = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "2", "--spares", "1",
                          "--nproc-per-node", "1", "--config", str(cfg), "--run-dir", str(run),
                          str(ROOT / "examples" / "train.py"), "--steps", "3000", "--step-sleep-s", "0.1",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job = str(json.loads(sub.stdout)["job_id"])
    dev_cluster.wait_for(lambda: run_named(run, "first_step"), 180, what="the first step")
    time.sleep(1.0)
    asked = subprocess.run([*CKPTSUP, "save-now", str(run)], capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    [ack] = run_named(run, "control")
    [saved] = dev_cluster.wait_for(lambda: run_named(run, "checkpoint_committed"), 60, what="the save-now checkpoint")
    assert ack["step"] <= saved["step"] <= ack["step"] + 20   # the next step boundary the ranks agreed on
    stopped = subprocess.run([*CKPTSUP, "stop", str(run)], capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    dev_cluster.wait_for(lambda: (s := dev_cluster.job_state(job)) is None or s.finished, 120, what=f"job {job} to end")
    time.sleep(2.0)   # a requeue, had there been one, would show the job pending again by now
    state = dev_cluster.job_state(job)
    assert state is None or state.finished
    [cancelled] = run_named(run, "run_cancelled")
    assert run_named(run, "checkpoint_committed")[-1]["step"] == cancelled["step"] + 1   # nothing lost
    assert not run_named(run, "requeue") and json.loads((run / "state.json").read_text())["status"] == "cancelled"
    log = (run / f"slurm-{job}.out").read_text()
    assert "supervisor exited 8: not requeueing" in log
