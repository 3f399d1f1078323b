"""The verified versions of a script's own checkpoint file, kept in the run directory
(docs/drop-in.md §The script's own checkpoint file). Torch-free.

    <run_dir>/script-checkpoints/<quoted path>/    0700, one folder per file
        v<N>.data<suffix>   0600: a version, copied (a reflink where the file system has them), then checked
        v<N>.meta.json      0600: {path, bytes, step, mtime_ns, verified, seconds, kind}, written after it

A version is taken by copying the file, then checking the copy (checkpoint/script_file.py): the
copy cannot change under the check, and a file rewritten while it was copied (its size or mtime
moved) is not kept. At most `keep` versions per file: the oldest go. A copy without its .json is
a take that did not finish, removed when seen. Putting one back (`restore`) copies it beside the
file under a temporary name, fsyncs it, gives it the original's mtime, moves the corrupt file
aside as `NAME.corrupt-<time>` (never deleted) and renames the copy over the name.

The supervisor's thread that takes versions runs at `lower_priority()`: nice 10 and the idle I/O
class (not SCHED_IDLE: a supervisor thread starved while it holds the GIL would stall the loop). A copy
starts the write-back of each chunk as it goes (sync_file_range) and waits for the one before,
so the dirty pages stay bounded and the disk sees a steady stream, then fsyncs the whole before
the copy is checked; a version checked (and a copy not kept) gives its page cache back
(POSIX_FADV_DONTNEED)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import platform
import secrets
import threading
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import CheckpointError
from ..safe_io import read_json
from . import script_file
from .durable import fsync_dir, rename_noreplace
from .trust import TrustError, private_mkdir

KEEP_DIR = "script-checkpoints"
FICLONE = 0x40049409          # linux/fs.h: _IOW(0x94, 9, int)
COPY_CHUNK = 64 << 20
MAX_META_BYTES = 64 << 10
TMP_PREFIX = ".tmp-"
META = ".meta.json"
NICE = 10                     # the keeper thread's (lower_priority)
IOPRIO_SET = {"x86_64": 251, "aarch64": 30}   # the ioprio_set syscall's number
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


class KeepError(CheckpointError):
    """The run dir's copies cannot be written or read; one line."""


@dataclass(frozen=True, kw_only=True)
class Version:
    seq: int
    data: Path              # the kept copy
    path: str               # the file it is a version of, as configured (relative to the launch directory)
    bytes: int
    step: int | None
    mtime_ns: int           # the original's
    verified: float         # wall clock of the check
    seconds: float          # the check's
    kind: str

    @property
    def name(self) -> str:
        return self.data.name

    def row(self) -> dict[str, object]:
        return {"path": self.path, "version": self.name, "bytes": self.bytes, "step": self.step,
                "verified": datetime.fromtimestamp(self.verified, timezone.utc).isoformat(timespec="seconds"),
                "check_s": round(self.seconds, 4), "kind": self.kind}


@dataclass(frozen=True, kw_only=True)
class Taken:
    """What `take` did: `version` set when kept; else `verdict` says why not, or `changed`."""

    verdict: script_file.Verdict | None
    version: Version | None = None
    changed: bool = False    # the file was rewritten while it was copied: not a version


def keep_root(run_dir: Path) -> Path:
    return Path(run_dir) / KEEP_DIR


def folder_for(run_dir: Path, path: str) -> Path:
    return keep_root(run_dir) / urllib.parse.quote(path, safe="")


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def lower_priority() -> list[str]:
    """Put the calling thread (only it, and the threads it starts after) where it takes as little
    as it can from the training: nice NICE and the idle I/O class. What took, e.g. ["nice 10",
    "idle I/O"]; what the system refuses is skipped. Not SCHED_IDLE: the keeper is a thread of the
    supervisor, and one that never gets a core on a busy batch host while it holds the GIL would
    stall the supervisor's loop (its lease, its detection) with it."""
    tid, done = threading.get_native_id(), []
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)   # a thread's id: this thread only (Linux)
        done.append(f"nice {NICE}")
    except OSError:
        pass
    libc, nr = _libc(), IOPRIO_SET.get(platform.machine())
    if libc is not None and nr is not None:
        value = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT
        if libc.syscall(ctypes.c_long(nr), ctypes.c_int(IOPRIO_WHO_PROCESS), ctypes.c_int(tid),
                        ctypes.c_int(value)) == 0:
            done.append("idle I/O")
    return done


