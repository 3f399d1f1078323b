"""Lightning with ckptsup's callback on the real dev cluster, through the sbatch template (2 nodes,
one rank each): a dead node is replaced by the hot spare, and a preemption ends in a requeue and a
resumed run that completes, never in "complete" at the preemption. Each run must see the sample
ids of an uninterrupted run at every step and end with its parameters, bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from hooks_helpers import private_dir
from run_helpers import (assert_completed_on_the_spare, assert_requeued_not_complete, ended, named, node_deaths,
                         preempt, sbatch_submit)
from test_integration_lightning import (ARGS, SCRIPT, assert_same_run, committed,  # noqa: F401 - a fixture
                                        lightning_reference)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None) -> tuple[str, Path, Path]:
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 60.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                   f"hang_min_s = 20.0\n[slurm]\nspare_partition = \"{SPANNING}\"\n"
                   "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    out = tmp / "out"
    job, run = sbatch_submit(tmp, cfg, SCRIPT, *ARGS, "--step-s", "0.15", "--out", str(out), nodes=nodes, spares=spares,
                             partition=partition)
    return job, run, out


def test_a_dead_node_is_replaced_by_the_spare_and_the_run_resumes_exactly(dev_cluster, tmp_path, lightning_reference):
    tmp = private_dir(tmp_path)
    job, run, out = submit(tmp, nodes=2, spares=1)
    dev_cluster.wait_for(lambda: any(s >= 10 for s in committed(run)), 240, what="a checkpoint of step >= 10")
    first = named(read_events(run), "launch")[0]
    victim = first["nodes"][1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: ended(run), 300, what=f"job {job} to end")
    events = read_events(run)
    assert_completed_on_the_spare(events, first, victim)
    down = node_deaths(events)
    assert down and down[-1]["node"] == victim
    assert [e["step"] for e in named(events, "checkpoint_loaded")] and not named(events, "requeue")
    assert_same_run(out, lightning_reference)


def test_a_preemption_requeues_and_the_resumed_run_completes_exactly(dev_cluster, tmp_path, lightning_reference):
    tmp = private_dir(tmp_path)
    job, run, out = submit(tmp, nodes=2, spares=0, partition="lowprio")
    dev_cluster.wait_for(lambda: any(s >= 10 for s in committed(run)), 240, what="a checkpoint of step >= 10")
    nodes = named(read_events(run), "launch")[-1]["nodes"]
    urgent = preempt(dev_cluster, nodes)
    dev_cluster.wait_for(lambda: ended(run), 500, what="the preempted run to end")
    events = read_events(run)
    assert_requeued_not_complete(events, "a preempted Lightning run is not done")
    assert named(events, "checkpoint_loaded")
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert "exits with PREEMPTED" in log or "exits with RANK_STOPPED" in log, "ckptsup's stop path ran"
    assert_same_run(out, lightning_reference)
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
