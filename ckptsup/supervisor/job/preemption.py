"""Preemption and time-limit budget (pure): how much time the ranks have after a stop signal,
and whether an emergency checkpoint fits in it (docs/timeouts.md §5).

* Time limit: the template's `--signal=B:USR1@<lead>` reaches the batch shell, which forwards
  it to the supervisor. Slurm sends it up to 60 s *early*, never late, so `signal_lead_s` is a
  safe lower bound of the time left.
* Preemption: SIGTERM reaches every step process at once; the job is killed when the
  partition's GraceTime ends (the batch shell gets SIGTERM then, SIGKILL KillWait later), so the
  window is GraceTime (0 when unknown: no save is attempted on a guess).

From the window we take the time already spent since the signal, the ranks' agreement on a
stop step (at most one more step) and a fixed reserve for stopping and the explicit
`scontrol requeue`. An emergency save is written only if the measured save time x
checkpoint.emergency_margin fits the remaining budget; an unmeasured save never "fits".
"""

from __future__ import annotations

import enum
import signal as _signal
from dataclasses import dataclass

from ...config import Config
from ...env import RankEnv

STOP_RESERVE_S = 5.0  # stop the ranks, exit, `scontrol requeue`: measured well under this


class StopKind(str, enum.Enum):
    TIME_LIMIT = "time_limit"    # SIGUSR1 (--signal=B:USR1@lead), forwarded by the batch shell
    PREEMPTION = "preemption"    # SIGTERM to every step process, GraceTime until the kill
    CLOUD_NOTICE = "cloud_notice"  # the cloud reclaims a node that cannot be moved: the notice's time ahead (docs/cloud.md)


def stop_kind(signum: int) -> StopKind:
    """The stop kind a signal stands for: USR1 = time limit, anything else (TERM) = preemption."""
    return StopKind.TIME_LIMIT if signum == _signal.SIGUSR1 else StopKind.PREEMPTION


@dataclass(frozen=True, kw_only=True)
class StopPlan:
    kind: StopKind
    window_s: float            # time from the signal to the kill
    budget_s: float            # what the ranks may spend on an emergency save (CKPTSUP_PREEMPT_BUDGET_S)
    save_needed_s: float | None  # measured save time x margin (None: never measured)
    emergency_save: bool
    reason: str

    def env(self) -> dict[str, str]:
        return RankEnv.variables(preempt_budget_s=round(self.budget_s, 1))

    def as_event(self) -> dict[str, object]:
        """Fields of the `preemption` event."""
        return {"signal": self.kind.value, "window_s": round(self.window_s, 3),
                "budget_s": round(self.budget_s, 3), "save_needed_s": self.save_needed_s,
                "emergency_save": self.emergency_save, "why": self.reason}


def plan_stop(*, kind: StopKind, config: Config, save_s: float | None,
              grace_time_s: float | None = None, elapsed_s: float = 0.0,
              step_p99_s: float | None = None, reserve_s: float = STOP_RESERVE_S,
              notice_s: float | None = None) -> StopPlan:
    """Decide the emergency save for a stop signal received `elapsed_s` ago (a cloud notice:
    `notice_s` ahead of the reclaim when it was received)."""
    if kind is StopKind.TIME_LIMIT:
        window = float(config.sbatch.signal_lead_s)
        source = f"time limit: --signal lead {window:g}s"
    elif kind is StopKind.CLOUD_NOTICE:
        window = max(0.0, float(notice_s or 0.0))
        source = f"cloud notice: the node is reclaimed {window:.0f}s after it"
    elif grace_time_s is None:
        window = 0.0
        source = "preemption: GraceTime unknown, assumed 0s"
    else:
        window = float(grace_time_s)
        source = f"preemption: GraceTime {window:g}s"
    stop_step = step_p99_s or 0.0
    budget = max(0.0, window - max(0.0, elapsed_s) - stop_step - reserve_s)
    if save_s is None:
        return StopPlan(kind=kind, window_s=window, budget_s=budget, save_needed_s=None,
                        emergency_save=False,
                        reason=f"{source}; no save measured yet, so no emergency save on a guess")
    needed = save_s * config.checkpoint.emergency_margin
    fits = needed <= budget
    verdict = "fits" if fits else "does not fit"
    reason = (f"{source}; budget {budget:.1f}s after {elapsed_s:.1f}s elapsed, {stop_step:.1f}s stop step "
              f"and {reserve_s:g}s reserve; save {save_s:.1f}s x {config.checkpoint.emergency_margin:g} = "
              f"{needed:.1f}s {verdict}")
    return StopPlan(kind=kind, window_s=window, budget_s=budget, save_needed_s=needed,
                    emergency_save=fits, reason=reason)


