"""Issue 39 part 4: a real run of more nodes than the rest of the real-cluster tier uses. A 16-node
dev cluster (`ckptsup dev-cluster up --nodes 16`: main n1-n15, the reserved spare n16), and
examples/train.py under `ckptsup sbatch --submit` at the shipped defaults (the job TOML sets only
the spare partition a requeue moves to) on 14 active nodes and one hot spare, 2 gloo ranks a node:
28 ranks. Three faults chained in one run:

1. a node dies (its PID namespace killed, as tests/test_supervisor_slurm_node_death.py does): it is
   blamed and excluded, the hot spare takes its ranks over inside the allocation, and the run
   resumes from the newest checkpoint;
2. the time-limit warning (`scancel --signal=USR1 --batch`, what `--signal=B:USR1@T` delivers, as
   tests/test_supervisor_slurm_sdc_elastic.py does): an emergency checkpoint, and a requeue into
   the spanning partition without the dead node, so the job lands on the reserved spare n16;
3. the requeued job resumes at the emergency checkpoint and completes,

with the uninterrupted 28-rank reference's data order at the end, every step's sample ids on every
rank, and its parameters to a few ulps (bit for bit only at two ranks: docs/training.md §Bit-exact
resume).

This is the scale tier: `make test-scale` (`pytest -m scale`). It holds both cores of a 2-core box
for minutes, more than `make test`'s budget has left (BENCHMARKS.md §Scale: a 16-node dev-cluster
run), so without `-m scale` it is skipped, saying so. It takes its own cluster (a directory, a port
range and job ids of its own: /tmp/ckptsup-scale-cluster, ports 18100-18116), never a test slot's.
`CKPTSUP_SCALE_NODES=N` runs it at N nodes (N-2 active, one hot spare, the reserved spare); the
figures (wall time, each recovery, the supervisor's CPU, the host's memory and load, the agents'
processes a node) are printed on one line, SCALE_RUN, for BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import datetime as dt
import fcntl
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import torch

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from conftest import DevClusterFixture, fresh_cluster
from run_helpers import CKPTSUP, named, node_deaths, samples
from supervisor_slurm_helpers import TRAIN, assert_goodput_accounted, torch_load, uninterrupted_run

# the 16-node run is the scale tier: skipped (saying so) unless `-m` names it
only_when_selected = pytest.mark.skipif("'scale' not in config.getoption('markexpr')",
                                        reason="the scale tier (a 16-node, 28-rank run holding both cores for "
                                               "minutes): `make test-scale` runs it")

NODES = int(os.environ.get("CKPTSUP_SCALE_NODES", "16"))
ACTIVE = NODES - 2                 # one hot spare in the job; the cluster's last node is the reserved spare
NPROC = 2                          # ranks a node
SCALE_DIR = Path("/tmp/ckptsup-scale-cluster")
SCALE_PORT_BASE = 18100            # past the test slots (17100-17185, their second clusters 17600-17685) and benches
SCALE_FIRST_JOB_ID = 900_001       # past the nine test slots' ids (1 + 100,000 k)
# the run: long enough for a checkpoint before the death, commits after the restart and a requeue
STEPS = int(os.environ.get("CKPTSUP_SCALE_STEPS", "120"))
TRAIN_ARGS = ["--steps", str(STEPS), "--save-every-steps", "5"]
STEP_SLEEP = ["--step-sleep-s", "0.1"]   # changes no parameter: the reference runs without it
PARAM_ATOL = 1e-5                  # the resumes' few ulps (measured below), far under what a lost state would move


def ts(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["ts"]).timestamp()


@pytest.fixture(scope="module")
def scale_cluster() -> Iterator[DevClusterFixture]:
    """A fresh NODES-node dev cluster of this module's own (conftest's `dev_cluster` is 5 nodes in a
    numbered slot), torn down at the end, which fails when a daemon survives."""
    from ckptsup.slurm.devcluster import DevCluster
    from ckptsup.slurm.devconf import ClusterSpec

    lock = open(f"{SCALE_DIR}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        pytest.fail(f"another session holds the scale cluster ({SCALE_DIR}.lock); wait for it to finish")
    cluster = DevCluster(ClusterSpec(dir=SCALE_DIR, port_base=SCALE_PORT_BASE, first_job_id=SCALE_FIRST_JOB_ID,
                                     nodes=NODES))
    with fresh_cluster(cluster, lock, "the scale cluster") as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The out folder of the uninterrupted run at the same world size (local mode, one machine): its
    sample ids of every step and rank, its final parameters."""
    return uninterrupted_run(tmp_path_factory, "scale-reference", ACTIVE * NPROC, TRAIN_ARGS)


