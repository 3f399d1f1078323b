"""Goodput accounting from events.jsonl alone, across attempts and requeues (docs/planning.md).

paid     = ∫ allocated devices dt over every attempt (active + hot spares; a GPU-less node counts
           its ranks). Queue time between attempts is not paid; it is reported beside it.
useful   = running time whose progress survived (not lost, not stalled), × active devices.
badput   = categories below, × active devices; idle spares × spare devices.
Each span's wall time is split among claims in a fixed order, each clipped to what is left, and
the remainder goes to the span's default category — so useful + Σ badput == paid by construction.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..events import Event, FailureKind
from . import spans as tl
from .spans import Attempt, EndReason, Span, SpanKind, num

CATEGORIES = (
    "checkpoint_stall",    # blocking part of disk saves (checkpoint_committed/failed.stall_s)
    "memory_stall",        # blocking part of memory saves (memory_saved.stall_s)
    "lost_progress",       # work after the checkpoint the next attempt resumed from
    "detection",           # failure → detection (detect_s)
    "restart_kill", "restart_health", "restart_container", "restart_launch", "restart_rendezvous", "restart_load",
    "restart_first_step",  # restart phases from restart_done.phases
    "startup",             # allocation start → first step, beyond any restart phases
    "teardown",            # failure/requeue → end of an attempt that does not restart in place
    "idle_spares",         # hot spares held, × their devices
    "other",               # recovery time no event explains
)


@dataclass(kw_only=True)
class Accounting:
    paid_device_s: float = 0.0
    useful_device_s: float = 0.0
    badput_device_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall_s: float = 0.0          # allocated wall time, all attempts
    queue_s: float = 0.0         # wall time between attempts (not paid)
    allocations: int = 0         # supervisor instances (the first + one per requeue)
    attempts: int = 0            # distinct attempt numbers (in-allocation restarts count)
    requeues: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    stalls_s: list[float] = field(default_factory=list)
    writes_s: list[float] = field(default_factory=list)
    memory_stalls_s: list[float] = field(default_factory=list)   # every memory save's, failed ones included
    memory_writes_s: list[float] = field(default_factory=list)   # the successful ones' write to the agent
    restarts_s: list[float] = field(default_factory=list)
    detects_s: list[float] = field(default_factory=list)
    checkpoint_bytes: list[float] = field(default_factory=list)
    mean_active_devices: float = 0.0
    end_reason: EndReason = EndReason.OPEN
    notes: list[str] = field(default_factory=list)
    timeline: dict[str, list[Any]] = field(default_factory=dict)
    attempt_rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failure_count(self) -> int:
        return sum(n for kind, n in self.failures.items() if FailureKind.counts_against_mtbf(kind))

    @property
    def observed_job_mtbf_s(self) -> float | None:
        return self.wall_s / self.failure_count if self.failure_count else None

    def to_dict(self, *, price_per_gpu_hour: float) -> dict[str, Any]:
        hours = lambda s: s / 3600.0  # noqa: E731
        usd = lambda s: s / 3600.0 * price_per_gpu_hour  # noqa: E731
        badput_total = sum(self.badput_device_s.values())
        mtbf = self.observed_job_mtbf_s
        return {
            "paid_device_hours": hours(self.paid_device_s),
            "useful_device_hours": hours(self.useful_device_s),
            "badput_device_hours": {k: hours(v) for k, v in self.badput_device_s.items()},
            "badput_total_device_hours": hours(badput_total),
            "goodput_fraction": self.useful_device_s / self.paid_device_s if self.paid_device_s else None,
            "price_per_gpu_hour": price_per_gpu_hour,
            "paid_usd": usd(self.paid_device_s),
            "useful_usd": usd(self.useful_device_s),
            "badput_usd": {k: usd(v) for k, v in self.badput_device_s.items()},
            "wall_s": self.wall_s,
            "queue_s": self.queue_s,
            "allocations": self.allocations,
            "attempts": self.attempts,
            "requeues": self.requeues,
            "failures": dict(self.failures),
            "failure_count": self.failure_count,
            "observed_job_mtbf_s": mtbf,
            "observed_device_mtbf_s": mtbf * self.mean_active_devices if mtbf is not None else None,
            "mean_active_devices": self.mean_active_devices,
            "measured_stall_s": _mean(self.stalls_s),
            "measured_write_s": _mean(self.writes_s),
            "measured_restart_s": _mean(self.restarts_s),
            "measured_detect_s": _mean(self.detects_s),
            "checkpoints": len(self.stalls_s),
            "measured_memory_stall_s": _mean(self.memory_stalls_s),
            "measured_memory_write_s": _mean(self.memory_writes_s),
            "memory_saves": len(self.memory_stalls_s),
            "checkpoint_bytes": _mean(self.checkpoint_bytes),
            "end_reason": self.end_reason.value,
            "attempt_rows": self.attempt_rows,
            "notes": list(self.notes),
        }


def account(events: Iterable[dict[str, Any]]) -> Accounting:
    events = list(events)
    attempts = tl.build_attempts(events)
    acc = Accounting(allocations=len(attempts),
                     attempts=len({n for a in attempts for n in a.attempt_numbers}))
    if not attempts:
        acc.notes.append("no datable events: nothing to account")
        return acc
    resumes = _resume_points(attempts)
    commits = sorted((t, step) for a in attempts for t, ev in a.events
                     if ev.get("event") == Event.CHECKPOINT_COMMITTED and (step := num(ev, "step")) is not None)
    active_total = 0.0
    for index, attempt in enumerate(attempts):
        if not attempt.devices:
            attempt.devices.append((attempt.start, 1.0, 0.0))
            acc.notes.append(f"attempt {attempt.attempt}: no allocation event; counted as 1 device")
        if index:
            gap = attempt.start - attempts[index - 1].end
            acc.queue_s += max(0.0, gap)
        acc.requeues += attempt.end_reason is EndReason.REQUEUE
        acc.wall_s += attempt.end - attempt.start
        spare = tl.integrate(attempt.devices, attempt.start, attempt.end, column=2)
        acc.badput_device_s["idle_spares"] += spare
        acc.paid_device_s += spare
        for span in attempt.spans:
            active = tl.integrate(attempt.devices, span.start, span.end, column=1)
            active_total += active
            acc.paid_device_s += active
            shares = _split_span(span, attempt, resumes, commits)
            length = span.length
            for category, seconds in shares.items():
                weighted = active * seconds / length if length > 0 else 0.0
                if category == "useful":
                    acc.useful_device_s += weighted
                else:
                    acc.badput_device_s[category] += weighted
        _collect(acc, attempt)
        acc.attempt_rows.append(_attempt_row(attempt))
    acc.end_reason = attempts[-1].end_reason
    acc.mean_active_devices = active_total / acc.wall_s if acc.wall_s > 0 else attempts[-1].devices[-1][1]
    acc.timeline = _timeline(attempts)
    return acc


def _split_span(span: Span, attempt: Attempt, resumes: list[tuple[float, float | None]],
                commits: list[tuple[float, float]]) -> dict[str, float]:
    """Wall seconds of one span by category; sums to span.length."""
    left = span.length
    out: dict[str, float] = {}

    def claim(category: str, seconds: float) -> None:
        nonlocal left
        take = min(max(0.0, seconds), left)
        if take > 0:
            out[category] = out.get(category, 0.0) + take
            left -= take

    stall_total = sum(s for _, s in span.stalls)
    memory_total = sum(s for _, s in span.memory_stalls)
    if span.kind is SpanKind.RUNNING:
        claim("checkpoint_stall", stall_total)
        claim("memory_stall", memory_total)
        if span.interrupted:
            resume = _resume_after(resumes, span.end)
            if resume is None:  # nothing resumed (yet): back to the newest committed checkpoint
                resume = max((step for t, step in commits if t <= span.end), default=None)
            claim("lost_progress", _lost_seconds(span, resume))
        claim("useful", left)
        return out
    claim("detection", span.detect_s)
    for phase in tl.PHASES:
        claim(f"restart_{phase}", span.phases.get(phase, 0.0))
    claim("checkpoint_stall", stall_total)
    claim("memory_stall", memory_total)
    if span.kind is SpanKind.STARTUP:
        claim("startup", left)
    elif span.ends_attempt and attempt.end_reason is not EndReason.OPEN:
        claim("teardown", left)
    else:
        claim("other", left)
    return out


def _resume_points(attempts: list[Attempt]) -> list[tuple[float, float | None]]:
    """(t, steps in the checkpoint resumed from) for every (re)start: restart_done.resume_step, or
    the index of the first step run after a launch (first_step.step: it runs step N after
    resuming from N steps done)."""
    points: list[tuple[float, float | None]] = []
    for attempt in attempts:
        for t, ev in attempt.events:
            name = ev.get("event")
            if name == Event.RESTART_DONE and "resume_step" in ev:
                points.append((t, num(ev, "resume_step")))
            elif name == Event.FIRST_STEP and num(ev, "step") is not None:
                points.append((t, num(ev, "step")))
    points.sort(key=lambda p: p[0])
    return points


def _resume_after(resumes: list[tuple[float, float | None]], t: float) -> float | None:
    """Where the first (re)start after `t` resumed from."""
    for when, step in resumes:
        if when >= t:
            return step
    return None


def _lost_seconds(span: Span, resume_step: float | None) -> float:
    """Running time after the point where training reached `resume_step`, minus the stalls (disk and
    memory saves) in it.
    The point is interpolated from step samples (linear between samples, extrapolated with the
    last step time); with no checkpoint at all, everything since the span's start is lost."""
    if resume_step is None:
        resume_step = span.start_step if span.start_step is not None else -math.inf
    t_resume = _time_at_step(_anchors(span), span, resume_step)
    stalls_after = sum(s for t, s in (*span.stalls, *span.memory_stalls) if t >= t_resume)
    return max(0.0, span.end - t_resume - stalls_after)


