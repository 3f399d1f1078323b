"""The supervisor on the real dev cluster, submitted through the sbatch template: node death with
a hot spare (in-allocation node-path restart, detection never waits for Slurm's DOWN) and without
one (requeue excluding the node). Each run ends with the parameters of an uninterrupted 2-rank
reference run (docs/training.md §Bit-exact resume), and with the events that explain it."""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostlist import expand_hostlist as expand
from s3_helpers import BUCKET, make_bucket, moto  # noqa: F401 - moto is a fixture

from ckptsup.events import read_events
from ckptsup.planning.accounting import account
from ckptsup.slurm.devconf import SPANNING
from ckptsup.slurm.parsers import JobState, parse_key_values

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
TRAIN_ARGS = ["--steps", "70", "--save-every-steps", "5", "--step-sleep-s", "0.1"]
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


def job_config(tmp: Path, extra_toml: str = "", supervisor_toml: str = "", adaptive: bool = False) -> Path:
    path = tmp / "job.toml"
    path.write_text("[supervisor]\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n" + supervisor_toml +
                    f"[checkpoint]\nadaptive_interval = {str(adaptive).lower()}\nkeep_daily_days = 0\ntest_load_every = 0\n"
                    f"[slurm]\nspare_partition = \"{SPANNING}\"\n" + extra_toml)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """Final parameters of the uninterrupted run: 2 gloo ranks, local mode, computed once."""
    tmp = tmp_path_factory.mktemp("slurm-reference")
    proc = subprocess.run([*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(job_config(tmp)),
                           "--run-dir", str(tmp / "run"), str(TRAIN), *TRAIN_ARGS, "--out", str(tmp / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp / "out" / "final.json").read_text())["params_sha256"]


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None,
           extra: tuple[str, ...] = (), extra_toml: str = "", supervisor_toml: str = "",
           adaptive: bool = False) -> tuple[str, Path, Path]:
    run, out = tmp / "run", tmp / "out"
    where = ["--partition", partition] if partition else []
    config = job_config(tmp, extra_toml, supervisor_toml, adaptive)
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(nodes), "--spares", str(spares), *where,
                           "--nproc-per-node", "1", "--config", str(config), "--run-dir", str(run),
                           str(TRAIN), *TRAIN_ARGS, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return str(data["job_id"]), run, out


def named(events, name):
    return [e for e in events if e["event"] == name]


def node_deaths(events):
    """Node deaths as the supervisor found them: detected as such (silence), or attributed after the
    kill (the dead node's agent did not answer; a peer's crash was the first symptom)."""
    return [e for e in events if e["event"] in ("failure_detected", "failure_attributed") and e["kind"] == "node_down"]


def ts(event) -> float:
    return dt.datetime.fromisoformat(event["ts"]).timestamp()


def committed(run: Path, step: int) -> bool:
    return any(e.get("step", -1) >= step for e in named(read_events(run), "checkpoint_committed"))


def active_nodes(run: Path) -> list[str]:
    return named(read_events(run), "launch")[-1]["nodes"]


def assert_goodput_accounted(events):
    """Issue 5 on a real faulted dev-cluster run: badput categories plus useful time equal the
    paid device-time within 1%, and the node death's detection is charged."""
    acc = account(events)
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert acc.paid_device_s > 0 and acc.useful_device_s > 0
    assert abs(total - acc.paid_device_s) <= 0.01 * acc.paid_device_s
    assert acc.failures.get("node_down") == 1 and acc.end_reason.value == "run_complete"
    assert acc.badput_device_s["detection"] > 0
    return acc


def finished(dev_cluster, job: str) -> bool:
    state = dev_cluster.job_state(job)
    return state is None or state.finished


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


@pytest.mark.matrix  # also on every Slurm version: make test-slurm-matrix
@pytest.mark.parametrize(("partition", "grace_s"), [("lowprio", 30), ("lowprio120", 120)])
def test_preemption_stops_with_an_emergency_checkpoint_within_grace_time_and_resumes_losing_no_step(
        dev_cluster, tmp_path, reference, partition, grace_s):
    job, run, out = submit(tmp_path, nodes=2, spares=0, partition=partition)
    dev_cluster.wait_for(lambda: committed(run, 5), 120, what="a checkpoint at step 5")
    nodes = active_nodes(run)
    urgent = dev_cluster.submit("#!/bin/bash\nsleep 5\n", "-p", "highprio", "--exclusive", "-N", str(len(nodes)),
                                "-w", ",".join(nodes))
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


