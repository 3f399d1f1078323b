"""The restart log: schema, writer and reader of `events.jsonl`.

One JSON object per line, append-only. Every event has at least `event`, `ts` (wall clock, ISO-8601
UTC), `mono` (monotonic seconds on the writing host), `job_id`, `attempt`; fenced writers add
`epoch`. One process writes a run's file at a time (docs/architecture.md §Message hops): the
supervisor; the hooks only when no supervisor runs; a requeuer in the supervisor's absence appends
one fenced `requeue`.

planning/ reads this module, so it must never import the supervisor.

Readers (`read_events`, `follow_events`) take the file as something anyone could have put there:
a regular file only (a directory or a FIFO is one `EventsFileError` line, and a FIFO never blocks
the open), at most MAX_EVENTS_BYTES, streamed line by line; a line longer than
MAX_EVENT_LINE_BYTES is skipped without being held, nesting is bounded before json.loads, and a
line that is not an event (torn, foreign, malformed, an `event` that is not a string) is skipped
and counted in the caller's `ReadStats`.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from .errors import CkptsupError
from .safe_io import encodable, loads_json

EVENTS_FILE = "events.jsonl"
MAX_EVENTS_BYTES = 1 << 30       # 1 GiB: far beyond any run's restart log
MAX_EVENT_LINE_BYTES = 1 << 20   # one record; a longer line is skipped unread
LAST_EVENT_TAIL_BYTES = 64 << 10  # last_event: far more than one record of ours
MAX_EVENT_DEPTH = 32             # records nest a few levels (phases, lists of nodes)
_CHUNK = 1 << 20


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
    MEMORY_SAVED = "memory_saved"                  # step, ok, stall_s, write_s, bytes, reason (the memory tier)
    MEMORY_REPLICATED = "memory_replicated"        # ok, step, ranks | node, rank, buddy, reason: every rank's replica of a step is on its buddy
    CHECKPOINT_VALIDATED = "checkpoint_validated"  # step, level
    CHECKPOINT_REJECTED = "checkpoint_rejected"    # step, level, reason
    CHECKPOINT_PROMOTED = "checkpoint_promoted"    # step, tier
    CHECKPOINT_LOADED = "checkpoint_loaded"        # step, path, load_s, source, files_by_source, read_local_files, read_shared_files, local_fallback_files
    ELASTIC_RESUME = "elastic_resume"              # step, saved_world_size, world_size (hooks: resumed at another world size)
    FR_DUMPED = "fr_dumped"                        # rank, path (the hooks thread wrote the flight recorder)
    FAILURE_DETECTED = "failure_detected"  # kind, node, rank, detect_s
    FAILURE_ATTRIBUTED = "failure_attributed"  # kind, node, was_kind, was_node, detail: what the policy found it was
    NODE_EXCLUDED = "node_excluded"        # node, reason
    SHRINK_DECIDED = "shrink_decided"      # choice (continue | requeue), survivors, nodes, min_nodes, reason, continue_cost_s, requeue_cost_s, {horizon,restart,queue_wait,requeue_restart}_{s,source}
    RESTART_DONE = "restart_done"          # restart_s, resume_step, phases{kill_s, health_s, launch_s, rendezvous_s, load_s, first_step_s}
    REQUEUE = "requeue"                    # reason, by, excluded, partition, phases
    REQUEUE_UPDATED = "requeue_updated"    # pending-job updates after a requeue: wait_pending_s, update_s, excluded, partition, ok;
    #                                        not ok and restarted: the job ran again first (nodes, job_partition, on_excluded)
    GIVE_UP = "give_up"                    # reason, kind | by
    RUN_COMPLETE = "run_complete"          # step
    RUN_CANCELLED = "run_cancelled"        # step, saved, request: stopped on the operator's `ckptsup stop`; not requeued
    CONTROL = "control"                    # request, command, outcome (accepted | refused), detail, step: an operator's request, acknowledged
    INTERVAL_CHANGED = "interval_changed"  # interval_s, why
    COLLECTIVE_TIMEOUT_SET = "collective_timeout_set"  # collective_s, was_s, steps: steady timeout sent mid-attempt
    PREEMPTION = "preemption"              # signal, budget_s, emergency_save: bool
    CLOUD_NOTICE = "cloud_notice"          # node, cloud, action, deadline, ahead_s, way, emergency_save, budget_s, save_needed_s, reason: a cloud announced a node's reclaim (docs/cloud.md)
    HEALTH_CHECK = "health_check"          # node, name, ok, detail
    TEARDOWN_ERROR = "teardown_error"      # node, rc: torchrun failed after every rank of the node finished
    RESTORE_LOSS_JUMP = "restore_loss_jump"  # step, loss, before, basis, detail: after a restore rank 0's loss is not where it was (a warning)
    BUSY = "busy"                          # ranks, detail, silent_s: no progress past the hang timeout, but ranks work (not a hang)
    BUSY_OVER = "busy_over"                # ranks, busy_s: progress again after a busy spell (busy_s: from its last progress)
    TEARDOWN_HANG = "teardown_hang"        # ranks [{node, rank, pid, host_pid, wchan, stack}], nodes, exit_grace_s, waited_s: rank processes killed after the ranks finished
    SUPERVISION_LEVEL = "supervision_level"  # level: hooks | heartbeat | progress | process, detail: how the attempt is watched
    WARM_READY = "warm_ready"              # node, interpreters: that node's next launch starts its ranks warm
    STRAGGLER = "straggler"                # rank, node, ratio, compute_s, others_s, windows, step, replace: a rank computes slower than the others
    AGENT_STARTED = "agent_started"        # node, version, container, pid, pid_ns, node_from, shm_free, container_s, python_s: an agent's hello (docs/containers.md)
    AGENT_STEPS_FINISHED = "agent_steps_finished"  # lost, finished, waited_s, budget_s, left[, error]: before the job ended, Slurm finished the agents' step that lost those nodes (step_completion.py)
    AGENT_LOST = "agent_lost"              # nodes, rc: a step of agents outside the launch (spares) ended; a launch needing them starts new ones
    PROGRESS_STALE = "progress_stale"      # since_launch_s, pattern: no hello and no progress line for progress_warn_s (a warning)
    EXTERNAL_RESUME = "external_resume"    # folder, step, checked, moved_aside: the external step folder the next attempt's framework loads
    HF_RESUME = "hf_resume"    # output_dir, folder, step, moved_aside, check_s: the checkpoint-N HF's get_last_checkpoint finds next
    SCRIPT_CHECKPOINT_VERIFIED = "script_checkpoint_verified"  # path, bytes, seconds, step, kind, version, kept: a new version of a script's own checkpoint file checked whole (and kept)
    SCRIPT_CHECKPOINT_RESTORED = "script_checkpoint_restored"  # path, reason, moved_to, version, step, bytes: a corrupt one moved aside, the newest verified copy put back
    SCRIPT_CHECKPOINT_REJECTED = "script_checkpoint_rejected"  # path, reason, moved_to, outcome (start_over | give_up): corrupt before a launch, no verified copy
    PHASE = "phase"                        # phase, was, step, rank: rank 0 entered a phase (init, load, train, eval, save, stopping)

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
    SDC = "sdc"                # replicas' fingerprints disagree: silent data corruption (docs/sdc.md)
    PREEMPTED = "preempted"
    USER_ERROR = "user_error"
    REPLACED = "replaced"      # an operator's `ckptsup replace`: the node's ranks move to a spare at a checkpoint

    @staticmethod
    def counts_against_mtbf(kind: object) -> bool:
        """Whether a failure of this kind (a member or its string; unknown ones count) is the
        hardware's or the system's: preemptions and the job's own errors say nothing of the MTBF."""
        return kind not in (FailureKind.PREEMPTED, FailureKind.USER_ERROR, FailureKind.REPLACED)


