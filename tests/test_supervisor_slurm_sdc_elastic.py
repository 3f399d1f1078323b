"""The supervisor on the real dev cluster, for bad data and a changing world: a NaN replayed before
blame, silent data corruption outvoted by the majority of three replicas (docs/sdc.md), the
time-limit warning's emergency checkpoint and requeue, and a node death with min_nodes below the
allocation: training continues on the survivors and regrows at the requeue (issue 24). Each run
ends with the parameters of an uninterrupted reference run (tests/supervisor_slurm_helpers.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hostlist import expand_hostlist as expand

from ckptsup.events import read_events
from ckptsup.slurm.parsers import JobState, parse_key_values

from run_helpers import CKPTSUP, named
from supervisor_slurm_helpers import (  # noqa: F401 - reference and reference_3_ranks are fixtures
    SDC_ARGS, active_nodes, assert_goodput_accounted, committed, finished, reference, reference_3_ranks, submit,
    torch_load
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_time_limit_warning_stops_with_an_emergency_checkpoint_and_requeues_losing_no_step(
        dev_cluster, tmp_path, reference):
    job, run, out = submit(tmp_path, nodes=2, spares=0)
    dev_cluster.wait_for(lambda: committed(run, 12), 120, what="a checkpoint at step 12")
    dev_cluster.client.cancel(job, signal="USR1", batch=True)  # what --signal=B:USR1@T delivers
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 300, what="the requeued run to complete")
    events = read_events(run)
    stop = [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert stop and "USR1" in stop[0]["detail"]
    [plan] = named(events, "preemption")
    assert plan["signal"] == "time_limit" and plan["emergency_save"] is True
    [requeue] = named(events, "requeue")
    assert "time_limit" in requeue["reason"]
    saved = max(e["step"] for e in named(events, "checkpoint_committed") if e["ts"] < requeue["ts"])
    resumed = [e for e in named(events, "first_step") if e["ts"] > requeue["ts"]][0]
    assert resumed["step"] == saved, "the emergency checkpoint is where the next run resumes: no step lost"
    assert named(events, "supervisor_start")[-1]["resumed"]
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def test_a_nan_replays_on_the_same_nodes_a_second_nan_on_that_node_moves_it_to_the_spare_then_two_replicas_rerun(
        dev_cluster, tmp_path, reference):
    """Replay before blame (docs/sdc.md), both halves in one run: the NaN at step 17 on rank 1 is
    replayed on the same nodes from step 15 and does not recur there (a transient: no blame); the
    NaN at step 23 on the same rank's node is a second at another step: that node is excluded and
    drained, the spare takes it. Then a bit flipped on rank 1 after step 32: two copies have no
    majority, so the run goes back to the last agreed checkpoint (step_30; step_35 was written
    disagreeing) on the same nodes, the flip does not recur (a transient): nobody blamed, nothing
    drained, and the NaNs before count nothing toward it. The run ends as an uninterrupted one."""
    job, run, out = submit(tmp_path, nodes=2, spares=1, extra=("--nan-at-step", "17,23", "--nan-rank", "1",
                                                               "--flip-at-step", "32", "--flip-rank", "1"))
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 300, what="the run to complete")
    events = read_events(run)
    first_nan, second_nan, sdc = named(events, "failure_detected")
    assert (first_nan["kind"], first_nan["rank"], first_nan["step"]) == ("nan", 1, 17)
    assert (second_nan["kind"], second_nan["rank"], second_nan["step"]) == ("nan", 1, 23)
    assert second_nan["node"] == first_nan["node"]
    launches = named(events, "launch")
    assert len(launches) == 4 and launches[1]["nodes"] == launches[0]["nodes"]   # the replay: same nodes
    [excluded] = named(events, "node_excluded")   # the NaN's node only: the two copies blamed nobody
    assert excluded["node"] == first_nan["node"] and excluded["drained"]
    assert excluded["reason"] == "nan: non-finite loss at steps 17 and 23 on this node"   # the drain's reason too
    dev_cluster.give_back(excluded["node"])  # give the drained node back to later tests
    assert launches[2]["path"] == "node" and first_nan["node"] not in launches[2]["nodes"] \
        and launches[0]["spares"][0] in launches[2]["nodes"]
    pair = sorted(launches[2]["nodes"])
    assert (sdc["kind"], sdc["step"], sdc["ranks"], sdc["nodes"], sdc["agreed_step"]) == ("sdc", 34, [0, 1], pair, 29)
    assert sdc.get("node") is None and "2 copies and no majority" in sdc["detail"], sdc
    assert launches[3]["nodes"] == launches[2]["nodes"] and launches[3]["path"] == "fast"   # the rerun: same nodes
    assert [r["resume_step"] for r in named(events, "restart_done")] == [15, 20, 30]
    [rejected] = named(events, "checkpoint_rejected")
    assert rejected["step"] == 35 and "replicas disagreed at step 35" in rejected["reason"], rejected
    assert all(not i.reason.startswith("ckptsup") for n, i in dev_cluster.client.node_info().items() if n in pair)
    report = subprocess.run([*CKPTSUP, "report", str(run), "--json"], capture_output=True, text=True, timeout=60)
    [incident] = json.loads(report.stdout)["sdc"]["list"]
    assert (incident["outcome"], incident["detect_lag_steps"], incident["rolled_back_steps"]) == ("transient", 5, 5)
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


# Silent data corruption (docs/sdc.md) on the dev cluster, at the default [sdc] settings: the
# every-5-steps saves check the replicas. One bit flipped after step 17 is caught at the save of
# step_20 (written as evidence, never resumed from), and the run resumes from step_15. (Two copies:
# chained into the NaN run above.)
FLIP = ("--flip-at-step", "17", "--flip-rank", "1")


def flipped_on(run: Path, attempt: int = 0) -> str:
    """The node whose rank log has the flip (the rank's own line: where it really ran)."""
    [node] = [p.name[len("ranks-"):-len(".log")] for p in (run / f"attempt-{attempt}").glob("ranks-*.log")
              if "rank 1: flipped a bit after step 17" in p.read_text(errors="replace")]
    return node


def test_a_flipped_bit_on_one_of_three_replicas_drains_that_node_and_the_spare_takes_its_place(
        dev_cluster, tmp_path, reference_3_ranks):
    """3 active + 1 spare, one rank per node: the majority names rank 1 and its node; that node is
    excluded and drained for SDC, the spare takes its place, the run resumes from the newest
    checkpoint whose replicas agreed (step_15: step_20 was written disagreeing), and every replica
    ends equal to the uninterrupted run's parameters."""
    import torch

    job, run, out = submit(tmp_path, nodes=3, spares=1, extra=(*SDC_ARGS, *FLIP))
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 240, what=f"job {job} to finish")
    victim = flipped_on(run)
    try:
        info = dev_cluster.client.node_info()[victim]   # ckptsup drained it ([slurm] drain_bad_nodes)
        assert info.state.value in ("drained", "draining") and info.reason.startswith("ckptsup: sdc:"), info
    finally:
        dev_cluster.give_back(victim)   # give the node back to later tests
    events = read_events(run)
    first = named(events, "launch")[0]
    [spare] = first["spares"]
    [failure] = named(events, "failure_detected")
    assert (failure["kind"], failure["rank"], failure["step"], failure["node"]) == ("sdc", 1, 19, victim), failure
    assert (failure["ranks"], failure["nodes"], failure["agreed_step"]) == ([1], [victim], 14), failure
    assert f"rank(s) 1 on {victim} differ from the majority of 3 copies" in failure["detail"]
    [excluded] = named(events, "node_excluded")
    assert excluded["node"] == victim and excluded["drained"], excluded
    assert excluded["reason"] == "sdc: replicas disagreed at step 19; the majority outvoted this node's"
    [rejected] = named(events, "checkpoint_rejected")
    assert rejected["step"] == 20 and "replicas disagreed at step 20" in rejected["reason"], rejected
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] == 15, restart
    assert named(events, "launch")[-1]["nodes"] == [n for n in first["nodes"] if n != victim] + [spare]
    assert not named(events, "requeue") and named(events, "run_complete")
    assert dev_cluster.job(job) is None or dev_cluster.job(job).state == JobState.COMPLETED
    finals = [torch_load(out / f"final_rank{r}.pt")["model"] for r in range(3)]
    for name, value in finals[0].items():   # every replica identical, and the uninterrupted run's
        assert all(torch.equal(f[name], value) for f in finals[1:]), name
        torch.testing.assert_close(value, reference_3_ranks[name], rtol=1e-6, atol=1e-7)


