"""The recovery policy: a pure function from what was observed (and what happened before) to what
to do. The loop only carries actions out (DESIGN §5).

Rules, in order:
1. no failure → Continue.
2. preemption / time limit → Requeue(preempted=True) (the loop exits PREEMPTED outside Slurm).
3. crash loop → GiveUp: the same kind of failure at the same step `crash_loop_threshold` times in a
   row (node deaths excluded: they are the hardware's fault, and the node is gone), or no step
   progress across that many attempts. Nothing is drained: it is the job's fault, not a node's.
4. restart budget spent (`max_restarts`) → GiveUp.
5. blame: a dead node and the node of a NaN rank, plus every suspect that failed its health check.
   A NaN is soft evidence: its node is excluded only when something can replace it.
6. enough healthy nodes (current ones first, then spares) → RestartInAllocation on them: FAST when
   the node set is unchanged, NODE otherwise; else Requeue excluding every bad node when Slurm can,
   else GiveUp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..config import SupervisorConfig
from .observations import AttemptResult, FailureKind, History, Observation, Outcome, RecoveryPath


@dataclass(frozen=True, kw_only=True)
class Continue:
    pass


@dataclass(frozen=True, kw_only=True)
class RestartInAllocation:
    nodes: tuple[str, ...]
    path: RecoveryPath
    exclude: tuple[str, ...] = ()    # newly blamed nodes to exclude (and drain) first
    backoff_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Requeue:
    exclude: tuple[str, ...] = ()    # every node the next allocation must avoid
    reason: str = ""
    preempted: bool = False
    newly_excluded: tuple[str, ...] = field(default=())


@dataclass(frozen=True, kw_only=True)
class GiveUp:
    reason: str


Action = Union[Continue, RestartInAllocation, Requeue, GiveUp]

# Failures that count toward the "same failure at the same step" crash loop.
_LOOP_KINDS = frozenset({FailureKind.CRASH, FailureKind.HANG, FailureKind.NAN, FailureKind.USER_ERROR})


def decide(obs: Observation, history: History, config: SupervisorConfig) -> Action:
    failure = obs.failure
    if failure is None:
        return Continue()
    if failure.kind is FailureKind.PREEMPTED:
        return Requeue(reason=failure.detail or "preempted", preempted=True)

    loop_reason = crash_loop(history, config.crash_loop_threshold)
    if loop_reason is not None:
        return GiveUp(reason=loop_reason)
    if obs.restarts_used >= config.max_restarts:
        return GiveUp(reason=f"restart budget spent ({obs.restarts_used} of supervisor.max_restarts="
                             f"{config.max_restarts}); last failure: {failure.kind.value}")

    replaceable = bool(obs.spares) or obs.can_requeue
    blamed = set(obs.unhealthy)
    if failure.kind is FailureKind.NODE_DOWN and failure.node:
        blamed.add(failure.node)
    if failure.kind is FailureKind.NAN and failure.node and replaceable:
        blamed.add(failure.node)
    excluded = set(obs.excluded) | blamed
    new = tuple(sorted(blamed - set(obs.excluded)))

    candidates = [n for n in obs.active if n not in excluded]
    candidates += [n for n in obs.spares if n not in excluded and n not in candidates]
    if len(candidates) >= obs.nodes_needed:
        nodes = tuple(candidates[: obs.nodes_needed])
        path = RecoveryPath.FAST if nodes == tuple(obs.active) else RecoveryPath.NODE
        return RestartInAllocation(nodes=nodes, path=path, exclude=new,
                                   backoff_s=backoff_s(history, config))
    if obs.can_requeue:
        return Requeue(exclude=tuple(sorted(excluded)), newly_excluded=new,
                       reason=f"{len(candidates)} healthy node(s) left, {obs.nodes_needed} needed")
    return GiveUp(reason=f"{len(candidates)} healthy node(s) left of {obs.nodes_needed} needed and "
                         f"no requeue outside Slurm; last failure: {failure.kind.value}")


def crash_loop(history: History, threshold: int) -> str | None:
    """Why the run is in a crash loop, or None. `history` includes the attempt that just failed."""
    attempts = list(history.attempts)
    if not attempts or attempts[-1].failure is None:
        return None
    last = attempts[-1].failure
    if last.kind in _LOOP_KINDS:
        same = 0
        for attempt in reversed(attempts):
            f = attempt.failure
            if f is None or f.kind is not last.kind or f.step != last.step:
                break
            same += 1
        if same >= threshold:
            return (f"user error: {last.kind.value} at step {last.step} {same} times in a row "
                    f"(supervisor.crash_loop_threshold={threshold}); fix the job, nothing was drained")
    stuck = _trailing_without_progress(attempts)
    if stuck >= threshold:
        return (f"no progress across {stuck} attempts (supervisor.crash_loop_threshold={threshold}); "
                f"last failure: {last.kind.value}; fix the job, nothing was drained")
    return None


def backoff_s(history: History, config: SupervisorConfig) -> float:
    """0 for the first restart in a row; backoff_initial_s for the 2nd, doubling, capped."""
    in_a_row = _trailing_without_progress(list(history.attempts))
    if in_a_row < 2 or config.backoff_initial_s <= 0:
        return 0.0
    return min(config.backoff_max_s, config.backoff_initial_s * 2 ** (in_a_row - 2))


def _trailing_without_progress(attempts: list[AttemptResult]) -> int:
    count = 0
    for attempt in reversed(attempts):
        if attempt.outcome is not Outcome.FAILED or attempt.progressed:
            break
        if attempt.failure is not None and attempt.failure.kind is FailureKind.NODE_DOWN:
            break
        count += 1
    return count
