"""The run in one line: what happened to it and what its failures cost ("resumed 3.9 s after n2
died; 0.6 % of the paid time lost to failures"). `ckptsup log`, `ckptsup report` and `ckptsup
status` lead with it, so all three tell the same story. Pure over events.jsonl (planning/ reads
the file, never the supervisor); the text holds the file's values as they are, and every
renderer makes it literal (textsafe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..events import Event, FailureKind
from .accounting import CATEGORIES, Accounting, account

# the badput a failure causes: what was redone, the time to see it, every restart phase, and the end
# of an attempt that could not restart in place (docs/planning.md); stalls, start-up and spares are not
FAILURE_BADPUT = tuple(c for c in CATEGORIES if c.startswith("restart_") or
                       c in ("lost_progress", "detection", "teardown", "other"))


@dataclass(kw_only=True)
class Incident:
    kind: Any
    node: Any = None
    rank: Any = None
    step: Any = None
    restart_s: float | None = None
    outcome: str = "open"        # open | resumed | requeued | gave_up
    reason: str = ""


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def incidents(events: Iterable[Mapping[str, Any]]) -> list[Incident]:
    """Every failure of the run with what it turned out to be (failure_attributed) and how it
    ended: resumed (restart_done), requeued, or the give-up."""
    found: list[Incident] = []
    for e in events:
        name = e.get("event")
        last = found[-1] if found else None
        if name == Event.FAILURE_DETECTED:
            found.append(Incident(kind=e.get("kind"), node=e.get("node"), rank=e.get("rank"), step=e.get("step")))
        elif name == Event.FAILURE_ATTRIBUTED and last is not None and last.outcome == "open":
            last.kind, last.node, last.rank = e.get("kind"), e.get("node"), None
        elif name == Event.RESTART_DONE and last is not None and last.outcome == "open":
            last.restart_s, last.outcome = _num(e.get("restart_s")), "resumed"
        elif name == Event.REQUEUE and last is not None and last.outcome == "open":
            last.outcome, last.reason = "requeued", str(e.get("reason", ""))
        elif name == Event.GIVE_UP and last is not None and last.outcome == "open":
            last.outcome, last.reason = "gave_up", str(e.get("reason", ""))
    return found


def subject(incident: Incident) -> str:
    """What failed, as a sentence's subject: "n2 died", "rank 1 on n3 crashed"."""
    kind, node, rank = incident.kind, incident.node, incident.rank
    on = f" on {node}" if node not in (None, "") else ""
    who = f"rank {rank}{on}" if rank is not None else (str(node) if on else "a rank")
    match kind:   # a str enum: "node_down" == FailureKind.NODE_DOWN; a foreign kind matches none
        case FailureKind.NODE_DOWN:
            return f"{node if on else 'a node'} died"
        case FailureKind.CRASH:
            return f"{who} crashed"
        case FailureKind.HANG:
            return f"{who} hung"
        case FailureKind.NAN:
            return f"a NaN loss at step {incident.step}" if incident.step is not None else "a NaN loss"
        case FailureKind.SDC:
            return "silent data corruption"
        case FailureKind.PREEMPTED:
            return "the preemption"
        case FailureKind.REPLACED:
            return f"{node if on else 'a node'} was replaced"
        case FailureKind.USER_ERROR:
            return "the script's own error"
    return f"{kind}{on}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f} %"


def failure_share(acc: Accounting) -> float | None:
    """The share of the paid device-time that failures cost (FAILURE_BADPUT), None before any is paid."""
    if acc.paid_device_s <= 0:
        return None
    return sum(acc.badput_device_s.get(k, 0.0) for k in FAILURE_BADPUT) / acc.paid_device_s


def headline(events: Iterable[Mapping[str, Any]], acc: Accounting | None = None) -> str:
    """The one line; `acc` when the caller has accounted the same events already."""
    events = list(events)
    acc = acc if acc is not None else account([dict(e) for e in events])
    found = incidents(events)
    ends = [e for e in events if e.get("event") in (Event.RUN_COMPLETE, Event.GIVE_UP, Event.RUN_CANCELLED)]
    end = ends[-1] if ends else None
    if not found:
        if end is not None and end.get("event") == Event.GIVE_UP:
            text = f"gave up: {end.get('reason', '')}"
        elif end is not None and end.get("event") == Event.RUN_CANCELLED:
            text = "stopped on request, without a failure"
        elif end is not None:
            text = "ran to completion without a failure"
        else:
            text = "no failure so far"
        useful = acc.useful_device_s / acc.paid_device_s if acc.paid_device_s > 0 else None
        return text + (f"; goodput {_pct(useful)} of the paid time" if useful is not None else "")
    last = found[-1]
    what = subject(last)
    if last.outcome == "resumed":
        text = (f"resumed {last.restart_s:.1f} s after {what}" if last.restart_s is not None
                else f"resumed after {what}")
    elif last.outcome == "requeued":
        text = f"requeued after {what}"
    elif last.outcome == "gave_up":
        text = f"gave up after {what}: {last.reason}"
    else:
        text = f"recovering from {what}"
    if len(found) > 1:
        text = f"{len(found)} failures; the last: {text}"
    if end is not None and end.get("event") == Event.RUN_COMPLETE and last.outcome != "gave_up":
        text += ", then ran to completion"
    share = failure_share(acc)
    return text + (f"; {_pct(share)} of the paid time lost to failures" if share is not None else "")