def _anchors(span: Span) -> list[tuple[float, float]]:
    """(t, steps done) known in a running span: its start, step samples, checkpoints taken and the
    step at the failure; sorted by time, keeping steps non-decreasing (clock noise)."""
    points = [(span.start, span.start_step)] if span.start_step is not None else []
    points += [(t, step) for t, step, _ in span.samples]
    points += [(t, step) for t, step in span.anchors if t <= span.end]
    out: list[tuple[float, float]] = []
    for t, step in sorted(points, key=lambda p: p[0]):
        if step is not None and (not out or step >= out[-1][1]):
            out.append((t, step))
    return out


def _time_at_step(points: list[tuple[float, float]], span: Span, step: float) -> float:
    if not points or step <= points[0][1]:
        return span.start
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    t_last, s_last = points[-1]
    rate = _step_time(span, points)
    return min(span.end, t_last + (step - s_last) * rate) if rate is not None else span.end


def _step_time(span: Span, points: list[tuple[float, float]]) -> float | None:
    times = [st for _, _, st in span.samples if st is not None and st > 0]
    if times:
        return times[-1]
    if len(points) >= 2 and points[-1][1] > points[0][1]:
        return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])
    return None


def _collect(acc: Accounting, attempt: Attempt) -> None:
    for _, ev in attempt.events:
        name = ev.get("event")
        if name == Event.CHECKPOINT_COMMITTED:
            acc.stalls_s.append(num(ev, "stall_s", 0.0) or 0.0)
            if num(ev, "write_s") is not None:
                acc.writes_s.append(num(ev, "write_s") or 0.0)
            if num(ev, "bytes") is not None:
                acc.checkpoint_bytes.append(num(ev, "bytes") or 0.0)
        elif name == Event.MEMORY_SAVED:
            acc.memory_stalls_s.append(num(ev, "stall_s", 0.0) or 0.0)
            if ev.get("ok") is True and num(ev, "write_s") is not None:
                acc.memory_writes_s.append(num(ev, "write_s") or 0.0)
        elif name == Event.FAILURE_DETECTED:
            kind = str(ev.get("kind") or "unknown")
            acc.failures[kind] = acc.failures.get(kind, 0) + 1
            if num(ev, "detect_s") is not None:
                acc.detects_s.append(num(ev, "detect_s") or 0.0)
        elif name == Event.FAILURE_ATTRIBUTED:
            # the policy found what the detected failure was: count it as that instead
            was, kind = str(ev.get("was_kind") or "unknown"), str(ev.get("kind") or "unknown")
            if acc.failures.get(was, 0) > 0:
                acc.failures[was] -= 1
                if not acc.failures[was]:
                    del acc.failures[was]
            acc.failures[kind] = acc.failures.get(kind, 0) + 1
        elif name == Event.RESTART_DONE and num(ev, "restart_s") is not None:
            acc.restarts_s.append(num(ev, "restart_s") or 0.0)


