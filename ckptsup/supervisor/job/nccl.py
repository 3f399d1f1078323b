"""Timeout tuning: the supervisor's hang timeout and the TORCH_NCCL_* / collective timeouts that
it exports to ranks, derived together so that they are always consistent (pure functions).

The ordering we keep (docs/timeouts.md has the long version):

    step p99  <<  hang_s (supervisor)  <  collective_s (torch)  <  NCCL defaults (10 min)

* `hang_s` — the supervisor declares a hang when no step progress arrives for this long:
  max(hang_min_s, hang_step_factor x p99 step time), or the configured number. Ten times the p99
  step is far above any healthy step's jitter yet seconds, not minutes, for typical steps; the
  30 s floor covers tiny steps whose p99 says little about the occasional GC pause or slow batch.
* `save_allowance_s` — while a blocking save runs, the supervisor waits longer: max(hang_s,
  SAVE_FACTOR x the slowest measured blocking save), capped by supervisor.save_timeout_s, which is
  also the value used before any save has been measured.
* `collective_s` — the steady-state collective timeout that the hooks' init helper applies (no
  environment variable sets `init_process_group(timeout=)`). A healthy rank blocks in a collective
  at most as long as its slowest peer needs for a step or a blocking save, so anything beyond the
  supervisor's own deadline for that phase is a hang. It must fire *after* the supervisor's
  detection: on a hang the supervisor first asks every rank (through the hooks' socket thread —
  a Python signal handler cannot run while the main thread is blocked in a collective) to dump
  the flight recorder, waits up to `dump_wait_s`, then kills with `kill_grace_s`. If torch's
  timeout fired first, the watchdog would tear the process down (ASYNC_ERROR_HANDLING) before
  the supervisor could collect a coherent dump from every rank. So
      collective_s = max(hang_s, save_allowance_s, busy_limit_s) + detection slack + dump_wait_s + kill_grace_s
  (busy_limit_s: ranks waiting in a collective while a peer works without progress — rank 0
  evaluating — are busy, not hung, until then; liveness.py).
  Before any step was measured (a run's first launch) the steady value equals the init value;
  the loop sends the derived one (`set_timeout`) once that attempt has measured its steps.
* `collective_init_s` — init, rendezvous, checkpoint load and the first steps: at least the
  configured collective_timeout_init_s and always above the supervisor's init and load allowances
  plus the same slack, for the same reason.
* TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC guards the NCCL watchdog thread itself (not collectives); it
  stays the configured value (default 120 s instead of torch's 480 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ... import env as envvars
from ...config import AUTO, Config
from .detection import HangTimeout, percentile

SAVE_FACTOR = 3.0           # a blocking save may take this x the slowest one measured
DUMP_WAIT_S = 15.0          # time ranks get to write the flight recorder (torch's default wait)
DETECTION_SLACK_HEARTBEATS = 2  # the supervisor notices a hang within ~2 heartbeat periods
FR_DIR = "flight_recorder"


def _finite(values: Iterable[float] | None) -> list[float]:
    return [float(v) for v in (values or ()) if v is not None and math.isfinite(float(v)) and float(v) >= 0]


def save_allowance_s(config: Config, hang: HangTimeout, save_times: Iterable[float] | None = ()) -> float:
    """How long the supervisor lets a blocking save run without progress."""
    cap = float(config.supervisor.save_timeout_s)
    saves = _finite(save_times)
    if not saves:
        return cap
    return min(cap, max(hang.s, SAVE_FACTOR * max(saves)))


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    hang: HangTimeout
    save_allowance_s: float
    collective_init_s: float
    collective_s: float
    heartbeat_s: float
    dump_wait_s: float
    margin_s: float                       # what collective timeouts keep above supervisor deadlines
    notes: tuple[str, ...] = field(default=())  # why a configured value was lifted, etc.

    @property
    def hang_cap_s(self) -> float:
        """The largest hang timeout the supervisor may use during this attempt: the collective
        timeout is fixed at launch, so if the step time (and with it the automatic hang
        timeout) grows mid-attempt, the supervisor clamps to this to keep firing first."""
        return self.collective_s - self.margin_s


def derive_timeouts(config: Config, *, step_times: Iterable[float] | None = (),
                    save_times: Iterable[float] | None = ()) -> Timeouts:
    sup, nccl = config.supervisor, config.nccl
    steps = _finite(step_times)
    hang_timeout = HangTimeout.of(sup, percentile(steps, 0.99))   # hang_min_s before a step is measured
    hang = hang_timeout.s
    save_allow = save_allowance_s(config, hang_timeout, save_times)
    margin = DETECTION_SLACK_HEARTBEATS * sup.heartbeat_interval_s + DUMP_WAIT_S + sup.kill_grace_s
    notes: list[str] = []

    allowance = max(sup.init_timeout_s, sup.load_timeout_s)
    init_floor = max(allowance, hang) + margin
    init = float(nccl.collective_timeout_init_s)
    if init < init_floor:
        what = (f"the supervisor's hang timeout ({hang:g}s)" if hang > allowance else
                f"the supervisor's init/load allowances ({allowance:g}s)")
        notes.append(f"collective_timeout_init_s {init:g}s lifted to {init_floor:g}s: it must exceed {what} + {margin:g}s")
        init = init_floor

    # ranks waiting in a barrier while one evaluates are busy, not hung (liveness.py): torch's
    # timeout must not end them before the supervisor's busy_limit_s would
    floor = max(hang, save_allow, sup.busy_limit_s) + margin
    if nccl.collective_timeout_s == AUTO:
        steady = floor if steps else init
        if not steps:
            notes.append("no step measured yet: steady collective timeout = init value until one is")
    else:
        steady = float(nccl.collective_timeout_s)
        if steady < floor:
            notes.append(f"collective_timeout_s {steady:g}s lifted to {floor:g}s: it must exceed the "
                         f"supervisor's hang timeout, save allowance and busy limit ({max(hang, save_allow, sup.busy_limit_s):g}s) "
                         f"+ {margin:g}s so the supervisor decides first")
            steady = floor
    if nccl.async_error_handling == 1 and nccl.flight_recorder_entries > 0:
        notes.append("async_error_handling=1 aborts communicators, which breaks flight-recorder dumps "
                     "(pytorch#121055); 3 is recommended")
    return Timeouts(hang=hang_timeout, save_allowance_s=save_allow, collective_init_s=init,
                    collective_s=steady, heartbeat_s=float(nccl.heartbeat_timeout_s),
                    dump_wait_s=DUMP_WAIT_S, margin_s=margin, notes=tuple(notes))


def flight_recorder_dir(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / f"attempt-{attempt}" / FR_DIR


def nccl_env(config: Config, *, run_dir: str | Path, attempt: int,
             step_times: Iterable[float] | None = (), save_times: Iterable[float] | None = (),
             timeouts: Timeouts | None = None) -> dict[str, str]:
    """The environment the supervisor exports to every rank of an attempt (strings only).
    Flight-recorder dumps go to <run_dir>/attempt-<N>/flight_recorder/rank_<R> (torch appends
    the rank to the prefix); both the TORCH_NCCL_* and the newer TORCH_FR_* names are set."""
    t = timeouts or derive_timeouts(config, step_times=step_times, save_times=save_times)
    nccl = config.nccl
    entries = int(nccl.flight_recorder_entries)
    prefix = str(flight_recorder_dir(run_dir, attempt) / "rank_")
    dump = "1" if (nccl.dump_on_timeout and entries > 0) else "0"
    env: dict[str, Any] = {
        envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING: int(nccl.async_error_handling),
        envvars.TORCH_NCCL_ENABLE_MONITORING: 1,
        envvars.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: int(math.ceil(t.heartbeat_s)),
        envvars.TORCH_NCCL_DUMP_ON_TIMEOUT: dump,
        envvars.TORCH_NCCL_TRACE_BUFFER_SIZE: entries,
        envvars.TORCH_FR_BUFFER_SIZE: entries,
        envvars.TORCH_NCCL_DEBUG_INFO_TEMP_FILE: prefix,
        envvars.TORCH_FR_DUMP_TEMP_FILE: prefix,
        envvars.TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: int(t.dump_wait_s * 1000),
        envvars.FR_DUMP_DIR: str(flight_recorder_dir(run_dir, attempt)),
        envvars.COLLECTIVE_TIMEOUT_INIT_S: _num(t.collective_init_s),
        envvars.COLLECTIVE_TIMEOUT_S: _num(t.collective_s),
    }
    return {k: str(v) for k, v in env.items()}


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.3f}"


def derived_rows(config: Config, *, run_dir: str | Path = "<run_dir>", attempt: int = 0,
                 step_times: Iterable[float] | None = (), save_times: Iterable[float] | None = ()) -> list[dict[str, Any]]:
    """What the supervisor would export, as `config show` rows ({key, value, source}); the
    source says what it is derived from, and each note why a configured value was lifted."""
    t = derive_timeouts(config, step_times=step_times, save_times=save_times)
    hang_source = ("configured supervisor.hang_timeout_s" if config.supervisor.hang_timeout_s != AUTO
                   else "derived: max(hang_min_s, hang_step_factor x p99 step)")
    rows = [{"key": "supervisor.hang_timeout_s (effective)", "value": t.hang.s, "source": hang_source},
            {"key": "supervisor.save_allowance_s (effective)", "value": t.save_allowance_s,
             "source": "derived: min(save_timeout_s, max(hang, 3 x slowest save))"},
            {"key": "nccl.collective_timeout_init_s (effective)", "value": t.collective_init_s,
             "source": "derived: max(configured, max(init, load allowance, hang) + margin)"},
            {"key": "nccl.collective_timeout_s (effective)", "value": t.collective_s,
             "source": "derived: max(hang, save allowance) + margin; the init value until a step is measured"}]
    for name, value in nccl_env(config, run_dir=run_dir, attempt=attempt, timeouts=t).items():
        rows.append({"key": f"env {name}", "value": value, "source": "derived (docs/timeouts.md)"})
    rows += [{"key": "note", "value": note, "source": "nccl.derive_timeouts"} for note in t.notes]
    return rows
