"""Silent data corruption and its family — replica disputes, NaN replays, restore-loss jumps —
from events.jsonl alone (pure): the one derivation behind `ckptsup report`, `ckptsup status` and
the live Prometheus textfile (docs/sdc.md §Where to see it).

Per `failure_detected` of kind sdc or nan, an `Incident`: the step, ranks and nodes, and what
followed it up to the next failure (`Outcome`). For an sdc incident:
  detect lag     step − agreed_step: the flip's own step is unknown; it happened after the last
                 state whose replicas agreed (the event's `agreed_step`, else the attempt's first
                 step − 1: every replica starts from the same state) and by the detected step;
  rolled back    step + 1 − the resume step of the restart that followed (the steps run again).
The fingerprint cost is rank 0's `sdc_s` (cumulative in an attempt: the largest value any event of
the attempt carries), summed over attempts, and as a share of rank 0's time in the train phase.
Every field is read as real logs hold them: missing, wrong types, junk — never a traceback.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable

from ..events import Event, FailureKind
from .phase_time import phase_times
from .spans import num


class Outcome(str, enum.Enum):
    """What followed one incident, as the events after it (to the next failure) show."""

    EXCLUDED = "excluded"     # its node was excluded (node_excluded: a spare or a requeue replaces it)
    SWAPPED = "swapped"       # sdc without a majority: a spare took one node's place, nobody blamed
    TRANSIENT = "transient"   # resumed on the same nodes and ran past the step: it did not come back
    REPLAYED = "replayed"     # resumed on the same nodes, not past the step (yet, or it failed again first)
    DATA = "data"             # nan: again at the same step on the replay: the job's (a user error), given up
    REQUEUED = "requeued"     # the job was requeued, no node excluded for it
    GAVE_UP = "gave_up"       # the run gave up
    PENDING = "pending"       # nothing after it yet: a live run between detection and restart


class AgreedBasis(str, enum.Enum):
    """Where an sdc incident's last agreed step comes from."""

    CHECK = "check"   # a fingerprint check of the attempt agreed there (failure_detected.agreed_step)
    START = "start"   # no check of the attempt had agreed: the state it started from


@dataclass(frozen=True, kw_only=True)
class Incident:
    kind: FailureKind          # SDC or NAN
    step: int | None           # the step detected (the last step done)
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    outcome: Outcome
    agreed_step: int | None = None      # sdc: the last step after which the replicas agreed
    agreed_basis: AgreedBasis | None = None
    resume_step: int | None = None      # the first step of the restart that followed
    excluded: tuple[str, ...] = ()      # nodes excluded for it

    @property
    def detect_lag_steps(self) -> int | None:
        if self.step is None or self.agreed_step is None:
            return None
        return max(0, self.step - self.agreed_step)

    @property
    def rolled_back_steps(self) -> int | None:
        if self.step is None or self.resume_step is None:
            return None
        return max(0, self.step + 1 - self.resume_step)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "ranks": list(self.ranks), "nodes": list(self.nodes),
                               "outcome": self.outcome.value, "resume_step": self.resume_step,
                               "rolled_back_steps": self.rolled_back_steps, "excluded": list(self.excluded)}
        if self.kind is FailureKind.SDC:
            out.update(agreed_step=self.agreed_step, detect_lag_steps=self.detect_lag_steps,
                       agreed_basis=self.agreed_basis.value if self.agreed_basis else None)
        return out


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(i for i in (_int(v) for v in value) if i is not None) if isinstance(value, list) else ()


