"""What a rank says to its agent at every step, whichever hooks speak: attach()'s Run (session.py)
and heartbeat() (heartbeat.py) share it.

StepLink holds the channel (agent_socket.py, with its command thread) and speaks the per-step
protocol: the hello (`checkpoints` says whether ckptsup keeps this rank's checkpoints), a `step`
frame with the time since the previous step, the `nan` report, the supervisor's collective
timeouts and the `bye`. Without CKPTSUP_RANK_SOCKET every send is a no-op.

One process runs one kind of hooks: `claim_hooks` refuses attach() after heartbeat() and the
reverse, under the supervisor or not, so a script fails the same way under plain torchrun.
Nothing here imports torch (heartbeat() must stay cheap for scripts that never attach).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import sys
import threading
from typing import Any, NoReturn

from ..env import LOCAL_RANK, ExitStatus, RankEnv, set_rank_title
from ..errors import CkptsupError
from .. import messages
from .agent_socket import RankChannel
from .phase import PhaseLink, current as current_phase_link, register as register_phase_link
from .process_group import set_steady_timeout

log = logging.getLogger("ckptsup.hooks")


class NonFiniteLossError(CkptsupError):
    """A rank saw a non-finite loss (NaN/inf)."""

    exit_code = int(ExitStatus.RANK_NAN)


class ReplicasDisagreeError(CkptsupError):
    """The replicas' fingerprints disagree: silent data corruption (docs/sdc.md)."""


class HooksMixedError(CkptsupError):
    """A script called both ckptsup.attach() and ckptsup.heartbeat()."""


class Hooks(enum.Enum):
    """The kind of hooks a process runs (claim_hooks)."""

    FULL = "ckptsup.attach()"
    HEARTBEAT = "ckptsup.heartbeat()"


class HooksClaim:
    """The first kind claimed wins for the process; claiming the other kind is a one-line error.
    Two step reporters of one rank would send two hellos (the agent drops the second) and two
    step clocks; which one the supervisor believed would be an accident."""

    def __init__(self) -> None:
        self.kind: Hooks | None = None
        self._lock = threading.Lock()

    def claim(self, kind: Hooks) -> None:
        with self._lock:
            if self.kind is None:
                self.kind = kind
        if self.kind is not kind:
            raise HooksMixedError(
                f"this script calls {kind.value} after {self.kind.value}: use one of them — ckptsup.attach() when "
                f"ckptsup keeps the checkpoints (its step_done is the heartbeat), ckptsup.heartbeat() when the "
                f"script keeps its own (docs/heartbeat.md)")


_CLAIM = HooksClaim()


def claim_hooks(kind: Hooks) -> None:
    _CLAIM.claim(kind)
    from ..stack_dump import install

    install()   # a rank started cold (no warm interpreter) can show its stacks too


def loss_value(loss: Any) -> float | None:
    if loss is None:
        return None
    if hasattr(loss, "detach"):
        return float(loss.detach().float().cpu())
    return float(loss)


def is_finite(loss: Any) -> bool:
    value = loss_value(loss)
    return value is None or math.isfinite(value)


def exit_rank(rank: int, status: ExitStatus, message: str) -> NoReturn:
    """The rank's exit with a status the agent reads (after the caller said bye)."""
    log.warning("ckptsup: rank %d exits with %s: %s", rank, status.name, message)
    raise SystemExit(int(status))