def consumed_samples(out: Path, worlds: list[tuple[int, int, int]]) -> list[int]:
    """The samples in the order the sampler hands them out (rank r of W takes the global index
    g + i*W + r of a step's batch), over `worlds`: (world size, first step, end step) per attempt.
    Each rank's samples log holds the attempts it took part in (those with world > r) one after
    the other, one rank process each (the `pid` of its lines); each line's `world` is checked."""
    per_rank: dict[int, dict[int, dict[int, list[int]]]] = {}
    for rank in range(max(w for w, _, _ in worlds)):
        blocks: list[tuple[int, dict[int, list[int]]]] = []
        last_pid = None
        for line in (out / f"samples_rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["pid"] != last_pid:
                blocks.append((rec["world"], {}))
                last_pid = rec["pid"]
            blocks[-1][1][rec["step"]] = rec["ids"]
        mine = [a for a, (w, _, _) in enumerate(worlds) if w > rank]
        assert [w for w, _ in blocks] == [worlds[a][0] for a in mine], (rank, [w for w, _ in blocks], worlds)
        per_rank[rank] = {a: steps for a, (_, steps) in zip(mine, blocks)}
    consumed: list[int] = []
    for attempt, (world, first, end) in enumerate(worlds):
        for step in range(first, end):
            for i in range(len(per_rank[0][attempt][step])):
                consumed.extend(per_rank[r][attempt][step][i] for r in range(world))
    return consumed


def test_a_dead_node_with_min_nodes_continues_on_the_survivors_then_regrows_at_the_requeue_repeating_no_sample(
        dev_cluster, tmp_path):
    """issue 24 part 3: 3 nodes, no spare, min_nodes 2 (= --nnodes 2:3). A node killed: the
    policy prices 1/3 of a 10 min horizon (+ the restart) below a 15 min queue wait, so training
    continues on the 2 survivors (world size 3 -> 2, resharded from the last disk checkpoint), no
    requeue. Then the time-limit warning: an emergency checkpoint and a requeue, whose allocation
    has 3 nodes again (the dead one excluded): resharded 2 -> 3. Over the whole run every sample
    of the epoch is seen once, in the sampler's order. MIN = MAX (the default) is the requeue of
    test_node_death_without_a_spare_requeues_the_job_excluding_the_node."""
    steps = 300
    job, run, out = submit(tmp_path, nodes=3, spares=0, extra=("--dataset-size", "4096", "--steps", str(steps)),
                           supervisor_toml="min_nodes = 2\nshrink_horizon_s = 600.0\nrequeue_wait_s = 900.0\n")
    dev_cluster.wait_for(lambda: committed(run, 15), 120, what="a checkpoint at step 15")
    active = active_nodes(run)
    victim = active[1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart on 2 nodes")
        # Slurm takes the dead node out of the --no-kill job for good (the allocation itself shrinks)
        # once it marks the node DOWN, SlurmdTimeout (10 s here) after its last answer: often after
        # our restart, which does not wait for it (CI: NumNodes still 3 at restart_done)
        def shrank() -> bool:
            shown = parse_key_values(dev_cluster.client.run(["scontrol", "show", "job", "-o", job]).stdout)
            return (shown["NumNodes"] == "2" and shown["ResizeTime"] not in ("None", "")
                    and expand(shown["NodeList"]) == sorted(set(active) - {victim}))
        dev_cluster.wait_for(shrank, 60, what="Slurm to take the dead node out of the job (NumNodes 2, ResizeTime)")
        resume = named(read_events(run), "restart_done")[-1]["resume_step"]
        dev_cluster.wait_for(lambda: committed(run, resume + 10), 120, what="a checkpoint on 2 nodes")
        dev_cluster.client.cancel(job, signal="USR1", batch=True)  # the time-limit warning: save, requeue
        dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 400, what="the run to complete")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 120, what=f"job {job} to finish")
    events = read_events(run)
    assert dev_cluster.job(job) is None or dev_cluster.job(job).state == JobState.COMPLETED
    acc = assert_goodput_accounted(events)
    print(f"GOODPUT continue-on-fewer: useful {acc.useful_device_s:.1f} of paid {acc.paid_device_s:.1f} device-s, "
          f"badput {dict((k, round(v, 1)) for k, v in acc.badput_device_s.items() if v)}")
    [choice] = named(events, "shrink_decided")
    assert (choice["choice"], choice["survivors"], choice["nodes"], choice["min_nodes"]) == ("continue", 2, 3, 2)
    assert choice["continue_cost_s"] < choice["requeue_cost_s"] and choice["queue_wait_source"] == "configured"
    [requeue] = named(events, "requeue")   # the time limit's, not the node death's
    assert "time_limit" in requeue["reason"] and victim in requeue["excluded"]
    first, fewer, regrown = named(events, "launch")
    assert first["world_size"] == 3 and fewer["world_size"] == 2 and victim not in fewer["nodes"]
    assert set(fewer["nodes"]) < set(first["nodes"]) and fewer["path"] == "node"
    assert regrown["world_size"] == 3 and victim not in regrown["nodes"], regrown   # MAX again, at the requeue
    # the hooks resharded the world-3 checkpoint onto 2 ranks, then the world-2 one back onto 3
    shrunk, grown = named(events, "elastic_resume")
    assert [(e["saved_world_size"], e["world_size"]) for e in (shrunk, grown)] == [(3, 2), (2, 3)]
    assert resume >= 15 and shrunk["step"] == resume
    saved = max(e["step"] for e in named(events, "checkpoint_committed") if e["ts"] < requeue["ts"])
    assert grown["step"] == saved > resume   # the emergency checkpoint on 2 nodes
    assert not named(events, "restore_loss_jump")   # another world size: its losses are not compared
    log = subprocess.run([*CKPTSUP, "log", str(run)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "400"})
    assert "continue on fewer nodes (2 of 3 left, min 2)" in log.stdout, log.stdout
    import torch

    consumed = consumed_samples(out, [(3, 0, resume), (2, resume, saved), (3, saved, steps)])
    assert len(consumed) == 12 * resume + 8 * (saved - resume) + 12 * (steps - saved) <= 4096   # 4 a rank a step; one epoch
    assert consumed == torch.randperm(4096, generator=torch.Generator().manual_seed(0)).tolist()[:len(consumed)]
    assert json.loads((out / "final.json").read_text())["step"] == steps
