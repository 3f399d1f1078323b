"""One writer per checkpoint_dir: `<dir>/.writer.lock`, created O_EXCL, holding pid, host,
fencing epoch and job id. A second live writer is refused up front; a newer epoch or a dead
writer on the same host is taken over (the pure rule is `may_take_over`)."""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointError, CkptsupError
from ..safe_io import read_json
from .durable import write_file_durable
from .trust import private_mkdir

LOCK_NAME = ".writer.lock"
MAX_LOCK_BYTES = 64 << 10   # {pid, host, epoch, job_id, token}


class WriterLockedError(CheckpointError):
    """Another live writer holds the checkpoint directory."""


@dataclass(kw_only=True)
class LockHolder:
    pid: int
    host: str
    epoch: int
    job_id: str = ""
    token: str = ""


def pid_alive(pid: int) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False  # 0 and negatives name process groups in kill(2), not one process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def may_take_over(holder: LockHolder, me: LockHolder, *, host: str, holder_alive: bool) -> bool:
    """Pure rule: a newer fencing epoch always takes over (the older attempt is a zombie); the
    same host may take a lock whose process is gone; otherwise the lock stands."""
    if me.epoch > holder.epoch:
        return True
    if holder.host == host and not holder_alive:
        return True
    return False


class WriterLock:
    """One writer per checkpoint_dir: `<dir>/.writer.lock`, created O_EXCL, holding pid, host,
    epoch and job id. Acquire at attach; release at close."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], *, epoch: int, job_id: str = "") -> None:
        self.path = Path(checkpoint_dir) / LOCK_NAME
        self.me = LockHolder(pid=os.getpid(), host=socket.gethostname(), epoch=epoch, job_id=job_id,
                             token=str(uuid.uuid4()))
        self.held = False

    def acquire(self) -> "WriterLock":
        """Take the lock or raise WriterLockedError. Taking over a stale lock is unlink + O_EXCL
        create, which two racing takers could both pass; that window is narrowed by re-reading
        the holder before the unlink, and closed where it matters by commit(): whole-directory
        no-replace renames and the checkpoint_id check never let two writers' shards mix."""
        private_mkdir(self.path.parent)
        for _ in range(3):
            try:
                write_file_durable(self.path, json.dumps(asdict(self.me)).encode())
                self.held = True
                return self
            except FileExistsError:
                holder = read_lock(self.path)
                if holder is None:
                    continue  # released between our create and read
                if not may_take_over(holder, self.me, host=self.me.host,
                                     holder_alive=holder.host == self.me.host and pid_alive(holder.pid)):
                    raise WriterLockedError(
                        f"{self.path.parent} is being written by pid {holder.pid} on {holder.host} (job {holder.job_id or '?'}, epoch {holder.epoch}); "
                        f"two writers would mix checkpoints. Use another checkpoint dir, or if that writer is dead remove {self.path}") from None
                if read_lock(self.path) == holder:   # still the stale holder we judged
                    self.path.unlink(missing_ok=True)
        raise WriterLockedError(f"could not take {self.path}: it keeps changing; another writer is racing for this directory")

    def still_ours(self) -> bool:
        holder = read_lock(self.path)
        return holder is not None and holder.token == self.me.token

    def release(self) -> None:
        if self.held and self.still_ours():
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lock(path: Path) -> LockHolder | None:
    unknown = LockHolder(pid=-1, host="<unreadable lock>", epoch=0)
    try:
        data = read_json(path, max_bytes=MAX_LOCK_BYTES, what="writer lock", error=CheckpointError, follow_symlinks=False)
        holder = LockHolder(**{k: data[k] for k in ("pid", "host", "epoch", "job_id", "token") if k in data})
    except FileNotFoundError:
        return None
    except (CkptsupError, ValueError, TypeError, KeyError, OSError):
        # A torn, foreign or unreadable lock file: held by an unknown writer of epoch 0 elsewhere.
        return unknown
    typed = (isinstance(holder.pid, int) and isinstance(holder.epoch, int) and isinstance(holder.host, str)
             and isinstance(holder.job_id, str) and isinstance(holder.token, str))
    return holder if typed else unknown
