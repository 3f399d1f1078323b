"""An unmodified DDP script (tests/helpers/plain_ddp.py: its own checkpoints, `step N` lines, no
ckptsup) on the real dev cluster through the sbatch template: a dead node is replaced by the hot
spare, and a preemption whose ranks exit 0 on SIGTERM (as Lightning's do) ends in a requeue, not
in "complete". Each run ends with the model of an uninterrupted plain-torchrun run."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from drop_in_helpers import CKPTSUP, SCRIPT, named, newest_step, reference, same_model

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STEPS = 60


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("plain-reference"), STEPS)


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None, script_args=()) -> tuple[str, Path]:
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 5.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                   f"hang_min_s = 10.0\n[slurm]\nspare_partition = \"{SPANNING}\"\n")
    run = tmp / "run"
    where = ["--partition", partition] if partition else []
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(nodes), "--spares", str(spares),
                           *where, "--nproc-per-node", "1", "--config", str(cfg), "--run-dir", str(run), str(SCRIPT),
                           "--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "final.pt"),
                           "--step-s", "0.15", *script_args],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def test_a_dead_node_under_an_unmodified_script_is_replaced_by_the_spare(dev_cluster, tmp_path, plain_reference):
    job, run = submit(tmp_path, nodes=2, spares=1)
    dev_cluster.wait_for(lambda: newest_step(run) >= 15, 180, what="step 15")
    first = named(read_events(run), "launch")[0]
    victim = first["nodes"][1]
    with dev_cluster.revived(victim):
        killed = time.time()
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "run_complete") or named(read_events(run), "give_up"),
                             240, what=f"job {job} to end")
    events = read_events(run)
    assert named(events, "run_complete"), [e for e in events if e["event"] in ("give_up", "failure_detected")]
    down = [e for e in events if e["event"] in ("failure_detected", "failure_attributed") and e["kind"] == "node_down"]
    assert down and down[-1]["node"] == victim
    relaunch = named(events, "launch")[-1]
    assert victim not in relaunch["nodes"] and set(first["spares"]) <= set(relaunch["nodes"])
    assert relaunch["path"] == "node" and not named(events, "requeue")
    assert {e["level"] for e in named(events, "supervision_level")} <= {"process", "progress"}
    assert named(events, "supervision_level")[-1]["level"] == "progress"
    assert same_model(torch.load(tmp_path / "final.pt"), plain_reference)
    assert time.time() - killed < 240


def test_a_preempted_script_whose_ranks_exit_0_on_sigterm_is_requeued_not_complete(dev_cluster, tmp_path,
                                                                                   plain_reference):
    job, run = submit(tmp_path, nodes=2, spares=0, partition="lowprio", script_args=("--exit0-on-sigterm",))
    dev_cluster.wait_for(lambda: newest_step(run) >= 10, 180, what="step 10")
    nodes = named(read_events(run), "launch")[-1]["nodes"]
    urgent = dev_cluster.submit("#!/bin/bash\nsleep 5\n", "-p", "highprio", "--exclusive", "-N", str(len(nodes)),
                                "-w", ",".join(nodes))
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete") or named(read_events(run), "give_up"),
                         400, what="the preempted run to end")
    events = read_events(run)
    starts = named(events, "supervisor_start")
    assert len(starts) >= 2 and starts[-1]["resumed"], "a preemption must requeue the job"
    first_end = [e for e in events if e["event"] in ("run_complete", "requeue", "give_up")][0]
    assert first_end["event"] != "run_complete", "exit 0 after SIGTERM is a preemption, not done"
    assert [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert len(named(events, "run_complete")) == 1 and named(events, "run_complete")[0]["ts"] > starts[-1]["ts"]
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert "SIGTERM: saved step" in log, "the script's own SIGTERM handler ran"
    assert same_model(torch.load(tmp_path / "final.pt"), plain_reference)
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
