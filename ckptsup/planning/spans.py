"""events.jsonl → per-allocation timelines of spans (the raw material of goodput accounting).

An allocation is what one supervisor instance ran (group_allocations); it may hold several
attempt numbers (in-allocation restarts). Clocks: within one allocation the supervisor's `mono`
gives precise durations; across allocations (other hosts, requeues) only the wall clock `ts` is
comparable. Each allocation's events are put on one axis: t = mono + offset, where offset is the
allocation's median (ts − mono); an event whose own
ts − mono is off that median by more than CLOCK_TOLERANCE_S came from another host or clock (a
requeuer on another node) and is placed by its ts instead.

Spans partition each allocation's wall time [first event, last event]:
  STARTUP  from its start to its first step (first_step / step_progress / restart_done),
  RUNNING  from there to a failure (failure_detected.t − detect_s), a requeue/give-up, or the end,
  FAILURE  from the failure to the next running start (or the end of the allocation).
Claims (durations known from event fields: stall_s of disk and of memory saves, detect_s, restart
phases) are attached to the span they happened in; accounting.py turns spans and claims into categories.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..events import Event, FailureKind, parse_ts

CLOCK_TOLERANCE_S = 2.0
PHASES = ("kill", "health", "container", "launch", "rendezvous", "load", "first_step")   # container: agents started in containers
TERMINAL = (Event.REQUEUE, Event.GIVE_UP, Event.RUN_COMPLETE, Event.RUN_CANCELLED)   # the events that end an attempt (EndReason)


class EndReason(str, enum.Enum):
    """How an attempt's stretch of the log ended. OPEN (still running, or cut off) → one of the
    terminal events' names."""

    OPEN = "open"
    REQUEUE = Event.REQUEUE.value
    GIVE_UP = Event.GIVE_UP.value
    RUN_COMPLETE = Event.RUN_COMPLETE.value
    RUN_CANCELLED = Event.RUN_CANCELLED.value


class SpanKind(str, enum.Enum):
    STARTUP = "startup"
    RUNNING = "running"
    FAILURE = "failure"


@dataclass(kw_only=True)
class Span:
    kind: SpanKind
    start: float
    end: float = math.nan
    start_step: float | None = None  # steps done at `start` (a checkpoint's `step` counts the same way)
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (t of commit, stall_s)
    memory_stalls: list[tuple[float, float]] = field(default_factory=list)  # (t the stall ended, memory_saved.stall_s)
    detect_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[float, float, float | None]] = field(default_factory=list)  # (t, steps done, step_time_s)
    anchors: list[tuple[float, float]] = field(default_factory=list)  # (t, steps done) from commits and failures
    interrupted: bool = False     # RUNNING span cut by a failure / requeue / give-up
    ends_attempt: bool = False

    @property
    def length(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(kw_only=True)
class Attempt:
    """One allocation: the events of one supervisor instance (see group_allocations)."""

    attempt: int                # the first attempt number seen in it
    attempt_numbers: list[int]
    start: float
    end: float
    spans: list[Span]
    devices: list[tuple[float, float, float]]  # (t, active devices, spare devices), piecewise constant
    events: list[tuple[float, dict[str, Any]]]  # (t, event), sorted
    end_reason: EndReason


def num(ev: dict[str, Any], key: str, default: float | None = None) -> float | None:
    """A finite number from an event field, or `default` (real logs miss fields or carry junk)."""
    value = ev.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value) if isinstance(value, str) else None
        except ValueError:
            value = None
    if value is None or not math.isfinite(value):
        return default
    return float(value)


