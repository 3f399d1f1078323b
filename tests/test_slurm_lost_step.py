"""Slurm finishes a step that lost a node a minute late, and a job ended sooner drains healthy nodes
(docs/slurm.md §Seen on the dev cluster; supervisor/job/step_completion.py). On a real cluster of
ten nodes (a step of nine: the dead node's report is awaited by an interior node of slurmstepd's
tree as well as the first): the agents' step as the supervisor runs it (placement's srun flags,
agent_step.AgentStep, agent_set.AgentSet), a node killed under it, then the job's end as the
supervisor carries it out: the agents told to leave, the wait for Slurm to list the step no more,
`scontrol requeue` — and no node drained. (The end-to-end run: tests/test_scale_slurm.py.)"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ckptsup.slurm.devcluster import DevCluster
from ckptsup.slurm.devconf import ClusterSpec
from ckptsup.slurm.parsers import JobState
from ckptsup.supervisor.job.agent_set import AgentSet
from ckptsup.supervisor.job.agent_step import AgentStep, CommandSender, Inbox
from ckptsup.supervisor.job.placement import AGENT_STEP_FLAGS
from ckptsup.supervisor.job.step_completion import agent_steps, wait_budget_s, wait_for_agent_steps
from ckptsup.slurm.client import SlurmClient

from conftest import TEST_PORT_BASE, DevClusterFixture

pytestmark = pytest.mark.slurm

NODES = 10                          # main n1-n9, the spare n10
STEP = [f"n{i}" for i in range(1, 10)]
VICTIM = "n6"                       # under n2 in a 7-wide tree of 9 (ranks 1-8 are n2's subtree)
# a stand-in agent: it leaves when its input ends, as the real one does (agent._read_stdin)
AGENT = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.buffer.read()"]


def test_a_job_ended_after_the_step_that_lost_a_node_is_finished_drains_no_node(dev_cluster: DevClusterFixture,
                                                                             tmp_path: Path) -> None:
    slot = (dev_cluster.cluster.spec.port_base - TEST_PORT_BASE) // 10   # this session's slot: ports of its own
    # a short directory: slurmstepd's sockets live under it (108 bytes at most; an xdist tmp_path is too long)
    home = Path(tempfile.mkdtemp(prefix="ckptsup-ten-", dir="/tmp"))
    cluster = DevCluster(ClusterSpec(dir=home, port_base=18200 + 20 * slot, nodes=NODES,
                                     first_job_id=800_001 + 1_000 * slot))
    cluster.up()
    try:
        client = cluster.client()
        job = client.submit(_script(tmp_path),
                            ["--nodes=9", "--no-kill", "--requeue", f"--output={tmp_path}/job.out"])
        DevClusterFixture.wait_for(lambda: _state(client, job) is JobState.RUNNING, 60, what="the job to run")
        inbox = Inbox()
        step = AgentStep(argv=SlurmClient.srun_argv(nodes=STEP, command=AGENT, job_id=job, extra=list(AGENT_STEP_FLAGS)),
                         env=client.env, nodes=STEP, secret=b"k" * 32, sender=CommandSender(b"k" * 32), inbox=inbox,
                         log_path=tmp_path / "agents.log")
        agents = AgentSet()
        agents.add(step)
        DevClusterFixture.wait_for(lambda: agent_steps(client.job_steps(job)), 60, what="the agents' step")
        time.sleep(2)   # every task started (their `up` lines go to the step's reader, not checked)

        cluster.kill_node(VICTIM)
        agents.lose(VICTIM)   # the supervisor's verdict: node_down, excluded
        DevClusterFixture.wait_for(lambda: VICTIM not in (client.job_info(job).nodes or [VICTIM]), 60,
                                   what=f"Slurm to remove {VICTIM} from the job")

        # the job's end, as the loop's _requeue carries it out
        agents.close(10.0)
        assert not step.alive(), "srun ends by itself once its agents left (--no-kill: the dead node's task is done)"
        lost = agents.take_lost()
        assert lost == {VICTIM: 9}
        budget = wait_budget_s(step_nodes=9, now=time.time(), end_time=None)
        wait = wait_for_agent_steps(client, job, budget_s=budget, lost=sorted(lost))
        assert wait.finished, wait
        # the premise: Slurm held the step for its tree's minute after every live agent had gone
        assert wait.waited_s > 30, f"Slurm finished the step {wait.waited_s:.1f} s after its agents left"
        client.requeue(job)
        # the old job's kill finds nothing left: it is pending again at once, and no node is drained
        DevClusterFixture.wait_for(lambda: _state(client, job) is JobState.PENDING, 30,
                                   what="the requeued job to be pending (its kill completed)")
        drained = {n: i.reason for n, i in client.node_info().items() if "kill task failed" in i.reason.lower()}
        assert drained == {}
    finally:
        cluster.down()
    assert cluster.running_pids() == []
    shutil.rmtree(home, ignore_errors=True)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\nsleep 900\n")
    return path


def _state(client: SlurmClient, job: str) -> JobState | None:
    info = client.job_info(job)
    return None if info is None else info.state
