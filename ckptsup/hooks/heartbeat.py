"""heartbeat(step, loss=None): ckptsup's supervision without its checkpoints, for scripts that keep
their own (a DDP script with its own torch.save, Lightning, HF; docs/heartbeat.md).

    for step in range(start, total):
        loss = train_step(...)
        ckptsup.heartbeat(step, loss)

The first call looks for the agent (CKPTSUP_RANK_SOCKET, set by ckptsup launch). Without one it
remembers that there is nothing to do: every later call is one check, so the script runs the same
under plain torchrun. With one it says hello with "checkpoints": false, and every call then checks
the loss (non-finite: a `nan` frame and exit RANK_NAN), sends a `step` frame with the time since
the previous call, applies the supervisor's collective timeout, and obeys a stop_at: exit
RANK_STOPPED at that step, saving nothing — the script's own SIGTERM handling and checkpoints are
its business, so no signal handler is installed. dump_fr is served by the channel's thread, even
while the main thread is stuck in a collective. At interpreter exit the rank says bye (exit_status).
`ckptsup.phase("eval")` works here too (hooks/phase.py) once the first heartbeat() has connected.
No collectives, no torch import.
"""

from __future__ import annotations

import atexit
import dis
import os
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Mapping, NoReturn

from ..env import RANK, WORLD_SIZE, ExitStatus, RankEnv
from ..errors import ConfigError
from .event_sink import Reporter
from .rank_link import Hooks, StepLink, claim_hooks, exit_rank, is_finite

RETURNS = frozenset({"RETURN_VALUE", "RETURN_CONST"})   # RETURN_CONST: Python 3.12+


class Heartbeat:
    """One rank's heartbeat-only link to its agent."""

    def __init__(self, *, env: RankEnv, rank: int, world_size: int, main_frame: FrameType | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link = StepLink(env=env, rank=rank, world_size=world_size, checkpoints=False)
        if self.link.connected:   # rank 0's phase events (ckptsup.phase) go up the channel; never a second writer
            self.link.phases.emit = Reporter(env=env, rank=rank, channel=self.link.channel).emit
        self.rank = rank
        self.clock = clock
        self.main_frame = main_frame
        self.pid = os.getpid()
        self.closed = False

    def beat(self, step: int, loss: Any = None) -> None:
        step_time = self.link.tick(self.clock())
        if not is_finite(loss):
            self._exit(ExitStatus.RANK_NAN, self.link.report_nan(step, loss))
        self.link.step(step, step_time)
        stop = self.link.requested_stop(step)
        if stop is not None and step >= stop:
            self._exit(ExitStatus.RANK_STOPPED, f"stopped after step {step} on the supervisor's stop_at "
                                                f"(heartbeat-only: ckptsup saved nothing)")

    def close(self, status: ExitStatus | None) -> None:
        """Say bye with `status`; with None only hang up (the agent reads the exit status)."""
        if self.closed:
            return
        self.closed = True
        if status is None:
            self.link.channel.close()
        else:
            self.link.bye(int(status))

    def at_exit(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child (say, a loader worker) ending normally: not this rank's exit
        self.close(exit_status(self.main_frame, crashed=hasattr(sys, "last_value")))

    def _exit(self, status: ExitStatus, message: str) -> NoReturn:
        self.close(status)
        exit_rank(self.rank, status, message)


def exit_status(frame: FrameType | None, *, crashed: bool) -> ExitStatus | None:
    """What the bye at interpreter exit says. FAILURE after an uncaught exception (the interpreter
    keeps it as sys.last_value); DONE when the main thread's outermost frame returned; otherwise
    no bye: a SystemExit unwound that frame and atexit cannot see its code (`sys.exit(main())` may
    be 1). Without a bye the agent reads the process's real exit status, whereas a DONE from a
    failed script would make the supervisor take torchrun's failure for a teardown error."""
    if crashed:
        return ExitStatus.FAILURE
    if frame is not None and returned(frame):
        return ExitStatus.DONE
    return None


def returned(frame: FrameType) -> bool:
    """Whether a finished frame returned rather than being unwound by an exception: CPython keeps a
    finished frame's last instruction, and one that returned ended on a return instruction."""
    code, last = frame.f_code.co_code, frame.f_lasti
    return 0 <= last < len(code) and dis.opname[code[last]] in RETURNS


def main_frame() -> FrameType | None:
    """The outermost frame of the main thread: the script's module (runpy's under python -m)."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None and frame.f_back is not None:
        frame = frame.f_back
    return frame


def torchrun_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rank, world size) from torchrun's RANK and WORLD_SIZE (0 and 1 when unset)."""
    try:
        rank, world = int(environ.get(RANK) or 0), int(environ.get(WORLD_SIZE) or 1)
    except ValueError:
        raise ConfigError(f"environment {RANK}={environ.get(RANK)!r} / {WORLD_SIZE}={environ.get(WORLD_SIZE)!r} "
                          f"is not a number: start the script with torchrun or ckptsup launch") from None
    if not (0 <= rank < world):
        raise ConfigError(f"environment {RANK}={rank} is not below {WORLD_SIZE}={world}: start the script with "
                          f"torchrun or ckptsup launch")
    return rank, world


_UNSTARTED: Any = object()
_beat: Heartbeat | None = _UNSTARTED   # None: no agent in this process, nothing to do
_start_lock = threading.Lock()


def heartbeat(step: int, loss: Any = None) -> None:
    """Call once per completed training step (step = its 0-based index), with its loss if known."""
    beat = _beat
    if beat is None:  # not under ckptsup launch: the one check of every call
        return
    if beat is _UNSTARTED:
        beat = _start()
        if beat is None:
            return
    beat.beat(step, loss)


def _start() -> Heartbeat | None:
    global _beat
    with _start_lock:
        if _beat is _UNSTARTED:
            claim_hooks(Hooks.HEARTBEAT)
            env = RankEnv.from_environ()
            if not env.supervised:
                _beat = None
            else:
                rank, world = torchrun_rank()
                beat = Heartbeat(env=env, rank=rank, world_size=world, main_frame=main_frame())
                atexit.register(beat.at_exit)
                _beat = beat
        return _beat
