"""Phases: what a rank says it is doing, for the supervisor's allowances (docs/training.md §Phases).

    with ckptsup.phase("eval"):          # or @ckptsup.phase("eval") on a function
        for batch in val_loader:
            evaluate(batch)
            ckptsup.phase_heartbeat()    # optional: the eval allowance runs from the last one

A rank's `PhaseLink` sends a `phase` frame at each change and, on rank 0, records a `phase` event
(the restart log's time per phase: `ckptsup status`, `ckptsup report`). A heartbeat in a phase is
the same frame again (wire.py), at most one per BEAT_EVERY_S: a framework callback may call it for
every batch of a fast validation loop.

attach()'s Run and heartbeat()'s Heartbeat each make the process's link (`current()`); before the
first of them, after its bye, or under plain torchrun, `phase()` and `phase_heartbeat()` do
nothing, so a script runs the same everywhere. Phases nest: leaving one goes back to the phase
the rank was in before it. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from ..errors import ConfigError
from ..events import Event
from .. import messages
from ..wire import Phase
from .agent_socket import RankChannel

BEAT_EVERY_S = 1.0    # far below any allowance (eval_timeout_s is minutes), and a few frames a second at most
USER_PHASES = {Phase.EVAL.value: Phase.EVAL}   # what a script may enter; the others are the hooks' own


class PhaseLink:
    """One rank's phase, told to its agent (and, on rank 0, to the restart log)."""

    def __init__(self, *, channel: RankChannel, rank: int, emit: Callable[..., None] | None = None,
                 clock: Callable[[], float] = time.monotonic, beat_every_s: float = BEAT_EVERY_S) -> None:
        self.channel = channel
        self.rank = rank
        self.emit = emit            # rank 0's event sink (Reporter.emit), None: no events
        self.clock = clock
        self.beat_every_s = beat_every_s
        self.phase: Phase | None = None
        self.step = 0
        self.last_beat = -float("inf")
        self.interrupted = False    # an eval since the last step: the next step's time is not a step time
        self._lock = threading.Lock()   # a framework may report from a loader thread; frames stay whole

    def enter(self, phase: Phase, step: int | None = None) -> Phase | None:
        """Say the rank is in `phase` now (the frame is sent even when it is the same phase: a
        heartbeat in it); returns the phase it was in. The event only on a change."""
        with self._lock:
            was, self.phase = self.phase, phase
            self.interrupted = self.interrupted or phase in USER_PHASES.values()
            if step is not None:
                self.step = step
            self.channel.send(messages.PhaseChange(rank=self.rank, phase=phase, step=self.step))
            self.last_beat = self.clock()
        if phase is not was and self.emit is not None:
            self.emit(Event.PHASE, phase=phase.value, step=self.step, **({"was": was.value} if was else {}))
        return was

    def stepped(self, step: int) -> None:
        """A step frame went up: the supervisor counts the rank as training from there (as
        attempt.py does: every phase but stopping ends at a step)."""
        self.step = step + 1
        if self.phase is not Phase.STOPPING:
            self.phase = Phase.TRAIN

    def beat(self) -> None:
        """A heartbeat in the current phase when the script entered it (an eval), at most one per
        beat_every_s. In the hooks' own phases it is nothing: a step is training's heartbeat."""
        phase = self.phase
        if phase is None or phase not in USER_PHASES.values() or self.clock() - self.last_beat < self.beat_every_s:
            return
        self.enter(phase)


_current: PhaseLink | None = None


def register(link: PhaseLink | None) -> None:
    """The process's link (attach's Run or heartbeat's Heartbeat); None after its bye."""
    global _current
    _current = link


def current() -> PhaseLink | None:
    return _current


def _parse(name: str | Phase) -> Phase:
    phase = USER_PHASES.get(str(getattr(name, "value", name)))
    if phase is None:
        raise ConfigError(f"ckptsup.phase({name!r}): unknown phase; use one of {sorted(USER_PHASES)} "
                          f"(init, load, train, save and stopping are reported by ckptsup itself)")
    return phase


class phase(contextlib.ContextDecorator):
    """`with ckptsup.phase("eval"):` or `@ckptsup.phase("eval")`: the rank is evaluating, so no
    step progress is expected; [supervisor] eval_timeout_s applies (from its last heartbeat,
    `phase_heartbeat()` or `.beat()`). On exit the rank is back in the phase it was in."""

    def __init__(self, name: str | Phase = Phase.EVAL) -> None:
        self.phase = _parse(name)
        self._stack: list[tuple[PhaseLink, Phase | None]] = []   # a decorator's instance may be re-entered

    def __enter__(self) -> "phase":
        link = current()
        if link is not None:
            self._stack.append((link, link.enter(self.phase)))
        else:
            self._stack.append((None, None))   # type: ignore[arg-type]
        return self

    def __exit__(self, *exc: Any) -> None:
        link, was = self._stack.pop()
        if link is not None and current() is link:
            link.enter(was or Phase.TRAIN)

    def beat(self) -> None:
        phase_heartbeat()


class Hold:
    """A phase entered at one framework hook and left at another (a callback's loop start and
    end): `enter()` is idempotent until `leave()`, so a lazy start at the first batch is fine."""

    def __init__(self, name: str | Phase = Phase.EVAL) -> None:
        self.name = name
        self.active: phase | None = None

    def enter(self) -> None:
        if self.active is None:
            self.active = phase(self.name)
            self.active.__enter__()

    def beat(self) -> None:
        self.enter()
        phase_heartbeat()

    def leave(self) -> None:
        if self.active is not None:
            active, self.active = self.active, None
            active.__exit__(None, None, None)


def phase_heartbeat() -> None:
    """A sign of life inside a phase (an eval batch done); throttled, a no-op outside one."""
    link = _current
    if link is not None:
        link.beat()