def processes_of(run: Path, *, attempt: str) -> list[int]:
    """Host PIDs of rank processes of `run`'s attempt (found by their environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("CKPTSUP_RUN_DIR") == str(run) and env.get("CKPTSUP_ATTEMPT") == attempt and "RANK" in env:
            found.append(proc.pid)
    return found


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
    assert processes_of(run, attempt="0")
    os.kill(supervisor_pid(run), signal.SIGKILL)
    dev_cluster.wait_for(lambda: not processes_of(run, attempt="0"), 30, what="no rank of the dead supervisor's attempt")
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


def rank_pid(run: Path, rank: int) -> int:
    """Host PID of a rank of `run` (dev-cluster PIDs are per node namespace; /proc is the host's)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("CKPTSUP_RUN_DIR") == str(run) and env.get("RANK") == str(rank):
            return proc.pid
    raise AssertionError(f"rank {rank} of {run} not found")


def test_a_hung_rank_on_a_cluster_node_restarts_on_the_fast_path(dev_cluster, tmp_path, reference):
    """Two hangs in one run: rank 1 SIGSTOPped (a hang at once, pinned on the stopped process),
    then rank 1 sleeping forever at step 40 (hang_min_s 10: a silence with no rank working, named
    from its Python stack with its node: the rank's own code, so no node is suspected). Both restart
    on the fast path, nothing excluded, and the run ends as an uninterrupted one. (The stacks of
    both nodes' agents arrive at once through one srun step: the frames go in pieces,
    step_lines.py; whole, they interleaved and were lost.)"""
    job, run, out = submit(tmp_path, nodes=2, spares=0, extra=("--hang-at-step", "40", "--hang-rank", "1"))
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    hit = time.time()
    os.kill(rank_pid(run, 1), signal.SIGSTOP)
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 240, what="the run to complete")
    events = read_events(run)
    stopped, asleep = named(events, "failure_detected")
    assert stopped["kind"] == "hang" and stopped["rank"] == 1 and "state T" in stopped["detail"]
    assert ts(stopped) - hit <= 10.0 + 2.0
    assert asleep["kind"] == "hang" and asleep["rank"] == 1 and asleep["detect_s"] <= 15.0
    line = next(i for i, text in enumerate(TRAIN.read_text().splitlines(), 1) if "time.sleep(3600)" in text)
    assert f"rank 1 on {asleep['node']}: at train.py:{line} in main" in asleep["detail"], asleep["detail"]
    assert [r["path"] for r in named(events, "restart_done")] == ["fast", "fast"] and not named(events, "node_excluded")
    assert not named(events, "restore_loss_jump")   # both restores were whole: no warning (training lowers the loss)
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


RANK = ROOT / "tests" / "helpers" / "wire_rank.py"  # a torch-free rank: only torchrun imports torch


def test_a_gpu_allocation_with_nproc_gpu_runs_a_rank_per_gpu_and_the_allocation_event_says_so(dev_cluster, tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "2", "--spares", "1",
                           "--gpus-per-node", "2", "--signal-lead-s", "77", "--nproc-per-node", "gpu",
                           "--config", str(job_config(tmp_path)), "--run-dir", str(run),
                           str(RANK), "--steps", "5", "--out", str(out)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 120, what=f"job {job} to finish")
    events = read_events(run)
    assert named(events, "run_complete"), (run / f"slurm-{job}.out").read_text()
    [allocation] = named(events, "allocation")
    assert (allocation["gpus_per_node"], allocation["ranks_per_node"], allocation["active"], allocation["spares"]) \
        == (2, 2, 2, 1)
    [launch] = named(events, "launch")
    assert launch["world_size"] == 4 and len(launch["nodes"]) == 2
    assert sorted(p.name for p in out.glob("rank*.step")) == [f"rank{r}.step" for r in range(4)]
    checks = named(events, "health_check")
    assert checks and all(c["ok"] and "2 GPU(s) allocated by Slurm here" in c["detail"] for c in checks), checks
    effective = json.loads((run / "config.json").read_text())
    sbatch = effective["config"]["sbatch"]
    assert (sbatch["spares"], sbatch["gpus_per_node"], sbatch["signal_lead_s"]) == (1, 2, 77)  # as submitted
    assert effective["config"]["supervisor"]["nproc_per_node"] == 2
    assert effective["provenance"]["supervisor.nproc_per_node"].startswith("allocation (gpu from flag")
    [row] = account(events).attempt_rows
    assert (row["active_devices"], row["spare_devices"]) == (4, 2)  # the report counts the allocation's GPUs