class HostSampler:
    """Every 0.5 s: the host's memory in use (MemTotal - MemAvailable), its peak, and the CPU time
    of each `ckptsup launch` (the supervisor) of `job`, kept per process until it ends."""

    def __init__(self) -> None:
        self.job = ""
        self.peak_used = 0
        self.baseline_used = self._used()
        self.loads: list[float] = []
        self.supervisors: dict[int, tuple[float, float, float]] = {}   # pid -> (start, last seen, cpu s)
        # what the test did when (wall clock, as the events' ts) and the agents' processes before the death
        self.killed = self.warned = 0.0
        self.active_pss: dict[str, list[float]] = {}
        self.spare_pss: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used() -> int:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024

    def _supervisor_cpu(self) -> None:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if "launch" not in cmd or not any(c.endswith("ckptsup") or c == "ckptsup.cli" for c in cmd[:3]):
                continue
            try:
                if proc.environ().get("SLURM_JOB_ID") != self.job:
                    continue
                cpu = proc.cpu_times()
                start = self.supervisors.get(proc.pid, (proc.create_time(), 0.0, 0.0))[0]
                self.supervisors[proc.pid] = (start, time.time(), cpu.user + cpu.system)
            except psutil.Error:
                continue

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak_used = max(self.peak_used, self._used())
            self.loads.append(os.getloadavg()[0])
            if self.job:
                self._supervisor_cpu()

    def __enter__(self) -> "HostSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def supervisor_cpu_pct(self) -> list[float]:
        return [round(100 * cpu / max(1e-9, last - start), 1) for start, last, cpu in self.supervisors.values()]


ROLES = (("srun", "srun --"), ("agent", " agent --spec "), ("zygote", "ckptsup.rankside.zygote"),
         ("warm interpreter (waiting)", "ckptsup warm interpreter"), ("rank", "ckptsup rank "),
         ("torchrun", "ckptsup torchrun"), ("warm proxy", "warm_proxy.py"), ("test load", "ckptsup.hooks.testload"),
         ("supervisor", " launch --run-dir "), ("watchdog", " watchdog --run-dir "),
         ("slurmd, slurmstepd, tini, batch shell", "slurm"), ("slurmd, slurmstepd, tini, batch shell", "tini"))


def pss_by_role(cluster: Any, nodes: list[str]) -> dict[str, list[float]]:
    """role -> [processes, PSS MiB] over `nodes`' PID namespaces: what each kind of process costs there
    (PSS: the pages shared by the interpreters forked from one zygote are split between them)."""
    roles: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for node in nodes:
        for pid in cluster.node_pids(node):
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            except (psutil.Error, OSError):
                continue
            role = next((name for name, word in ROLES if word in cmd), "other")
            roles[role][0] += 1
            roles[role][1] += next((int(line.split()[1]) for line in rollup if line.startswith("Pss:")), 0) / 1024
    return {role: [n, round(mib, 1)] for role, (n, mib) in sorted(roles.items())}


@pytest.mark.scale
@pytest.mark.slurm
@pytest.mark.torch
@only_when_selected
def test_sixteen_nodes_a_node_death_to_the_hot_spare_then_a_requeue_onto_the_reserved_spare(
        reference, scale_cluster, tmp_path):
    dc = scale_cluster
    out, run = tmp_path / "out", tmp_path / "run"
    (tmp_path / "job.toml").write_text(f'[slurm]\nspare_partition = "{SPANNING}"\n')   # everything else: defaults
    with HostSampler() as host:
        started = time.monotonic()
        done = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(ACTIVE), "--spares", "1",
                               "--nproc-per-node", str(NPROC), "--config", str(tmp_path / "job.toml"),
                               "--run-dir", str(run), str(TRAIN), *TRAIN_ARGS, *STEP_SLEEP, "--out", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        job = host.job = str(json.loads(done.stdout)["job_id"])
        try:
            events = _chain(dc, job, run, host)
        finally:
            dc.client.cancel(job)
        wall_s = time.monotonic() - started
    worst = _check(events, job, out, reference, dc)
    _figures(events, run, host, wall_s, job, worst)


