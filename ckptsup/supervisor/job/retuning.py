"""What the ranks are told as the run measures them, so that their schedule and timeouts follow
their measured pace:

  the checkpoint schedule  the disk interval and the memory saves' every_steps, decided by the
                           interval tuner (interval_tuner.py) from every event the loop writes and
                           from the ranks' hellos (each says its own disk schedule); a change goes
                           to every rank as `set_interval` and is recorded as `interval_changed`
  the collective timeout   a launch that knew no step time runs with steady = init
                           (docs/timeouts.md §3); once STEADY_AFTER_STEPS steps of the attempt are
                           measured, the ranks' collective timeout is tightened (`set_timeout`,
                           `collective_timeout_set`), and with it the tracker's hang cap, which
                           keeps the supervisor's detection first
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ... import messages
from ...config import Config
from ...events import Event, EventWriter
from .agent_set import AgentSet
from .attempt import AttemptTracker
from .interval_tuner import IntervalChange, IntervalTuner
from .nccl import Timeouts
from .operating import Emit
from . import recovery

STEADY_AFTER_STEPS = 10  # steps measured before a launch that knew none gets its steady collective timeout


def steady_timeouts(config: Config, current: Timeouts | None, *, step_times: Sequence[float],
                    save_s: float | None) -> Timeouts | None:
    """The timeouts the measured steps call for, when their collective timeout is shorter than the
    launch's; None otherwise (never longer: the ranks' groups were made with the launch's). Pure."""
    steady = recovery.attempt_timeouts(config, step_times=step_times, save_s=save_s)
    if current is None or steady.collective_s >= current.collective_s:
        return None
    return steady


class Retuning:
    def __init__(self, *, config: Config, interval: IntervalTuner, agents: AgentSet, emit: Emit,
                 writer: Callable[[], EventWriter | None]) -> None:
        self.config = config
        self.interval = interval
        self.agents = agents
        self.emit = emit
        self.writer = writer   # the loop's: interval_changed is written past emit (no event of the tuner's own feeds it)
        self.timeouts: Timeouts | None = None   # the current attempt's collective timeouts
        self.steady_pending = False             # launched before any step was measured

    def observe(self, record: dict[str, Any]) -> None:
        """Every event the loop wrote: the tuner's inputs (commits, failures, restarts, …)."""
        for change in self.interval.observe(record):
            self._set_interval(change)

    def on_hello(self, tracker: AttemptTracker, hello: messages.Hello, *, measured: dict[str, Any]) -> None:
        """A rank's hello says its own disk schedule, the memory saves' cap (kept in `measured`:
        state.json's). Retuned at the last rank's hello: a set_interval sent earlier misses the ranks
        not yet connected, and the ranks apply one only once every rank holds it."""
        measured.update(self.interval.learn_schedule(
            {"save_every_steps": hello.save_every_steps, "save_every_s": hello.save_every_s}))
        if tracker.hellos == tracker.world_size:
            for change in self.interval.retune("hello"):
                self._set_interval(change)

    def launch(self, *, step_times: list[float], save_s: float | None) -> Timeouts:
        """The next launch's timeouts, from the step times measured so far (none: steady = init,
        tightened once this attempt's are measured)."""
        self.timeouts = recovery.attempt_timeouts(self.config, step_times=step_times, save_s=save_s)
        self.steady_pending = not step_times
        return self.timeouts

    def on_steps(self, tracker: AttemptTracker, *, save_s: float | None) -> None:
        """After a step: the steady collective timeout, once enough of this attempt's steps are measured."""
        if not (self.steady_pending and len(tracker.step_window.samples) >= STEADY_AFTER_STEPS):
            return
        self.steady_pending = False
        was, steady = self.timeouts, steady_timeouts(self.config, self.timeouts, step_times=tracker.step_window.samples,
                                                     save_s=save_s)
        if was is None or steady is None:
            return
        self.agents.send(messages.SetTimeout(collective_s=round(steady.collective_s, 3)))
        tracker.hang_cap_s, tracker.save_allowance_s = steady.hang_cap_s, steady.save_allowance_s
        self.emit(Event.COLLECTIVE_TIMEOUT_SET, collective_s=round(steady.collective_s, 3),
                  was_s=round(was.collective_s, 3), steps=len(tracker.step_window.samples))
        self.timeouts = steady

    def _set_interval(self, change: IntervalChange) -> None:
        """The ranks follow a new disk interval or memory schedule."""
        self.agents.send(change.command())
        writer = self.writer()
        assert writer is not None
        writer.emit(Event.INTERVAL_CHANGED, **change.event_fields())