def test_an_operators_replace_moves_a_nodes_ranks_to_the_spare_at_a_checkpoint(dev_cluster, tmp_path, reference):
    job, run, out = submit(tmp_path, nodes=2, spares=1)
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    try:
        asked = subprocess.run([*CKPTSUP, "replace", str(run), victim], capture_output=True, text=True, timeout=60)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
        info = dev_cluster.client.node_info()[victim]   # ckptsup drained it ([slurm] drain_bad_nodes)
        assert info.state.value in ("drained", "draining") and info.reason.startswith("ckptsup: replaced")
    finally:
        dev_cluster.give_back(victim)  # give the node back to later tests
    events = read_events(run)
    [ack] = named(events, "control")
    [detected] = named(events, "failure_detected")
    assert detected["kind"] == "replaced" and detected["node"] == victim
    saved = [e for e in named(events, "checkpoint_committed") if e["ts"] > ack["ts"]][0]   # the one asked for
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] == saved["step"]   # nothing lost
    assert named(events, "launch")[-1]["nodes"] == [first["nodes"][0], spare]
    [excluded] = named(events, "node_excluded")
    assert excluded["node"] == victim and excluded["reason"].startswith("replaced")
    assert not named(events, "requeue") and named(events, "run_complete")
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


MEMORY_EVERY = 5
MEMORY = f"[memory]\nenabled = true\nevery_steps = {MEMORY_EVERY}\n"


def replicated(run: Path, step: int) -> bool:
    return any(e["ok"] and e.get("step", -1) >= step for e in named(read_events(run), "memory_replicated"))


