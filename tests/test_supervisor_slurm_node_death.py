"""The supervisor on the real dev cluster, submitted through the sbatch template, when a node or the
job itself is lost: node death with a hot spare (in-allocation node-path restart, detection never
waits for Slurm's DOWN) and without one (requeue excluding the node), preemption within the
partition's grace time, the supervisor SIGKILLed, and the requeue's refusals (a --no-requeue job,
more nodes than the allocation). The tests marked `matrix` run on every Slurm version too
(`make test-slurm-matrix`, the Makefile's SLURM_MATRIX_TORCH). Each faulted run ends with the
parameters of an uninterrupted 2-rank reference run (tests/supervisor_slurm_helpers.py), and with
the events that explain it. The memory tier's dev-cluster runs are in
test_supervisor_slurm_memory.py; SDC, NaN, the time-limit warning and min_nodes in
test_supervisor_slurm_sdc_elastic.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckptsup.events import read_events
from ckptsup.slurm.parsers import JobState

from drop_in_helpers import env_processes, with_real_ranks
from run_helpers import CKPTSUP, gone, named, node_deaths, preempt
from supervisor_slurm_helpers import (  # noqa: F401 - reference is a fixture
    TRAIN, TRAIN_ARGS, active_nodes, assert_goodput_accounted, committed, finished, job_config, reference, submit,
    ts
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def agent_pids(dev_cluster, run: Path) -> dict[str, int]:
    """node -> host PID of `run`'s agent there (its srun task: `ckptsup agent --spec RUN/...`)."""
    import psutil

    found = {}
    for node in dev_cluster.nodes:
        for pid in dev_cluster.cluster.node_pids(node):
            try:
                cmd = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if "agent" in cmd and "--spec" in cmd and cmd[cmd.index("--spec") + 1].startswith(str(run)):
                found[node] = pid
    return found


def status_of(run: Path) -> dict | None:
    """`ckptsup status --json` of the run, None until its supervisor has published."""
    done = subprocess.run([*CKPTSUP, "status", "--json", str(run)], capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else None


@pytest.mark.matrix  # also on every Slurm version: make test-slurm-matrix
def test_node_death_with_a_spare_restarts_on_the_spare_within_the_allocation(dev_cluster, tmp_path, reference):
    release = tmp_path / "release"   # the ranks wait before step 40 until the node is killed: a loaded box
    job, run, out = submit(tmp_path, nodes=2, spares=1, extra=("--hold-at-step", "40", "--hold-file", str(release)))
    dev_cluster.wait_for(lambda: committed(run, 15), 120, what="a checkpoint at step 15")
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    # the spare's interpreters, and the survivor's for the next launch (on a loaded box > 12 s after the
    # first step): `restart_done.warm` is true only when every node's ranks started warm
    dev_cluster.wait_for(lambda: {spare, *first["nodes"]} <= {e["node"] for e in named(read_events(run), "warm_ready")},
                         120, what="the spare's and the nodes' agents to be warm")
    agents = agent_pids(dev_cluster, run)
    assert set(agents) == {*first["nodes"], spare}   # one agent per usable node, the spare's too
    before = dev_cluster.wait_for(lambda: (s := status_of(run)) and s["nodes"][spare]["warm"] and s, 30,
                                  what="the status to show the warm spare")
    assert before["spares"] == [spare] and before["nodes"][spare]["agent"] is True
    with dev_cluster.revived(victim):
        killed = time.time()
        dev_cluster.kill_node(victim)
        release.touch()   # the restarted ranks run to the end
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart")
        # only the dead node's agent is gone: the survivor's and the spare's are the same processes
        assert agent_pids(dev_cluster, run) == {n: pid for n, pid in agents.items() if n != victim}
        after = dev_cluster.wait_for(lambda: (s := status_of(run)) and s["attempt"] == 1 and s, 30,
                                     what="the status after the restart")
        assert spare in after["active"] and victim in after["excluded"] and victim not in after["nodes"]
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    assert dev_cluster.job(job) is None or dev_cluster.job(job).state == JobState.COMPLETED
    down = node_deaths(events)
    assert down and down[0]["node"] == victim
    assert ts(down[0]) - killed <= 10.0, "node death must be seen in seconds, not at Slurm's DOWN"
    if down[0]["event"] == "failure_attributed":   # a peer's crash came first: the kill asked the dead node's slurmd
        assert "nor its slurmd" in down[0]["detail"], down[0]
    assert [e["node"] for e in named(events, "node_excluded")] == [victim]
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] >= 15
    assert restart["warm"] is True   # the spare's ranks started in interpreters it had warmed
    relaunch = named(events, "launch")[-1]
    assert victim not in relaunch["nodes"] and set(first["spares"]) <= set(relaunch["nodes"])
    assert not named(events, "requeue") and named(events, "run_complete")
    assert json.loads((run / "state.json").read_text())["excluded_nodes"].keys() == {victim}
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference
    bad = assert_goodput_accounted(events).badput_device_s
    assert bad["idle_spares"] > 0  # the spare idled until it took over
    assert sum(v for k, v in bad.items() if k.startswith("restart_")) > 0  # in-allocation restart phases