def place_events(events: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """One attempt's events on one time axis (see module doc), sorted, undatable ones dropped."""
    pairs = [(parse_ts(e.get("ts")), num(e, "mono")) for e in events]
    offsets = [ts - mono for ts, mono in pairs if ts is not None and mono is not None]
    ref = statistics.median(offsets) if offsets else None
    placed: list[tuple[float, dict[str, Any]]] = []
    for (ts, mono), ev in zip(pairs, events):
        if mono is not None and ref is not None and (ts is None or abs(ts - mono - ref) <= CLOCK_TOLERANCE_S):
            placed.append((mono + ref, ev))
        elif ts is not None:
            placed.append((ts, ev))
    placed.sort(key=lambda pair: pair[0])
    return placed


def group_allocations(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Events grouped by allocation, in file order. Each `supervisor_start` opens a group (a new
    supervisor process: the first one, or the next after a requeue); an in-allocation restart
    bumps the attempt number under the same supervisor and stays in its group, and a requeue
    appended by a requeuer lands before the next supervisor_start, in the group it ends. Events
    before any supervisor started (the hooks writing alone) are grouped by `attempt`; there a
    `requeue` that would open a group goes back to the group before."""
    groups: list[list[dict[str, Any]]] = []
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    supervised = False
    for ev in events:
        if ev.get("event") == Event.SUPERVISOR_START:
            supervised = True
            groups.append([ev])
            continue
        if supervised:
            groups[-1].append(ev)
            continue
        attempt = num(ev, "attempt")
        key = int(attempt) if attempt is not None else -1
        if ev.get("event") == Event.REQUEUE and key not in by_attempt and by_attempt:
            key = list(by_attempt)[-1]
        if key not in by_attempt:
            by_attempt[key] = []
            groups.append(by_attempt[key])
        by_attempt[key].append(ev)
    return groups


def devices_of(ev: dict[str, Any]) -> tuple[float, float] | None:
    """(active devices, idle devices) from an `allocation` event. With `active` (what the
    supervisor writes) `nodes` is the whole allocation and every node not active — hot spares and
    excluded nodes still held — is idle; without it `nodes` are the active nodes and `spares` the
    hot spares on top (`allocated_nodes`, when given, is the whole allocation). A node without
    GPUs counts its ranks (`ranks_per_node`) as devices."""
    per_node = _per_node(ev)
    nodes = num(ev, "nodes")
    if nodes is None and isinstance(ev.get("nodes"), list):
        nodes = float(len(ev["nodes"]))
    active = num(ev, "active")
    allocated = num(ev, "allocated_nodes")
    if active is not None:
        total = allocated if allocated is not None else (nodes if nodes is not None else active)
        return active * per_node, max(0.0, total - active) * per_node
    if nodes is None and allocated is None:
        return None
    spares = num(ev, "spares", 0.0) or 0.0
    if nodes is None:
        nodes = max(0.0, (allocated or 0.0) - spares)
    elif allocated is not None:
        spares = max(0.0, allocated - nodes)
    return nodes * per_node, spares * per_node


def _per_node(ev: dict[str, Any]) -> float:
    gpus = num(ev, "gpus_per_node", 0.0) or 0.0
    return gpus if gpus > 0 else (num(ev, "ranks_per_node", 0.0) or num(ev, "nproc_per_node", 0.0) or 1.0)


def build_attempt(events: list[dict[str, Any]], *, default_devices: tuple[float, float] | None) -> Attempt | None:
    placed = place_events(events)
    if not placed:
        return None
    start, end = placed[0][0], placed[-1][0]
    folder = _SpanFolder(start=start, end=end)
    for t, ev in placed:
        name = ev.get("event")
        fold = _FOLDS.get(name) if isinstance(name, str) else None
        if fold is not None:
            fold(folder, t, ev)
    spans = folder.close()
    devices = folder.devices
    if not devices and default_devices is not None:
        devices.append((start, *default_devices))
    elif devices:
        devices[0] = (start, devices[0][1], devices[0][2])  # the first allocation holds from the start
    numbers = sorted({int(a) for a in (num(e, "attempt") for _, e in placed) if a is not None})
    return Attempt(attempt=int(num(placed[0][1], "attempt", -1) or 0), attempt_numbers=numbers, start=start,
                   end=end, spans=spans, devices=devices, events=placed, end_reason=folder.end_reason)


@dataclass
class _SpanFolder:
    """One allocation's events folded, in order, into spans (`cur` the open one) and device counts
    over time (`devices`: t, active, idle): one method per event kind (_FOLDS)."""

    start: float
    end: float
    devices: list[tuple[float, float, float]] = field(default_factory=list)
    per_node: float = 1.0                 # from the newest allocation event
    held_nodes: float | None = None
    down: set[str] = field(default_factory=set)
    spans: list[Span] = field(default_factory=list)
    end_reason: EndReason = EndReason.OPEN
    cur: Span = field(init=False)

    def __post_init__(self) -> None:
        self.cur = Span(kind=SpanKind.STARTUP, start=self.start)

    def switch(self, kind: SpanKind, at: float, *, step: float | None = None) -> Span:
        at = min(max(at, self.cur.start), self.end)
        self.cur.end = at
        self.spans.append(self.cur)
        self.cur = Span(kind=kind, start=at, start_step=step)
        return self.cur

    def close(self) -> list[Span]:
        self.cur.end = self.end
        self.spans.append(self.cur)
        self.spans[-1].ends_attempt = True
        return self.spans

    def allocation(self, t: float, ev: dict[str, Any]) -> None:
        dev = devices_of(ev)
        if dev is not None:
            self.devices.append((t, dev[0], dev[1]))
            self.per_node = _per_node(ev)
            self.held_nodes = (dev[0] + dev[1]) / self.per_node
            self.down.clear()

    def launch(self, t: float, ev: dict[str, Any]) -> None:
        if isinstance(ev.get("nodes"), list) and self.held_nodes is not None:
            # a (re)launch on other nodes: a dead node has left the allocation (Slurm removes
            # it under --no-kill); every other node held but not launched on is idle
            active_nodes = float(len(ev["nodes"]))
            held = max(active_nodes, self.held_nodes - len(self.down))
            self.devices.append((t, active_nodes * self.per_node, (held - active_nodes) * self.per_node))

    def step(self, t: float, ev: dict[str, Any]) -> None:
        # `step` is the 0-based index of the step just completed: step + 1 steps are done
        index = num(ev, "step")
        done = None if index is None else index + 1
        if self.cur.kind is not SpanKind.RUNNING:
            self.switch(SpanKind.RUNNING, t, step=done)
        if done is not None:
            self.cur.samples.append((t, done, num(ev, "step_time_s")))

    def restart_done(self, t: float, ev: dict[str, Any]) -> None:
        phases = ev.get("phases") if isinstance(ev.get("phases"), dict) else {}
        target = self.cur if self.cur.kind is not SpanKind.RUNNING else _last_recovery(self.spans)
        if target is not None:
            for phase in PHASES:
                value = num(phases, f"{phase}_s", None) if phases else None
                if value is None:
                    value = num(ev, f"{phase}_s", None)
                if value is not None and value > 0:
                    target.phases[phase] = target.phases.get(phase, 0.0) + value
        # resume_step = steps in the checkpoint resumed from; the first step after it is done
        resume = num(ev, "resume_step")
        done = None if resume is None else resume + 1
        if self.cur.kind is not SpanKind.RUNNING:
            self.switch(SpanKind.RUNNING, t, step=done)
        elif self.cur.start_step is None:
            self.cur.start_step = done

    def failure_attributed(self, t: float, ev: dict[str, Any]) -> None:
        if ev.get("kind") != FailureKind.NODE_DOWN or not isinstance(ev.get("node"), str):
            return
        self.down.add(ev["node"])  # the failure was this node's death (its agent fell silent)
        cur = self.cur
        if cur.kind is SpanKind.FAILURE:
            # the node fell silent detect_s before this attribution: time before the failure
            # span began (a peer's crash was detected later) moves from the running span into
            # detection; silence inside the span is the recovery's own time (the kill that
            # probed it), already claimed by its phases
            silent_since = t - max(0.0, num(ev, "detect_s", 0.0) or 0.0)
            before = self.spans[-1] if self.spans and self.spans[-1].kind is SpanKind.RUNNING else None
            if before is not None and silent_since < cur.start:
                moved_to = max(silent_since, before.start)
                cur.detect_s += cur.start - moved_to
                before.end = cur.start = moved_to

    def failure_detected(self, t: float, ev: dict[str, Any]) -> None:
        detect = max(0.0, num(ev, "detect_s", 0.0) or 0.0)
        if ev.get("kind") == FailureKind.NODE_DOWN and isinstance(ev.get("node"), str):
            self.down.add(ev["node"])
        if self.cur.kind is SpanKind.RUNNING:
            at_failure = num(ev, "step")  # the step being worked on = steps done
            if at_failure is not None:
                self.cur.anchors.append((max(self.cur.start, t - detect), at_failure))
            self.cur.interrupted = True
            self.switch(SpanKind.FAILURE, t - detect)
            self.cur.detect_s += t - self.cur.start
        else:
            self.cur.detect_s += detect  # a second failure while recovering

    def checkpoint(self, t: float, ev: dict[str, Any]) -> None:
        stall = num(ev, "stall_s", 0.0) or 0.0
        if stall > 0:
            self.cur.stalls.append((t, stall))
        saved = num(ev, "step")
        if ev.get("event") == Event.CHECKPOINT_COMMITTED and saved is not None and self.cur.kind is SpanKind.RUNNING:
            # the state was captured before the stall (sync) or before the background write
            # (async): max(stall, write) before the commit, to within the stall
            taken = t - max(stall, num(ev, "write_s", 0.0) or 0.0)
            if taken >= self.cur.start:
                self.cur.anchors.append((taken, saved))

    def memory_saved(self, t: float, ev: dict[str, Any]) -> None:
        stall = num(ev, "stall_s", 0.0) or 0.0
        if stall > 0:   # a failed memory save stalled the step too; the event comes after its write
            self.cur.memory_stalls.append((t - max(0.0, num(ev, "write_s", 0.0) or 0.0), stall))

    def terminal(self, t: float, ev: dict[str, Any]) -> None:
        name = ev["event"]
        self.end_reason = EndReason(name)
        if self.cur.kind is SpanKind.RUNNING and name != Event.RUN_COMPLETE:
            self.cur.interrupted = True
            self.switch(SpanKind.FAILURE, t)


_FOLDS: dict[str, Callable[[_SpanFolder, float, dict[str, Any]], None]] = {
    Event.ALLOCATION: _SpanFolder.allocation,
    Event.LAUNCH: _SpanFolder.launch,
    Event.FIRST_STEP: _SpanFolder.step,
    Event.STEP_PROGRESS: _SpanFolder.step,
    Event.RESTART_DONE: _SpanFolder.restart_done,
    Event.FAILURE_ATTRIBUTED: _SpanFolder.failure_attributed,
    Event.FAILURE_DETECTED: _SpanFolder.failure_detected,
    Event.CHECKPOINT_COMMITTED: _SpanFolder.checkpoint,
    Event.CHECKPOINT_FAILED: _SpanFolder.checkpoint,
    Event.MEMORY_SAVED: _SpanFolder.memory_saved,
    **{name: _SpanFolder.terminal for name in TERMINAL},
}


def _last_recovery(spans: list[Span]) -> Span | None:
    for span in reversed(spans):
        if span.kind is not SpanKind.RUNNING:
            return span
    return None


def build_attempts(events: Iterable[dict[str, Any]]) -> list[Attempt]:
    attempts: list[Attempt] = []
    default: tuple[float, float] | None = None
    for group in group_allocations(events):
        attempt = build_attempt(group, default_devices=default)
        if attempt is None:
            continue
        if attempt.devices:
            default = attempt.devices[-1][1:]
        attempts.append(attempt)
    attempts.sort(key=lambda a: a.start)
    return attempts


def integrate(devices: list[tuple[float, float, float]], a: float, b: float, *, column: int) -> float:
    """∫ of a piecewise-constant device count (column 1 active, 2 spare) over [a, b]."""
    if b <= a or not devices:
        return 0.0
    total = 0.0
    for i, row in enumerate(devices):
        seg_start = row[0] if i else -math.inf
        seg_end = devices[i + 1][0] if i + 1 < len(devices) else math.inf
        lo, hi = max(a, seg_start), min(b, seg_end)
        if hi > lo:
            total += (hi - lo) * row[column]
    return total