# one event per node per launch (each agent's hello, each node's warm pool): neither the story nor the
# goodput report reads them, and at 16,384 nodes they are 98 % of a day's log, so those readers leave
# them unparsed (read_events' skip; bench_scale_ops.py, BENCHMARKS.md §Scale)
NODE_NOTES = frozenset({Event.AGENT_STARTED.value, Event.WARM_READY.value})

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


class EventsFileError(CkptsupError):
    """The restart log cannot be read at all (not a regular file, unreadable, too large): one line."""


@dataclass
class ReadStats:
    """What a reader skipped: lines that are not events (torn, foreign, malformed, too deep or too long)."""

    skipped: int = 0
    left_out: int = 0   # well-formed or not, lines of a kind the reader asked to skip (read_events' skip)


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """One line → event dict, or None for a blank, torn or foreign line (never raises): a record
    with every required field and a string `event` (NaN and Infinity are kept: json.dumps writes them)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line or len(line) > MAX_EVENT_LINE_BYTES:
        return None
    try:
        record = loads_json(line, what="event line", error=EventsFileError, max_depth=MAX_EVENT_DEPTH,
                            allow_nonfinite=True)
    except EventsFileError:
        return None
    if not isinstance(record, dict) or any(k not in record for k in REQUIRED_FIELDS):
        return None
    if not isinstance(record["event"], str):
        return None
    return record


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _open_log(path: Path) -> tuple[BinaryIO, int] | None:
    """(the restart log opened for reading, its size), None when there is none; EventsFileError
    for anything but a regular file of at most MAX_EVENTS_BYTES."""
    p = encodable(path, what="restart log", error=EventsFileError)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise EventsFileError(f"cannot read {p}: {err.strerror or err}; it must be the run's restart log, "
                              "a file readable by you") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EventsFileError(f"cannot read {p}: it is {_kind(st.st_mode).removeprefix('not ')}, not the "
                                  "restart log (a regular file); move it aside")
        if st.st_size > MAX_EVENTS_BYTES:
            raise EventsFileError(f"cannot read {p}: it is {st.st_size} bytes, more than the "
                                  f"{MAX_EVENTS_BYTES >> 30} GiB a restart log may be; is it the right file?")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


class _Lines:
    """Splits a byte stream into lines, never holding more than MAX_EVENT_LINE_BYTES of one: a
    longer line is dropped as it arrives (counted once) up to its newline."""

    def __init__(self, stats: ReadStats) -> None:
        self.stats = stats
        self.buf = b""
        self.discarding = False

    def feed(self, chunk: bytes) -> list[bytes]:
        parts = chunk.split(b"\n")
        out = []
        for part in parts[:-1]:
            if self.discarding:
                self.discarding = False  # this newline ends the long line
                continue
            line, self.buf = self.buf + part, b""
            if len(line) > MAX_EVENT_LINE_BYTES:
                self.stats.skipped += 1
                continue
            out.append(line)
        if not self.discarding:
            self.buf += parts[-1]
            if len(self.buf) > MAX_EVENT_LINE_BYTES:
                self.buf, self.discarding = b"", True
                self.stats.skipped += 1
        return out

    def rest(self) -> bytes:
        line, self.buf = self.buf, b""
        return line


def _records(lines: list[bytes], stats: ReadStats, skip: tuple[bytes, ...] = ()) -> Iterator[dict[str, Any]]:
    for line in lines:
        if skip and line.startswith(skip):
            stats.left_out += 1   # a kind the reader does not want, as EventWriter writes it: not parsed at all
            continue
        record = parse_line(line)
        if record is not None:
            yield record
        elif line.strip():
            stats.skipped += 1


def read_events(run_dir: str | os.PathLike[str], *, stats: ReadStats | None = None,
                skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """All well-formed events of a run, in file order ([] when there is no log). Bad lines (a
    torn last one too) are skipped and counted in `stats`; a bad file is one EventsFileError.
    Events named in `skip` are left out, those EventWriter wrote unparsed (its compact line starts
    with the name: at 16,384 nodes the per-node notes are 98 % of a day's log); a reader still
    checks what it gets, since another writer's line of that kind is parsed and returned."""
    stats = stats if stats is not None else ReadStats()
    prefixes = tuple(f'{{"event":"{name}"'.encode() for name in sorted(skip))
    path = Path(run_dir) / EVENTS_FILE
    opened = _open_log(path)
    if opened is None:
        return []
    fh, _ = opened
    lines = _Lines(stats)
    out: list[dict[str, Any]] = []
    total = 0
    with fh:
        while True:
            try:
                chunk = fh.read(_CHUNK)
            except OSError as err:
                raise EventsFileError(f"cannot read {path}: {err.strerror or err}") from None
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_EVENTS_BYTES:
                raise EventsFileError(f"cannot read {path}: it grew past {MAX_EVENTS_BYTES >> 30} GiB while being read")
            out.extend(_records(lines.feed(chunk), stats, prefixes))
    out.extend(_records([lines.rest()], stats, prefixes))
    return out


def last_event(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The log's last well-formed event, read from its end (at most LAST_EVENT_TAIL_BYTES): who
    wrote the run dir last, without reading a long log. None when there is no log or no event in
    that tail; a bad file is one EventsFileError, as for read_events."""
    path = Path(run_dir) / EVENTS_FILE
    opened = _open_log(path)
    if opened is None:
        return None
    fh, size = opened
    with fh:
        try:
            fh.seek(max(0, size - LAST_EVENT_TAIL_BYTES))
            data = fh.read(LAST_EVENT_TAIL_BYTES)
        except OSError as err:
            raise EventsFileError(f"cannot read {path}: {err.strerror or err}") from None
    lines = data.split(b"\n")
    if size > LAST_EVENT_TAIL_BYTES:
        lines = lines[1:]  # the tail starts inside a line
    for line in reversed(lines):
        record = parse_line(line)
        if record is not None:
            return record
    return None


def follow_events(run_dir: str | os.PathLike[str], *, poll_s: float = 0.5,
                  stop_after_idle_s: float | None = None, stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """Yield events as they are appended (like `tail -f`), starting from the beginning. Bad lines
    are skipped and counted in `stats`; a partial last line waits for its newline."""
    stats = stats if stats is not None else ReadStats()
    path = Path(run_dir) / EVENTS_FILE
    pos = 0
    lines = _Lines(stats)
    idle = 0.0
    while True:
        opened = _open_log(path)
        if opened is not None:
            fh, size = opened
            with fh:
                if size < pos:  # replaced or truncated: a new file, read from its start
                    pos, lines = 0, _Lines(stats)
                fh.seek(pos)
                try:
                    chunk = fh.read(_CHUNK)
                except OSError as err:
                    raise EventsFileError(f"cannot read {path}: {err.strerror or err}") from None
                pos = fh.tell()
            if chunk:
                idle = 0.0
                yield from _records(lines.feed(chunk), stats)
                continue
        if stop_after_idle_s is not None and idle >= stop_after_idle_s:
            return
        time.sleep(poll_s)
        idle += poll_s
