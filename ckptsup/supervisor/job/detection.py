"""Pure failure detectors. They read what the supervisor has heard (timestamps on its own monotonic
clock) and return a `Failure` or None; they never sleep, signal or log.

Hang timeout (documented reasoning): NCCL's own watchdog waits minutes (10 min collective timeout,
8 min heartbeat). A training step is regular, so "no progress for three times the slowest normal
step" (p99 over the recent window) is outside normal jitter yet seconds, not minutes; the floor
`hang_min_s` (10 s) keeps a fast model from being killed by one GC pause or a slow batch, and a
silence past it is only suspect until the evidence says no rank works (liveness.py).
Init, checkpoint load, blocking save and evaluation are not steps: each phase has its own, longer
allowance (an eval phase's runs from its last heartbeat: a framework callback beats per batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from ...config import AUTO, SupervisorConfig
from ...env import ExitStatus
from ...wire import Phase
from .observations import Failure, FailureKind


# what one supervisor core folds in for <= 10 %: 8-rank beats of wire version 2 cost 32-54 us each in the
# real loop (2,048 x 8 at 1 Hz: 6-10 %; 16,384 x 8 at 1 Hz would be ~60 %: BENCHMARKS.md §Scale)
HEARTBEATS_PER_S = 2048
MISSED_HEARTBEATS = 3     # at scale: this many missed beats (at least node_silence_s) mean a dead node


def at_scale(config: SupervisorConfig, nodes: int, *, interval_chosen: bool = False) -> SupervisorConfig:
    """The heartbeat period and node silence for an allocation of `nodes`: beyond
    HEARTBEATS_PER_S nodes, unless relays summarise their heartbeats (`relayed`: then the
    supervisor folds in ~√nodes frames a beat and the period stays), every agent beats less often, so the supervisor's cost stays flat
    (one core cannot decode 16,384 heartbeats a second), and the silence that means a dead node
    grows with the period. A period the user chose (`interval_chosen`) is kept. `config` itself
    when nothing changes."""
    interval = nodes / HEARTBEATS_PER_S
    if interval_chosen or interval <= config.heartbeat_interval_s or relayed(config, nodes):
        return config
    return replace(config, heartbeat_interval_s=round(interval, 3),
                   node_silence_s=round(max(config.node_silence_s, MISSED_HEARTBEATS * interval), 3))


def relayed(config: SupervisorConfig, nodes: int) -> bool:
    """Heartbeats go through relays (supervisor/job/relays.py) for a job of `nodes`."""
    return 0 < config.relay_above_nodes < nodes


@dataclass(kw_only=True)
class RankView:
    rank: int
    node: str
    phase: Phase = Phase.INIT
    phase_since: float = 0.0          # supervisor mono when the phase began
    last_step: int | None = None
    last_progress: float = 0.0        # supervisor mono of the last step or phase change
    stopped: bool = False             # the agent saw its process stopped (state T)
    stopped_since: float | None = None  # supervisor mono of the first heartbeat that saw it stopped

    @property
    def last_sign_of_life(self) -> float:
        return max(self.last_progress, self.phase_since)


@dataclass(kw_only=True)
class NodeView:
    node: str
    last_heard: float                 # supervisor mono of the last frame from its agent
    ranks_alive: tuple[int, ...] = ()  # as its agent's last heartbeat said
    step_window: "StepWindow | None" = None   # its ranks' recent step times (ckptsup status)


@dataclass(kw_only=True)
class StepWindow:
    """Recent step times for the automatic hang timeout (bounded)."""

    size: int = 512
    samples: list[float] = field(default_factory=list)

    def add(self, step_time_s: float) -> None:
        if step_time_s >= 0 and math.isfinite(step_time_s):
            self.samples.append(step_time_s)
            if len(self.samples) > self.size:
                del self.samples[: len(self.samples) - self.size]

    def p99(self) -> float | None:
        return percentile(self.samples, 0.99)

    def p50(self) -> float | None:
        return percentile(self.samples, 0.5)

    def p50_p99(self) -> tuple[float | None, float | None]:
        """Both from one sort: status.json asks every node's at every publish (16,384 nodes)."""
        ordered = sorted(self.samples)
        return percentile(ordered, 0.5, ordered=True), percentile(ordered, 0.99, ordered=True)


def percentile(values: Sequence[float], q: float, *, ordered: bool = False) -> float | None:
    """`ordered`: `values` are sorted already."""
    if not values:
        return None
    ordered_values = values if ordered else sorted(values)
    index = min(len(ordered_values) - 1, max(0, math.ceil(q * len(ordered_values)) - 1))
    return ordered_values[index]


