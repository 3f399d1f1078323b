"""The attempt tracker's verdicts that are not failures, said and carried out by the loop each
tick (attempt.py queues them; each is taken once): the supervision level once it is known, a
script without hooks that shows no progress line, the ranks' stacks a suspected hang asks for
(liveness.py), a loss jump after a restore (restore_check.py), ranks busy without progress — not
hung — and the end of it. Each report is one event and, where a person should look, one console
line; the only command is `stacks`, to the agents of the nodes still running.
"""

from __future__ import annotations

from typing import Callable

from ... import console, messages
from ...config import SupervisorConfig
from ...events import Event
from .agent_set import AgentSet
from .attempt import AttemptTracker
from .observations import SupervisionLevel
from .operating import Emit
from .unhooked import level_detail


class TrackerNews:
    def __init__(self, *, emit: Emit, agents: AgentSet, clock: Callable[[], float], sup: SupervisorConfig) -> None:
        self.emit = emit
        self.agents = agents
        self.clock = clock
        self.sup = sup

    def level(self, tracker: AttemptTracker, attempt: int) -> None:
        """The supervision_level event when the attempt's level becomes known (the process level
        also on the console: nothing will detect a hang); the progress_stale warning when a script
        without hooks shows no progress line for progress_warn_s."""
        level = tracker.take_level()
        if level is not None:
            self.emit(Event.SUPERVISION_LEVEL, level=level, detail=level_detail(level, self.sup))
            if level is SupervisionLevel.PROCESS:
                console.info(f"ckptsup: attempt {attempt}: {level_detail(level, self.sup)}")
        stale = tracker.progress_stale(self.clock(), self.sup.progress_warn_s)
        if stale is not None:
            self.emit(Event.PROGRESS_STALE, since_launch_s=round(stale, 1), pattern=self.sup.progress_pattern)

    def after_check(self, tracker: AttemptTracker) -> None:
        """What the tracker's check asked for: the ranks' stacks from their agents, a
        `restore_loss_jump` warning, a `busy` event when ranks work without progress (not a hang),
        `busy_over` when they progress again."""
        if tracker.want_stacks:
            nodes = {n for n in tracker.nodes if n not in tracker.done_nodes}
            self.agents.send(messages.Stacks(), nodes=sorted(nodes))
            tracker.asked_for_stacks(self.clock(), nodes)
        while tracker.restore_news:
            jump = tracker.restore_news.pop(0)
            self.emit(Event.RESTORE_LOSS_JUMP, step=jump.step, loss=jump.loss, before=jump.before, basis=jump.basis,
                      detail=jump.detail)
            console.warning(f"ckptsup: warning: {jump.detail}")
        while tracker.busy_news:
            news = tracker.busy_news.pop(0)
            self.emit(Event.BUSY, ranks=list(news.ranks), detail=news.detail,
                      silent_s=None if tracker.busy_quiet_since is None else round(self.clock() - tracker.busy_quiet_since, 3))
            console.warning(f"ckptsup: no progress past the hang timeout, but the ranks work: busy, not hung ({news.detail}; "
                            f"killed only after supervisor.busy_limit_s={self.sup.busy_limit_s:g}s)")
        while tracker.busy_over_news:
            ranks, busy_s = tracker.busy_over_news.pop(0)
            self.emit(Event.BUSY_OVER, ranks=list(ranks), busy_s=round(busy_s, 3))
