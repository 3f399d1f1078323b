"""Straggler detection on the real dev cluster: 3 ranks on 3 nodes (DDP over gloo, the hooks'
compute time per step), 60 s at the same speed — no flag — then rank 2 sleeping 1.3x as long per
step (examples/train.py --slow-rank): named, with its node, within 30 steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
SLOW_FROM = 600   # 60 s of 0.1 s steps first


def test_a_rank_1_3x_slower_is_named_within_30_steps_and_60_s_without_one_flag_nothing(dev_cluster, tmp_path):
    run, cfg = tmp_path / "run", tmp_path / "job.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\n[checkpoint]\nadaptive_interval = false\n"
                   "keep_daily_days = 0\ntest_load_every = 0\n")
    sub = subprocess.run([sys.executable, "-m", "ckptsup.cli", "sbatch", "--submit", "--json", "--nodes", "3",
                          "--spares", "0", "--nproc-per-node", "1", "--config", str(cfg), "--run-dir", str(run),
                          str(ROOT / "examples" / "train.py"), "--steps", str(SLOW_FROM + 60), "--step-sleep-s", "0.1",
                          "--slow-rank", "2", "--slow-factor", "1.3", "--slow-from-step", str(SLOW_FROM),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job = str(json.loads(sub.stdout)["job_id"])
    dev_cluster.wait_for(lambda: (s := dev_cluster.job_state(job)) is None or s.finished, 300, what=f"job {job}")
    events = read_events(run)
    assert any(e["event"] == "run_complete" for e in events), (run / f"slurm-{job}.out").read_text()[-3000:]
    [launch] = [e for e in events if e["event"] == "launch"]
    flags = [e for e in events if e["event"] == "straggler"]
    assert [(f["rank"], f["node"]) for f in flags] == [(2, launch["nodes"][2])], flags   # nothing before it
    assert SLOW_FROM < flags[0]["step"] <= SLOW_FROM + 30 and 1.15 <= flags[0]["ratio"] < 1.5
