"""Before the job ends, Slurm has finished every agents' step that ran on a node that died.

A step of at least REVERSE_TREE_WIDTH (7) nodes reports its end up a tree of its nodes
(slurmstepd's reverse tree; a smaller step's nodes each report to slurmctld): each node's stepd
waits for its children's reports, up to REVERSE_TREE_CHILDREN_TIMEOUT = 60 s plus 3 s a level below
it, then reports to its parent; the step's first node reports to slurmctld. A node that died under
the step never reports, so its parent and every node above it wait that full minute after the
step's tasks end. If the job ends meanwhile (`scontrol requeue`, or the
batch script's exit), slurmd's kill of the job reaches stepds that cannot end within
UnkillableStepTimeout (60 s by default): Slurm drains those healthy nodes "Kill task failed", and a
requeued job may find too few nodes to start. Seen at 15 nodes on the dev cluster and reproduced
with a plain `srun --no-kill` step, a killed node and `scontrol requeue` (BENCHMARKS.md §Scale).

So when a node was lost under one of our steps of 7 nodes or more, the run ends in this order: the agents are told to
exit and their srun ends on its own (a killed srun has slurmstepd kill the tasks: a kill of its
own), then the supervisor waits until `squeue --steps` lists no agents' step, then it requeues or
exits. The wait is bounded by what the tree can take, and never runs past the job's time limit less
the margin a requeue needs: two drained nodes cost less than a job that times out unrequeued.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from ... import console
from ...errors import SlurmCommandError
from ...slurm.parsers import StepInfo

AGENTS_STEP_NAME = "ckptsup-agents"   # srun --job-name of every agents' step (placement.agent_argv)
# slurmstepd's REVERSE_TREE_WIDTH in 22.05 (the 15-node drain matched it); a step of fewer nodes has
# no tree. 24.11 (TreeWidth 16) held a 9-node step that lost a node the same 66 s (docs/slurm.md)
TREE_WIDTH = 7
CHILDREN_TIMEOUT_S = 60.0             # slurmstepd's REVERSE_TREE_CHILDREN_TIMEOUT
LEVEL_S = 3.0                         # ... plus this a level of the tree below a node
SLACK_S = 10.0                        # the last report's hops, slurmctld's bookkeeping, our polls
TIME_LIMIT_MARGIN_S = 15.0            # a requeue (and its finisher's first poll) before the time limit
POLL_S = 1.0


class StepsClient(Protocol):
    def job_steps(self, job_id: str) -> list[StepInfo]: ...


def tree_waits(step_nodes: int) -> bool:
    """Does a step of this many nodes report its end up a tree (where a dead node holds its
    ancestors a minute)? Below the width every node reports to slurmctld itself: nothing waits, and
    slurmctld may list such a step until the job ends (seen at 3 nodes), so it is not waited for."""
    return step_nodes >= TREE_WIDTH


def tree_bound_s(step_nodes: int) -> float:
    """The longest a step's end can take to reach slurmctld with dead nodes in it: the children's
    timeout plus 3 s a level, levels counted as in a binary tree (Slurm's is 7 wide in 22.05 and
    may follow TreeWidth in others: a binary tree is never shallower)."""
    levels = max(1, math.ceil(math.log2(max(step_nodes, 2))))
    return CHILDREN_TIMEOUT_S + LEVEL_S * levels + SLACK_S


def wait_budget_s(*, step_nodes: int, now: float, end_time: float | None) -> float:
    """How long to wait: the tree's bound, cut to the job's time limit (epoch s; None: none
    known) less TIME_LIMIT_MARGIN_S."""
    bound = tree_bound_s(step_nodes)
    if end_time is None:
        return bound
    return max(0.0, min(bound, end_time - TIME_LIMIT_MARGIN_S - now))


def agent_steps(steps: Sequence[StepInfo]) -> tuple[str, ...]:
    return tuple(s.step_id for s in steps if s.name == AGENTS_STEP_NAME)


@dataclass(frozen=True, kw_only=True)
class StepWait:
    finished: bool                 # Slurm lists no agents' step any more
    waited_s: float
    budget_s: float
    left: tuple[str, ...] = ()     # agents' steps still listed when the budget ran out
    error: str = ""                # the last query's failure, when the last query failed

    def as_event(self) -> dict[str, object]:
        return {"finished": self.finished, "waited_s": round(self.waited_s, 2), "budget_s": round(self.budget_s, 1),
                "left": list(self.left), **({"error": self.error} if self.error else {})}


def wait_for_agent_steps(client: StepsClient, job_id: str, *, budget_s: float, lost: Sequence[str],
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep) -> StepWait:
    """Poll `squeue --steps` until the job lists no agents' step, at most `budget_s`; one console
    line before a wait that is not over at once, one after."""
    start = clock()
    said = False
    left: tuple[str, ...] = ()
    error = ""
    while True:
        try:
            left, error = agent_steps(client.job_steps(job_id)), ""
        except SlurmCommandError as err:   # slurmctld busy or restarting: asked again until the budget is spent
            error = str(err)
        waited = clock() - start
        if not left and not error:
            if said:
                console.info(f"ckptsup: Slurm finished the agents' step {waited:.1f} s after its agents left")
            return StepWait(finished=True, waited_s=waited, budget_s=budget_s)
        if waited >= budget_s:
            break
        if not said:
            console.info(f"ckptsup: waiting up to {budget_s:.0f} s for Slurm to finish the agents' step that ran on "
                         f"{', '.join(lost)} (lost): its nodes report its end up a tree that waits a minute for a "
                         "dead node, and a job ending sooner has Slurm drain healthy nodes 'Kill task failed'")
            said = True
        sleep(min(POLL_S, max(0.0, budget_s - waited)))
    console.warning(f"ckptsup: Slurm still lists the agents' step {', '.join(left) or '(query failed: ' + error + ')'} "
                    f"after {waited:.0f} s; ending the job anyway (Slurm may drain nodes 'Kill task failed'; "
                    "`scontrol update NodeName=... State=RESUME` returns them)")
    return StepWait(finished=False, waited_s=waited, budget_s=budget_s, left=left, error=error)
