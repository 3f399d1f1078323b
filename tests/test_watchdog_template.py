"""The real thing end to end: `ckptsup sbatch` renders the template, `ckptsup launch` runs
examples/train.py on 2 nodes, and the batch host's node dies under --no-kill. The watchdog step on
the other node requeues the job (one fenced requeue event, the dead host excluded, the spanning
partition), the next batch run resumes from the newest checkpoint on other nodes, and its own
watchdog is alive (it does not mistake the previous run's "requeued" for its own)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from test_requeue_cluster import check_finisher_outcomes

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def count(run_dir: Path, name: str) -> int:
    return sum(1 for e in read_events(run_dir) if e["event"] == name)


def wait_events(run_dir: Path, name: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while count(run_dir, name) < n:
        assert time.monotonic() < deadline, [e["event"] for e in read_events(run_dir)]
        time.sleep(0.3)


def submit_train_job(dev_cluster, tmp_path: Path, *, steps: int, extra_toml: str = "") -> tuple[str, Path]:
    """examples/train.py through `ckptsup sbatch` (2 nodes in main, no spare, the spanning
    partition for requeues), submitted to the dev cluster: (job id, run dir)."""
    run_dir = tmp_path / "run"
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(f'[slurm]\nspare_partition = "{SPANNING}"\n' + extra_toml)
    script = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "ckptsup.cli", "sbatch", "--config", str(job_toml), "--nodes", "2",
                    "--spares", "0", "--partition", "main", "--run-dir", str(run_dir), "--output", str(script),
                    str(TRAIN), "--steps", str(steps), "--step-sleep-s", "0.1", "--save-every-steps", "20"],
                   check=True, capture_output=True, text=True)
    run_dir.mkdir(mode=0o700)
    return dev_cluster.client.submit(script), run_dir


@pytest.mark.matrix  # also on every Slurm version: make test-slurm-matrix
def test_batch_host_death_is_recovered_by_the_watchdog_twice_in_a_row(dev_cluster, tmp_path):
    # 200 steps: each round kills the batch host at the first commit after its run's first step
    # (every 20 steps), so the second kill comes by about step 60-80; what is left after the second
    # requeue is only the run's end (400 steps ran 20+ s more of it and proved nothing more)
    job, run_dir = submit_train_job(dev_cluster, tmp_path, steps=200, extra_toml="[supervisor]\nlease_stale_s = 3.0\n")
    killed = []
    try:
        for round_ in (1, 2):
            wait_events(run_dir, "first_step", round_, 120)
            wait_events(run_dir, "checkpoint_committed", count(run_dir, "checkpoint_committed") + 1, 60)
            host = dev_cluster.job(job).batch_host
            killed.append(host)
            dev_cluster.kill_node(host)
            wait_events(run_dir, "requeue", round_, 30)
        wait_events(run_dir, "run_complete", 1, 240)
        events = read_events(run_dir)
        requeues = [e for e in events if e["event"] == "requeue"]
        assert [(e["by"], e["reason"]) for e in requeues] == [("watchdog", "batch_host_lost")] * 2
        assert requeues[0]["excluded"] == [killed[0]] and requeues[1]["excluded"] == sorted(killed)
        starts = [e for e in events if e["event"] == "supervisor_start"]
        assert len(starts) == 3 and starts[-1]["excluded"] == sorted(killed)
        last_nodes = [e for e in events if e["event"] == "allocation"][-1]["node_names"]
        assert not set(last_nodes) & set(killed)
        resumed = [e["resume_from"] for e in events if e["event"] == "launch"]
        assert resumed[0] is None and all(r for r in resumed[1:])  # resumed from a checkpoint each time
        info = dev_cluster.job(job)
        assert info.restart_count == 2
        check_finisher_outcomes([e for e in events if e["event"] == "requeue_updated"], info.partition, events)
    finally:
        dev_cluster.client.cancel(job)
        for node in killed:
            dev_cluster.revive_node(node)