class StepLink:
    def __init__(self, *, env: RankEnv, rank: int, world_size: int, checkpoints: bool,
                 schedule: dict[str, Any] | None = None) -> None:
        """`schedule`: this rank's own disk save schedule (save_every_steps, save_every_s), in the
        hello: attach() keywords win over the supervisor's environment, so only the rank knows it."""
        self.rank = rank
        self.channel = RankChannel(socket_path=env.rank_socket, secret_file=env.secret_file, rank=rank,
                                   fr_dump_dir=env.fr_dump_dir)
        self.last_step_time: float | None = None
        self.first_step_seen = False
        self.channel.send(messages.Hello(rank=rank, local_rank=int(os.environ.get(LOCAL_RANK, "0")),
                                         world_size=world_size, node=env.node, pid=os.getpid(),
                                         checkpoints=checkpoints, **(schedule or {})))
        self.phases = PhaseLink(channel=self.channel, rank=rank)   # ckptsup.phase() speaks through it
        if self.channel.connected:
            set_rank_title(rank, sys.argv)   # ps shows the rank, not `python -u ...` (a warm rank set it already)
            register_phase_link(self.phases)

    @property
    def connected(self) -> bool:
        return self.channel.connected

    def tick(self, now: float) -> float | None:
        """Seconds since the previous step ended (None at the first step, and after an eval phase:
        an evaluation's minutes would make the hang timeout's p99 step an evaluation)."""
        if self.phases.interrupted:
            self.phases.interrupted = False
            self.last_step_time = None
        step_time = None if self.last_step_time is None else now - self.last_step_time
        self.last_step_time = now
        return step_time

    def report_nan(self, step: int, loss: Any) -> str:
        """The `nan` frame; returns the line that says what happened."""
        value = loss_value(loss)
        self.channel.send(messages.Nan(rank=self.rank, step=step, loss=str(value)))
        return f"rank {self.rank} saw a non-finite loss ({value}) at step {step}"

    def report_sdc(self, step: int, verdict: Any, *, agreed_step: int | None = None) -> str:
        """The `sdc` frame (hooks/fingerprint.py Verdict); returns the line that says what happened.
        `agreed_step`: the last step after which this attempt's replicas agreed (None: no check agreed yet)."""
        agreed = agreed_step if agreed_step is not None and 0 <= agreed_step < step else None
        self.channel.send(messages.Sdc(rank=self.rank, step=step, copies=verdict.copies,
                                       disputed=tuple(verdict.disputed), majority=verdict.majority,
                                       fingerprint=verdict.fingerprint, agreed_step=agreed))
        who = (f"rank(s) {list(verdict.odd)} differ from the majority" if verdict.majority
               else "no majority to say which")
        return (f"replicas disagree after step {step} ({verdict.copies} copies: {who}): silent data corruption "
                f"(docs/sdc.md)")

    def step(self, step: int, step_time: float | None, *, compute_s: float | None = None,
             loss: float | None = None, sdc_s: float | None = None) -> bool:
        """The `step` frame, sent at every step (the supervisor's crash-loop rule compares the exact
        step of a failure), and the collective timeouts. True at the first step. `compute_s`: the
        step time minus the time blocked in collectives, when measured (hooks/compute_time.py).
        `loss` (rank 0's, finite): the supervisor compares a restore's first steps with it.
        `sdc_s` (rank 0's): seconds spent on replica fingerprints so far in this attempt."""
        self.channel.send(messages.Step(rank=self.rank, step=step, step_time_s=step_time, loss_finite=True,
                                        compute_s=None if compute_s is None else round(compute_s, 6),
                                        sdc_s=None if sdc_s is None else round(sdc_s, 6),
                                        loss=loss if loss is not None and math.isfinite(loss) else None))
        self.phases.stepped(step)
        first = not self.first_step_seen
        if first:
            self.first_step_seen = True
            set_steady_timeout()
        steady = self.channel.commands.take_timeout()
        if steady is not None:  # the supervisor measured this attempt's steps (first launch: none before)
            set_steady_timeout(steady)
        return first

    def requested_stop(self, step: int) -> int | None:
        """The step a stop_at command asks to stop after (without one in the command: this one)."""
        stop_at = self.channel.commands.stop_at
        if stop_at is None:
            return None
        return step if stop_at.step is None else stop_at.step

    def bye(self, status: int) -> None:
        if current_phase_link() is self.phases:
            register_phase_link(None)   # a phase() after the bye has no one to tell
        self.channel.send(messages.Bye(rank=self.rank, status=status))
        self.channel.close()
