"""What one line of `ckptsup log`'s story says (story.py builds them): the kinds of lines and
of events, an attempt's routine folded, an incident from its detection to its decision, a
launch or restart from its event to its first step. Pure text from the file's values as they
are; the renderer makes each line literal (textsafe).
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...events import Event, FailureKind


class Kind(str, enum.Enum):
    """What a story line (and, for `--all --kind`, an event) is about."""

    START = "start"            # a supervisor's start: its allocation, health checks, the first launch
    ROUTINE = "routine"        # an attempt's steps and saves, folded
    CHECKPOINT = "checkpoint"  # a checkpoint that failed or was rejected (with --kind, also the folded lines)
    FAILURE = "failure"        # an incident: what failed, its detection, blame, exclusion, drain, decision
    RECOVERY = "recovery"      # a restart: path, phases, where the resume loaded from
    REQUEUE = "requeue"        # the allocation given back (requeue, its pending-job update)
    OPERATOR = "operator"      # an operator's request (save-now, stop, replace)
    WARNING = "warning"        # busy spells, stragglers, restore-loss jumps, teardown trouble, unknown events
    END = "end"                # complete, gave up, stopped


ROUTINE_EVENTS = frozenset({
    Event.STEP_PROGRESS, Event.CHECKPOINT_COMMITTED, Event.MEMORY_SAVED, Event.CHECKPOINT_VALIDATED,
    Event.CHECKPOINT_PROMOTED, Event.WARM_READY, Event.PHASE, Event.FIRST_STEP, Event.SUPERVISION_LEVEL,
    Event.COLLECTIVE_TIMEOUT_SET, Event.INTERVAL_CHANGED, Event.AGENT_STARTED, Event.BUSY_OVER,
    Event.EXTERNAL_RESUME, Event.HF_RESUME, Event.SCRIPT_CHECKPOINT_VERIFIED, Event.CHECKPOINT_LOADED,
    Event.ELASTIC_RESUME, Event.FR_DUMPED, Event.LAUNCH, Event.MEMORY_REPLICATED})
EVENT_KIND: dict[Event, Kind] = {
    Event.SUPERVISOR_START: Kind.START, Event.ALLOCATION: Kind.START, Event.HEALTH_CHECK: Kind.START,
    Event.LAUNCH: Kind.START,
    Event.CHECKPOINT_COMMITTED: Kind.CHECKPOINT, Event.CHECKPOINT_FAILED: Kind.CHECKPOINT,
    Event.MEMORY_SAVED: Kind.CHECKPOINT, Event.MEMORY_REPLICATED: Kind.CHECKPOINT,
    Event.CHECKPOINT_VALIDATED: Kind.CHECKPOINT, Event.CHECKPOINT_REJECTED: Kind.CHECKPOINT,
    Event.CHECKPOINT_PROMOTED: Kind.CHECKPOINT, Event.CHECKPOINT_LOADED: Kind.RECOVERY,
    Event.ELASTIC_RESUME: Kind.RECOVERY, Event.RESTART_DONE: Kind.RECOVERY,
    Event.SCRIPT_CHECKPOINT_RESTORED: Kind.CHECKPOINT, Event.SCRIPT_CHECKPOINT_REJECTED: Kind.CHECKPOINT,
    Event.FAILURE_DETECTED: Kind.FAILURE, Event.FAILURE_ATTRIBUTED: Kind.FAILURE, Event.NODE_EXCLUDED: Kind.FAILURE,
    Event.SHRINK_DECIDED: Kind.FAILURE, Event.PREEMPTION: Kind.FAILURE, Event.CLOUD_NOTICE: Kind.FAILURE,
    Event.FR_DUMPED: Kind.FAILURE, Event.AGENT_LOST: Kind.FAILURE, Event.AGENT_STEPS_FINISHED: Kind.REQUEUE,
    Event.REQUEUE: Kind.REQUEUE, Event.REQUEUE_UPDATED: Kind.REQUEUE,
    Event.CONTROL: Kind.OPERATOR,
    Event.BUSY: Kind.WARNING, Event.STRAGGLER: Kind.WARNING, Event.RESTORE_LOSS_JUMP: Kind.WARNING,
    Event.TEARDOWN_HANG: Kind.WARNING, Event.TEARDOWN_ERROR: Kind.WARNING, Event.PROGRESS_STALE: Kind.WARNING,
    Event.RUN_COMPLETE: Kind.END, Event.GIVE_UP: Kind.END, Event.RUN_CANCELLED: Kind.END,
}
STYLE = {Kind.FAILURE: "bold red", Kind.RECOVERY: "green", Kind.REQUEUE: "bold yellow", Kind.WARNING: "yellow",
         Kind.CHECKPOINT: "red", Kind.START: "cyan", Kind.OPERATOR: "magenta", Kind.END: "bold"}
QUIET_PHASES = ("init", "load", "train", "stopping", "done", None)   # every attempt has them: nothing to tell
SOURCES = {"memory": "own memory", "peer_memory": "a buddy's memory", "node_local": "node-local disk",
           "shared": "the shared file system", "object": "the object store"}


def kind_of(event: Mapping[str, Any]) -> Kind:
    """The kind of one event (for `--all --kind`): routine unless it says more."""
    name = Event.parse(event.get("event"))
    if name is None:
        return Kind.WARNING   # a record ckptsup does not know
    if name is Event.HEALTH_CHECK and event.get("ok") is False:
        return Kind.FAILURE
    if name is Event.MEMORY_REPLICATED and event.get("ok") is False:
        return Kind.WARNING
    if name is Event.AGENT_STEPS_FINISHED and event.get("finished") is False:
        return Kind.WARNING
    return EVENT_KIND.get(name, Kind.ROUTINE)


@dataclass(frozen=True, kw_only=True)
class Line:
    ts: float | None        # wall clock (POSIX seconds) of the event that opened the line
    attempt: Any
    kind: Kind
    text: str


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def secs(value: Any) -> str:
    n = num(value)
    if n is None:
        return "?"
    return f"{n * 1000:.1f}ms" if 0 < n < 0.1 else f"{n:.2f}s"   # as phases_text writes them


def nodes_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    return "none" if value in (None, "") else str(value)


def step_of(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(kw_only=True)
class Fold:
    """An attempt's routine, folded into one line."""

    number: Any
    first: int | None = None
    last: int | None = None
    commits: list[tuple[float | None, float | None]] = field(default_factory=list)   # (ts, stall_s)
    memory_steps: set[str] = field(default_factory=set)
    replicated: int = 0
    replica_failures: int = 0
    validated: int = 0
    promoted: int = 0
    phases: dict[str, int] = field(default_factory=dict)   # entries into phases other than train/init/load
    intervals: list[str] = field(default_factory=list)
    busy_over: int = 0
    ts: float | None = None   # of the last event folded

    def saw(self, step: Any, ts: float | None, *, after: bool = False) -> None:
        """A step the attempt ran (`after`: a checkpoint's step, the one after the last step run)."""
        s = step_of(step)
        s = s - 1 if s is not None and after and s > 0 else s
        if s is not None:
            self.first = s if self.first is None else min(self.first, s)
            self.last = s if self.last is None else max(self.last, s)
        if ts is not None:
            self.ts = ts

    def empty(self) -> bool:
        return self.last is None and not self.commits and not self.memory_steps

    def text(self) -> str:
        steps = (f"steps {self.first}–{self.last}" if self.first != self.last else f"step {self.first}") \
            if self.first is not None else "no step"
        parts = [f"attempt {self.number}: {steps}"]
        if self.commits:
            n = len(self.commits)
            times = sorted(t for t, _ in self.commits if t is not None)
            gaps = [b - a for a, b in zip(times, times[1:])]
            every = f" every ~{statistics.median(gaps):.1f}s" if gaps else ""
            stalls = [s for _, s in self.commits if s is not None]
            stall = f" (stall p50 {secs(statistics.median(stalls))})" if stalls else ""
            parts.append(f"{n} checkpoint{'s' if n != 1 else ''} committed{every}{stall}")
        else:
            parts.append("no checkpoint committed")
        if self.validated:
            parts.append(f"{self.validated} validated")
        if self.promoted:
            parts.append(f"{self.promoted} promoted")
        if self.memory_steps or self.replicated:
            saves = len(self.memory_steps) or self.replicated
            parts.append(f"{saves} memory save{'s' if saves != 1 else ''}"
                         + (f", {self.replicated} replicated" if self.replicated and self.replicated != saves
                            else " replicated" if self.replicated else ""))
        if self.replica_failures:
            parts.append(f"{self.replica_failures} replica(s) NOT stored on a buddy")
        for phase, n in self.phases.items():
            parts.append(f"rank 0 entered the {phase} phase {n}x")
        if self.busy_over:
            parts.append(f"{self.busy_over} busy spell(s) over")
        if self.intervals:
            parts.append(f"interval now {self.intervals[-1]}")
        return ", ".join(parts)


