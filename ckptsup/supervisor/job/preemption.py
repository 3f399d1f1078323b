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
              step_p99_s: float | None = None, reserve_s: float = STOP_RESERVE_S) -> StopPlan:
    """Decide the emergency save for a stop signal received `elapsed_s` ago."""
    if kind is StopKind.TIME_LIMIT:
        window = float(config.sbatch.signal_lead_s)
        source = f"time limit: --signal lead {window:g}s"
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
