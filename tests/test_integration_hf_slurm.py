"""The HF Trainer with CkptsupCallback on the real dev cluster through the sbatch template (2 nodes,
1 rank each, gloo on CPU): a dead node is replaced by the hot spare and the run resumes from
the memory tier (the survivor's own agent, the buddy's copy of the dead rank's bundle); a preemption on the preemptable partition ends in a requeue and a resumed
run, never in "complete" at the preemption. Both end with the samples of every step and the
parameters of an uninterrupted plain-torchrun run of the same Trainer without ckptsup."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from run_helpers import (assert_completed_on_the_spare, assert_requeued_not_complete, assert_same_run, ended, named,
                         newest_sample_step, preempt, sbatch_submit, uninterrupted)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "hf_train.py"
STEPS = 24
ARGS = ["--save-every-steps", "4", "--step-sleep-s", "0.4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-slurm-reference") / "out"
    # without the step sleep: it changes no sample and no parameter
    uninterrupted(SCRIPT, "--out", str(out), "--mode", "none", *ARGS, "--step-sleep-s", "0")
    return out


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None,
           args: list[str] = ARGS) -> tuple[str, Path, Path]:
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\nhang_min_s = 10.0\n"
                   f"[slurm]\nspare_partition = \"{SPANNING}\"\n"
                   "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    out = tmp / "out"
    job, run = sbatch_submit(tmp, cfg, SCRIPT, "--out", str(out), *args, nodes=nodes, spares=spares,
                             partition=partition)
    return job, run, out


def test_a_dead_node_under_the_hf_trainer_is_replaced_by_the_spare_and_resumes_from_the_buddys_memory(
        dev_cluster, tmp_path, reference):
    """issue 24 part 4: the callback at its defaults (a disk checkpoint every 1800 s, a memory save
    every 10 steps): the node dies after the memory save of step 10, with no disk checkpoint yet.
    The spare's rank takes its state from the buddy's copy of the dead rank's bundle (peer
    memory), the survivor from its own agent; HF's data skip and TrainerState come from that copy."""
    job, run, out = submit(tmp_path, nodes=2, spares=1, args=["--save-every-steps", "0", "--step-sleep-s", "0.4"])
    # replicated, not only saved: the dead rank's state must be on its buddy (a clean-clone run killed
    # the node between the save and its replica: the restart rightly began at step 0)
    dev_cluster.wait_for(lambda: any(e["ok"] and e["step"] >= 10 for e in named(read_events(run), "memory_replicated"))
                         and newest_sample_step(out) >= 11, 240, what="the memory save of step 10, replicated")
    first = named(read_events(run), "launch")[0]
    victim = first["nodes"][1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: ended(run), 300, what=f"job {job} to end")
    events = read_events(run)
    relaunch = assert_completed_on_the_spare(events, first, victim)
    assert not [e for e in named(events, "checkpoint_committed") if e["ts"] < relaunch["ts"]]   # memory alone
    [load] = named(events, "checkpoint_loaded")
    assert load["step"] >= 10 and load["path"] == f"memory:step_{load['step']}", load
    # one rank from its own agent's store, the spare's from the buddy's copy of the dead rank's bundle
    assert load["source"] == "peer_memory" and load["files_by_source"] == {**load["files_by_source"], "memory": 1,
                                                                          "peer_memory": 1}, load
    assert set(named(events, "restart_done")[-1]["load_by_source"]) == {"memory", "peer_memory"}
    assert_same_run(out, reference, STEPS)


def test_a_preempted_hf_run_is_requeued_and_resumed_not_complete(dev_cluster, tmp_path, reference):
    job, run, out = submit(tmp_path, nodes=2, spares=0, partition="lowprio")
    dev_cluster.wait_for(lambda: newest_sample_step(out) >= 6, 240, what="step 6")
    nodes = named(read_events(run), "launch")[-1]["nodes"]
    urgent = preempt(dev_cluster, nodes)
    dev_cluster.wait_for(lambda: ended(run), 400, what="the preempted run to end")
    events = read_events(run)
    assert_requeued_not_complete(events)
    # the ranks got the SIGTERM, stopped at an agreed step, wrote the emergency checkpoint (GraceTime
    # fits the save measured at step_4) and left HF's train() with PREEMPTED; the requeue resumed from it
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert log.count("exits with PREEMPTED") == 2 and log.count("emergency save written") == 2
    stop = int(log.split("exits with PREEMPTED: stopped after step ")[1].split()[0])
    assert named(events, "checkpoint_loaded")[0]["step"] == stop + 1
    assert_same_run(out, reference, STEPS)
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