@dataclass(frozen=True, kw_only=True)
class HangTimeout:
    """The train phase's hang timeout, and why it is what it is (docs/timeouts.md): the one value
    that detection applies, the collective timeouts are derived from (nccl.Timeouts.hang),
    `ckptsup status` shows and the events record. `HangTimeout.of` builds it."""

    configured_s: float | None    # supervisor.hang_timeout_s when a number; None: "auto"
    min_s: float                  # hang_min_s
    step_factor: float            # hang_step_factor
    p99_s: float | None = None    # the measured p99 step; None: none measured yet
    cap_s: float = math.inf       # below the attempt's collective timeout (nccl.Timeouts.hang_cap_s)

    @classmethod
    def of(cls, config: SupervisorConfig, step_p99_s: float | None = None, *, cap_s: float = math.inf) -> "HangTimeout":
        configured = None if config.hang_timeout_s == AUTO else float(config.hang_timeout_s)
        return cls(configured_s=configured, min_s=config.hang_min_s, step_factor=config.hang_step_factor,
                   p99_s=step_p99_s, cap_s=cap_s)

    @property
    def uncapped_s(self) -> float:
        """The configured number, or max(hang_min_s, hang_step_factor x p99 step) when "auto"."""
        if self.configured_s is not None:
            return self.configured_s
        if self.p99_s is None:
            return self.min_s
        return max(self.min_s, self.step_factor * self.p99_s)

    @property
    def s(self) -> float:
        return min(self.uncapped_s, self.cap_s)

    def reason(self) -> str:
        if self.configured_s is not None:
            why = f"supervisor.hang_timeout_s = {self.configured_s:g}s"
        elif self.p99_s is None:
            why = f"hang_min_s {self.min_s:g}s: no step measured yet"
        else:
            why = f"max(hang_min_s {self.min_s:g}s, {self.step_factor:g} x p99 step {self.p99_s:.3f}s)"
        if self.s < self.uncapped_s:
            why += f", capped below the ranks' collective timeout ({self.cap_s:g}s)"
        return why


def allowance(phase: Phase, config: SupervisorConfig, train_timeout_s: float, *, peer_in_eval: bool = False,
              save_allowance_s: float | None = None) -> float:
    """How long a rank may show no progress in `phase`. `peer_in_eval`: another rank of the
    attempt is in an eval phase, so a training rank may be waiting for it in a collective (rank
    0 evaluating while the others sit in a barrier): it gets the eval allowance too.
    `save_allowance_s`: the attempt's `Timeouts.save_allowance_s` (docs/timeouts.md), the figure
    its ranks' collective timeout was derived from; None (not derived): `save_timeout_s`."""
    if phase is Phase.EVAL:
        return config.eval_timeout_s
    if phase is Phase.TRAIN and peer_in_eval:
        return max(train_timeout_s, config.eval_timeout_s)
    if phase is Phase.INIT:
        return config.init_timeout_s
    if phase is Phase.LOAD:
        return config.load_timeout_s
    if phase is Phase.SAVE:
        return config.save_timeout_s if save_allowance_s is None else save_allowance_s
    if phase is Phase.STOPPING:
        return config.save_timeout_s + config.kill_grace_s
    if phase is Phase.DONE:
        return math.inf
    return train_timeout_s


def detect_hang(ranks: Iterable[RankView], *, now: float, config: SupervisorConfig,
                train_timeout_s: float, save_allowance_s: float | None = None) -> Failure | None:
    """A rank with no progress beyond its phase's allowance. Blame: a process seen stopped first,
    then the rank furthest behind (a hung rank holds the others in their collective). The
    tracker weighs a silence against the ranks' evidence of work first (liveness.py)."""
    every = list(ranks)
    return detect_stopped(every, now=now, config=config) or \
        detect_silence(every, now=now, config=config, train_timeout_s=train_timeout_s,
                       save_allowance_s=save_allowance_s)


def detect_stopped(ranks: Iterable[RankView], *, now: float, config: SupervisorConfig) -> Failure | None:
    """A stopped process (SIGSTOP, state T) answers nothing until continued: a hang at once, not
    after the timeout; two heartbeats in a row saw it, so a stop-and-continue is spared."""
    every = list(ranks)
    held = [v for v in every if v.stopped and v.stopped_since is not None
            and now - v.stopped_since >= config.heartbeat_interval_s]
    if not held:
        return None
    culprit = min(held, key=lambda v: v.rank)
    stopped_s = now - (culprit.stopped_since or now)
    return Failure(kind=FailureKind.HANG, node=culprit.node, rank=culprit.rank, step=_job_step(every),
                   detect_s=stopped_s, suspects=(culprit.node,),
                   detail=f"rank {culprit.rank} process stopped (state T) for "
                          f"{stopped_s:.1f}s in phase {culprit.phase.value} (process stopped)")