def _attempt_row(attempt: Attempt) -> dict[str, Any]:
    return {"attempt": attempt.attempt, "attempts": attempt.attempt_numbers, "start": attempt.start, "wall_s": attempt.end - attempt.start,
            "end_reason": attempt.end_reason.value, "active_devices": attempt.devices[-1][1],
            "spare_devices": attempt.devices[-1][2],
            "failures": sum(1 for _, e in attempt.events if e.get("event") == Event.FAILURE_DETECTED),
            # "attempt N: level" for each attempt whose supervision level was logged
            "levels": [f"{e.get('attempt')}: {e.get('level')}" for _, e in attempt.events
                       if e.get("event") == Event.SUPERVISION_LEVEL]}


def _timeline(attempts: list[Attempt]) -> dict[str, list[Any]]:
    """Points for the report's plot, in seconds since the first event."""
    t0 = attempts[0].start
    out: dict[str, list[Any]] = {"progress": [], "checkpoints": [], "failures": [], "restarts": [],
                                 "attempts": [], "intervals": [], "memory_intervals": []}
    for attempt in attempts:
        if out["progress"]:
            out["progress"].append([attempt.start - t0, None])  # no line across the queue
        out["attempts"].append([attempt.start - t0, attempt.end - t0, attempt.attempt, attempt.end_reason.value])
        for t, ev in attempt.events:
            name, rel = ev.get("event"), t - t0
            step = num(ev, "step")
            if name in (Event.STEP_PROGRESS, Event.FIRST_STEP) and step is not None:
                out["progress"].append([rel, step])
            elif name == Event.CHECKPOINT_COMMITTED:
                out["checkpoints"].append([rel, step])
            elif name == Event.FAILURE_DETECTED:
                out["failures"].append([rel, str(ev.get("kind") or "unknown")])
                out["progress"].append([rel, None])  # break the progress line at a failure
            elif name == Event.RESTART_DONE:
                out["restarts"].append([rel, num(ev, "resume_step")])
                if num(ev, "resume_step") is not None:
                    out["progress"].append([rel, num(ev, "resume_step")])
            elif name == Event.INTERVAL_CHANGED and ev.get("level") == "memory":
                out["memory_intervals"].append([rel, num(ev, "every_steps"), num(ev, "interval_s"), str(ev.get("why") or "")])
            elif name == Event.INTERVAL_CHANGED:   # the disk interval (logs before `level` hold only those)
                out["intervals"].append([rel, num(ev, "interval_s"), str(ev.get("why") or "")])
    return out


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None