@dataclass(kw_only=True)
class Incident:
    """A failure until it is decided: detection, attribution, health checks, blame, decision."""

    ts: float | None
    attempt: Any
    detected: dict[str, Any]
    attributed: dict[str, Any] | None = None
    unhealthy: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    flight_recorder: int = 0

    def text(self) -> str:
        d, a = self.detected, self.attributed or {}
        kind, node = a.get("kind", d.get("kind")), a.get("node", d.get("node"))
        rank = d.get("rank") if not a else None
        step = d.get("step")
        detect = a.get("detect_s", d.get("detect_s"))
        at = f" at step {step}" if step is not None else ""
        who = f"rank {rank}" + (f" on {node}" if node not in (None, "") else "") if rank is not None else str(node)
        match kind:
            case FailureKind.NODE_DOWN:
                what = f"{node} died (node down)"
            case FailureKind.CRASH:
                what = f"{who} crashed{at}"
            case FailureKind.HANG:
                what = f"{who} hung{at}"
            case FailureKind.NAN:
                what = f"NaN loss on {who}{at}"
            case FailureKind.SDC:
                nodes = d.get("nodes")
                what = f"silent data corruption{at}: replicas disagree" + (f" (ranks {nodes_text(d.get('ranks'))} on "
                                                                           f"{nodes_text(nodes)})" if nodes else "")
            case FailureKind.PREEMPTED:
                what = f"preempted{at}"
            case FailureKind.REPLACED:
                what = f"operator replace of {node}{at}"
            case _:
                what = f"{kind}" + (f" on {who}" if node not in (None, "") or rank is not None else "") + at
        if kind == FailureKind.NODE_DOWN and step is not None:
            what += at
        text = what + (f", detected in {secs(detect)}" if num(detect) is not None else "")
        why = a.get("detail") or d.get("detail")
        if a and not a.get("detail"):
            text += f" (first seen as {d.get('kind')} on {d.get('node')})"
        if why:
            text += f": {why}"
        if self.flight_recorder:
            text += f"; {self.flight_recorder} flight recorder dump(s)"
        if self.unhealthy:
            text += "; health check failed: " + "; ".join(self.unhealthy)
        if self.excluded:
            text += "; " + "; ".join(self.excluded)
        for decision in self.decisions:
            text += f"; {decision}"
        return text


