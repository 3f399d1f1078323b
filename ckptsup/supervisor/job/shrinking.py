"""The inputs of "fewer nodes or a requeue" (planning/shrink.py) from what this run measured and
what the config says, each named with its source (docs/planning.md §Fewer nodes or a requeue).
Pure: the loop passes state.json's `measured`, the config and the clock."""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping, Sequence

from ...config import SupervisorConfig
from ...events import Event
from ...planning.shrink import Figure
from .observations import ShrinkCosts

MEASURED, CONFIGURED, SLURM, UNMEASURED = "measured", "configured", "slurm", "unmeasured"


def _measured(measured: Mapping[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = measured.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def shrink_costs(measured: Mapping[str, Any], sup: SupervisorConfig, *, end_time: float | None,
                 now: float) -> ShrinkCosts:
    """horizon: shrink_horizon_s (the rest of the work, as the user expects it), or the time left
    in the allocation when that is shorter (the next allocation has every node again); restart: the last in-allocation restart (else the allocation's start-up, else
    0, unmeasured); queue wait: this run's last requeue's time in the queue, else requeue_wait_s;
    a requeue's start-up: this run's allocation start-up (supervisor start to first step), else
    the restart's figure."""
    left = None if end_time is None else end_time - now
    horizon = Figure(value_s=left, source=SLURM) if left is not None and 0 < left < sup.shrink_horizon_s else \
        Figure(value_s=sup.shrink_horizon_s, source=CONFIGURED)
    restart_s = _measured(measured, "restart_s", "startup_s")
    restart = Figure(value_s=restart_s, source=MEASURED) if restart_s is not None else Figure(value_s=0.0, source=UNMEASURED)
    queue_s = _measured(measured, "queue_s")
    queue = Figure(value_s=queue_s, source=MEASURED) if queue_s is not None else \
        Figure(value_s=sup.requeue_wait_s, source=CONFIGURED)
    startup_s = _measured(measured, "startup_s")
    startup = Figure(value_s=startup_s, source=MEASURED) if startup_s is not None else restart
    return ShrinkCosts(horizon=horizon, restart=restart, queue_wait=queue, requeue_restart=startup)


def queue_time_s(earlier: Sequence[Mapping[str, Any]], now_wall: float) -> float | None:
    """Seconds from the run's last `requeue` event to now (a new supervisor's start), when the
    last allocation ended in one; None otherwise."""
    for record in reversed(earlier):
        name = record.get("event")
        if name == Event.SUPERVISOR_START:
            return None   # the last allocation did not end in a requeue
        if name == Event.REQUEUE and isinstance(record.get("ts"), str):
            try:
                at = dt.datetime.fromisoformat(record["ts"]).timestamp()
            except ValueError:
                return None
            return max(0.0, now_wall - at)
    return None
