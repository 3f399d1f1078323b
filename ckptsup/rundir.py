"""The run directory: one per job, on the shared file system, surviving requeues
(docs/contracts.md §Run directory).

    <run_dir>/            0700
      events.jsonl        the restart log (events.py)
      state.json          attempt, fencing epoch, excluded nodes, measured costs (atomic writes)
      lease               the supervisor's lease: JSON {pid, host, epoch, renewed}, rewritten every
                          lease_interval_s; a watchdog on another node requeues when it goes stale
      secret              0600 per-job HMAC key (ranks/agent get its path, never its value):
                          64 hex characters (secrets.token_hex(32)); anything shorter is refused
      config.json         0600 effective config the supervisor resolved (config.write_config_json)
      status.json         0600 the live status for `ckptsup status`, rewritten every 2 s (supervisor/job/status.py)
      control/            0700 operator requests (`ckptsup save-now`, `ckptsup stop`; supervisor/job/control.py)
      checkpoints/        default checkpoint_dir
      script-checkpoints/ 0700 verified versions of a script's own checkpoint files (checkpoint/script_keep.py)
      attempt-<N>/        per-attempt agent and rank logs, flight-recorder dumps

Every file here is read through safe_io (a regular file, bounded, never blocking) and checked
field by field, so a damaged one is one ConfigError line naming the file and the fix.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError
from .events import FailureKind
from .safe_io import read_json, read_regular

STATE_FILE = "state.json"
LEASE_FILE = "lease"
SECRET_FILE = "secret"
CONFIG_JSON = "config.json"
MAX_STATE_BYTES = 16 << 20      # attempts x failures: far below this even after 10^4 restarts
MAX_LEASE_BYTES = 64 << 10
MAX_SECRET_BYTES = 4096
SECRET_HEX_CHARS = 64           # secrets.token_hex(32), as RunDir.create writes it
_HEX = re.compile(rb"[0-9a-fA-F]+")


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) 0700, or check an existing one is ours and not group/world
    writable. Raises ConfigError with a fix."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create directory {path}: {err.strerror}; choose a writable location") from None
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} is owned by uid {st.st_uid}, not you; use a directory you own")
    if st.st_mode & 0o022:
        raise ConfigError(f"{path} is writable by group or others; run `chmod go-w {path}`")
    return path


def atomic_write_json(path: Path, payload: Any, *, mode: int = 0o600) -> None:
    """Write JSON to a temporary file (unique per call: threads of one process may write the same
    file at once), fsync, rename over `path`, fsync the directory. A failed write leaves no
    temporary behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            data = memoryview((json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class RunStatus(str, enum.Enum):
    """The run's lifecycle in state.json. Transitions: RUNNING → DONE | GAVE_UP | STOPPED (the
    supervisor), RUNNING → CANCELLED (an operator's `ckptsup stop`) and RUNNING → REQUEUED (whoever requeues; the next supervisor sets RUNNING)."""

    RUNNING = "running"
    DONE = "done"          # training finished: never requeue
    GAVE_UP = "gave_up"    # policy gave up: never requeue
    STOPPED = "stopped"    # stopped for preemption / time limit; the requeue follows
    REQUEUED = "requeued"  # requeued in this epoch: no second requeuer
    CANCELLED = "cancelled"  # stopped on the operator's request (`ckptsup stop`): never requeue


FINISHED = (RunStatus.DONE, RunStatus.GAVE_UP, RunStatus.CANCELLED)


@dataclass(kw_only=True)
class RunState:
    """What survives between attempts and requeues. The run dir, not SLURM_RESTART_COUNT, is the
    source of truth."""

    attempt: int = 0                 # increments on every launch (fast path, node path, requeue)
    epoch: int = 0                   # fencing epoch; increments whenever a new supervisor or attempt takes over
    excluded_nodes: dict[str, str] = field(default_factory=dict)  # node -> reason
    restarts: int = 0                # restarts spent from the budget
    measured: dict[str, Any] = field(default_factory=dict)        # e.g. stall_s, save_s, restart_s (floats), step_times (a list)
    status: RunStatus = RunStatus.RUNNING
    failures: list[dict[str, Any]] = field(default_factory=list)  # history for the policy (kind, step, node, rank)

    @classmethod
    def from_json(cls, data: Any) -> "RunState":
        """Check every field's type (TypeError naming the first bad one); unknown keys are
        ignored (a newer ckptsup's). Non-finite measurements are dropped: they are estimates
        the next attempt measures again, and must not end a run."""
        if not isinstance(data, dict):
            raise TypeError(f"not a JSON object but {_a(data)}")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for name in ("attempt", "epoch", "restarts"):
            if name in known and not _count(known[name]):
                raise TypeError(f"{name} must be an integer >= 0, not {_short(known[name])}")
        nodes = known.get("excluded_nodes", {})
        if not isinstance(nodes, dict) or not all(isinstance(v, str) for v in nodes.values()):
            raise TypeError(f"excluded_nodes must be an object of node -> reason, not {_short(nodes)}")
        if "measured" in known:
            known["measured"] = _measured(known["measured"])
        if "status" in known:
            try:
                known["status"] = RunStatus(known["status"])
            except (ValueError, TypeError):
                raise TypeError(f"unknown run status {_short(known['status'])}") from None
        failures = known.get("failures", [])
        if not isinstance(failures, list):
            raise TypeError(f"failures must be a list, not {_a(failures)}")
        for i, record in enumerate(failures):
            _check_failure(i, record)
        return cls(**known)


# The attempt history's records (supervisor/job/observations.py AttemptResult.to_record, read back by
# AttemptResult.from_record): key -> (check, what it must be). FAILURE_OUTCOMES is Outcome's
# values (a test holds them equal; the run dir may not import the supervisor).
FAILURE_OUTCOMES = ("running", "completed", "failed", "preempted")
SUPERVISION_LEVELS = ("hooks", "heartbeat", "progress", "process")   # SupervisionLevel's values
_KINDS = tuple(k.value for k in FailureKind)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _finite(v: float) -> bool:
    """math.isfinite, false for an integer past any float (JSON integers have any size; isfinite
    raises OverflowError for them)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_FAILURE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attempt": (_count, "an integer >= 0"),
    "outcome": (lambda v: v in FAILURE_OUTCOMES, f"one of {', '.join(FAILURE_OUTCOMES)}"),
    "start_step": (_count, "an integer >= 0"),
    "last_step": (_optional(lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
    "kind": (_optional(lambda v: v in _KINDS), f"one of {', '.join(_KINDS)}"),
    "node": (_optional(lambda v: isinstance(v, str)), "a node name or null"),
    "rank": (_optional(lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
    "step": (_optional(lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
    "detect_s": (_optional(_number), "a number or null"),
    "detail": (_optional(lambda v: isinstance(v, str)), "a string"),
    "level": (lambda v: v in SUPERVISION_LEVELS, f"one of {', '.join(SUPERVISION_LEVELS)}"),
    "progress": (lambda v: isinstance(v, bool), "true or false"),
}


def _check_failure(i: int, record: Any) -> None:
    if not isinstance(record, dict):
        raise TypeError(f"failures[{i}] must be an object, not {_a(record)}")
    for key, (check, what) in _FAILURE_FIELDS.items():
        if key in record and not check(record[key]):
            raise TypeError(f"failures[{i}].{key} must be {what}, not {_short(record[key])}")


def _measured(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"measured must be an object of name -> seconds, not {_a(value)}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out[key] = [x for x in v if _finite(x)]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if _finite(v):
                out[key] = v
        else:
            raise TypeError(f"measured.{key} must be a number or a list of numbers, not {_short(v)}")
    return out


def _a(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + "..."


@dataclass(kw_only=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> "RunDir":
        run_dir = cls(path=ensure_private_dir(Path(path)))
        run_dir._ensure_secret()
        return run_dir

    def _ensure_secret(self) -> None:
        """Write the secret whole or not at all: a temporary file, fsynced, then linked into
        place (a link never replaces: a concurrent creator's secret wins). An empty secret (an
        older ckptsup died between creating and writing it) is replaced; any other is kept, and
        read_secret judges it."""
        try:
            if self.secret_path.lstat().st_size > 0:
                return
            empty = True
        except FileNotFoundError:
            empty = False
        tmp = self.path / f".{SECRET_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.write(fd, secrets.token_hex(SECRET_HEX_CHARS // 2).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            if empty:
                os.replace(tmp, self.secret_path)
            else:
                try:
                    os.link(tmp, self.secret_path)
                except FileExistsError:
                    pass
        finally:
            if tmp.exists():
                tmp.unlink()

    @property
    def state_path(self) -> Path:
        return self.path / STATE_FILE

    @property
    def lease_path(self) -> Path:
        return self.path / LEASE_FILE

    @property
    def secret_path(self) -> Path:
        return self.path / SECRET_FILE

    @property
    def config_json_path(self) -> Path:
        return self.path / CONFIG_JSON

    def attempt_dir(self, attempt: int) -> Path:
        return ensure_private_dir(self.path / f"attempt-{attempt}")

    def read_secret(self) -> bytes:
        return read_secret(self.secret_path)

    def load_state(self) -> RunState:
        """state.json (a fresh RunState when there is none yet); a damaged one — not JSON, the
        wrong shape, a field of the wrong type, not a regular file — is one ConfigError line."""
        fix = "move it aside to start the run's state afresh"
        try:
            data = read_json(self.state_path, max_bytes=MAX_STATE_BYTES, what="run state", error=_StateError,
                             allow_nonfinite=True)
            return RunState.from_json(data)
        except FileNotFoundError:
            return RunState()
        except _StateError as err:  # safe_io's line, less the path and its own fix: ours follows
            problem = str(err).removeprefix(f"run state {self.state_path} ").removesuffix(
                "; replace it with the file itself")
            raise ConfigError(f"{self.state_path} is corrupt ({problem}); {fix}") from None
        except TypeError as err:
            raise ConfigError(f"{self.state_path} is corrupt ({err}); {fix}") from None

    def save_state(self, state: RunState) -> None:
        atomic_write_json(self.state_path, asdict(state))

    def renew_lease(self, *, epoch: int, host: str) -> None:
        atomic_write_json(self.lease_path, {"pid": os.getpid(), "host": host, "epoch": epoch,
                                            "renewed": time.time()})

    def read_lease(self) -> dict[str, Any] | None:
        """The lease as written ({pid, host, epoch, renewed}), None when there is none or it is
        unreadable (the watchdog's start-up grace applies to both alike)."""
        try:
            lease = read_json(self.lease_path, max_bytes=MAX_LEASE_BYTES, what="lease", error=ConfigError)
        except (FileNotFoundError, ConfigError):
            return None
        return lease if isinstance(lease, dict) else None

    def lease_age_s(self, now: float | None = None) -> float | None:
        """Seconds since the lease was renewed (wall clock: the watchdog runs on another host,
        so monotonic clocks are not comparable), or None when there is no lease."""
        renewed = (self.read_lease() or {}).get("renewed")
        if not isinstance(renewed, (int, float)) or not _number(renewed):
            return None
        return (time.time() if now is None else now) - float(renewed)


class _StateError(ConfigError):
    """safe_io's refusal of state.json, wrapped into load_state's one line."""


def read_secret(path: str | os.PathLike[str], *, named_by: str | None = None) -> bytes:
    """The per-job HMAC key: the hex text of a 0600 regular file, at least 64 hex characters
    (an empty or short key would make every frame forgeable). `named_by` is the variable that
    gave the path (CKPTSUP_SECRET_FILE), for the message. Every problem is one ConfigError line."""
    what = "secret file" + (f" ({named_by})" if named_by else "")
    fix = "it is written by `ckptsup launch` in the run directory; start the job through ckptsup launch"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; {fix}") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} is readable by others; run `chmod 600 {path}`")
    try:
        data = read_regular(path, max_bytes=MAX_SECRET_BYTES, what=what, error=ConfigError).strip()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; {fix}") from None
    if len(data) < SECRET_HEX_CHARS or not _HEX.fullmatch(data):
        found = "is empty" if not data else (f"holds {len(data)} characters" if _HEX.fullmatch(data)
                                               else f"holds {len(data)} bytes, not all hex")
        raise ConfigError(f"{what} {path} {found}: a ckptsup secret is at least {SECRET_HEX_CHARS} hex characters; "
                          "remove it and relaunch through ckptsup launch, which writes a new one")
    return data


def read_epoch(run_dir: str | os.PathLike[str]) -> int:
    """Current fencing epoch of a run (0 when no state yet). The checkpoint commit refuses a
    manifest whose epoch is older (a zombie attempt)."""
    return RunDir(path=Path(run_dir)).load_state().epoch