def test_a_node_that_dies_while_no_peer_talks_to_it_is_found_by_its_silence_and_its_slurmd(
        dev_cluster, tmp_path, reference):
    """Issue 38: a node that dies while its peers wait outside any collective (here every rank holds
    before step 20: no peer crash reveals it) used to be found after node_silence_s. Now its silent
    agent's slurmd is asked after two missed heartbeats, and does not answer: node_down then."""
    release = tmp_path / "release"
    job, run, out = submit(tmp_path, nodes=2, spares=1, extra=("--hold-at-step", "20", "--hold-file", str(release)))
    dev_cluster.wait_for(lambda: committed(run, 15) and any(e.get("phase") == "eval" for e in named(read_events(run), "phase")),
                         120, what="the ranks holding before step 20")
    victim = active_nodes(run)[1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: node_deaths(read_events(run)), 60, what="the node death")
        release.touch()
        dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 240, what="the run to complete")
    events = read_events(run)
    [down] = node_deaths(events)
    assert down["event"] == "failure_detected" and down["node"] == victim, down
    assert "slurmd does not answer" in down["detail"], down   # not node_silence_s's "while others talk"
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def test_a_live_node_whose_agent_is_slow_at_the_kill_is_not_taken_for_dead(dev_cluster, tmp_path, reference):
    """Issue 38: the kill no longer waits ~2 s on a dead node's agent (its slurmd is asked), but a live
    node's agent that is slow to ack (stopped 1 s here: a loaded box) must keep the whole ack window:
    its slurmd answers, the ack comes, the crash restarts on the fast path, nothing is excluded."""
    import os
    import signal

    job, run, out = submit(tmp_path, nodes=2, spares=0)
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    first = named(read_events(run), "launch")[0]
    slow = agent_pids(dev_cluster, run)[first["nodes"][1]]
    victim = with_real_ranks(env_processes(CKPTSUP_RUN_DIR=str(run), RANK="0"))[-1]
    os.kill(slow, signal.SIGSTOP)
    try:
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(1.0)
    finally:
        os.kill(slow, signal.SIGCONT)
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 240, what="the run to complete")
    events = read_events(run)
    assert [f["kind"] for f in named(events, "failure_detected")] == ["crash"]
    assert not named(events, "failure_attributed") and not named(events, "node_excluded")
    assert [e["path"] for e in named(events, "launch")] == ["initial", "fast"]
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


@pytest.mark.matrix  # also on every Slurm version: make test-slurm-matrix
def test_node_death_without_a_spare_requeues_the_job_excluding_the_node(dev_cluster, tmp_path, reference):
    job, run, out = submit(tmp_path, nodes=2, spares=0)
    dev_cluster.wait_for(lambda: committed(run, 15), 120, what="a checkpoint at step 15")
    victim = active_nodes(run)[1]
    with dev_cluster.revived(victim):
        killed = time.time()
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 300, what="the requeued run to complete")
    events = read_events(run)
    down = node_deaths(events)
    assert down and down[0]["node"] == victim and ts(down[0]) - killed <= 10.0
    [requeue] = named(events, "requeue")
    assert victim in requeue["excluded"]
    again = named(events, "supervisor_start")[-1]
    assert again["resumed"] and victim in again["excluded"]
    assert victim not in named(events, "launch")[-1]["nodes"]
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference
    acc = assert_goodput_accounted(events)
    assert acc.requeues == 1 and acc.queue_s > 0  # the requeue's time in the queue is reported, not paid
    assert not named(events, "shrink_decided")   # min_nodes at its default (= the active nodes): no fewer nodes


