"""Containers on the real dev cluster (docs/containers.md): Slurm's own OCI support, `srun --container`,
with runc and the cluster's test bundle (`dev-cluster up --containers`: an empty read-only rootfs binding
the host's system directories, this checkout and its venv; a 64 MiB /dev/shm; Slurm's commands covered
by /dev/null, so no agent can run one). One job at the defaults but for the container option meets every
fault in turn inside containers: a rank SIGKILLed (its real process, found on the host), a hang, its
second node killed (the spare takes over), a preemption with an emergency checkpoint and a requeue whose
new agents start in containers again — and ends with the uninterrupted reference's parameters. Also: an
interpreter that is not in the container ends the run in one line before anything else is spent.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ckptsup.events import read_events

from drop_in_helpers import env_processes, with_real_ranks
from run_helpers import CKPTSUP, named, node_deaths, preempt
from supervisor_slurm_helpers import (  # noqa: F401 - reference is a fixture
    TRAIN, active_nodes, committed, job_config, reference, submit
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.matrix]   # also on 24.11 and 26.05 (make test-slurm-matrix)


def container_flags(dev_cluster, python: str | None = None) -> tuple[str, ...]:
    import sys

    return ("--container", str(dev_cluster.cluster.spec.bundle), "--container-python", python or sys.executable)


def pid_levels(pid: int) -> list[int]:
    """The pids of a host process in each pid namespace it is in, the host's first (/proc/PID/status NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def ranks_of(run: Path, rank: str | None = None) -> list:
    return with_real_ranks(env_processes(CKPTSUP_RUN_DIR=str(run), RANK=rank))


def after(events: list[dict], name: str, ts: str) -> list[dict]:
    return [e for e in named(events, name) if e["ts"] > ts]


def test_every_fault_inside_oci_containers_resumes_bit_identically(dev_cluster, tmp_path, reference):
    release = tmp_path / "release"
    job, run, out = submit(tmp_path, nodes=2, spares=1, partition="lowprio", flags=container_flags(dev_cluster),
                           extra=("--step-sleep-s", "0.3", "--hang-at-step", "25", "--hold-at-step", "40",
                                  "--hold-file", str(release)))
    dev_cluster.wait_for(lambda: committed(run, 10), 180, what="a checkpoint at step 10")
    # the ranks run in a pid namespace of their own: the host's, the dev-cluster node's, the container's
    ranks = ranks_of(run)
    assert ranks and all(len(pid_levels(p.pid)) == 3 for p in ranks), [pid_levels(p.pid) for p in ranks]
    # 1. a rank SIGKILLed: its real process (a warm rank's interpreter, not its proxy)
    victim_rank = ranks_of(run, "1")[-1]
    os.kill(victim_rank.pid, signal.SIGKILL)
    dev_cluster.wait_for(lambda: len(named(read_events(run), "restart_done")) >= 1, 120, what="the crash's restart")
    # 2. the hang at step 25 (rank 0, once), then 3. the second node's death while the ranks wait at step 40
    dev_cluster.wait_for(lambda: len(named(read_events(run), "restart_done")) >= 2, 180, what="the hang's restart")
    dev_cluster.wait_for(lambda: committed(run, 35), 120, what="a checkpoint at step 35 after the hang")
    node = active_nodes(run)[1]   # not the batch host
    with dev_cluster.revived(node):
        dev_cluster.kill_node(node)
        dev_cluster.wait_for(lambda: len(named(read_events(run), "restart_done")) >= 3, 180,
                             what="the node death's restart on the spare")
        release.touch()
        # 4. a preemption on the nodes now running: an emergency checkpoint, a requeue, containers again
        dev_cluster.wait_for(lambda: committed(run, 45), 120, what="a checkpoint at step 45 on the spare")
        preempt(dev_cluster, active_nodes(run))
        try:
            dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 400,
                                 what="the requeued run to complete")
        except BaseException:   # pytest's Failed: the run's own story says where it stopped
            import subprocess
            story = subprocess.run([*CKPTSUP, "log", str(run)], capture_output=True, text=True, timeout=60)
            print(story.stdout[-6000:], story.stderr[-2000:])
            raise
    events = read_events(run)
    kinds = [f["kind"] for f in named(events, "failure_detected")]
    assert kinds[:2] == ["crash", "hang"] and kinds[-1] == "preempted", kinds
    assert node_deaths(events) and node_deaths(events)[-1]["node"] == node
    [plan] = named(events, "preemption")
    assert plan["emergency_save"] is True
    second = named(events, "supervisor_start")[-1]
    assert second["resumed"] is True
    # the requeued job's health checks blame no node (a job still completing is asked again)
    assert all(h["ok"] for h in after(events, "health_check", second["ts"])), after(events, "health_check", second["ts"])
    saved = max(e["step"] for e in named(events, "checkpoint_committed") if e["ts"] < second["ts"])
    assert [e for e in named(events, "first_step") if e["ts"] > second["ts"]][0]["step"] == saved
    # every agent, before the requeue and after it, was the init of an OCI container and found its node there
    started = named(events, "agent_started")
    assert after(events, "agent_started", second["ts"]), "the requeued job's agents"
    # (22.05 gives a container srun's environment only: the node comes from Slurm's container id; 24.11+
    # hands it the task's, SLURMD_NODENAME included)
    assert all(e["container"] == "oci" and e["pid"] == 1 and e["node_from"] in ("container id", "SLURMD_NODENAME")
               for e in started), started
    first = named(events, "launch")[0]
    assert {e["node"] for e in started if e["ts"] < second["ts"]} == {*first["nodes"], *first["spares"]}
    assert all(e["shm_free"] <= 64 << 20 and e["container_s"] is not None for e in started)
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference
    # no agent ran a Slurm command (they are /dev/null in the bundle), and the node was drained by the supervisor
    assert not [e for e in named(events, "node_excluded") if e["node"] == node and e.get("drained") is False]


def test_an_interpreter_missing_from_the_container_is_one_line_before_any_launch(dev_cluster, tmp_path):
    config = job_config(tmp_path)
    proc_run = tmp_path / "run"
    import subprocess

    done = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "1", "--spares", "0",
                           *container_flags(dev_cluster, python="/opt/no-such-python"), "--config", str(config),
                           "--run-dir", str(proc_run), str(TRAIN), "--steps", "5"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    dev_cluster.wait_for(lambda: (proc_run / "events.jsonl").exists() and named(read_events(proc_run), "give_up"),
                         120, what="the give-up")
    [give_up] = named(read_events(proc_run), "give_up")
    assert "the agents could not start" in give_up["reason"] and "[container] python" in give_up["reason"]
    events = read_events(proc_run)
    assert not named(events, "failure_detected") and not named(events, "node_excluded")   # no node blamed
    assert len(named(events, "supervisor_start")) == 1   # not requeued: it would fail the same way