@dataclass(kw_only=True)
class Launch:
    """A launch until its first step: the start (initial path) or a restart (fast, node)."""

    ts: float | None
    attempt: Any
    event: dict[str, Any]
    previous: tuple[str, ...]          # the nodes of the launch before, to name who took over
    number: int = 0                    # the run's restart count at its restart_done
    seen: bool = True                  # False: no launch event (an older log), only its restart_done
    before: list[str] = field(default_factory=list)   # checkpoints rejected on the way
    loaded: dict[str, Any] | None = None
    elastic: dict[str, Any] | None = None
    level: str | None = None
    first_step: dict[str, Any] | None = None
    done: dict[str, Any] | None = None

    @property
    def initial(self) -> bool:
        return self.event.get("path") in ("initial", None)

    def _loaded(self) -> str:
        if self.loaded is None:
            return "" if self.event.get("resume_from") else ", from step 0 (no checkpoint)"
        files = self.loaded.get("files_by_source")
        used = [f"{SOURCES.get(k, k)} ×{v}" for k, v in files.items() if isinstance(v, (int, float)) and v > 0] \
            if isinstance(files, dict) else []
        source = SOURCES.get(str(self.loaded.get("source")), str(self.loaded.get("source") or "?"))
        text = f", loaded step {self.loaded.get('step')} from " + (", ".join(used) if len(used) > 1 else str(source))
        if self.elastic is not None:
            text += f" (resharded from world size {self.elastic.get('saved_world_size')} to {self.elastic.get('world_size')})"
        return text

    def _where(self) -> str:
        nodes = self.event.get("nodes")
        names = tuple(map(str, nodes)) if isinstance(nodes, list) else ()
        new = [n for n in names if n not in self.previous] if self.previous else []
        gone = [n for n in self.previous if n not in names]
        if new and self.initial:   # a new allocation (after a requeue)
            return f"on {nodes_text(nodes)}" + (f" ({','.join(new)} in place of {','.join(gone)})" if gone else "")
        if new:
            return f"{','.join(new)} took over from {','.join(gone) or '?'} (nodes {nodes_text(nodes)})"
        return f"on {nodes_text(nodes)}" + (f", without {','.join(gone)}" if gone else "")

    def text(self) -> str:
        rejected = "; " + "; ".join(self.before) if self.before else ""
        if self.initial:
            spares = self.event.get("spares")
            text = f"launch {self._where()}" + (f" (spare {nodes_text(spares)})" if spares else "")
            text += self._loaded()
            if self.first_step is not None:
                since = self.first_step.get("since_launch_s")
                text += f"; first step {self.first_step.get('step')}" + (f" after {secs(since)}"
                                                                         if num(since) is not None else "")
            else:
                text += "; no step run"
            if self.level:
                text += f", supervised at the {self.level} level"
            return text + rejected
        path = self.event.get("path")
        if self.done is None:
            return f"relaunch on the {path} path: {self._where()}{self._loaded()}; no step run{rejected}"
        d = self.done
        phases = d.get("phases")
        text = (f"restart {self.number}: {secs(d.get('restart_s'))} to resume step {d.get('resume_step')} "
                f"on the {d.get('path') or path} path" + (f": {self._where()}{self._loaded()}" if self.seen else ""))
        if isinstance(phases, Mapping) and phases:
            from .restart_log import phases_text   # rich, only where a line is made (not for --kind's choices)

            text += f"; {phases_text(phases)}"
        if num(d.get("backoff_s")):
            text += f", after a backoff of {secs(d.get('backoff_s'))}"
        if d.get("warm") is True:
            text += ", warm"
        return text + rejected
