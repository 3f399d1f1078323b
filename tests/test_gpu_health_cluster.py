"""GPU health on the real dev cluster: a GPU job (gpu:2 GRES) whose node n2 shows XID 79 in its
kernel log (the stand-in tools of tests/helpers/gpu_tools, first on PATH, faults per node) is
found unhealthy by the start-up checks that run on each node through srun, excluded and drained,
and the job runs on the healthy node and the spare."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.events import read_events

pytestmark = [pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tests" / "helpers" / "gpu_tools"
RANK = ROOT / "tests" / "helpers" / "wire_rank.py"  # a torch-free rank: only torchrun imports torch


def test_a_node_with_a_fatal_xid_is_excluded_at_start_and_the_spare_runs_instead(dev_cluster, tmp_path):
    faults = tmp_path / "faults"
    faults.write_text("n2: xid79\n")
    env = {**os.environ, "PATH": f"{TOOLS}{os.pathsep}{os.environ['PATH']}", "CKPTSUP_FAKE_GPU_FILE": str(faults)}
    run, out = tmp_path / "run", tmp_path / "out"
    cfg = tmp_path / "job.toml"
    cfg.write_text("[health]\ndcgm_diag = \"off\"\n")
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "sbatch", "--submit", "--json", "--nodes", "2",
                           "--spares", "1", "--gpus-per-node", "2", "--nproc-per-node", "1", "--config", str(cfg),
                           "--run-dir", str(run), str(RANK), "--steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    try:
        dev_cluster.wait_for(lambda: (s := dev_cluster.job_state(job)) is None or s.finished, 120, what=f"job {job}")
        events = read_events(run)
        checks = {e["node"]: e for e in events if e["event"] == "health_check"}
        assert not checks["n2"]["ok"] and "gpu_xid: XID 79 on PCI:0000:2a:00" in checks["n2"]["detail"]
        assert checks["n1"]["ok"] and checks["n3"]["ok"] and "2 GPU(s) visible" in checks["n1"]["detail"]
        [excluded] = [e for e in events if e["event"] == "node_excluded"]
        assert excluded["node"] == "n2" and excluded["reason"].startswith("health: gpu_xid") and excluded["drained"]
        [launch] = [e for e in events if e["event"] == "launch"]
        assert launch["nodes"] == ["n1", "n3"] and any(e["event"] == "run_complete" for e in events)
    finally:
        dev_cluster.give_back("n2")   # give the drained node back to later tests
