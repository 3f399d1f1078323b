"""The recovery policy: a pure function from what was observed (and what happened before) to what
to do. The loop only carries actions out (docs/architecture.md §Decisions; docs/supervisor.md §Policy).

Rules, in order:
0. start-up (`Observation.starting`): ask for health checks of every usable node (CheckHealth),
   then RestartInAllocation(path=INITIAL) on the first healthy ones, blaming the unhealthy; too few
   → Requeue excluding them inside Slurm, else GiveUp.
1. no failure → Continue.
2. preemption / time limit → Requeue(preempted=True) (the loop stops the ranks first; outside
   Slurm it exits PREEMPTED). An operator's replace (at a checkpoint the ranks just committed)
   → RestartInAllocation on the node path without that node, which is blamed (excluded, drained);
   no crash-loop, budget or health rule applies to it.
3. attribution: an agent that neither answered the kill nor spoke (`silent`) is a dead node,
   whatever the first symptom was; the action carries the attributed failure.
4. suspects not yet checked (a hang, an unpinned node death, a crash repeating on one node) →
   CheckHealth; an unpinned node death is then pinned on the first unhealthy node.
5. replay before blame (docs/sdc.md §NaN): a NaN at the same step as an earlier NaN — on the same
   rank after the replay on the same nodes, or on another node — follows the data → GiveUp (user
   error), nobody blamed. A first NaN resumes on the same nodes, nobody blamed; a NaN at another
   step on a node that had one before follows that node (rule 8).
6. crash loop → GiveUp: the same kind of failure at the same step `crash_loop_threshold` times in a
   row (user error; node deaths excluded: they are the hardware's fault; only steps that were
   seen count: a script that reports none has no "same step"), or no progress across that many
   attempts (steps, or for a script without steps a newer file in `progress_dir` or outliving
   the init allowance). No node is blamed: it is the job's fault.
7. restart budget spent (`max_restarts`) → GiveUp.
8. blame: a dead node, the node a NaN follows, the node(s) whose replicas the majority outvoted
   (sdc), plus every suspect that failed its health check. A NaN's or an outvoted replica's node is
   excluded only when something can replace it. Replicas without a majority (two copies) are
   rerun on the same nodes first; a second disagreement names the node common to both disputes,
   or swaps a spare in for one of the pair to compare again (`sdc_blame`, docs/sdc.md).
9. enough healthy nodes (current ones first, then spares) → RestartInAllocation on them: FAST when
   the node set is unchanged and the agents still run, NODE otherwise; else Requeue excluding every
   bad node when Slurm can, else GiveUp.
10. fewer nodes (`min_nodes` below the active nodes, torchrun's --nnodes MIN:MAX): too few for rule
   9 but at least `min_nodes` healthy → RestartInAllocation on all of them when continuing costs
   less than a requeue (planning/shrink.py, `shrink_choice`), else the Requeue of rule 9; either
   action carries the ShrinkChoice that says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Union

from ...config import SupervisorConfig
from ...planning.shrink import ShrinkInputs, ShrinkPrice, price
from .observations import AttemptResult, Failure, FailureKind, History, Observation, Outcome, RecoveryPath


class ShrinkWay(str, enum.Enum):
    """What was chosen when a node was lost with no spare left and min_nodes allows fewer."""

    CONTINUE = "continue"   # train on the survivors, world size shrunk
    REQUEUE = "requeue"     # a new allocation of the full size


@dataclass(frozen=True, kw_only=True)
class ShrinkChoice:
    """Continue on fewer nodes or requeue, and why (the `shrink_decided` event)."""

    way: ShrinkWay
    survivors: int
    nodes: int          # the active nodes the job is sized for (MAX)
    min_nodes: int
    reason: str
    price: ShrinkPrice | None = None
    inputs: ShrinkInputs | None = None

    def event_fields(self) -> dict:
        out: dict = {"choice": self.way.value, "survivors": self.survivors, "nodes": self.nodes,
                     "min_nodes": self.min_nodes, "reason": self.reason}
        if self.price is not None and self.inputs is not None:
            out.update(continue_cost_s=round(self.price.continue_s, 3), requeue_cost_s=round(self.price.requeue_s, 3))
            for name in ("horizon", "restart", "queue_wait", "requeue_restart"):
                figure = getattr(self.inputs, name)
                out[f"{name}_s"], out[f"{name}_source"] = round(figure.value_s, 3), figure.source
        return out


@dataclass(frozen=True, kw_only=True)
class Continue:
    pass


@dataclass(frozen=True, kw_only=True)
class CheckHealth:
    """Health-check these nodes, then decide again with `Observation.unhealthy` filled in."""

    nodes: tuple[str, ...]
    failure: Failure | None = field(default=None, compare=False)   # as attributed so far


@dataclass(frozen=True, kw_only=True)
class RestartInAllocation:
    nodes: tuple[str, ...]
    path: RecoveryPath
    exclude: tuple[str, ...] = ()    # newly blamed nodes to exclude (and drain) first
    backoff_s: float = 0.0
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (node, why) per exclude
    failure: Failure | None = field(default=None, compare=False)            # as attributed
    shrink: ShrinkChoice | None = field(default=None, compare=False)        # fewer nodes than needed, and why


@dataclass(frozen=True, kw_only=True)
class Requeue:
    exclude: tuple[str, ...] = ()    # every node the next allocation must avoid
    reason: str = ""
    preempted: bool = False
    newly_excluded: tuple[str, ...] = field(default=())
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    failure: Failure | None = field(default=None, compare=False)
    shrink: ShrinkChoice | None = field(default=None, compare=False)   # fewer nodes were priced, and lost


@dataclass(frozen=True, kw_only=True)
class GiveUp:
    reason: str
    failure: Failure | None = field(default=None, compare=False)
    # earlier failures that the give-up shows were the job's too (a crash loop's first ones)
    also_user_errors: tuple[Failure, ...] = field(default=(), compare=False)


Action = Union[Continue, CheckHealth, RestartInAllocation, Requeue, GiveUp]

def blamed(action: Action) -> tuple[tuple[str, str], ...]:
    """(node, why) for every node the action excludes first."""
    match action:
        case RestartInAllocation(reasons=reasons) | Requeue(reasons=reasons):
            return reasons
    return ()


def attributed(action: Action) -> Failure | None:
    """The failure as `decide` found it to be (None: no failure, or nothing changed it)."""
    match action:
        case CheckHealth(failure=f) | RestartInAllocation(failure=f) | Requeue(failure=f) | GiveUp(failure=f):
            return f
    return None


# Failures that count toward the "same failure at the same step" crash loop.
_LOOP_KINDS = frozenset({FailureKind.CRASH, FailureKind.HANG, FailureKind.NAN, FailureKind.USER_ERROR})


def decide(obs: Observation, history: History, config: SupervisorConfig) -> Action:
    """What to do now. `history` ends with the attempt that just failed (its raw failure)."""
    if obs.starting:
        return _start(obs)
    failure = obs.failure
    if failure is None:
        return Continue()
    if failure.kind is FailureKind.PREEMPTED:
        return Requeue(reason=failure.detail or "preempted", preempted=True, failure=failure)
    if failure.kind is FailureKind.REPLACED and failure.node is not None:
        return _replace(obs, failure)

    failure = attribute(failure, obs)
    if obs.unhealthy is None:
        nodes = suspects(failure, history, obs.active)
        if nodes:
            return CheckHealth(nodes=nodes, failure=failure)
    unhealthy = obs.unhealthy or frozenset()
    if failure.kind is FailureKind.NODE_DOWN and failure.node is None and unhealthy:
        failure = replace(failure, node=sorted(unhealthy)[0])
    history = _with_last(history, failure)

    data_nan = nan_follows_data(history, obs.excluded)
    if data_nan is not None:
        return GiveUp(reason=data_nan, failure=replace(failure, kind=FailureKind.USER_ERROR))
    loop_reason = crash_loop(history, config.crash_loop_threshold)
    if loop_reason is not None:
        earlier: tuple[Failure, ...] = ()
        if loop_reason.startswith("user error"):
            failure = replace(failure, kind=FailureKind.USER_ERROR)
            loop = history.attempts[-config.crash_loop_threshold:-1]
            earlier = tuple(a.failure for a in loop if a.failure is not None)
        return GiveUp(reason=loop_reason, failure=failure, also_user_errors=earlier)
    if obs.restarts_used >= config.max_restarts:
        return GiveUp(reason=f"restart budget spent ({obs.restarts_used} of supervisor.max_restarts="
                             f"{config.max_restarts}); last failure: {failure.kind.value}", failure=failure)

    replaceable = bool(obs.spares) or obs.can_requeue
    blamed = {n: f"health: {unhealthy_why}" for n, unhealthy_why in obs.health_detail if n in unhealthy}
    blamed.update({n: "health check failed" for n in unhealthy if n not in blamed})
    if failure.kind is FailureKind.NODE_DOWN and failure.node:
        blamed.setdefault(failure.node, FailureKind.NODE_DOWN.value)
    if failure.kind is FailureKind.NAN and failure.node and replaceable:
        follows = nan_follows_node(history)
        if follows is not None:
            blamed.setdefault(failure.node, follows)
    benched: set[str] = set()   # not used this time, not blamed (a two-copy dispute's swap)
    if failure.kind is FailureKind.SDC:
        sdc = sdc_blame(history, obs, replaceable=replaceable)
        if isinstance(sdc, GiveUp):
            return sdc
        for node, why in sdc[0]:
            blamed.setdefault(node, why)
        benched = set(sdc[1])
    excluded = set(obs.excluded) | set(blamed)
    new = tuple(sorted(set(blamed) - set(obs.excluded)))
    reasons = tuple((n, blamed[n]) for n in new)

    candidates = [n for n in obs.active if n not in excluded and n not in benched]
    chosen = set(candidates)   # a set: O(N) spare choice at 16,384 nodes (bench_scale_ops.py)
    candidates += [n for n in obs.spares if n not in excluded and n not in chosen and n not in benched]
    if len(candidates) >= obs.nodes_needed:
        nodes = tuple(candidates[: obs.nodes_needed])
        same = nodes == tuple(obs.active) and obs.agents_alive
        return RestartInAllocation(nodes=nodes, path=RecoveryPath.FAST if same else RecoveryPath.NODE,
                                   exclude=new, backoff_s=backoff_s(history, config), reasons=reasons,
                                   failure=failure)
    shrink = shrink_choice(len(candidates), obs)
    if shrink is not None and shrink.way is ShrinkWay.CONTINUE:
        nodes = tuple(candidates)
        same = nodes == tuple(obs.active) and obs.agents_alive
        return RestartInAllocation(nodes=nodes, path=RecoveryPath.FAST if same else RecoveryPath.NODE,
                                   exclude=new, backoff_s=backoff_s(history, config), reasons=reasons,
                                   failure=failure, shrink=shrink)
    if obs.can_requeue:
        why = shrink.reason if shrink is not None else f"{obs.nodes_needed} needed"
        return Requeue(exclude=tuple(sorted(excluded)), newly_excluded=new, reasons=reasons, failure=failure,
                       reason=f"{len(candidates)} healthy node(s) left, {why}", shrink=shrink)
    return GiveUp(reason=f"{len(candidates)} healthy node(s) left of {obs.nodes_needed} needed and "
                         f"no requeue outside Slurm; last failure: {failure.kind.value}", failure=failure)


def shrink_choice(survivors: int, obs: Observation) -> ShrinkChoice | None:
    """Continue on `survivors` (< nodes_needed) healthy nodes, or requeue? None when fewer nodes
    were not allowed (min_nodes unset or not below nodes_needed): the requeue of today. Below
    min_nodes, a requeue; else the cheaper of the two (planning/shrink.py); outside Slurm nothing
    can requeue, so at least min_nodes continue."""
    least, most = obs.min_nodes, obs.nodes_needed
    if not 0 < least < most or survivors >= most:
        return None
    if survivors < least:
        return ShrinkChoice(way=ShrinkWay.REQUEUE, reason=f"below supervisor.min_nodes={least} of {most}", survivors=survivors, nodes=most, min_nodes=least)
    if not obs.can_requeue or obs.shrink is None:
        return ShrinkChoice(way=ShrinkWay.CONTINUE, reason=f"continue on {survivors} of {most} nodes "
                            f"(>= min_nodes {least}): no requeue outside Slurm", survivors=survivors, nodes=most, min_nodes=least)
    costs = obs.shrink
    inputs = ShrinkInputs(nodes=most, survivors=survivors, horizon=costs.horizon, restart=costs.restart,
                          queue_wait=costs.queue_wait, requeue_restart=costs.requeue_restart)
    p = price(inputs)
    lost = f"{most - survivors}/{most}"
    cont = (f"continuing costs {p.continue_s:.0f}s (restart {costs.restart.shown()} + {lost} of the "
            f"{costs.horizon.shown()} horizon)")
    req = (f"a requeue {p.requeue_s:.0f}s (queue wait {costs.queue_wait.shown()} + start-up "
           f"{costs.requeue_restart.shown()})")
    if p.continue_wins:
        return ShrinkChoice(way=ShrinkWay.CONTINUE, price=p, inputs=inputs,
                            reason=f"continue on {survivors} of {most} nodes: {cont} < {req}", survivors=survivors, nodes=most, min_nodes=least)
    return ShrinkChoice(way=ShrinkWay.REQUEUE, price=p, inputs=inputs,
                        reason=f"requeue rather than {survivors} of {most} nodes: {cont} >= {req}", survivors=survivors, nodes=most, min_nodes=least)


def _replace(obs: Observation, failure: Failure) -> Action:
    node = failure.node
    assert node is not None
    why = f"replaced: {failure.detail}" if failure.detail else "replaced on request"
    candidates = [n for n in obs.active if n != node and n not in obs.excluded]
    chosen = set(candidates)
    candidates += [n for n in obs.spares if n != node and n not in obs.excluded and n not in chosen]
    if len(candidates) >= obs.nodes_needed:
        return RestartInAllocation(nodes=tuple(candidates[: obs.nodes_needed]), path=RecoveryPath.NODE,
                                   exclude=(node,), reasons=((node, why),), failure=failure)
    excluded = tuple(sorted({*obs.excluded, node}))
    if obs.can_requeue:
        return Requeue(exclude=excluded, newly_excluded=(node,), reasons=((node, why),), failure=failure,
                       reason=f"no spare to replace {node} with: requeue without it")
    return GiveUp(reason=f"no spare to replace {node} with, and no requeue outside Slurm", failure=failure)


def _start(obs: Observation) -> Action:
    """Start-up: health-check every usable node, then launch on the first healthy ones."""
    usable = [n for n in obs.spares if n not in obs.excluded]
    if obs.unhealthy is None:
        return CheckHealth(nodes=tuple(usable))
    detail = dict(obs.health_detail)
    bad = tuple(sorted(n for n in usable if n in obs.unhealthy))
    reasons = tuple((n, f"health: {detail.get(n, 'check failed')}") for n in bad)
    healthy = [n for n in usable if n not in obs.unhealthy]
    if len(healthy) >= obs.nodes_needed:
        return RestartInAllocation(nodes=tuple(healthy[: obs.nodes_needed]), path=RecoveryPath.INITIAL,
                                   exclude=bad, reasons=reasons)
    why = f"{len(healthy)} healthy node(s), {obs.nodes_needed} needed"
    if obs.can_requeue:
        return Requeue(exclude=tuple(sorted(set(obs.excluded) | set(bad))), newly_excluded=bad,
                       reasons=reasons, reason=why,
                       failure=Failure(kind=FailureKind.NODE_DOWN, detail="too few healthy nodes at start"))
    return GiveUp(reason=why, failure=Failure(kind=FailureKind.NODE_DOWN, detail="too few healthy nodes at start"))


def attribute(failure: Failure, obs: Observation) -> Failure:
    """Agents that neither answered the kill nor spoke are on dead nodes: whatever the first
    symptom was (often a peer's crash), the failure is that node's death."""
    if not obs.silent:
        return failure
    node = obs.silent[0]
    slurmd = ", nor its slurmd" if node in obs.unreachable else ""
    return Failure(kind=FailureKind.NODE_DOWN, node=node, step=failure.step, detect_s=obs.silent_for_s,
                   suspects=tuple(obs.silent), detail=f"agent did not answer the kill{slurmd} ({failure.kind.value} "
                                                      f"on {failure.node} was the first symptom)")


def suspects(failure: Failure, earlier: History, active: tuple[str, ...]) -> tuple[str, ...]:
    """Nodes to health-check after a failure. A first crash is the software's until shown
    otherwise (fast path, no check); a hang, or a crash on a node that also failed the attempt
    before, makes the node suspect. Blamed nodes (dead, NaN) are excluded without a check.
    `earlier` ends with the attempt that just failed."""
    if failure.kind is FailureKind.HANG or (failure.kind is FailureKind.NODE_DOWN and failure.node is None):
        nodes = list(failure.suspects)
    elif failure.kind is FailureKind.CRASH:
        attempts = earlier.attempts[:-1]
        before = attempts[-1].failure if attempts else None
        repeat = before is not None and before.node is not None and before.node == failure.node
        nodes = list(failure.suspects) if repeat else []
    else:
        nodes = []
    return tuple(n for n in nodes if n in active)


def nan_follows_data(history: History, excluded: frozenset[str] = frozenset()) -> str | None:
    """A NaN at the same step as an earlier NaN follows the data: the job's fault, not a node's.
    On the same rank, it is the replay on the same nodes (same data-to-rank mapping) that says
    so; on another node, the data moved with the step (a NaN that follows a node is that node's)."""
    attempts = [a.failure for a in history.attempts if a.failure is not None]
    if not attempts or attempts[-1].kind is not FailureKind.NAN:
        return None
    last = attempts[-1]
    for earlier in reversed(attempts[:-1]):
        if earlier.kind is FailureKind.NAN and earlier.step == last.step and _same_rank(earlier, last):
            rank = f"rank {last.rank}" if last.rank is not None else f"a rank on {last.node}"
            return (f"user error: non-finite loss at step {last.step} on {rank} again, replayed on the same nodes "
                    f"from the last checkpoint: it follows the data (that rank's batch at that step), not a node; "
                    f"fix the job (data, learning rate, loss scaling); no node is blamed")
        if earlier.kind is FailureKind.NAN and earlier.step == last.step and earlier.node != last.node:
            why = (f"user error: non-finite loss at step {last.step} on {earlier.node}, then on {last.node}: "
                   f"it follows the data, not a node; fix the job (data, learning rate, loss scaling)")
            if earlier.node in excluded:
                why += (f"; {earlier.node} was excluded after the first one: `scontrol update "
                        f"nodename={earlier.node} state=resume` returns it if it was drained")
            return why
    return None


def _same_rank(a: Failure, b: Failure) -> bool:
    if a.rank is not None and b.rank is not None:
        return a.rank == b.rank and a.node == b.node
    return a.node == b.node


def nan_follows_node(history: History) -> str | None:
    """Why the last NaN's node is to blame: it had a NaN before at another step (the replay ran
    past the first one's step, so it was not the data). None: a first NaN, replayed on the same
    nodes before anyone is blamed."""
    attempts = [a.failure for a in history.attempts if a.failure is not None]
    if not attempts or attempts[-1].kind is not FailureKind.NAN or attempts[-1].node is None:
        return None
    last = attempts[-1]
    for earlier in attempts[:-1]:
        if earlier.kind is FailureKind.NAN and earlier.node == last.node and earlier.step != last.step:
            return f"nan: non-finite loss at steps {earlier.step} and {last.step} on this node"
    return None


def sdc_blame(history: History, obs: Observation, *, replaceable: bool
              ) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | GiveUp:
    """((node, why) to exclude, nodes to leave out this time without blame) after replicas
    disagreed (docs/sdc.md). With a majority its outvoted nodes are blamed when something can
    replace them (else the run resumes on the same nodes from the last agreed checkpoint). Without
    one: the first dispute reruns on the same nodes; a later one names the one node common to it
    and the dispute before; else a spare swaps in for the pair's first node (benched, not
    blamed) to compare again; with no spare, a requeue excludes the pair, or the run gives up."""
    failure = history.attempts[-1].failure
    assert failure is not None
    step = failure.step
    if failure.node is not None:   # the majority named it
        if not replaceable:
            return (), ()
        return tuple((n, f"sdc: replicas disagreed at step {step}; the majority outvoted this node's")
                     for n in failure.suspects), ()
    earlier = [a.failure for a in history.attempts[:-1]
               if a.failure is not None and a.failure.kind is FailureKind.SDC and a.failure.node is None]
    if not earlier:
        return (), ()
    disputed = set(failure.suspects)
    common = disputed & set(earlier[-1].suspects)
    if len(common) == 1 and common != disputed | set(earlier[-1].suspects):
        node = next(iter(common))
        return ((((node, f"sdc: in both of two replica disputes (steps {earlier[-1].step} and {step})"),)
                 if replaceable else ()), ())
    pair = sorted(disputed)
    active = set(obs.active)
    spare = [n for n in obs.spares if n not in obs.excluded and n not in active]
    if spare and pair:
        return (), (pair[0],)
    if obs.can_requeue:
        return tuple((n, f"sdc: two copies disagreed again at step {step}, no spare to tell which") for n in pair), ()
    return GiveUp(reason=f"replicas disagreed twice (steps {earlier[-1].step} and {step}) on {', '.join(pair)} with "
                         f"two copies and no spare or requeue to tell which node: run `ckptsup` health checks on them "
                         f"or add a spare ([sbatch] spares)", failure=failure)


def _with_last(history: History, failure: Failure) -> History:
    if not history.attempts:
        return history
    *before, last = history.attempts
    return History(attempts=(*before, replace(last, failure=failure)))


def crash_loop(history: History, threshold: int) -> str | None:
    """Why the run is in a crash loop, or None. `history` includes the attempt that just failed."""
    attempts = list(history.attempts)
    if not attempts or attempts[-1].failure is None:
        return None
    last = attempts[-1].failure
    if last.kind in _LOOP_KINDS and last.step is not None:  # no step seen: nothing to call "the same step"
        same = 0
        for attempt in reversed(attempts):
            f = attempt.failure
            if f is None or f.kind is not last.kind or f.step != last.step:
                break
            same += 1
        if same >= threshold:
            return (f"user error: {last.kind.value} at step {last.step} {same} times in a row "
                    f"(supervisor.crash_loop_threshold={threshold}); fix the job; no node is blamed for it")
    stuck = _trailing_without_progress(attempts)
    if stuck >= threshold:
        return (f"no progress across {stuck} attempts (supervisor.crash_loop_threshold={threshold}); "
                f"last failure: {last.kind.value}; fix the job; no node is blamed for it")
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
