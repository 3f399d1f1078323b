"""The run directory: one per job, on the shared file system, surviving requeues
(docs/contracts.md §Run directory).

    <run_dir>/            0700
      events.jsonl        the restart log (events.py)
      state.json          attempt, fencing epoch, excluded nodes, measured costs (atomic writes)
      lease               the supervisor's lease: JSON {pid, host, epoch, renewed}, rewritten every
                          lease_interval_s; a watchdog on another node requeues when it goes stale
      secret              0600 per-job HMAC key (ranks/agent get its path, never its value)
      config.json         0600 effective config the supervisor resolved (config.write_config_json)
      checkpoints/        default checkpoint_dir
      attempt-<N>/        per-attempt agent and rank logs, flight-recorder dumps
"""

from __future__ import annotations

import enum
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

STATE_FILE = "state.json"
LEASE_FILE = "lease"
SECRET_FILE = "secret"
CONFIG_JSON = "config.json"


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
    supervisor) and RUNNING → REQUEUED (whoever requeues; the next supervisor sets RUNNING)."""

    RUNNING = "running"
    DONE = "done"          # training finished: never requeue
    GAVE_UP = "gave_up"    # policy gave up: never requeue
    STOPPED = "stopped"    # stopped for preemption / time limit; the requeue follows
    REQUEUED = "requeued"  # requeued in this epoch: no second requeuer


FINISHED = (RunStatus.DONE, RunStatus.GAVE_UP)


@dataclass(kw_only=True)
class RunState:
    """What survives between attempts and requeues. The run dir, not SLURM_RESTART_COUNT, is the
    source of truth."""

    attempt: int = 0                 # increments on every launch (fast path, node path, requeue)
    epoch: int = 0                   # fencing epoch; increments whenever a new supervisor or attempt takes over
    excluded_nodes: dict[str, str] = field(default_factory=dict)  # node -> reason
    restarts: int = 0                # restarts spent from the budget
    measured: dict[str, float] = field(default_factory=dict)      # e.g. stall_s, save_s, restart_s, step_p99_s
    status: RunStatus = RunStatus.RUNNING
    failures: list[dict[str, Any]] = field(default_factory=list)  # history for the policy (kind, step, node, rank)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunState":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "status" in known:
            try:
                known["status"] = RunStatus(known["status"])
            except ValueError:
                raise TypeError(f"unknown run status {known['status']!r}") from None
        return cls(**known)


@dataclass(kw_only=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> "RunDir":
        run_dir = cls(path=ensure_private_dir(Path(path)))
        if not run_dir.secret_path.exists():
            fd = os.open(run_dir.secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_hex(32).encode())
            finally:
                os.close(fd)
        return run_dir

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
        try:
            return RunState.from_json(json.loads(self.state_path.read_text()))
        except FileNotFoundError:
            return RunState()
        except (json.JSONDecodeError, TypeError) as err:
            raise ConfigError(f"{self.state_path} is corrupt ({err}); move it aside to start the run's state afresh") from None

    def save_state(self, state: RunState) -> None:
        atomic_write_json(self.state_path, asdict(state))

    def renew_lease(self, *, epoch: int, host: str) -> None:
        atomic_write_json(self.lease_path, {"pid": os.getpid(), "host": host, "epoch": epoch,
                                            "renewed": time.time()})

    def lease_age_s(self, now: float | None = None) -> float | None:
        """Seconds since the lease was renewed (wall clock: the watchdog runs on another host,
        so monotonic clocks are not comparable), or None when there is no lease."""
        try:
            renewed = float(json.loads(self.lease_path.read_text())["renewed"])
        except (FileNotFoundError, KeyError, ValueError, json.JSONDecodeError):
            return None
        return (time.time() if now is None else now) - renewed


def read_secret(path: str | os.PathLike[str]) -> bytes:
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ConfigError(f"secret file {path} is readable by others; run `chmod 600 {path}`")
    return Path(path).read_bytes().strip()


def read_epoch(run_dir: str | os.PathLike[str]) -> int:
    """Current fencing epoch of a run (0 when no state yet). The checkpoint commit refuses a
    manifest whose epoch is older (a zombie attempt)."""
    return RunDir(path=Path(run_dir)).load_state().epoch