def _write_back(fd: int, offset: int, length: int, flags: int) -> None:
    """sync_file_range where the C library has it; nothing else (the fsync after is what counts)."""
    libc = _libc()
    fn = getattr(libc, "sync_file_range", None) if libc is not None else None
    if fn is None or length <= 0:
        return
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn(fd, offset, length, flags)


def drop_cache(fd: int) -> None:
    """Give the file's (clean) page cache back: it is not read again soon."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def copy_file(src_fd: int, dst_fd: int, size: int) -> str:
    """The bytes of `src_fd` into the empty `dst_fd`: a reflink where the file system has them
    (FICLONE), else copy_file_range, else read/write, each chunk's write-back started as it is
    written and the one before waited for (the caller still fsyncs). Returns how ("reflink" or
    "copy")."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return "reflink"
    except OSError:
        pass
    done, flushed = 0, 0
    use_range = hasattr(os, "copy_file_range")
    while done < size:
        n = 0
        if use_range:
            try:
                n = os.copy_file_range(src_fd, dst_fd, min(COPY_CHUNK, size - done), done, done)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                use_range = False
                continue
        else:
            chunk = os.pread(src_fd, min(COPY_CHUNK, size - done), done)
            n = len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(dst_fd, view, done + n - len(view)):]
        if n <= 0:
            break
        _write_back(dst_fd, done, n, SYNC_FILE_RANGE_WRITE)
        if done > flushed:   # the chunk before: written out by now, mostly
            _write_back(dst_fd, flushed, done - flushed,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)
            flushed = done
        done += n
    return "copy"