@pytest.mark.matrix  # also on every Slurm version: make test-slurm-matrix
@pytest.mark.parametrize(("partition", "grace_s"), [("lowprio", 30), ("lowprio120", 120)])
def test_preemption_stops_with_an_emergency_checkpoint_within_grace_time_and_resumes_losing_no_step(
        dev_cluster, tmp_path, reference, partition, grace_s):
    job, run, out = submit(tmp_path, nodes=2, spares=0, partition=partition)
    dev_cluster.wait_for(lambda: committed(run, 5), 120, what="a checkpoint at step 5")
    nodes = active_nodes(run)
    urgent = preempt(dev_cluster, nodes)
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 400, what="the preempted run to complete")
    events = read_events(run)
    stop = [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert stop, "the agents' SIGTERM must reach the supervisor as a preemption"
    [plan] = named(events, "preemption")
    assert plan["signal"] == "preemption" and plan["window_s"] == grace_s
    assert plan["emergency_save"] is True
    second = named(events, "supervisor_start")[-1]
    saved = max(e["step"] for e in named(events, "checkpoint_committed") if e["ts"] < second["ts"])
    resumed = [e for e in named(events, "first_step") if e["ts"] > second["ts"]][0]
    assert resumed["step"] == saved, "resumed at the emergency checkpoint: no step lost"
    assert dev_cluster.job_state(urgent) is None or dev_cluster.job_state(urgent).finished
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def processes_of(run: Path, *, attempt: str) -> list[psutil.Process]:
    """The rank processes of `run`'s attempt (a cold rank, a warm rank's proxy) and the warm
    interpreters that run the proxies' ranks."""
    return with_real_ranks(env_processes(CKPTSUP_RUN_DIR=str(run), CKPTSUP_ATTEMPT=attempt, RANK=None))


def supervisor_pid(run: Path) -> int:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "launch" in cmd and str(run) in " ".join(cmd) and any("ckptsup" in c for c in cmd):
            return proc.pid
    raise AssertionError("supervisor not found")


def test_a_sigkilled_supervisor_leaves_no_rank_and_the_job_is_requeued_and_resumes(dev_cluster, tmp_path, reference):
    import os
    import signal

    job, run, out = submit(tmp_path, nodes=2, spares=0)
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    ranks = processes_of(run, attempt="0")
    assert ranks
    os.kill(supervisor_pid(run), signal.SIGKILL)
    dev_cluster.wait_for(lambda: all(gone(p.pid) for p in ranks), 30, what="no rank of the dead supervisor's attempt")
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 300, what="the requeued run to complete")
    events = read_events(run)
    assert [e["by"] for e in named(events, "requeue")] != [] and named(events, "supervisor_start")[-1]["resumed"]
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def test_more_active_nodes_than_the_allocation_is_one_clear_line(dev_cluster, tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    job = dev_cluster.submit(f"#!/bin/bash\n{sys.executable} -m ckptsup.cli launch --nodes 5 --run-dir {tmp_path}/run "
                             f"{script}\necho rc=$?\n", "-N", "2")
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 60, what=f"job {job}")
    out = dev_cluster.output(job).strip().splitlines()
    assert out[-1] == "rc=2"
    [line] = [x for x in out if x.startswith("ckptsup:")]
    assert "--nodes 5 active nodes requested but the allocation has 2" in line


def test_a_job_that_cannot_be_requeued_gives_up_with_one_clear_line(dev_cluster, tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "2", "--spares", "0",
                           "--extra-directive=--no-requeue", "--nproc-per-node", "1",
                           "--config", str(job_config(tmp_path)), "--run-dir", str(run), str(TRAIN), *TRAIN_ARGS,
                           "--out", str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    victim = active_nodes(run)[1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "give_up"), 120, what="the supervisor to give up")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 120, what=f"job {job} to end")
    [give_up] = named(read_events(run), "give_up")
    assert "--no-requeue" in give_up["reason"]
    assert json.loads((run / "state.json").read_text())["status"] == "gave_up"
    log = (run / f"slurm-{job}.out").read_text()
    assert "supervisor exited 3: not requeueing" in log
