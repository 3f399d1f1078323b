"""The ranks' events on their way to the restart log: each `event` frame (messages.EventRecord)
is read once here (`read`, pure), and the loop carries out what it says — the event appended as
the rank wrote it (its own time kept as `rank_ts`), a checkpoint tier reached for the published
status (operating.py), the files a load read by source for restart_done (restart_record.py), a
save's measured stall and write kept in state.json for the next timeouts and plans.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ...events import Event

# written by the supervisor itself from what it saw, never forwarded from a rank
OWN_EVENTS = frozenset({Event.FIRST_STEP, Event.STEP_PROGRESS, Event.RUN_COMPLETE})
ENVELOPE = ("event", "ts", "mono", "job_id", "attempt", "epoch")   # the rank's writer's; the supervisor's writer adds its own
CHECKPOINT_TIERS = {Event.CHECKPOINT_COMMITTED: "committed", Event.CHECKPOINT_VALIDATED: "validated",
                    Event.CHECKPOINT_PROMOTED: "durable"}
MEASURED_KEYS = ("stall_s", "write_s")   # of a checkpoint_committed: kept in state.json's `measured`


class Fate(enum.Enum):
    FORWARD = "forward"   # appended to the restart log
    OWN = "own"           # one the supervisor writes itself: dropped
    UNKNOWN = "unknown"   # a name this ckptsup does not know (a rank of another version): said, dropped


@dataclass(frozen=True, kw_only=True)
class RankEvent:
    fate: Fate
    name: Event | None = None
    fields: dict[str, Any] = field(default_factory=dict)   # the restart log's fields, `rank_ts` included
    tier: str | None = None                      # committed | validated | durable, with an int step
    files_by_source: dict[str, Any] | None = None   # a checkpoint_loaded's
    measured: dict[str, float] = field(default_factory=dict)   # a checkpoint_committed's stall_s, write_s


def read(record: Any) -> RankEvent:
    """What a rank's event record means for the supervisor. Pure."""
    name = Event.parse(record.get("event")) if isinstance(record, dict) else None
    if name is None:
        return RankEvent(fate=Fate.UNKNOWN)
    if name in OWN_EVENTS:
        return RankEvent(fate=Fate.OWN, name=name)
    fields = {k: v for k, v in record.items() if k not in ENVELOPE}
    fields["rank_ts"] = record.get("ts")
    tier = CHECKPOINT_TIERS.get(name) if isinstance(record.get("step"), int) else None
    files = record.get("files_by_source")
    measured = {key: float(record[key]) for key in MEASURED_KEYS if isinstance(record.get(key), (int, float))} \
        if name is Event.CHECKPOINT_COMMITTED else {}
    return RankEvent(fate=Fate.FORWARD, name=name, fields=fields, tier=tier, measured=measured,
                     files_by_source=files if name is Event.CHECKPOINT_LOADED and isinstance(files, dict) else None)
