"""Wall time per phase (init, load, train, eval, save, stopping) from events.jsonl alone (pure):
`ckptsup report` and `ckptsup status` show it.

Within each allocation (spans.group_allocations, one clock: spans.place_events) a phase runs from
the event that starts it to the next one:
  launch              → init (the ranks start, import, rendezvous)
  phase {phase}       → that phase (rank 0's, hooks/phase.py: attach and heartbeat ranks)
  first_step          → train, when no phase event said otherwise (heartbeat ranks, scripts without hooks)
  failure_detected    ends it at the failure (t − detect_s): recovery is the goodput report's
  requeue, give_up, run_complete, run_cancelled, the allocation's last event (or `until`) end it.
Wall time, not device time: one rank's view (rank 0's) of what the job was doing.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..events import Event
from .spans import TERMINAL, group_allocations, num, place_events

PHASES = ("init", "load", "train", "eval", "save", "stopping")


def phase_times(events: Iterable[dict[str, Any]], *, until: float | None = None) -> dict[str, float]:
    """Seconds per phase, in PHASES order, phases never entered left out. `until` (wall clock,
    seconds): the open phase of the last allocation runs to it (a live run's status)."""
    totals: dict[str, float] = {}
    groups = group_allocations(events)
    for index, group in enumerate(groups):
        placed = place_events(group)
        if not placed:
            continue
        current: str | None = None
        since = 0.0

        def close(at: float) -> None:
            nonlocal current
            if current is not None:
                totals[current] = totals.get(current, 0.0) + max(0.0, at - since)
                current = None

        def start(phase: str, at: float) -> None:
            nonlocal current, since
            close(at)
            current, since = phase, at

        for t, ev in placed:
            name = Event.parse(ev.get("event"))
            if name is Event.LAUNCH:
                start("init", t)
            elif name is Event.PHASE and ev.get("phase") in PHASES:
                start(str(ev["phase"]), t)
            elif name is Event.FIRST_STEP and current in (None, "init", "load"):
                start("train", t)
            elif name is Event.FAILURE_DETECTED:
                close(max(since, t - max(0.0, num(ev, "detect_s", 0.0) or 0.0)))
            elif name in TERMINAL:
                close(t)
        end = placed[-1][0]
        if until is not None and index == len(groups) - 1:
            end = max(end, until)
        close(end)
    return {phase: round(totals[phase], 3) for phase in PHASES if phase in totals}


def phases_line(times: dict[str, Any]) -> str:
    """"train 1h 2m 0s (93.1%), eval 4m 10s (6.2%), …" for a terminal; "-" when nothing was timed."""
    from .units import format_duration

    values = {k: float(v) for k, v in times.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    total = sum(values.values())
    if total <= 0:
        return "-"
    return ", ".join(f"{phase} {format_duration(s)} ({s / total:.1%})" for phase, s in values.items())


def busy_time(events: Iterable[dict[str, Any]], *, until: float | None = None) -> dict[str, float | int]:
    """Busy spells (supervisor/job/liveness.py: no progress past the hang timeout while ranks work:
    a quiet evaluation, a compile, a data phase; never a hang): {"spells", "busy_s"}. A spell runs
    from its last progress to `busy_over`; one still open ends at the failure or the end of its
    allocation (or `until`: a live run's status)."""
    spells, total = 0, 0.0
    groups = group_allocations(events)
    for index, group in enumerate(groups):
        placed = place_events(group)
        open_at: float | None = None   # the open spell's last progress
        for t, ev in placed:
            name = Event.parse(ev.get("event"))
            if name is Event.BUSY and open_at is None:
                spells += 1
                open_at = t - max(0.0, num(ev, "silent_s", 0.0) or 0.0)
            elif name is Event.BUSY_OVER and open_at is not None:
                total += max(0.0, num(ev, "busy_s", 0.0) or (t - open_at))
                open_at = None
            elif open_at is not None and (name is Event.FAILURE_DETECTED or name in TERMINAL or name is Event.LAUNCH):
                total += max(0.0, t - open_at)
                open_at = None
        if open_at is not None and placed:
            end = placed[-1][0]
            if until is not None and index == len(groups) - 1:
                end = max(end, until)
            total += max(0.0, end - open_at)
    return {"spells": spells, "busy_s": round(total, 3)}


def busy_line(busy: Any) -> str:
    """"2 spells, 45s in all" for a terminal; "none" without one."""
    from .units import format_duration

    spells = busy.get("spells") if isinstance(busy, dict) else None
    seconds = busy.get("busy_s") if isinstance(busy, dict) else None
    if not isinstance(spells, int) or isinstance(spells, bool) or spells <= 0:
        return "none"
    total = format_duration(float(seconds)) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else "?"
    return f"{spells} spell{'s' if spells != 1 else ''}, {total} in all"