# ---- cloud preemption notices (docs/cloud.md) ------------------------------------------------------
class NoticeWay(str, enum.Enum):
    """What a cloud's notice for one node leads to."""

    SAVE_AND_MOVE = "save_and_move"   # an emergency checkpoint now; the node's ranks move at its commit (or at the deadline)
    MOVE = "move"                     # no checkpoint fits or can be asked for: they move now, from the newest one
    STOP = "stop"                     # nowhere to move them (no spare, no requeue): the run stops as if preempted
    EXCLUDE = "exclude"               # a node not training (a spare): excluded, nothing moves
    IGNORE = "ignore"                 # a node already excluded, or not this run's


@dataclass(frozen=True, kw_only=True)
class NoticePlan:
    way: NoticeWay
    window_s: float              # the notice's time ahead, less what passed before it was decided on
    budget_s: float              # what an emergency checkpoint may take (window - a step - the reserve)
    save_needed_s: float | None  # measured stall + write x emergency_margin (None: never measured)
    emergency_save: bool
    move_by_s: float             # from now: the node's ranks move then at the latest (window - the reserve)
    reason: str

    def as_event(self) -> dict[str, object]:
        """Fields of the `cloud_notice` event (beside node, cloud, action, deadline, ahead_s)."""
        return {"way": self.way.value, "window_s": round(self.window_s, 3), "budget_s": round(self.budget_s, 3),
                "save_needed_s": None if self.save_needed_s is None else round(self.save_needed_s, 3),
                "emergency_save": self.emergency_save, "reason": self.reason}


def plan_notice(*, node: str, ahead_s: float, config: Config, active: tuple[str, ...], spares: tuple[str, ...],
                excluded: frozenset[str] | set[str], can_requeue: bool, checkpoints: bool,
                save_s: float | None, write_s: float | None, elapsed_s: float = 0.0,
                step_p99_s: float | None = None, reserve_s: float = STOP_RESERVE_S) -> NoticePlan:
    """Decide what a cloud's notice that `node` is reclaimed `ahead_s` after it (received
    `elapsed_s` ago) leads to. Pure.

    A training node's ranks move to a spare (or, without one, the job is requeued without the
    node), as `ckptsup replace` moves them: first an emergency checkpoint when one fits before the
    reclaim — the measured save (the stall and the background write: the commit is what counts) x
    `emergency_margin` within the window less one step and the reserve — else at once, from the
    newest checkpoint. A run with no spare and no requeue (outside Slurm) stops as a preemption
    (StopKind.CLOUD_NOTICE). A spare is only excluded."""
    window = max(0.0, ahead_s - max(0.0, elapsed_s))
    stop_step = step_p99_s or 0.0
    budget = max(0.0, window - stop_step - reserve_s)
    move_by = max(0.0, window - reserve_s)
    needed = None if save_s is None else (save_s + (write_s or 0.0)) * config.checkpoint.emergency_margin

    def plan(way: NoticeWay, save: bool, reason: str) -> NoticePlan:
        return NoticePlan(way=way, window_s=window, budget_s=budget, save_needed_s=needed, emergency_save=save,
                          move_by_s=move_by, reason=reason)

    if node in excluded:
        return plan(NoticeWay.IGNORE, False, f"{node} is already excluded from this run")
    if node not in active:
        if node in spares:
            return plan(NoticeWay.EXCLUDE, False, f"{node} is a spare: excluded, so that no launch picks it")
        return plan(NoticeWay.IGNORE, False, f"{node} is not a node of this run")
    target = f"{spares[0]}" if spares else None
    if target is None and not can_requeue:
        return plan(NoticeWay.STOP, False, "no spare and no requeue outside Slurm: the run stops as if preempted")
    where = f"{node}'s ranks move to {target}" if target else f"the job is requeued without {node} (no spare left)"
    if not checkpoints:
        return plan(NoticeWay.MOVE, False, f"{where} now: the ranks keep no ckptsup checkpoints to save one first")
    if needed is None:
        return plan(NoticeWay.MOVE, False, f"{where} now, from the newest checkpoint: no save measured yet, so no "
                                           "emergency checkpoint on a guess")
    fits = needed <= budget
    figures = (f"save {save_s:.1f}s + write {write_s or 0.0:.1f}s x {config.checkpoint.emergency_margin:g} = {needed:.1f}s "
               f"{'fits' if fits else 'does not fit'} the {budget:.1f}s budget ({window:.0f}s ahead less "
               f"{stop_step:.1f}s step and {reserve_s:g}s reserve)")
    if fits:
        return plan(NoticeWay.SAVE_AND_MOVE, True, f"checkpoint now, then {where}: {figures}")
    return plan(NoticeWay.MOVE, False, f"{where} now, from the newest checkpoint: {figures}")
