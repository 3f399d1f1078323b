"""`ckptsup log`'s default view: the restart log as a story, one line per incident and recovery.

An incident line says what failed, how it was detected and in how long, whom it blamed and why,
which nodes were excluded and drained, and what was decided; a recovery line says the path
taken, the restart's phases and where the resume loaded from. The routine of an attempt
(checkpoints, memory saves, validations, phases, warm interpreters, step samples) folds into one
line per attempt. `Story` is incremental — `feed` one event, get the lines it completes;
`finish` flushes what is still open — so `--follow` prints the same story as it happens that
the plain command prints at once. Pure: lines hold the file's values as they are; `render` makes every
line literal (textsafe). What each line says: story_parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ...errors import ConfigError
from ...events import Event, FailureKind, parse_ts
from ...textsafe import literal
from .restart_log import fmt_t, describe
from .story_parts import (QUIET_PHASES, ROUTINE_EVENTS, STYLE, Kind, Line, Fold, Incident, Launch, nodes_text, num, secs,
                          kind_of)

__all__ = ["Kind", "Line", "Selection", "Story", "kind_of", "lines", "line_text", "render", "since_cutoff"]


class Story:
    """events → story lines, one event at a time (module docstring)."""

    def __init__(self) -> None:
        self.attempt: Fold | None = None
        self.incident: Incident | None = None
        self.launch: Launch | None = None
        self.start: dict[str, Any] | None = None     # supervisor_start + allocation + health, until the launch
        self.start_lines: list[str] = []
        self.nodes: tuple[str, ...] = ()             # the last launch's nodes
        self.restarts = 0
        self.rejected: list[str] = []                 # checkpoints rejected before the next launch
        self.requeued_at: float | None = None

    # ---- flushing ---------------------------------------------------------------------------------
    def _line(self, ts: float | None, attempt: Any, kind: Kind, text: str) -> Line:
        return Line(ts=ts, attempt=attempt, kind=kind, text=text)

    def _flush_start(self) -> list[Line]:
        if self.start is None:
            return []
        s, self.start = self.start, None
        text = s["text"] + ("; " + "; ".join(self.start_lines) if self.start_lines else "")
        self.start_lines = []
        return [self._line(s["ts"], s["attempt"], Kind.START, text)]

    def _flush_launch(self) -> list[Line]:
        if self.launch is None:
            return []
        launch, self.launch = self.launch, None
        kind = Kind.START if launch.initial else Kind.RECOVERY
        return [self._line(launch.ts, launch.attempt, kind, launch.text())]

    def _flush_attempt(self) -> list[Line]:
        if self.attempt is None:
            return []
        fold, self.attempt = self.attempt, None
        return [] if fold.empty() else [self._line(fold.ts, fold.number, Kind.ROUTINE, fold.text())]

    def _flush_incident(self) -> list[Line]:
        if self.incident is None:
            return []
        inc, self.incident = self.incident, None
        return [self._line(inc.ts, inc.attempt, Kind.FAILURE, inc.text())]

    def finish(self) -> list[Line]:
        """What is still open: the start, a launch without its first step, the attempt's fold, an incident."""
        return self._flush_start() + self._flush_launch() + self._flush_attempt() + self._flush_incident()

    def _fold(self, attempt: Any) -> Fold:
        if self.attempt is None or self.attempt.number != attempt:
            self.attempt = Fold(number=attempt)
        return self.attempt

    # ---- feeding ----------------------------------------------------------------------------------
    def feed(self, event: Mapping[str, Any]) -> list[Line]:
        """The lines this event completes (often none: it waits in a fold, a launch or an incident)."""
        e = dict(event)
        name = Event.parse(e.get("event"))
        ts, attempt = parse_ts(e.get("ts")), e.get("attempt")
        if name is None:   # a record ckptsup does not know: shown, never interpreted
            return [self._line(ts, attempt, Kind.WARNING, f"unknown event {e.get('event')!s}: {describe(e)}")]
        out: list[Line] = []
        if name is not Event.ALLOCATION and name is not Event.HEALTH_CHECK:
            out += self._flush_start()
        handler = getattr(self, f"_on_{name.value}", None)
        if handler is not None:
            out += handler(e, ts, attempt)
        elif name in ROUTINE_EVENTS:
            self._routine(name, e, ts, attempt)
        else:
            out += self._flush_incident() if name is not Event.CONTROL else []
            out.append(self._line(ts, attempt, kind_of(e), describe(e)))
        return out

    def _routine(self, name: Event, e: dict[str, Any], ts: float | None, attempt: Any) -> None:
        if name is Event.CHECKPOINT_COMMITTED and self.incident is not None:   # saved on the way out: part of the incident
            self.incident.decisions.append(f"checkpoint step {e.get('step')} committed after it "
                                           f"(stall {secs(e.get('stall_s'))})")
            return
        fold = self._fold(attempt)
        stepped = name in (Event.STEP_PROGRESS, Event.CHECKPOINT_COMMITTED, Event.MEMORY_SAVED)
        fold.saw(e.get("step") if stepped else None, ts, after=name is not Event.STEP_PROGRESS)
        if name is Event.CHECKPOINT_COMMITTED:
            fold.commits.append((ts, num(e.get("stall_s"))))
        elif name is Event.MEMORY_SAVED and e.get("ok") is not False:
            fold.memory_steps.add(str(e.get("step")))   # str: a record's step may be anything
        elif name is Event.MEMORY_REPLICATED:
            if e.get("ok") is False:
                fold.replica_failures += 1
            else:
                fold.replicated += 1
        elif name is Event.CHECKPOINT_VALIDATED:
            fold.validated += 1
        elif name is Event.CHECKPOINT_PROMOTED:
            fold.promoted += 1
        elif name is Event.PHASE and e.get("phase") not in QUIET_PHASES:
            fold.phases[str(e.get("phase"))] = fold.phases.get(str(e.get("phase")), 0) + 1
        elif name is Event.BUSY_OVER:
            fold.busy_over += 1
        elif name is Event.INTERVAL_CHANGED:
            level = "memory saves" if e.get("level") == "memory" else "checkpoints"
            fold.intervals.append(f"{secs(e.get('interval_s'))} between {level}")
        elif name is Event.SUPERVISION_LEVEL and self.launch is not None:
            self.launch.level = str(e.get("level"))
        elif name is Event.CHECKPOINT_LOADED and self.launch is not None:
            self.launch.loaded = e
        elif name is Event.ELASTIC_RESUME and self.launch is not None:
            self.launch.elastic = e
        elif name is Event.FR_DUMPED and self.incident is not None:
            self.incident.flight_recorder += 1

    def _on_supervisor_start(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        out = self._flush_launch() + self._flush_attempt() + self._flush_incident()
        if e.get("resumed"):
            back = f" {ts - self.requeued_at:.1f}s after the requeue" if ts is not None and \
                self.requeued_at is not None else ""
            text = f"supervisor back{back}, resuming the run"
            excluded = e.get("excluded")
            if excluded:
                text += f"; excluded {nodes_text(excluded)}"
        else:
            text = f"supervisor started for job {e.get('job_id')}"
        self.requeued_at = None
        self.start = {"ts": ts, "attempt": attempt, "text": text}
        return out

    def _on_allocation(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        names = e.get("node_names")
        count = e.get("nodes")
        nodes = f"{len(names)} nodes ({nodes_text(names)})" if isinstance(names, list) else \
            (f"nodes {nodes_text(count)}" if isinstance(count, list) else f"{count} nodes")
        active, spares = e.get("active"), e.get("spares")
        shape = f", {active} active + {nodes_text(spares)} spare" if active is not None else \
            (f", spares {nodes_text(spares)}" if spares else "")
        text = f"allocation: {nodes}{shape}, {e.get('gpus_per_node', 0)} GPU(s) a node"
        if self.start is None:
            return [self._line(ts, attempt, Kind.START, text)]
        self.start["text"] += f"; {text}"
        return []

    def _on_health_check(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        if e.get("ok") is not False:
            return []
        problem = f"{e.get('node')}: {e.get('name') or ''} {e.get('detail', '')}".replace("  ", " ").strip()
        if self.incident is not None:
            self.incident.unhealthy.append(problem)
        elif self.start is not None:
            self.start_lines.append(f"unhealthy {problem}")
        else:
            return [self._line(ts, attempt, Kind.FAILURE, f"health check failed on {problem}")]
        return []

    def _on_launch(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        out = self._flush_launch() + self._flush_incident()
        if self.attempt is not None and self.attempt.number != attempt:
            out += self._flush_attempt()
        nodes = e.get("nodes")
        self.launch = Launch(ts=ts, attempt=attempt, event=e, previous=self.nodes, before=self.rejected)
        self.rejected = []
        self.nodes = tuple(map(str, nodes)) if isinstance(nodes, list) else ()
        return out

    def _on_first_step(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        self._fold(attempt).saw(e.get("step"), ts)
        if self.launch is None or self.launch.first_step is not None:
            return []
        self.launch.first_step = e
        return self._flush_launch() if self.launch.initial else []

    def _on_restart_done(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        self.restarts += 1
        out = self._flush_incident()
        if self.launch is None or self.launch.initial:
            # no launch event seen (an older log): the restart alone
            out += self._flush_launch()
            self.launch = Launch(ts=ts, attempt=attempt, event={"path": e.get("path") or "?"}, previous=(), seen=False)
        self.launch.done, self.launch.number = e, self.restarts
        self.launch.attempt = attempt
        return out + self._flush_launch()

    def _on_failure_detected(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        fold = self._fold(attempt)
        fold.saw(e.get("step"), None)
        out = self._flush_launch() + self._flush_attempt() + self._flush_incident()
        self.incident = Incident(ts=ts, attempt=attempt, detected=e)
        return out

    def _on_failure_attributed(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        if self.incident is None:
            return [self._line(ts, attempt, Kind.FAILURE, describe(e))]
        if self.incident.attributed is None and e.get("was_kind") != FailureKind.USER_ERROR:
            self.incident.attributed = e
        else:
            self.incident.decisions.append(describe(e))
        return []

    def _on_node_excluded(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        node = str(e.get("node"))
        drained = "drained in Slurm" if e.get("drained") else "not drained"
        text = f"blamed {node} ({e.get('reason', '')}): excluded, {drained}"
        if self.incident is not None:
            self.incident.excluded.append(text)
            return []
        if self.start is not None:   # blamed at start-up by a health check
            self.start_lines.append(text)
            return []
        return [self._line(ts, attempt, Kind.FAILURE, text)]

    def _decision(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        if self.incident is not None:
            self.incident.decisions.append(describe(e))
            return []
        return [self._line(ts, attempt, kind_of(e), describe(e))]

    _on_shrink_decided = _decision
    _on_preemption = _decision

    def _on_checkpoint_rejected(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        if self.incident is not None or self.launch is None:   # on the way to a relaunch: part of its line
            self.rejected.append(describe(e))
            return []
        return [self._line(ts, attempt, Kind.CHECKPOINT, describe(e))]

    def _on_requeue(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        out = self._flush_launch() + self._flush_attempt() + self._flush_incident()
        self.requeued_at = ts
        return out + [self._line(ts, attempt, Kind.REQUEUE, describe(e))]

    def _on_requeue_updated(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        return [self._line(ts, attempt, Kind.REQUEUE if e.get("ok") else Kind.WARNING, describe(e))]

    def _end(self, e: dict[str, Any], ts: float | None, attempt: Any) -> list[Line]:
        if self.attempt is not None:
            self.attempt.saw(e.get("step"), ts)
        out = self._flush_launch() + self._flush_attempt() + self._flush_incident()
        if e.get("event") == Event.RUN_COMPLETE:
            text = "run complete" + (f" at step {e.get('step')}" if e.get("step") is not None else "")
        else:
            text = describe(e)
        return out + [self._line(ts, attempt, Kind.END, text)]

    _on_run_complete = _end
    _on_give_up = _end
    _on_run_cancelled = _end


def lines(events: Iterable[Mapping[str, Any]]) -> list[Line]:
    """The whole story of `events`."""
    story = Story()
    out: list[Line] = []
    for event in events:
        out += story.feed(event)
    return out + story.finish()


# ---- choosing lines (--attempt, --since, --kind) -----------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Selection:
    attempt: int | None = None
    since: float | None = None          # wall clock (POSIX seconds)
    kinds: frozenset[Kind] = frozenset()

    def line(self, line: Line) -> bool:
        return self._common(line.attempt, line.ts) and (
            not self.kinds or line.kind in self.kinds or (Kind.CHECKPOINT in self.kinds and line.kind is Kind.ROUTINE))

    def event(self, event: Mapping[str, Any]) -> bool:
        return self._common(event.get("attempt"), parse_ts(event.get("ts"))) and (
            not self.kinds or kind_of(event) in self.kinds)

    def _common(self, attempt: Any, ts: float | None) -> bool:
        if self.attempt is not None and str(attempt) != str(self.attempt):
            return False
        return self.since is None or (ts is not None and ts >= self.since)


def since_cutoff(text: str, now: float) -> float:
    """`--since`: a duration back from now (`90s`, `10m`, `2h`), an ISO 8601 time
    (`2026-12-06T04:50:00`, UTC unless it says otherwise) or a UTC time of today (`04:50`, `04:50:30`)."""
    import datetime as dt

    from ...planning.units import parse_duration

    value = text.strip()
    if value[:1].isdigit() and ":" in value and "T" not in value and "-" not in value:
        try:
            clock = dt.time.fromisoformat(value)
        except ValueError:
            clock = None
        if clock is not None:
            today = dt.datetime.fromtimestamp(now, dt.timezone.utc).date()
            return dt.datetime.combine(today, clock, tzinfo=dt.timezone.utc).timestamp()
    when = parse_ts(value)
    if when is not None:
        return when
    try:
        return now - parse_duration(value, what="--since")
    except ConfigError:
        raise ConfigError(f"--since {literal(value, limit=60)!r} is neither a duration (90s, 10m, 2h) nor a time "
                          "(04:50, 2026-12-06T04:50:00); give one of those") from None


# ---- rendering ---------------------------------------------------------------------------------------

def line_text(line: Line, start: float | None) -> Any:
    """One story line for the terminal: relative time, attempt, kind, text; the file's values literal."""
    from rich.text import Text

    t = None if line.ts is None or start is None else line.ts - start
    out = Text(f"{fmt_t(t):>11}  a{literal(line.attempt, limit=12):<3} ")
    out.append(f"{line.kind.value:<10}", style=STYLE.get(line.kind, ""))
    out.append(f" {literal(line.text)}", style="bold red" if line.kind is Kind.FAILURE else "")
    return out


def render(events: list[dict[str, Any]], console: Any, *, selection: Selection = Selection(), untold: int = 0) -> int:
    """The story of `events` on `console`, led by the run's one line (planning/headline.py); returns
    the number of story lines printed. `untold`: events of the log left unread (events.NODE_NOTES), counted."""
    from ...planning.headline import headline
    from ...textsafe import text as safe_text

    start = next((t for e in events if (t := parse_ts(e.get("ts"))) is not None), None)
    job = next((e.get("job_id") for e in events if e.get("job_id") is not None), "?")
    console.print(safe_text(f"ckptsup restart log — job {job}", "bold"))
    if events:
        console.print(safe_text(headline(events), "bold"))
    shown = [line for line in lines(events) if selection.line(line)]
    for line in shown:
        console.print(line_text(line, start))
    console.print(safe_text(f"({len(events) + untold} events told in {len(shown)} line(s); --all shows every event)",
                            "dim"))
    return len(shown)
