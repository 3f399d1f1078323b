"""Lightning with ckptsup's callback on the real dev cluster, through the sbatch template (2 nodes,
one rank each): a dead node is replaced by the hot spare, and a preemption ends in a requeue and a
resumed run that completes, never in "complete" at the preemption. Each run must see the sample
ids of an uninterrupted run at every step and end with its parameters, bit for bit."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from drop_in_helpers import CKPTSUP
from hooks_helpers import private_dir
from test_integration_lightning import ARGS, SCRIPT, assert_same_run, committed, named, reference

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory) -> Path:
    return reference(private_dir(tmp_path_factory.mktemp("lightning-reference")))


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None) -> tuple[str, Path, Path]:
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 60.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                   f"hang_min_s = 20.0\n[slurm]\nspare_partition = \"{SPANNING}\"\n"
                   "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    run, out = tmp / "run", tmp / "out"
    where = ["--partition", partition] if partition else []
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(nodes), "--spares", str(spares),
                           *where, "--nproc-per-node", "1", "--config", str(cfg), "--run-dir", str(run), str(SCRIPT),
                           *ARGS, "--step-s", "0.15", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run, out


def ended(run: Path) -> bool:
    events = read_events(run)
    return bool(named(events, "run_complete") or named(events, "give_up"))


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
    assert named(events, "run_complete"), [e for e in events if e["event"] in ("give_up", "failure_detected")]
    down = [e for e in events if e["event"] in ("failure_detected", "failure_attributed") and e["kind"] == "node_down"]
    assert down and down[-1]["node"] == victim
    relaunch = named(events, "launch")[-1]
    assert victim not in relaunch["nodes"] and set(first["spares"]) <= set(relaunch["nodes"])
    assert [e["step"] for e in named(events, "checkpoint_loaded")] and not named(events, "requeue")
    assert_same_run(out, lightning_reference)


def test_a_preemption_requeues_and_the_resumed_run_completes_exactly(dev_cluster, tmp_path, lightning_reference):
    tmp = private_dir(tmp_path)
    job, run, out = submit(tmp, nodes=2, spares=0, partition="lowprio")
    dev_cluster.wait_for(lambda: any(s >= 10 for s in committed(run)), 240, what="a checkpoint of step >= 10")
    nodes = named(read_events(run), "launch")[-1]["nodes"]
    urgent = dev_cluster.submit("#!/bin/bash\nsleep 5\n", "-p", "highprio", "--exclusive", "-N", str(len(nodes)),
                                "-w", ",".join(nodes))
    dev_cluster.wait_for(lambda: ended(run), 500, what="the preempted run to end")
    events = read_events(run)
    starts = named(events, "supervisor_start")
    assert len(starts) >= 2 and starts[-1]["resumed"], "a preemption must requeue the job"
    first_end = [e for e in events if e["event"] in ("run_complete", "requeue", "give_up")][0]
    assert first_end["event"] != "run_complete", "a preempted Lightning run is not done"
    assert [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert len(named(events, "run_complete")) == 1 and named(events, "run_complete")[0]["ts"] > starts[-1]["ts"]
    assert named(events, "checkpoint_loaded")
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert "exits with PREEMPTED" in log or "exits with RANK_STOPPED" in log, "ckptsup's stop path ran"
    assert_same_run(out, lightning_reference)
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
