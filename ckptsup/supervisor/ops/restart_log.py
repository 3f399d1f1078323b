"""`ckptsup log --all`: the restart log (events.jsonl) as a table of every event; its one-line
`describe` of an event is also what the story (story.py, the default view) says of the events it
does not fold.

Pure functions turn events into rows (`describe`, `rows`) and a summary (`summarize`: detection
latency per failure, every restart's phases, exclusions, requeues); `render` prints them with
rich, every value from the file through textsafe (literal: never markup, never a control
sequence, bounded). Time is shown relative to the first event, from the wall-clock `ts` (every host writes the
same file across requeues, and `mono` is only comparable on one host).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ...events import Event, parse_ts
from ...textsafe import literal, text as safe_text

BASE_FIELDS = {"event", "ts", "mono", "job_id", "attempt", "epoch"}
HIDDEN_BY_DEFAULT = {Event.STEP_PROGRESS}
TERMINAL = {Event.RUN_COMPLETE, Event.GIVE_UP, Event.RUN_CANCELLED}
PHASES = ("kill_s", "health_s", "container_s", "launch_s", "rendezvous_s", "load_s", "first_step_s")
STYLE: dict[str, str] = {Event.FAILURE_DETECTED: "bold red", Event.GIVE_UP: "bold red", Event.CHECKPOINT_REJECTED: "red",
         Event.CHECKPOINT_FAILED: "red", Event.NODE_EXCLUDED: "yellow", Event.REQUEUE: "bold yellow",
         Event.SHRINK_DECIDED: "bold yellow",
         Event.REQUEUE_UPDATED: "yellow", Event.PREEMPTION: "yellow", Event.CLOUD_NOTICE: "bold yellow", Event.TEARDOWN_ERROR: "yellow",
         Event.RESTART_DONE: "green", Event.RUN_COMPLETE: "bold green", Event.FIRST_STEP: "green",
         Event.LAUNCH: "cyan", Event.SUPERVISOR_START: "cyan", Event.ALLOCATION: "cyan"}  # looked up by the plain name


def _s(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.2f}s" if abs(value) < 100 else f"{value:.0f}s"
    return str(value)


def _nodes(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    return str(value) if value not in (None, "") else "none"


def _extras(event: Mapping[str, Any], used: Iterable[str] = ()) -> str:
    skip = BASE_FIELDS | set(used)
    parts = [f"{k}={v}" for k, v in event.items() if k not in skip and v not in (None, "", [], {})]
    return " ".join(parts)


def phases_text(phases: Mapping[str, Any]) -> str:
    ordered = [p for p in PHASES if p in phases] + sorted(str(p) for p in phases if p not in PHASES)
    return ", ".join(f"{p.removesuffix('_s')} {float(phases[p]):.2f}s" for p in ordered
                     if isinstance(phases[p], (int, float)))


def describe(event: Mapping[str, Any]) -> str:
    """One human line for one event."""
    e = event
    name = e.get("event")
    g = e.get
    if name == Event.FAILURE_DETECTED:
        where = " ".join(x for x in (f"node {g('node')}" if g("node") else "",
                                      f"rank {g('rank')}" if g("rank") is not None else "") if x)
        detect_s = g("detect_s")
        latency = f", detected in {float(detect_s):.2f}s" if isinstance(detect_s, (int, float)) else ""
        extra = _extras(e, ("kind", "node", "rank", "detect_s", "ranks_seen"))   # ranks_seen: in --json (the detail names them)
        return f"{g('kind', '?')} {where}{latency}".replace("  ", " ") + (f" ({extra})" if extra else "")
    if name == Event.FAILURE_ATTRIBUTED:
        node = f" on {g('node')}" if g("node") else ""
        return f"it was {g('kind', '?')}{node} (detected as {g('was_kind', '?')}): {g('detail', '')}"
    if name == Event.NODE_EXCLUDED:
        return f"{g('node')} excluded: {g('reason', '')}"
    if name == Event.SHRINK_DECIDED:
        way = "continue on fewer nodes" if g("choice") == "continue" else "requeue"
        return f"{way} ({g('survivors')} of {g('nodes')} left, min {g('min_nodes')}): {g('reason', '')}"
    if name == Event.RESTART_DONE:
        text = f"restarted in {_s(g('restart_s'))}, resume step {g('resume_step')}"
        phases = g("phases")
        if isinstance(phases, Mapping):
            text += f" ({phases_text(phases)})"
        if g("path"):
            text += f" [{g('path')} path]"
        return text
    if name == Event.REQUEUE:
        text = f"requeued by {g('by', '?')}: {g('reason', '')}; excluded {_nodes(g('excluded'))}"
        if g("partition"):
            text += f"; partition {g('partition')}"
        return text
    if name == Event.REQUEUE_UPDATED:
        if g("ok"):
            return (f"pending job updated: waited {_s(g('wait_pending_s'))} for PENDING, update "
                    f"{_s(g('update_s'))}; {_s(g('total_s'))} after the requeue; excluded {_nodes(g('excluded'))}")
        return f"pending job NOT updated: {g('error', '')}"
    if name == Event.AGENT_STEPS_FINISHED:
        if g("finished"):
            return (f"Slurm finished the agents' step that lost {_nodes(g('lost'))} after {_s(g('waited_s'))} "
                    "(ending the job sooner drains healthy nodes)")
        return (f"Slurm still listed the agents' step {_nodes(g('left'))} after {_s(g('waited_s'))}: the job ended "
                f"anyway; its nodes may be drained 'Kill task failed'" + (f" ({g('error')})" if g("error") else ""))
    if name == Event.GIVE_UP:
        return f"gave up: {g('reason', '')}"
    if name == Event.TEARDOWN_ERROR:
        return (f"torchrun on {g('node', '?')} exited rc={g('rc', '?')} after all its ranks finished: "
                "a crash in process teardown, nothing lost, not restarted")
    if name == Event.LAUNCH:
        return f"launch on {_nodes(g('nodes'))}" + (f" [{g('path')}]" if g("path") else "") + \
            (f" ({_extras(e, ('nodes', 'path'))})" if _extras(e, ("nodes", "path")) else "")
    if name == Event.ALLOCATION:
        return (f"allocation {_nodes(g('nodes'))}, {g('gpus_per_node', 0)} GPU(s)/node, "
                f"spares {_nodes(g('spares'))}")
    if name == Event.CHECKPOINT_COMMITTED:
        size = g("bytes")
        mb = f", {size / 1e6:.1f} MB" if isinstance(size, (int, float)) else ""
        return f"checkpoint step {g('step')} committed (stall {_s(g('stall_s'))}, write {_s(g('write_s'))}{mb})"
    if name in (Event.CHECKPOINT_VALIDATED, Event.CHECKPOINT_REJECTED):
        verdict = "validated" if name == Event.CHECKPOINT_VALIDATED else "REJECTED"
        why = f": {g('reason')}" if g("reason") else ""
        return f"checkpoint step {g('step')} {verdict} (level {g('level', '?')}){why}"
    if name == Event.FIRST_STEP:
        return "first step" + (f" {g('step')}" if g("step") is not None else "") + \
            (f" ({_extras(e, ('step',))})" if _extras(e, ("step",)) else "")
    if name == Event.STEP_PROGRESS:
        return f"step {g('step')} ({_s(g('step_time_s'))}/step)"
    if name == Event.INTERVAL_CHANGED and g("level") == "memory":
        took = f" (~{_s(g('interval_s'))})" if g("interval_s") is not None else ""   # absent: no step time yet
        return f"memory save interval {g('every_steps', '?')} steps{took}: {g('why', '')}"
    if name == Event.INTERVAL_CHANGED:
        return f"checkpoint interval {_s(g('interval_s'))}: {g('why', '')}"
    if name == Event.PREEMPTION:
        save = "emergency save" if g("emergency_save") else "no emergency save"
        return f"{g('signal', '?')}: budget {_s(g('budget_s'))}, {save}" + (f" ({g('why')})" if g("why") else "")
    if name == Event.CLOUD_NOTICE:
        ahead = g("ahead_s")
        when = f" ({float(ahead):.0f}s ahead)" if isinstance(ahead, (int, float)) else ""
        return (f"cloud notice: {g('cloud', '?')} will {g('action', '?')} {g('node', '?')} at {g('deadline', '?')}{when}: "
                f"{g('way', '?')}" + (f" ({g('reason')})" if g("reason") else ""))
    if name == Event.HEALTH_CHECK:
        return f"health {g('node')}: {g('name')} {'ok' if g('ok') else 'FAILED'} {g('detail', '')}".rstrip()
    if name == Event.RUN_COMPLETE:
        return "run complete" + (f" ({_extras(e)})" if _extras(e) else "")
    if name == Event.RUN_CANCELLED:
        return f"stopped on request {g('request', '?')} at step {g('step', '?')}" + ("" if g("saved") else " (no save asked)")
    if name == Event.CONTROL:
        return (f"operator request {g('request', '?')} ({g('command', '?')}): {g('outcome', '?')}"
                + (f", {g('detail')}" if g("detail") else ""))
    if name == Event.WARM_READY:
        return f"{g('node', '?')}: {g('interpreters', '?')} warm rank interpreter(s) ready for a launch"
    if name == Event.SUPERVISION_LEVEL:
        return f"supervised at the {g('level', '?')} level: {g('detail', '')}"
    if name == Event.PROGRESS_STALE:
        return (f"warning: no hello and no progress line {_s(g('since_launch_s'))} after launch "
                f"(progress_pattern {g('pattern', '?')!r}); still supervised at the process level")
    return _extras(e)


@dataclass(frozen=True, kw_only=True)
class Row:
    t_s: float | None       # seconds since the first event (wall clock)
    ts: str
    attempt: Any
    event: str
    text: str


def rows(events: Iterable[Mapping[str, Any]], *, show_all: bool = False,
         start: float | None = None) -> list[Row]:
    out = []
    for e in events:
        when = parse_ts(e.get("ts"))
        if start is None and when is not None:
            start = when
        if not show_all and Event.parse(e.get("event")) in HIDDEN_BY_DEFAULT:
            continue
        rel = (when - start) if (when is not None and start is not None) else None
        name = e.get("event")
        out.append(Row(t_s=rel, ts=str(e.get("ts", "")), attempt=e.get("attempt"),
                       event=name.value if isinstance(name, Event) else str(name), text=describe(e)))
    return out


@dataclass(frozen=True, kw_only=True)
class Summary:
    failures: list[dict[str, Any]] = field(default_factory=list)   # kind, node, detect_s
    restarts: list[dict[str, Any]] = field(default_factory=list)   # restart_s, resume_step, phases
    excluded: list[tuple[str, str]] = field(default_factory=list)
    requeues: list[dict[str, Any]] = field(default_factory=list)   # reason, by, total_s (when updated)
    outcome: str = "running"

    def detect_stats(self) -> dict[str, float]:
        vals = [f["detect_s"] for f in self.failures if isinstance(f.get("detect_s"), (int, float))]
        if not vals:
            return {}
        return {"min_s": min(vals), "median_s": statistics.median(vals), "max_s": max(vals)}


def summarize(events: Iterable[Mapping[str, Any]]) -> Summary:
    failures: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    excluded: list[Any] = []
    requeues: list[dict[str, Any]] = []
    outcome = "running"
    for e in events:
        name = e.get("event")
        if name == Event.FAILURE_DETECTED:
            failures.append({k: e.get(k) for k in ("kind", "node", "rank", "detect_s")})
        elif name == Event.FAILURE_ATTRIBUTED and failures:
            failures[-1].update(kind=e.get("kind"), node=e.get("node"))  # what the failure turned out to be
            if isinstance(e.get("detect_s"), (int, float)):
                # and its detection: a dead node's silence, not the peer crash that was its first symptom
                failures[-1]["detect_s"] = e.get("detect_s")
        elif name == Event.RESTART_DONE:
            phases = e.get("phases")
            restarts.append({"restart_s": e.get("restart_s"), "resume_step": e.get("resume_step"),
                             "phases": dict(phases) if isinstance(phases, Mapping) else {}})
        elif name == Event.NODE_EXCLUDED:
            excluded.append((str(e.get("node")), str(e.get("reason", ""))))
        elif name == Event.REQUEUE:
            requeues.append({"reason": e.get("reason"), "by": e.get("by"), "excluded": e.get("excluded"),
                             "_at": parse_ts(e.get("ts"))})
            outcome = "requeued"
        elif name == Event.REQUEUE_UPDATED and requeues:
            requeues[-1]["total_s"] = e.get("total_s")
            requeues[-1]["updated"] = bool(e.get("ok"))
        # the next batch run, timed from the requeue on the wall clock (another host wrote it)
        if name in (Event.SUPERVISOR_START, Event.FIRST_STEP) and requeues and requeues[-1].get("_at") is not None:
            key = "back_s" if name == Event.SUPERVISOR_START else "first_step_s"
            when = parse_ts(e.get("ts"))
            if key not in requeues[-1] and when is not None and ("back_s" in requeues[-1] or key == "back_s"):
                requeues[-1][key] = round(when - requeues[-1]["_at"], 3)
        elif name == Event.GIVE_UP:
            outcome = f"gave up: {e.get('reason', '')}"
        elif name == Event.RUN_COMPLETE:
            outcome = "complete"
        elif name == Event.RUN_CANCELLED:
            outcome = "cancelled on request"
        elif name in (Event.LAUNCH, Event.SUPERVISOR_START) and outcome == "requeued":
            outcome = "running"
    for r in requeues:
        r.pop("_at", None)
    return Summary(failures=failures, restarts=restarts, excluded=excluded, requeues=requeues, outcome=outcome)


def fmt_t(t: float | None) -> str:
    if t is None:
        return "?"
    minutes, seconds = divmod(t, 60)
    return f"+{int(minutes)}:{seconds:06.3f}" if minutes else f"+{seconds:.3f}s"


def row_text(row: Row) -> Text:
    line = Text(f"{fmt_t(row.t_s):>12}  a{literal(row.attempt):<3} ")
    line.append(f"{literal(row.event):<21}", style=STYLE.get(row.event, ""))
    line.append(f" {literal(row.text)}")
    return line


def render(events: Sequence[Mapping[str, Any]], console: Console, *, show_all: bool = False) -> None:
    table = Table(title="ckptsup restart log", show_lines=False, expand=False)
    table.add_column("t", justify="right", no_wrap=True)
    table.add_column("attempt", justify="right")
    table.add_column("event", no_wrap=True)
    table.add_column("what")
    for row in rows(events, show_all=show_all):
        table.add_row(fmt_t(row.t_s), safe_text(row.attempt), safe_text(row.event, STYLE.get(row.event, "")),
                      safe_text(row.text))
    hidden = sum(1 for e in events if Event.parse(e.get("event")) in HIDDEN_BY_DEFAULT) if not show_all else 0
    console.print(table)
    if hidden:
        console.print(safe_text(f"({hidden} step_progress events hidden; --all shows them)"))
    summary = summarize(events)
    console.print(safe_text(f"outcome: {summary.outcome}", "bold"))
    stats = summary.detect_stats()
    if summary.failures:
        kinds: dict[str, int] = {}
        for f in summary.failures:
            kinds[str(f.get("kind"))] = kinds.get(str(f.get("kind")), 0) + 1
        line = ", ".join(f"{k} x{n}" for k, n in kinds.items())
        if stats:
            line += (f"; detection min {stats['min_s']:.2f}s, median {stats['median_s']:.2f}s, "
                     f"max {stats['max_s']:.2f}s")
        console.print(safe_text(f"failures: {line}"))
    for i, r in enumerate(summary.restarts, 1):
        console.print(safe_text(f"restart {i}: {_s(r['restart_s'])} to resume step {r['resume_step']}"
                                + (f" ({phases_text(r['phases'])})" if r["phases"] else "")))
    if summary.excluded:
        console.print(safe_text("excluded: " + ", ".join(f"{n} ({why})" for n, why in summary.excluded)))
    for r in summary.requeues:
        parts = []
        if r.get("total_s") is not None:
            parts.append(f"pending updates done after {_s(r['total_s'])}")
        if r.get("back_s") is not None:
            parts.append(f"supervisor back after {_s(r['back_s'])}")
        if r.get("first_step_s") is not None:
            parts.append(f"first step after {_s(r['first_step_s'])}")
        console.print(safe_text(f"requeue by {r['by']}: {r['reason']}" + (f" ({'; '.join(parts)})" if parts else "")))
