"""The restart log: schema, writer and reader of `events.jsonl`.

One JSON object per line, append-only. Every event has at least `event`, `ts` (wall clock, ISO-8601
UTC), `mono` (monotonic seconds on the writing host), `job_id`, `attempt`; fenced writers add
`epoch`. One process writes a run's file at a time (docs/architecture.md §Message hops): the
supervisor; the hooks only when no supervisor runs; a requeuer in the supervisor's absence appends
one fenced `requeue`.

planning/ reads this module, so it must never import the supervisor.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"


class Event(str, enum.Enum):
    """Every event name written to events.jsonl, listed in docs/contracts.md §Restart log; a test
    holds the two together. Writers pass members; readers compare members (Event is a str, so
    `record["event"] == Event.RUN_COMPLETE` holds for the string "run_complete"). Format a member
    into text with `.value`: in Python 3.11 f"{Event.RUN_COMPLETE}" is "Event.RUN_COMPLETE"."""

    SUPERVISOR_START = "supervisor_start"  # script, resumed, in_slurm, excluded: a supervisor process started
    ALLOCATION = "allocation"            # nodes, gpus_per_node, spares
    LAUNCH = "launch"                    # nodes, path: initial | fast | node
    FIRST_STEP = "first_step"            # step, since_launch_s
    STEP_PROGRESS = "step_progress"      # step, step_time_s
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # step, stall_s, write_s, bytes
    CHECKPOINT_FAILED = "checkpoint_failed"        # step, reason
    CHECKPOINT_VALIDATED = "checkpoint_validated"  # step, level
    CHECKPOINT_REJECTED = "checkpoint_rejected"    # step, level, reason
    CHECKPOINT_PROMOTED = "checkpoint_promoted"    # step, tier
    CHECKPOINT_LOADED = "checkpoint_loaded"        # step, path, load_s, read_local_files, read_shared_files, local_fallback_files
    ELASTIC_RESUME = "elastic_resume"              # step, saved_world_size, world_size (hooks: resumed at another world size)
    FR_DUMPED = "fr_dumped"                        # rank, path (the hooks thread wrote the flight recorder)
    FAILURE_DETECTED = "failure_detected"  # kind, node, rank, detect_s
    FAILURE_ATTRIBUTED = "failure_attributed"  # kind, node, was_kind, was_node, detail: what the policy found it was
    NODE_EXCLUDED = "node_excluded"        # node, reason
    RESTART_DONE = "restart_done"          # restart_s, resume_step, phases{kill_s, health_s, launch_s, rendezvous_s, load_s, first_step_s}
    REQUEUE = "requeue"                    # reason, by, excluded, partition, phases
    REQUEUE_UPDATED = "requeue_updated"    # pending-job updates after a requeue: wait_pending_s, update_s, excluded, partition, ok;
    #                                        not ok and restarted: the job ran again first (nodes, job_partition, on_excluded)
    GIVE_UP = "give_up"                    # reason, kind | by
    RUN_COMPLETE = "run_complete"          # step
    INTERVAL_CHANGED = "interval_changed"  # interval_s, why
    COLLECTIVE_TIMEOUT_SET = "collective_timeout_set"  # collective_s, was_s, steps: steady timeout sent mid-attempt
    PREEMPTION = "preemption"              # signal, budget_s, emergency_save: bool
    HEALTH_CHECK = "health_check"          # node, name, ok, detail
    TEARDOWN_ERROR = "teardown_error"      # node, rc: torchrun failed after every rank of the node finished

    @classmethod
    def parse(cls, name: object) -> "Event | None":
        """The member `name` is (a member or its string value), else None. For names that arrive
        from elsewhere (a rank's record, a file): an unknown one must not crash the reader."""
        if isinstance(name, cls):
            return name
        if isinstance(name, str):
            return cls._value2member_map_.get(name)  # type: ignore[return-value]
        return None

    @classmethod
    def coerce(cls, name: object) -> "Event":
        """The member `name` is, for a writer: TypeError for a non-string, ValueError for a
        name that is not a member (add it here and to docs/contracts.md first)."""
        if not isinstance(name, str):
            raise TypeError(f"an event name is an Event member, not {type(name).__name__}")
        event = cls.parse(name)
        if event is None:
            raise ValueError(f"unknown event name {name!r}: add it to ckptsup.events.Event and docs/contracts.md")
        return event


class FailureKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    NODE_DOWN = "node_down"
    NAN = "nan"
    PREEMPTED = "preempted"
    USER_ERROR = "user_error"

    @staticmethod
    def counts_against_mtbf(kind: object) -> bool:
        """Whether a failure of this kind (a member or its string; unknown ones count) is the
        hardware's or the system's: preemptions and the job's own errors say nothing of the MTBF."""
        return kind not in (FailureKind.PREEMPTED, FailureKind.USER_ERROR)


REQUIRED_FIELDS = ("event", "ts", "mono", "job_id", "attempt")


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def make_event(name: Event | str, *, job_id: str, attempt: int, mono: float | None = None,
               ts: str | None = None, **fields: Any) -> dict[str, Any]:
    """One record. `name` is an Event member (or its value, for a forwarded record); anything else
    raises (Event.coerce), so no writer can put a name into the log that readers do not know."""
    event = Event.coerce(name)
    record: dict[str, Any] = {
        "event": event.value,
        "ts": ts or utc_now_iso(),
        "mono": time.monotonic() if mono is None else mono,
        "job_id": str(job_id),
        "attempt": int(attempt),
    }
    for key, value in fields.items():
        record[key] = value.value if isinstance(value, enum.Enum) else value
    return record


@dataclass(kw_only=True)
class EventWriter:
    """Appends events to `<run_dir>/events.jsonl`: one `write` per line on an O_APPEND fd, so a
    crash never leaves half a line in the middle of the file (only, at worst, at its end)."""

    run_dir: Path
    job_id: str
    attempt: int
    epoch: int | None = None
    fsync: bool = False
    _fd: int | None = field(default=None, init=False, repr=False)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / EVENTS_FILE

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

    def emit(self, name: Event | str, **fields: Any) -> dict[str, Any]:
        if self.epoch is not None:
            fields.setdefault("epoch", self.epoch)
        record = make_event(name, job_id=self.job_id, attempt=self.attempt, **fields)
        self.write_record(record)
        return record

    def write_record(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        fd = self._open()
        os.write(fd, line)
        if self.fsync:
            os.fsync(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def parse_ts(value: Any) -> float | None:
    """An event's `ts` (ISO 8601; naive means UTC, as utc_now_iso writes) → POSIX seconds, or None."""
    if not isinstance(value, str):
        return None
    try:
        moment = _dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.timezone.utc)
    return moment.timestamp()


def parse_line(line: str) -> dict[str, Any] | None:
    """One line → event dict, or None for a blank, torn or foreign line (never raises)."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or any(k not in record for k in REQUIRED_FIELDS):
        return None
    return record


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All well-formed events of a run, in file order. A torn last line is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    with open(path, encoding="utf-8", errors="replace") as fh:
        return [e for e in (parse_line(line) for line in fh) if e is not None]


def follow_events(run_dir: str | os.PathLike[str], *, poll_s: float = 0.5,
                  stop_after_idle_s: float | None = None) -> Iterator[dict[str, Any]]:
    """Yield events as they are appended (like `tail -f`), starting from the beginning."""
    path = Path(run_dir) / EVENTS_FILE
    pos = 0
    buf = ""
    idle = 0.0
    while True:
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            if chunk:
                idle = 0.0
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    record = parse_line(line)
                    if record is not None:
                        yield record
                continue
        if stop_after_idle_s is not None and idle >= stop_after_idle_s:
            return
        time.sleep(poll_s)
        idle += poll_s
