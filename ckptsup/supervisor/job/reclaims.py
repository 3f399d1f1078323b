"""The clouds' reclaim notices, carried out (docs/cloud.md): the agents hear them
(supervisor/node/cloud_notice.py) and send `cloud_notice` frames; `preemption.plan_notice` decides
what each one leads to (pure); `Reclaims` keeps the notices heard until the loop takes them, and
carries each plan out: a spare excluded; a training node's ranks moved to a spare (or the job
requeued without it) after an emergency checkpoint when one fits — an operator's replace, with the
notice's deadline — else at once; a run with nowhere to move them stopped as a preemption.

A reclaimed node is excluded but never drained: its next instance is another machine.
"""

from __future__ import annotations

from typing import Callable

from ... import console, messages
from ...config import Config
from ...events import Event
from ...rundir import RunState
from .agent_set import AgentSet
from .attempt import AttemptTracker
from .observations import Failure, FailureKind
from .operating import Emit, Operator, PendingReplace
from .preemption import NoticePlan, NoticeWay, plan_notice


class Reclaims:
    """The notices heard, the nodes reclaimed, and the window of a notice that stops the run."""

    def __init__(self, *, config: Config, operator: Operator, agents: AgentSet, emit: Emit,
                 clock: Callable[[], float], exclude: Callable[[str, str], None],
                 spares: Callable[[], tuple[str, ...]], run_state: Callable[[], RunState], can_requeue: bool) -> None:
        self.config = config
        self.operator = operator     # its pending replace is the machinery a move waits in
        self.agents = agents
        self.emit = emit
        self.clock = clock
        self.exclude = exclude       # the loop's: excludes (and drains unless reclaimed) a node
        self.spares = spares         # this attempt's spare nodes, in pick order
        self.run_state = run_state   # the loop's RunState: excluded nodes, measured save times
        self.can_requeue = can_requeue
        self.heard: list[tuple[str, messages.CloudNotice, float]] = []   # (node, notice, recv) to decide on
        self.reclaimed: set[str] = set()               # nodes a cloud takes back: excluded, never drained
        self.stop: tuple[float, float] | None = None   # (recv, ahead_s) of the notice that stops the run

    def offer(self, node: str, notice: messages.CloudNotice, recv: float) -> None:
        """A notice as it comes: decided on in the loop (`take`), never during a wait."""
        self.heard.append((node, notice, recv))

    def take(self, tracker: AttemptTracker, active: tuple[str, ...]) -> Failure | None:
        """The notices heard so far, each decided on (`plan_notice`), written as one `cloud_notice`
        event and one console line, and carried out; the first failure (a move, a stop) is the
        loop's to recover from. A notice for a node while another node's replace waits for its
        checkpoint waits its turn, as do the notices after a failure."""
        waiting, failure = [], None
        for node, notice, recv in self.heard:
            pending = self.operator.replace
            if failure is not None or (pending is not None and pending.node != node and node in active):
                waiting.append((node, notice, recv))
                continue
            state = self.run_state()
            plan = plan_notice(node=node, ahead_s=notice.ahead_s, config=self.config, active=active,
                               spares=self.spares(), excluded=frozenset(state.excluded_nodes),
                               can_requeue=self.can_requeue,
                               checkpoints=not self.operator.save_refusal(tracker),
                               save_s=state.measured.get("stall_s"), write_s=state.measured.get("write_s"),
                               elapsed_s=self.clock() - recv, step_p99_s=tracker.step_window.p99())
            self.emit(Event.CLOUD_NOTICE, node=node, cloud=notice.cloud, action=notice.action, deadline=notice.deadline,
                      ahead_s=notice.ahead_s, detail=notice.detail, step=tracker.current_step(), **plan.as_event())
            console.warning(f"ckptsup: cloud notice: {notice.cloud} will {notice.action} {node} at {notice.deadline} "
                            f"({notice.ahead_s:.0f}s ahead): {plan.reason}")
            failure = self._carry_out(node, notice, plan, tracker, active)
        self.heard = waiting
        return failure

    def _carry_out(self, node: str, notice: messages.CloudNotice, plan: NoticePlan, tracker: AttemptTracker,
                   active: tuple[str, ...]) -> Failure | None:
        detail = f"cloud notice: {notice.cloud} {notice.action} at {notice.deadline}"
        if plan.way is NoticeWay.IGNORE:
            return None
        self.reclaimed.add(node)   # the cloud takes it back: excluded, but not drained (its next instance is another machine)
        if plan.way is NoticeWay.EXCLUDE:
            self.exclude(node, detail)
            return None
        if plan.way is NoticeWay.STOP:
            self.stop = (self.clock(), plan.window_s)
            return Failure(kind=FailureKind.PREEMPTED, step=tracker.current_step(), detail=detail)
        if plan.way is NoticeWay.MOVE:
            pending = self.operator.replace
            if pending is not None and pending.node == node:
                self.operator.replace = None   # a replace of the same node waited for a checkpoint: it moves now
            return Failure(kind=FailureKind.REPLACED, node=node, step=tracker.current_step(), suspects=(node,),
                           detail=detail)
        deadline = self.clock() + plan.move_by_s
        pending = self.operator.replace
        if pending is not None and pending.node == node:   # already waiting for a checkpoint: by the deadline now
            pending.deadline = deadline if pending.deadline is None else min(pending.deadline, deadline)
            pending.detail = detail
            return None
        self.operator.replace = PendingReplace(request=f"cloud-notice-{node}", node=node,
                                               after_step=tracker.current_step() or 0, deadline=deadline,
                                               detail=detail)
        self.agents.send(messages.SaveNow(reason=f"cloud notice for {node}"), nodes=list(active))
        return None