def test_node_death_with_a_spare_resumes_from_memory_and_the_buddys_replica(dev_cluster, tmp_path, reference):
    # disk saves only at the end: the spare's rank can only come back from the survivor's replica
    job, run, out = submit(tmp_path, nodes=2, spares=1, extra=("--save-every-steps", "1000"), extra_toml=MEMORY)
    dev_cluster.wait_for(lambda: replicated(run, 15), 120, what="every rank's replica of step >= 15")
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    dev_cluster.wait_for(lambda: spare in {e["node"] for e in named(read_events(run), "warm_ready")}, 60,
                         what="the spare's agent to be warm")
    last_replica = max(e["step"] for e in named(read_events(run), "memory_replicated") if e["ok"])
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] >= last_replica
    [loaded] = named(events, "checkpoint_loaded")
    assert loaded["step"] == restart["resume_step"] and loaded["source"] == "peer_memory", loaded
    # the survivor's rank from its own agent, the spare's from the survivor's replica of the dead node's
    assert loaded["files_by_source"]["memory"] == 1 and loaded["files_by_source"]["peer_memory"] == 1, loaded
    assert set(restart["load_by_source"]) == {"memory", "peer_memory"}
    assert not [e for e in named(events, "checkpoint_committed") if e["step"] < 70]
    # what the death cost: at most the memory interval plus the steps of the save whose replica
    # was still in flight (saved, not yet on the buddy) when the node died
    death = named(events, "failure_detected")[0]   # its step: the newest step the job had reached
    before = [e for e in events if ts(e) <= ts(death)]
    saved = max(e["step"] for e in named(before, "memory_saved") if e["ok"])
    whole = max(e["step"] for e in named(before, "memory_replicated") if e["ok"] and "ranks" in e)
    assert whole <= restart["resume_step"] <= saved, (whole, restart, saved)
    assert death["step"] - restart["resume_step"] <= MEMORY_EVERY + (saved - whole), (death, restart, saved, whole)
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def test_a_rank_whose_own_memory_copy_is_flipped_loads_the_buddys_replica(dev_cluster, tmp_path, reference,
                                                                         monkeypatch):
    # every agent flips a bit of the bundles its own ranks put (their replicas on the buddy stay
    # intact); no disk save before the end: the resume can only come from memory
    monkeypatch.setenv("CKPTSUP_TEST_FLIP_MEMORY", "own")
    job, run, out = submit(tmp_path, nodes=2, spares=0, extra=("--save-every-steps", "1000"), extra_toml=MEMORY)
    dev_cluster.wait_for(lambda: replicated(run, 15), 120, what="every rank's replica of step >= 15")
    hit = time.time()
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 240, what=f"job {job} to finish")
    events = read_events(run)
    [failure] = named(events, "failure_detected")
    assert failure["kind"] == "crash" and failure["rank"] == 1 and ts(failure) - hit <= 1.0, failure
    restart = named(events, "restart_done")[-1]
    [loaded] = named(events, "checkpoint_loaded")
    assert restart["path"] == "fast" and loaded["step"] == restart["resume_step"] >= 15, loaded
    assert not named(events, "node_excluded")
    # each rank refused its own agent's copy and took its buddy's replica of the same bundle
    assert loaded["files_by_source"]["memory"] == 0 and loaded["files_by_source"]["peer_memory"] == 2, loaded
    assert "its memory copy of step" in (run / f"slurm-{job}.out").read_text()   # rank 0's console: why
    assert not named(events, "checkpoint_rejected") and not (run / "checkpoints" / "quarantine").exists()
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def memory_changes(run: Path) -> list[dict]:
    return [e for e in named(read_events(run), "interval_changed") if e.get("level") == "memory"]


def whole_replica_after(run: Path, after: dict) -> dict | None:
    """The first step every rank's replica reached its buddies after the event `after`."""
    later = [e for e in named(read_events(run), "memory_replicated")
             if e["ok"] and "ranks" in e and ts(e) > ts(after) and e["step"] > after.get("resume_step", -1)]
    return later[0] if later else None


def test_with_the_adaptive_interval_a_rank_kill_then_a_node_death_resume_from_the_buddys_memory(
        dev_cluster, tmp_path, reference):
    # issue 20: the script saves to disk every 20 steps (attach's keyword: the supervisor's config
    # says nothing), [memory] every_steps is left to the tuner; its cap must be those 20 steps, so
    # the relaunch after the rank kill still makes memory saves and the node death resumes from them
    job, run, out = submit(tmp_path, nodes=2, spares=1, adaptive=True, extra_toml="[memory]\nenabled = true\n",
                           extra=("--save-every-steps", "20", "--step-sleep-s", "0.3"))
    [change, *_] = dev_cluster.wait_for(lambda: memory_changes(run), 120, what="the tuner's memory schedule")
    assert change["every_steps"] == 20, change      # Young's is hours here: capped at the disk's 20 steps
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    fast = dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the fast-path restart")[0]
    relaunch = named(read_events(run), "launch")[1]
    spec = json.loads((run / f"attempt-{relaunch['attempt']}" / "launch.json").read_text())
    assert spec["env"]["CKPTSUP_MEMORY_EVERY_STEPS"] == "20", spec["env"]   # the clamped schedule, kept
    whole = dev_cluster.wait_for(lambda: whole_replica_after(run, fast), 120, what="a memory save replicated after the restart")
    dev_cluster.wait_for(lambda: spare in {e["node"] for e in named(read_events(run), "warm_ready")}, 60,
                         what="the spare's agent to be warm")
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: len(named(read_events(run), "restart_done")) >= 2, 120, what="the node restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    assert all(c["every_steps"] <= 20 for c in memory_changes(run)), memory_changes(run)
    [kill, death] = named(events, "failure_detected")
    assert kill["kind"] == "crash" and kill["rank"] == 1 and fast["path"] == "fast", (kill, fast)
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] >= whole["step"], (restart, whole)
    loaded = named(events, "checkpoint_loaded")[-1]
    assert loaded["step"] == restart["resume_step"] and loaded["source"] == "peer_memory", loaded
    # the survivor's rank from its own agent, the spare's from the survivor's replica: no disk file
    by_source = loaded["files_by_source"]
    assert by_source["memory"] == 1 and by_source["peer_memory"] == 1 and by_source["shared"] == 0, loaded
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def promoted(run: Path) -> list[int]:
    return sorted(e["step"] for e in named(read_events(run), "checkpoint_promoted") if e.get("ok"))