def detect_silence(ranks: Iterable[RankView], *, now: float, config: SupervisorConfig,
                   train_timeout_s: float, save_allowance_s: float | None = None) -> Failure | None:
    """No progress beyond a phase's allowance: a suspect attempt (hung only if nothing works)."""
    every = list(ranks)
    in_eval = any(v.phase is Phase.EVAL for v in every)
    overdue = []
    for view in every:
        silent = now - view.last_sign_of_life
        if silent > allowance(view.phase, config, train_timeout_s, peer_in_eval=in_eval,
                              save_allowance_s=save_allowance_s):
            overdue.append((view, silent))
    if not overdue:
        return None
    stopped = [v for v in every if v.stopped]
    if stopped:
        culprit = min(stopped, key=lambda v: v.rank)
    else:
        culprit = min(every, key=lambda v: (v.last_step if v.last_step is not None else -1,
                                           v.last_sign_of_life, v.rank))
    silent = max(s for _, s in overdue)
    return Failure(kind=FailureKind.HANG, node=culprit.node, rank=culprit.rank, step=_job_step(every),
                   detect_s=silent, suspects=(culprit.node,),
                   detail=f"no progress for {silent:.1f}s in phase {culprit.phase.value}"
                          f"{' (process stopped)' if culprit.stopped else ''}")


def detect_node_down(nodes: Iterable[NodeView], *, now: float, silence_s: float,
                     step: int | None = None) -> Failure | None:
    """An agent silent for `silence_s` while another agent still talks. When every agent is
    silent, the cause may be the supervisor's side: wait twice as long, then blame them all."""
    views = list(nodes)
    if not views:
        return None
    silent = [v for v in views if now - v.last_heard > silence_s]
    if not silent:
        return None
    talking = len(silent) < len(views)
    worst = min(silent, key=lambda v: v.last_heard)
    if talking:
        return Failure(kind=FailureKind.NODE_DOWN, node=worst.node, step=step,
                       detect_s=now - worst.last_heard, suspects=(worst.node,),
                       detail=f"agent silent for {now - worst.last_heard:.1f}s while others talk")
    if now - worst.last_heard > 2 * silence_s:
        return Failure(kind=FailureKind.NODE_DOWN, node=worst.node, step=step,
                       detect_s=now - worst.last_heard, suspects=tuple(v.node for v in views),
                       detail=f"every agent silent for {now - worst.last_heard:.1f}s")
    return None


@dataclass(frozen=True, kw_only=True)
class TeardownHang:
    """The ranks finished (every bye; without hooks, a rank's exit 0) but processes of these
    nodes are still there past exit_grace_s: they are to be killed, the attempt counts done."""

    nodes: tuple[str, ...]
    waited_s: float


def detect_teardown_hang(*, since: float | None, activity: Iterable[float], pending: Iterable[str], now: float,
                         exit_grace_s: float) -> TeardownHang | None:
    """`since`: when the ranks finished (None: not yet). `activity`: the last signs of life of
    ranks that may still be training (a progress line pushes the deadline: a rank still training
    is never cut). `pending`: the nodes whose torchrun has not exited."""
    nodes = tuple(pending)
    if since is None or not nodes:
        return None
    start = max([since, *activity])
    if now - start <= exit_grace_s:
        return None
    return TeardownHang(nodes=nodes, waited_s=now - since)


def classify_rank_exit(*, node: str, rank: int | None, rc: int | None, step: int | None,
                       age_s: float = 0.0, detail: str = "") -> Failure | None:
    """A rank (or its torchrun) ended. rc None = vanished without a status (connection lost)."""
    if rc == ExitStatus.DONE:
        return None
    if rc == ExitStatus.RANK_NAN:
        return Failure(kind=FailureKind.NAN, node=node, rank=rank, step=step, detect_s=age_s,
                       detail=detail or "rank exited on a non-finite loss")
    if rc == ExitStatus.RANK_STOPPED:
        return None
    what = "lost its connection" if rc is None else (f"killed by signal {-rc}" if rc < 0 else f"exited rc={rc}")
    return Failure(kind=FailureKind.CRASH, node=node, rank=rank, step=step, detect_s=age_s,
                   suspects=(node,), detail=detail or f"rank {rank} {what}")


def nan_failure(*, node: str, rank: int, step: int, loss: object, age_s: float = 0.0) -> Failure:
    return Failure(kind=FailureKind.NAN, node=node, rank=rank, step=step, detect_s=age_s,
                   suspects=(node,), detail=f"non-finite loss {loss} on rank {rank} at step {step}")


def _job_step(ranks: Sequence[RankView]) -> int | None:
    steps = [v.last_step for v in ranks if v.last_step is not None]
    return min(steps) if steps else None


def job_step(ranks: Mapping[int, RankView]) -> int | None:
    """The step every rank has finished (the minimum over ranks)."""
    return _job_step(list(ranks.values()))