def _corrupt_name(target: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    aside = target.with_name(f"{target.name}.corrupt-{stamp}")
    n = 1
    while aside.exists() or aside.is_symlink():
        aside = target.with_name(f"{target.name}.corrupt-{stamp}-{n}")
        n += 1
    return aside


def move_aside(target: Path) -> Path:
    """Rename `target` to `NAME.corrupt-<time>` beside it (never over anything); the new path."""
    aside = _corrupt_name(target)
    rename_noreplace(target, aside)
    fsync_dir(target.parent)
    return aside


class Keeper:
    """The kept versions of one file. `target` is its absolute path, `path` as configured."""

    def __init__(self, *, run_dir: Path, target: Path, path: str, keep: int) -> None:
        self.run_dir, self.target, self.path, self.keep = Path(run_dir), Path(target), path, keep
        self.dir = folder_for(self.run_dir, path)
        list_versions(self.dir, clean=True)   # leftovers of a take a previous supervisor did not finish

    def _ensure_dir(self) -> Path:
        try:
            private_mkdir(keep_root(self.run_dir))
            return private_mkdir(self.dir)
        except TrustError as err:
            raise KeepError(str(err)) from None

    def versions(self) -> list[Version]:
        """The kept versions, newest first."""
        return list_versions(self.dir)

    def holds(self, size: int, mtime_ns: int) -> Version | None:
        """The kept version of the file as it is now (same size and mtime), if any."""
        return next((v for v in self.versions() if v.bytes == size and v.mtime_ns == mtime_ns), None)

    def take(self, *, step: int | None) -> Taken:
        """Copy the file, check the copy, keep it when whole (and prune to `keep`)."""
        folder = self._ensure_dir()
        tmp = folder / f"{TMP_PREFIX}{secrets.token_hex(6)}{''.join(self.target.suffixes[-1:])}"
        try:
            src = os.open(self.target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return Taken(verdict=None, changed=True)
        try:
            before = os.fstat(src)
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                copy_file(src, dst, before.st_size)
                os.fsync(dst)
                copied = os.fstat(dst).st_size
            finally:
                os.close(dst)
            after = os.fstat(src)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise KeepError(f"cannot copy {self.path} into {folder}: {err.strerror or err}; free space there "
                            "or lower [supervisor] script_checkpoint_keep") from None
        finally:
            os.close(src)
        ident = (before.st_size, before.st_mtime_ns, before.st_ino)
        if ident != (after.st_size, after.st_mtime_ns, after.st_ino) or copied != before.st_size:
            tmp.unlink(missing_ok=True)
            return Taken(verdict=None, changed=True)
        verdict = script_file.check(tmp, threads=1)   # one thread: no hurry, and the training's CPUs
        _drop_cache_of(tmp)
        if not verdict.ok:
            tmp.unlink(missing_ok=True)
            return Taken(verdict=verdict)
        kept = self.versions()
        seq = (kept[0].seq + 1) if kept else 1
        data = folder / f"v{seq:08d}.data{''.join(self.target.suffixes[-1:])}"
        os.rename(tmp, data)
        meta = {"path": self.path, "bytes": verdict.bytes, "step": step, "mtime_ns": before.st_mtime_ns,
                "verified": time.time(), "seconds": round(verdict.seconds, 6), "kind": verdict.kind.value}
        _write_json(folder / f"v{seq:08d}{META}", meta)
        version = _version(folder / f"v{seq:08d}{META}", data)
        for old in self.versions()[self.keep:]:
            old.data.unlink(missing_ok=True)
            (folder / f"v{old.seq:08d}{META}").unlink(missing_ok=True)
        return Taken(verdict=verdict, version=version)

    def restore(self, version: Version) -> Path | None:
        """Put `version` back as the file, atomically; the corrupt file moved aside first (its
        new path), or None when there was none."""
        parent = self.target.parent
        tmp = parent / f".{self.target.name}.ckptsup-restore-{secrets.token_hex(4)}"
        try:
            src = os.open(version.data, os.O_RDONLY | os.O_CLOEXEC)
            try:
                dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    copy_file(src, dst, os.fstat(src).st_size)
                    os.fsync(dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            if self.target.exists():   # the file's own mode (the copies are 0600)
                os.chmod(tmp, os.stat(self.target).st_mode & 0o777)
            os.utime(tmp, ns=(version.mtime_ns, version.mtime_ns))
            aside = move_aside(self.target) if (self.target.exists() or self.target.is_symlink()) else None
            os.replace(tmp, self.target)
            fsync_dir(parent)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise KeepError(f"cannot put {version.name} back as {self.path}: {err.strerror or err}; "
                            f"copy {version.data} there by hand") from None
        return aside


def _drop_cache_of(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        drop_cache(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, payload: dict[str, object]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(payload, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _version(meta_path: Path, data: Path) -> Version | None:
    try:
        meta = read_json(meta_path, max_bytes=MAX_META_BYTES, what="script checkpoint version", error=KeepError)
    except (KeepError, FileNotFoundError):
        return None
    if not isinstance(meta, dict):
        return None
    try:
        step = meta.get("step")
        return Version(seq=int(meta_path.name.split(".", 1)[0][1:]), data=data, path=str(meta["path"]), bytes=int(meta["bytes"]),
                       step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                       mtime_ns=int(meta["mtime_ns"]), verified=float(meta["verified"]),
                       seconds=float(meta["seconds"]), kind=str(meta["kind"]))
    except (KeyError, TypeError, ValueError):
        return None


def list_versions(folder: Path, *, clean: bool = False) -> list[Version]:
    """The versions in one file's folder, newest first (a reader: `clean` removes leftovers)."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    metas = {n.split(".", 1)[0]: n for n in names if n.endswith(META)}
    out = []
    for name in names:
        stem, _, rest = name.partition(".")
        if name.startswith(TMP_PREFIX):
            if clean:
                (folder / name).unlink(missing_ok=True)
            continue
        if not (rest.startswith("data") and stem.startswith("v") and stem[1:].isdigit()):
            continue
        version = _version(folder / metas[stem], folder / name) if stem in metas else None
        if version is None:
            if clean:
                (folder / name).unlink(missing_ok=True)
            continue
        out.append(version)
    return sorted(out, key=lambda v: v.seq, reverse=True)


def all_versions(run_dir: Path) -> list[Version]:
    """Every kept version of every script checkpoint file of a run, newest first per file."""
    root = keep_root(run_dir)
    try:
        folders = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [v for name in folders for v in list_versions(root / name)]