@pytest.mark.s3
def test_a_node_and_its_buddy_lost_together_fall_back_to_disk_and_the_object_store_bit_identical(
        dev_cluster, tmp_path, reference, moto):
    """2 active + 2 spares, the batch host kept as the last spare ([supervisor] batch_host_spare):
    the two active nodes are each other's buddy and die together, the supervisor lives on. No
    memory copy is left: the disk tiers decide, and the shared copy of the newest checkpoint the
    object store (a real moto_server) holds is deleted too, with everything newer: the resume
    fetches it back from the object store and validates it."""
    make_bucket(moto)
    storage = f'[storage]\nobject_store = "s3://{BUCKET}/buddies"\ns3_endpoint_url = "{moto.url}"\n'
    job, run, out = submit(tmp_path, nodes=2, spares=2, extra=("--save-every-steps", "10"),
                           extra_toml=MEMORY + storage, supervisor_toml="batch_host_spare = true\n")
    dev_cluster.wait_for(lambda: replicated(run, 15) and committed(run, 10) and promoted(run), 120,
                         what="replicas, a disk checkpoint and its object-store copy")
    events = read_events(run)
    first = named(events, "launch")[0]
    batch_host = named(events, "allocation")[0]["node_names"][0]   # Slurm runs the batch script there
    assert batch_host not in first["nodes"] and first["spares"][-1] == batch_host, first
    a, b = first["nodes"]
    with dev_cluster.revived(a, b):
        dev_cluster.kill_node(a)
        dev_cluster.kill_node(b)
        newest = promoted(run)[-1]   # the dead nodes promote nothing more
        gone = [d for d in (run / "checkpoints").glob("step_*") if int(d.name.split("_")[1]) >= newest]
        for folder in gone:
            shutil.rmtree(folder)
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    restart = named(events, "restart_done")[-1]
    [loaded] = named(events, "checkpoint_loaded")
    assert restart["path"] == "node" and loaded["source"] == "object" and loaded["step"] == newest, (loaded, gone)
    by_source = loaded["files_by_source"]
    assert by_source["object"] > 0 and by_source["memory"] == by_source["peer_memory"] == by_source["shared"] == 0
    assert not named(events, "checkpoint_rejected") and not (run / "checkpoints" / "quarantine").exists()
    assert sorted(named(events, "launch")[-1]["nodes"]) == sorted([first["spares"][0], batch_host])
    assert "a node and its buddy lost together" in (run / f"slurm-{job}.out").read_text()   # rank 0's console line
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


# Silent data corruption (docs/sdc.md) on the dev cluster, at the default [sdc] settings: the
# every-5-steps saves check the replicas. One bit flipped after step 17 is caught at the save of
# step_20 (written as evidence, never resumed from), and the run resumes from step_15. (Two copies:
# chained into the NaN run above.)
FLIP = ("--flip-at-step", "17", "--flip-rank", "1")
SDC_ARGS = ["--steps", "40", "--save-every-steps", "5"]


@pytest.fixture(scope="module")
def reference_3_ranks(tmp_path_factory) -> dict:
    """Final parameters of the uninterrupted 3-rank run (local mode; the step sleep changes nothing)."""
    tmp = tmp_path_factory.mktemp("sdc-reference")
    proc = subprocess.run([*CKPTSUP, "launch", "--nproc-per-node", "3", "--config", str(job_config(tmp)),
                           "--run-dir", str(tmp / "run"), str(TRAIN), *SDC_ARGS, "--out", str(tmp / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch_load(tmp / "out" / "final_rank0.pt")["model"]


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


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