def _chain(dc: DevClusterFixture, job: str, run: Path, host: HostSampler) -> list[dict]:
    """The three faults, one after the other; returns the run's events at the end."""
    dc.wait_for(lambda: named(read_events(run), "checkpoint_committed") if (run / "events.jsonl").exists() else None,
                600, what="a first checkpoint")
    first = named(read_events(run), "launch")[0]
    [spare] = first["spares"]
    assert len(first["nodes"]) == ACTIVE
    # the spare's agent is warm: it is the one that takes over
    dc.wait_for(lambda: spare in {e["node"] for e in named(read_events(run), "warm_ready")}, 300,
                what="the spare's agent to be warm")
    batch_host = dc.job(job).batch_host
    others = [n for n in first["nodes"] if n != batch_host]
    victim = others[len(others) // 2]   # neither the batch host (the watchdog's case) nor an end of the ring
    host.active_pss = pss_by_role(dc.cluster, first["nodes"])
    host.spare_pss = pss_by_role(dc.cluster, [spare])
    host.killed = time.time()
    with dc.revived(victim):
        dc.kill_node(victim)
        restart = dc.wait_for(lambda: named(read_events(run), "restart_done"), 600, what="the restart on the spare")[0]
        # a checkpoint of the restarted attempt, then the time-limit warning
        dc.wait_for(lambda: [e for e in named(read_events(run), "checkpoint_committed")
                             if e["step"] > restart["resume_step"] and ts(e) > ts(restart)], 600,
                    what="a checkpoint after the restart")
        host.warned = time.time()
        dc.client.cancel(job, signal="USR1", batch=True)
        dc.wait_for(lambda: requeued_run_complete(dc, run), 900, what="the requeued run to complete")
    dc.wait_for(lambda: (i := dc.job(job)) is None or i.state.finished, 120, what=f"job {job} to end")
    return read_events(run)


def requeued_run_complete(dc: DevClusterFixture, run: Path) -> bool:
    """The run completed; fails at once when a node of the job was drained because Slurm could not
    kill the job's processes there (the requeued job may then never find its nodes again)."""
    if named(read_events(run), "run_complete"):
        return True
    stuck = {n: i.reason for n, i in dc.client.node_info().items() if "Kill task failed" in (i.reason or "")}
    assert not stuck, f"Slurm drained {stuck} at the requeue: the old job's processes outlived its kill (UnkillableStepTimeout)"
    return False


def _check(events: list[dict], job: str, out: Path, reference: Path, dc: DevClusterFixture) -> float:
    """The chain's outcome; returns the final parameters' largest distance to the reference's."""
    launches = named(events, "launch")
    first = launches[0]
    [spare] = first["spares"]
    [down] = node_deaths(events)
    victim = down["node"]
    # 1. the node death: blamed, excluded, the hot spare in its place, resumed from a checkpoint
    assert [e["node"] for e in named(events, "node_excluded")] == [victim]
    [restart] = named(events, "restart_done")
    assert restart["path"] == "node" and restart["resume_step"] > 0
    on_spare = launches[1]
    assert on_spare["path"] == "node" and victim not in on_spare["nodes"] and spare in on_spare["nodes"]
    assert len(on_spare["nodes"]) == ACTIVE
    # 2. the time-limit warning: an emergency checkpoint, one requeue without the dead node, to the spanning partition
    stop = [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert stop and "USR1" in stop[0]["detail"]
    [plan] = named(events, "preemption")
    assert plan["signal"] == "time_limit" and plan["emergency_save"] is True
    [requeue] = named(events, "requeue")
    assert "time_limit" in requeue["reason"] and victim in requeue["excluded"] and requeue["partition"] == SPANNING
    assert all(u["ok"] for u in named(events, "requeue_updated")), named(events, "requeue_updated")
    # before it, Slurm finished the agents' step that lost the node (its tree waits a minute for the
    # dead node's report; a requeue sooner drained n1 and n2 'Kill task failed': step_completion.py)
    [finished] = named(events, "agent_steps_finished")
    assert finished["finished"] and finished["lost"] == [victim] and ts(finished) <= ts(requeue), finished
    # 3. the requeued job: on the spanning partition's nodes without the dead one (the reserved spare among
    # them: one node short otherwise), resumed at the emergency checkpoint, to the end
    again = named(events, "supervisor_start")[-1]
    assert again["resumed"] and victim in again["excluded"]
    nodes = named(events, "allocation")[-1]["node_names"]
    assert victim not in nodes and dc.cluster.spec.spare_nodes[0] in nodes and len(nodes) == ACTIVE + 1
    assert victim not in launches[-1]["nodes"] and len(launches[-1]["nodes"]) == ACTIVE
    saved = max(e["step"] for e in named(events, "checkpoint_committed") if ts(e) < ts(requeue))
    resumed = [e for e in named(events, "first_step") if ts(e) > ts(requeue)][0]
    assert resumed["step"] == saved, "the emergency checkpoint is where the requeued run resumes: no step lost"
    [complete] = named(events, "run_complete")
    assert complete["step"] == STEPS - 1, complete
    # every step's sample ids on every rank are the uninterrupted run's: nothing skipped, nothing repeated
    # (a replayed step rewrites its line), through the restart on the spare and the requeue
    for rank in range(ACTIVE * NPROC):
        assert samples(out, rank) == samples(reference, rank), f"rank {rank}'s data order"
    # the parameters: the replicas agree bit for bit, and with the uninterrupted run's to a few ulps, not bit
    # for bit: past two ranks a fresh DDP's first iteration (each resume's) reduces in another order than a
    # running one's (docs/training.md §Bit-exact resume; 4 ranks: max |diff| 9e-8 after one resume)
    final = [torch_load(out / f"final_rank{r}.pt") for r in range(ACTIVE * NPROC)]
    want = torch_load(reference / "final_rank0.pt")
    worst = 0.0
    for name, value in final[0]["model"].items():
        assert all(torch.equal(f["model"][name], value) for f in final[1:]), name
        worst = max(worst, (value - want["model"][name]).abs().max().item())
    assert worst <= PARAM_ATOL, worst
    acc = assert_goodput_accounted(events)
    assert acc.requeues == 1
    return worst


def _figures(events: list[dict], run: Path, host: HostSampler, wall_s: float, job: str, worst: float) -> None:
    """One SCALE_RUN line for BENCHMARKS.md, and the run's story (`ckptsup log`)."""
    [down] = node_deaths(events)
    [requeue] = named(events, "requeue")
    stop = [f for f in named(events, "failure_detected") if f["kind"] == "preempted"][0]
    first_steps = named(events, "first_step")
    after_death = [e for e in first_steps if ts(e) > ts(down)][0]
    after_requeue = [e for e in first_steps if ts(e) > ts(requeue)][0]
    figures = {
        "job": job, "nodes": NODES, "active": ACTIVE, "ranks": ACTIVE * NPROC, "steps": STEPS,
        "wall_s": round(wall_s, 1),
        "death_detected_s": round(ts(down) - host.killed, 2),
        "death_to_first_step_s": round(ts(after_death) - ts(down), 2),
        "kill_to_first_step_s": round(ts(after_death) - host.killed, 2),
        "restart_phases": named(events, "restart_done")[0].get("phases"),
        "warning_to_first_step_s": round(ts(after_requeue) - host.warned, 2),
        "stop_detected_to_first_step_s": round(ts(after_requeue) - ts(stop), 2),
        "supervisor_cpu_pct": host.supervisor_cpu_pct(),
        "host_mem_used_gib": {"before": round(host.baseline_used / 2**30, 2), "peak": round(host.peak_used / 2**30, 2)},
        "load_1m": {"max": max(host.loads, default=0.0), "mean": round(sum(host.loads) / max(1, len(host.loads)), 2)},
        "pss_mib_active_nodes": host.active_pss,
        "pss_mib_spare_node": host.spare_pss,
        "param_max_abs_diff": worst,
    }
    story = subprocess.run([*CKPTSUP, "log", str(run)], capture_output=True, text=True, timeout=60)
    print(f"\n{story.stdout}\nSCALE_RUN {json.dumps(figures)}")


# ---- `dev-cluster up --nodes N`: cheap, in every run (the unit tier and the real-cluster tier) ----------


def test_the_node_count_out_of_range_and_ports_past_65535_are_one_line_naming_the_fix(tmp_path):
    from ckptsup.errors import DevClusterError
    from ckptsup.slurm.devconf import ClusterSpec

    for nodes in (1, 257):
        with pytest.raises(DevClusterError, match=rf"^--nodes {nodes}: .*choose --nodes between 2 and 256$"):
            ClusterSpec(dir=tmp_path, nodes=nodes)
    with pytest.raises(DevClusterError, match=r"^--nodes 16 from --port-base 65520 needs ports up to 65536, past "
                                              r"65535; choose a --port-base of at most 65519$"):
        ClusterSpec(dir=tmp_path, nodes=16, port_base=65520)
    with pytest.raises(DevClusterError, match="choose between 1 and 4 spare nodes"):
        ClusterSpec(dir=tmp_path, nodes=5, spares=5)
    done = subprocess.run([*CKPTSUP, "dev-cluster", "up", "--nodes", "0", "--dir", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("ckptsup: error: --nodes 0: ") and not (tmp_path / "c").exists()


def test_sixteen_nodes_scale_the_partitions_and_the_ports_and_the_default_stays_five():
    from ckptsup.slurm.devconf import ClusterSpec, nodes_in_conf, render_gres_conf, render_slurm_conf

    spec = ClusterSpec(dir=Path("/x/c"), nodes=16, port_base=18100)
    text = render_slurm_conf(spec, controller_host="host")
    lines = {line.split()[0]: line for line in text.splitlines() if line and not line.startswith("#")}
    assert "Port=[18101-18116]" in lines["NodeName=n[1-16]"] and spec.ports() == list(range(18100, 18117))
    assert " Nodes=n[1-15] Default=YES" in lines["PartitionName=main"]
    assert " Nodes=n16 " in lines["PartitionName=spares"]
    for spanning in ("mainspare", "lowprio", "lowprio120", "highprio"):
        assert " Nodes=n[1-16] " in lines[f"PartitionName={spanning}"]
    assert render_gres_conf(spec).splitlines()[1].startswith("NodeName=n[1-16] ")
    assert nodes_in_conf(text) == 16 and nodes_in_conf("# no nodes\n") is None
    default = ClusterSpec(dir=Path("/x/c"))
    assert default.nodes == 5 and default.spare_nodes == ["n5"] and nodes_in_conf(render_slurm_conf(default, controller_host="h")) == 5


@pytest.mark.slurm
def test_up_with_16_nodes_and_the_commands_after_it_know_the_size_and_down_leaves_nothing(tmp_path):
    """The CLI end to end on a real 16-node cluster (its own directory and ports, ~3 s): `up --nodes 16`,
    then `status`, `kill-node n16`, `revive-node n16` without --nodes (read from its slurm.conf); `up`
    of the default size there is refused in one line; a `down` that knows only 5 nodes stops all 16."""
    from ckptsup.slurm.devcluster import DevCluster
    from ckptsup.slurm.devconf import ClusterSpec

    directory, base = tmp_path / "c16", 18200   # past the scale run's 18100-18116
    where = ["--dir", str(directory), "--port-base", str(base)]
    cli = [*CKPTSUP, "dev-cluster"]
    with open("/tmp/ckptsup-scale-cli-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # another session's run of this test: ~3 s
        try:
            up = subprocess.run([*cli, "up", "--nodes", "16", "--json", *where, "--first-job-id", "950001"],
                                capture_output=True, text=True, timeout=120)
            assert up.returncode == 0, up.stderr
            assert sorted(json.loads(up.stdout)["node_local"], key=lambda n: int(n[1:])) == [f"n{k}" for k in range(1, 17)]
            status = json.loads(subprocess.run([*cli, "status", "--json", *where], capture_output=True, text=True,
                                               timeout=60, check=True).stdout)
            assert len(status["nodes"]) == 16 and all(v["responding"] for v in status["nodes"].values()), status
            assert all(status["daemons"][f"node-n{k}"] for k in range(1, 17))
            killed = subprocess.run([*cli, "kill-node", "n16", *where], capture_output=True, text=True, timeout=60)
            assert killed.returncode == 0 and killed.stdout.startswith("n16 killed"), killed.stderr
            revived = subprocess.run([*cli, "revive-node", "n16", *where], capture_output=True, text=True, timeout=120)
            assert revived.returncode == 0 and revived.stdout.startswith("n16 back in service"), revived.stderr
            again = subprocess.run([*cli, "up", *where], capture_output=True, text=True, timeout=60)
            assert again.returncode == 1 and len(again.stderr.splitlines()) == 1, again.stderr
            assert "with another configuration; run `ckptsup dev-cluster down" in again.stderr
        finally:
            small = DevCluster(ClusterSpec(dir=directory, port_base=base))   # 5 nodes: the records say 16
            pids = small.running_pids()
            small.down()
    assert len(pids) >= 2 + 3 * 16   # munged, slurmctld, and per node: unshare + tini + slurmd
    assert [p for p in pids if alive(p)] == [] and small.running_pids() == []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