def _names(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def _who(ev: dict[str, Any]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ranks and nodes of a failure: sdc's `ranks`/`nodes` lists, else its `rank`/`node`."""
    ranks, nodes = _ints(ev.get("ranks")), _names(ev.get("nodes"))
    rank, node = _int(ev.get("rank")), ev.get("node")
    return (ranks or ((rank,) if rank is not None else ()),
            nodes or ((node,) if isinstance(node, str) and node else ()))


SHOWN_INCIDENTS = 20   # the report's rows: the last ones (the JSON lists every one)

# events whose `step` says how far the run got after a restart (the next failure's too)
_PAST = (Event.STEP_PROGRESS, Event.RUN_COMPLETE, Event.RUN_CANCELLED, Event.CHECKPOINT_COMMITTED,
         Event.FAILURE_DETECTED)


def _outcome(kind: FailureKind, step: int | None, nodes_before: tuple[str, ...],
             after: list[dict[str, Any]]) -> tuple[Outcome, int | None, tuple[str, ...]]:
    """(outcome, resume step, nodes excluded for it) from the events after one failure, up to and
    with the next one (whose step says how far the replay got)."""
    prefix = f"{kind.value}:"
    excluded = tuple(n for n in (e.get("node") for e in after if e.get("event") == Event.NODE_EXCLUDED
                                 and str(e.get("reason") or "").startswith(prefix)) if isinstance(n, str))
    resume: int | None = None
    nodes_after: tuple[str, ...] | None = None
    passed = data = gave_up = requeued = False
    for ev in after:
        name = Event.parse(ev.get("event"))
        if name is Event.FAILURE_ATTRIBUTED and ev.get("kind") == FailureKind.USER_ERROR and \
                ev.get("was_kind") == kind:
            data = True
        elif name is Event.GIVE_UP:
            gave_up = True
        elif name is Event.REQUEUE:
            requeued = True
        elif name is Event.LAUNCH and nodes_after is None:
            nodes_after = _names(ev.get("nodes"))
        elif name in (Event.RESTART_DONE, Event.FIRST_STEP) and resume is None:
            resume = _int(ev.get("resume_step" if name is Event.RESTART_DONE else "step"))
        if resume is not None and step is not None and name in _PAST:
            done = _int(ev.get("step"))   # a step index; a checkpoint's step counts the steps done
            done = done - 1 if done is not None and name is Event.CHECKPOINT_COMMITTED else done
            passed = passed or (done is not None and done > step)
    if excluded:
        outcome = Outcome.EXCLUDED
    elif data and kind is FailureKind.NAN:
        outcome = Outcome.DATA
    elif gave_up:
        outcome = Outcome.GAVE_UP
    elif requeued:
        outcome = Outcome.REQUEUED
    elif kind is FailureKind.SDC and nodes_after is not None and nodes_before and set(nodes_after) != set(nodes_before):
        outcome = Outcome.SWAPPED
    elif resume is not None:
        outcome = Outcome.TRANSIENT if passed else Outcome.REPLAYED
    else:
        outcome = Outcome.PENDING
    return outcome, resume, excluded


def incidents(events: Iterable[dict[str, Any]]) -> list[Incident]:
    """Every sdc and nan failure of the run, in order, with what followed each."""
    events = [e for e in events if isinstance(e, dict)]
    failures = [i for i, e in enumerate(events) if e.get("event") == Event.FAILURE_DETECTED]
    out: list[Incident] = []
    nodes_before: tuple[str, ...] = ()
    first_of: dict[Any, int] = {}   # attempt -> its first step
    cursor = 0
    for n, index in enumerate(failures):
        for ev in events[cursor:index]:   # what the failing attempt ran on and started from
            name = Event.parse(ev.get("event"))
            if name is Event.LAUNCH:
                nodes_before = _names(ev.get("nodes")) or nodes_before
            elif name is Event.FIRST_STEP and _int(ev.get("step")) is not None:
                first_of.setdefault(_key(ev.get("attempt")), _int(ev.get("step")) or 0)
        cursor = index
        ev = events[index]
        kind = _kind(ev.get("kind"))
        if kind not in (FailureKind.SDC, FailureKind.NAN):
            continue
        step = _int(ev.get("step"))
        step = step if step is not None and step >= 0 else None
        end = failures[n + 1] if n + 1 < len(failures) else len(events)
        outcome, resume, excluded = _outcome(kind, step, nodes_before, events[index + 1:end + 1])
        ranks, nodes = _who(ev)
        agreed, basis = None, None
        if kind is FailureKind.SDC:
            agreed = _int(ev.get("agreed_step"))
            if agreed is not None and step is not None and 0 <= agreed <= step:
                basis = AgreedBasis.CHECK
            else:
                first = first_of.get(_key(ev.get("attempt")))
                agreed = None if first is None or step is None or first - 1 > step else first - 1
                basis = AgreedBasis.START if agreed is not None else None
        out.append(Incident(kind=kind, step=step, ranks=ranks, nodes=nodes, outcome=outcome, agreed_step=agreed,
                            agreed_basis=basis, resume_step=resume, excluded=excluded))
    return out


def _key(attempt: Any) -> Any:
    return attempt if isinstance(attempt, (int, str)) and not isinstance(attempt, bool) else None


def _kind(value: Any) -> FailureKind | None:
    try:
        return FailureKind(value) if isinstance(value, str) else None
    except ValueError:
        return None


def fingerprint_seconds(events: Iterable[dict[str, Any]]) -> float | None:
    """Rank 0's seconds on replica fingerprints over the run: per attempt the largest `sdc_s` any
    of its events carries (it only grows within an attempt), summed. None: never measured."""
    best: dict[Any, float] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        value = num(ev, "sdc_s")
        if value is not None and value >= 0 and not isinstance(ev.get("sdc_s"), str):
            key = _key(ev.get("attempt"))
            best[key] = max(value, best.get(key, 0.0))
    return sum(best.values()) if best else None


def sdc_summary(events: Iterable[dict[str, Any]], *, train_s: float | None = None) -> dict[str, Any]:
    """The figures every renderer shows (JSON-ready). `train_s`: rank 0's seconds in the train
    phase (planning/phase_time.py), the base of the fingerprint cost's share; computed when None."""
    events = [e for e in events if isinstance(e, dict)]
    found = incidents(events)
    sdc = [i for i in found if i.kind is FailureKind.SDC]
    nan = [i for i in found if i.kind is FailureKind.NAN]
    lags = [i.detect_lag_steps for i in sdc if i.detect_lag_steps is not None]
    rolled = [i.rolled_back_steps for i in sdc if i.rolled_back_steps is not None]
    seconds = fingerprint_seconds(events)
    if train_s is None:
        train_s = phase_times(events).get("train")
    return {
        "incidents": len(sdc),
        "by_outcome": _count(sdc),
        "detect_lag_steps_max": max(lags) if lags else None,
        "rolled_back_steps": sum(rolled) if rolled else (0 if not sdc else None),
        "fingerprint_s": None if seconds is None else round(seconds, 6),
        "fingerprint_share": (None if seconds is None or not train_s or train_s <= 0
                              else round(seconds / train_s, 6)),
        "checkpoints_refused": sum(1 for e in events if e.get("event") == Event.CHECKPOINT_REJECTED
                                   and "replicas disagreed" in str(e.get("reason") or "")),
        "list": [i.to_dict() for i in sdc],
        "nan": {"incidents": len(nan), "by_outcome": _count(nan), "list": [i.to_dict() for i in nan]},
        "restore_loss_jumps": sum(1 for e in events if e.get("event") == Event.RESTORE_LOSS_JUMP),
    }


def _count(found: list[Incident]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for incident in found:
        counts[incident.outcome.value] = counts.get(incident.outcome.value, 0) + 1
    return counts


def sdc_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows for a terminal or HTML table; plain text (the caller makes it literal)."""
    from .units import format_duration

    if not isinstance(summary, dict):
        return []
    rows: list[tuple[str, str]] = []
    count = summary.get("incidents")
    outcomes = _outcomes_text(summary.get("by_outcome"))
    rows.append(("SDC incidents", f"{count}" + (f" ({outcomes})" if outcomes else "")))
    shown = [i for i in summary.get("list") or () if isinstance(i, dict)]
    if len(shown) > SHOWN_INCIDENTS:
        rows.append(("  SDC incident", f"... {len(shown) - SHOWN_INCIDENTS} earlier, not shown"))
    for i in shown[-SHOWN_INCIDENTS:]:
        lag, basis = i.get("detect_lag_steps"), i.get("agreed_basis")
        rolled = i.get("rolled_back_steps")
        text = (f"step {i.get('step')}, ranks {_join(i.get('ranks'))} on {_join(i.get('nodes'))}: {i.get('outcome')}"
                + (f", excluded {_join(i.get('excluded'))}" if i.get("excluded") else "")
                + (f"; flip within {lag} step(s) before detection (last agreed step {i.get('agreed_step')}"
                   f"{', the attempt start' if basis == AgreedBasis.START.value else ''})" if lag is not None else
                   "; flip to detection: unknown")
                + (f"; {rolled} step(s) rolled back (resumed at {i.get('resume_step')})" if rolled is not None else ""))
        rows.append(("  SDC incident", text))
    lag = summary.get("detect_lag_steps_max")
    if count:
        rows.append(("SDC flip to detection (max)", "unknown" if lag is None else f"{lag} step(s)"))
        rolled = summary.get("rolled_back_steps")
        rows.append(("SDC steps rolled back", "unknown" if rolled is None else f"{rolled}"))
    if summary.get("checkpoints_refused"):
        rows.append(("checkpoints refused (replicas disagreed)", f"{summary['checkpoints_refused']}"))
    seconds, share = summary.get("fingerprint_s"), summary.get("fingerprint_share")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        rows.append(("fingerprint cost (rank 0)", format_duration(float(seconds))
                     + (f" ({float(share):.2%} of train time)" if isinstance(share, (int, float))
                        and not isinstance(share, bool) else "")))
    else:
        rows.append(("fingerprint cost (rank 0)", "not measured (no replicas compared)"))
    nan = _nan_of(summary)
    outcomes = _outcomes_text(nan.get("by_outcome"))
    rows.append(("NaN incidents", f"{nan.get('incidents', 0)}" + (f" ({outcomes})" if outcomes else "")))
    rows.append(("restore-loss jumps", f"{summary.get('restore_loss_jumps', 0)}"))
    return rows


def sdc_line(summary: Any) -> str:
    """One line for `ckptsup status`: "SDC 2 (transient 2), flip to detection <= 5 steps, 15 steps
    rolled back, fingerprints 0.4s (0.31% of train); NaN 0; restore-loss jumps 0"."""
    from .units import format_duration

    if not isinstance(summary, dict):
        return "SDC: -"
    count = summary.get("incidents", 0)
    outcomes = _outcomes_text(summary.get("by_outcome"))
    parts = [f"SDC {count}" + (f" ({outcomes})" if outcomes else "")]
    if count:
        lag, rolled = summary.get("detect_lag_steps_max"), summary.get("rolled_back_steps")
        parts.append("flip to detection " + ("unknown" if lag is None else f"<= {lag} steps"))
        parts.append(f"{'?' if rolled is None else rolled} steps rolled back")
    seconds, share = summary.get("fingerprint_s"), summary.get("fingerprint_share")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        parts.append(f"fingerprints {format_duration(float(seconds))}" + (
            f" ({float(share):.2%} of train)" if isinstance(share, (int, float)) and not isinstance(share, bool) else ""))
    else:
        parts.append("fingerprints not measured")
    nan = _nan_of(summary)
    outcomes = _outcomes_text(nan.get("by_outcome"))
    return (", ".join(parts) + f"; NaN {nan.get('incidents', 0)}" + (f" ({outcomes})" if outcomes else "")
            + f"; restore-loss jumps {summary.get('restore_loss_jumps', 0)}")


def _nan_of(summary: dict[str, Any]) -> dict[str, Any]:
    value = summary.get("nan")
    return value if isinstance(value, dict) else {}


def _outcomes_text(by: Any) -> str:
    if not isinstance(by, dict):
        return ""
    return ", ".join(f"{str(k).replace('_', ' ')} {v}" for k, v in sorted(by.items(), key=lambda kv: str(kv[0])))


def _join(values: Any) -> str:
    return ", ".join(str(v) for v in values) if isinstance(values, list) and values else "?"


def prom_metrics(summary: dict[str, Any]) -> list[tuple[str, str, str, list[tuple[str, Any]]]]:
    """(name without `ckptsup_`, help, type, [(extra labels, value)]) for both Prometheus files:
    `ckptsup report --prom` (goodput_report.prom_text) and the live textfile (supervisor/job/prom_live.py).
    Values that are None are left out by the renderers."""
    if not isinstance(summary, dict):
        return []
    nan = _nan_of(summary)

    def outcomes(by: Any) -> list[tuple[str, Any]]:
        return [(f',outcome="{Outcome(k).value}"', v) for k, v in sorted(by.items())
                if k in Outcome._value2member_map_] if isinstance(by, dict) else []

    return [
        ("sdc_incidents_total", "Replica disagreements detected (silent data corruption).", "counter",
         [("", summary.get("incidents"))]),
        ("sdc_outcomes_total", "Replica disagreements by what followed (excluded, swapped, transient, ...).", "counter",
         outcomes(summary.get("by_outcome"))),
        ("sdc_detect_lag_steps", "Most steps between the last agreeing fingerprint and a disagreement (the flip's bound).",
         "gauge", [("", summary.get("detect_lag_steps_max"))]),
        ("sdc_rolled_back_steps_total", "Steps run again after replica disagreements (detected step + 1 - resume step).",
         "counter", [("", summary.get("rolled_back_steps"))]),
        ("sdc_fingerprint_seconds_total", "Rank 0's seconds computing and exchanging replica fingerprints.", "counter",
         [("", summary.get("fingerprint_s"))]),
        ("sdc_fingerprint_ratio", "Replica fingerprint seconds over rank 0's train-phase seconds.", "gauge",
         [("", summary.get("fingerprint_share"))]),
        ("sdc_checkpoints_refused_total", "Checkpoints refused because their replicas disagreed.", "counter",
         [("", summary.get("checkpoints_refused"))]),
        ("nan_incidents_total", "Non-finite losses detected.", "counter", [("", nan.get("incidents"))]),
        ("nan_outcomes_total", "Non-finite losses by what the replay showed (transient, data, excluded, ...).", "counter",
         outcomes(nan.get("by_outcome"))),
        ("restore_loss_jumps_total", "Restores after which rank 0's loss was not where it was before.", "counter",
         [("", summary.get("restore_loss_jumps"))]),
    ]
