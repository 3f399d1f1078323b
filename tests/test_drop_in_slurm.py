"""An unmodified DDP script (tests/helpers/plain_ddp.py: its own checkpoints, `step N` lines, no
ckptsup) on the real dev cluster through the sbatch template: a dead node is replaced by the hot
spare, and a preemption whose ranks exit 0 on SIGTERM (as Lightning's do) ends in a requeue, not
in "complete". Each run ends with the model of an uninterrupted plain-torchrun run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from drop_in_helpers import SCRIPT, newest_step, reference, same_model
from run_helpers import (assert_requeued_not_complete, ended, named, node_death_to_the_spare, preempt,
                         sbatch_submit)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STEPS = 60


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("plain-reference"), STEPS)


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None, script_args=()) -> tuple[str, Path]:
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 5.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                   f"hang_min_s = 10.0\n[slurm]\nspare_partition = \"{SPANNING}\"\n")
    return sbatch_submit(tmp, cfg, SCRIPT, "--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"), "--out",
                         str(tmp / "final.pt"), "--step-s", "0.15", *script_args, nodes=nodes, spares=spares,
                         partition=partition)


def test_a_dead_node_under_an_unmodified_script_is_replaced_by_the_spare(dev_cluster, tmp_path, plain_reference):
    job, run = submit(tmp_path, nodes=2, spares=1)
    dev_cluster.wait_for(lambda: newest_step(run) >= 15, 180, what="step 15")
    events, relaunch = node_death_to_the_spare(dev_cluster, run, job)
    assert relaunch["path"] == "node" and not named(events, "requeue")
    assert {e["level"] for e in named(events, "supervision_level")} <= {"process", "progress"}
    assert named(events, "supervision_level")[-1]["level"] == "progress"
    assert same_model(torch.load(tmp_path / "final.pt"), plain_reference)


def test_a_preempted_script_whose_ranks_exit_0_on_sigterm_is_requeued_not_complete(dev_cluster, tmp_path,
                                                                                   plain_reference):
    job, run = submit(tmp_path, nodes=2, spares=0, partition="lowprio", script_args=("--exit0-on-sigterm",))
    dev_cluster.wait_for(lambda: newest_step(run) >= 10, 180, what="step 10")
    nodes = named(read_events(run), "launch")[-1]["nodes"]
    urgent = preempt(dev_cluster, nodes)
    dev_cluster.wait_for(lambda: ended(run), 400, what="the preempted run to end")
    events = read_events(run)
    assert_requeued_not_complete(events, "exit 0 after SIGTERM is a preemption, not done")
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert "SIGTERM: saved step" in log, "the script's own SIGTERM handler ran"
    assert same_model(torch.load(tmp_path / "final.pt"), plain_reference)
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
