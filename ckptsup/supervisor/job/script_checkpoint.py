"""A script's own checkpoint file, protected ([supervisor] script_checkpoint; docs/drop-in.md
§The script's own checkpoint file). One `ScriptCheckpoints` per supervisor, made in its
constructor with what it uses.

While the job runs, a thread (nice 10 and the idle I/O class: script_keep's
`lower_priority`; off the training's path: the ranks never wait for it) sees each new version of every configured file once its writer closed it — inotify's close-write
on this host, and always also a stat every POLL_S (inotify does not see writes made on another
node of a shared file system): a version whose size and mtime held still for one poll is closed
too — and hands it to the file's `Keeper` (checkpoint/script_keep.py): copied, the copy checked
(checkpoint/script_file.py), kept when whole. The loop drains what the thread found at each
tick (`tick`): one `script_checkpoint_verified` event per kept version, with the step of the last
progress line.

Before every launch (`before_launch`; the first one of a supervisor too, e.g. after a requeue)
each file is checked again: a torn or corrupt one is moved aside and the newest verified copy put
back, or with none the run gives up in one line (or, with `script_checkpoint_on_corrupt =
"start-over"`, the file is moved aside and the script starts fresh). An attempt that starts with
every file whole gets `resume_args` appended to the script's arguments (`args`)."""

from __future__ import annotations

import ctypes
import enum
import errno
import fnmatch
import glob
import os
import re
import select
import shlex
import struct
import threading
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from ... import console
from ...checkpoint import script_file
from ...checkpoint.script_keep import KeepError, Keeper, Taken, lower_priority, move_aside
from ...config import Config
from ...errors import ConfigError
from ...events import Event

POLL_S = 1.0
CORRUPT_NAME = re.compile(r"\.corrupt-\d{8}-\d{6}(-\d+)?$")
IN_CLOSE_WRITE, IN_MOVED_TO = 0x8, 0x80
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
MAX_FILES = 1000       # files a glob may match that are watched


class Emit(Protocol):
    def __call__(self, name: Event, **fields: Any) -> None: ...


class OnCorrupt(str, enum.Enum):
    GIVE_UP = "give-up"
    START_OVER = "start-over"


class Inotify:
    """Close-write and moved-to events of a few directories, through libc (ctypes): the
    supervisor imports nothing for it. `fd` is None where the kernel or libc has none."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.dirs: dict[int, str] = {}       # watch descriptor -> directory
        self.watched: set[str] = set()
        try:
            self.libc = ctypes.CDLL(None, use_errno=True)
            fd = self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        except (OSError, AttributeError):
            return
        self.fd = fd if fd >= 0 else None

    def watch(self, directory: str) -> None:
        if self.fd is None or directory in self.watched or not os.path.isdir(directory):
            return
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_CLOSE_WRITE | IN_MOVED_TO)
        if wd >= 0:
            self.dirs[wd] = directory
            self.watched.add(directory)

    def wait(self, timeout: float) -> list[str]:
        """The paths closed after writing (or moved in) within `timeout` seconds."""
        if self.fd is None:
            return []
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self.fd, 64 << 10)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EINTR):
                return []
            raise
        out, at = [], 0
        while at + 16 <= len(data):
            wd, _mask, _cookie, length = struct.unpack_from("iIII", data, at)
            name = data[at + 16:at + 16 + length].rstrip(b"\x00")
            if wd in self.dirs and name:
                out.append(os.path.join(self.dirs[wd], os.fsdecode(name)))
            at += 16 + length
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ScriptCheckpoints:
    """The script's own checkpoint files: versions kept while it runs, checked before each launch."""

    def __init__(self, *, patterns: list[str], cwd: str, run_dir: Path, keep: int, on_corrupt: OnCorrupt,
                 resume_args: list[str], emit: Emit, poll_s: float = POLL_S, inotify: bool = True) -> None:
        self.patterns = [p if os.path.isabs(p) else os.path.normpath(p) for p in patterns]
        self.cwd, self.run_dir, self.keep = cwd, Path(run_dir), keep
        self.on_corrupt, self.resume_args, self.emit, self.poll_s = on_corrupt, list(resume_args), emit, poll_s
        self.use_inotify = inotify             # False: the stat poll alone (as for another node's writes)
        self.lock = threading.Lock()          # one take or pre-launch check at a time
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.results: deque[tuple[str, Taken | str]] = deque()   # the thread's findings, for `tick`
        self.step: int | None = None          # the last progress line's step (the loop's)
        self.resume = False                   # the coming attempt starts with every file whole
        self.seen: dict[str, tuple[int, int, int]] = {}    # path -> (inode, size, mtime_ns) at the last poll
        self.done: set[tuple[str, tuple[int, int, int]]] = set()   # versions already taken (or refused)
        self.warned: set[str] = set()
        self.keepers: dict[str, Keeper] = {}

    @classmethod
    def from_config(cls, config: Config, *, cwd: str, run_dir: Path, emit: Emit) -> "ScriptCheckpoints | None":
        sup = config.supervisor
        if not sup.script_checkpoint:
            if sup.resume_args:
                raise ConfigError("supervisor.resume_args (--resume-args) needs supervisor.script_checkpoint "
                                  "(--script-checkpoint PATH): the words are appended only when a verified "
                                  "checkpoint is in place; name the script's checkpoint file")
            return None
        return cls(patterns=list(sup.script_checkpoint), cwd=cwd, run_dir=run_dir, keep=sup.script_checkpoint_keep,
                   on_corrupt=OnCorrupt(sup.script_checkpoint_on_corrupt), resume_args=shlex.split(sup.resume_args),
                   emit=emit)

    # ---- which files ---------------------------------------------------------------------------
    def matched(self) -> list[str]:
        """The files the patterns name now (relative to the launch directory as written)."""
        found: list[str] = []
        for pattern in self.patterns:
            if glob.has_magic(pattern):
                names = sorted(glob.glob(pattern, root_dir=self.cwd))
            else:
                names = [pattern] if os.path.isfile(os.path.join(self.cwd, pattern)) else []
            for name in names:
                if name not in found and not CORRUPT_NAME.search(name) and \
                        os.path.isfile(os.path.join(self.cwd, name)):
                    found.append(name)
        return found[:MAX_FILES]

    def _is_ours(self, abspath: str) -> str | None:
        rel = os.path.relpath(abspath, self.cwd)
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(rel, os.path.normpath(pattern)) or \
                    fnmatch.fnmatchcase(abspath, os.path.join(self.cwd, pattern)):
                return rel if not os.path.isabs(pattern) else abspath
        return None

    def _keeper(self, rel: str) -> Keeper:
        if rel not in self.keepers:
            self.keepers[rel] = Keeper(run_dir=self.run_dir, target=Path(self.cwd, rel), path=rel, keep=self.keep)
        return self.keepers[rel]

    # ---- the loop's calls ------------------------------------------------------------------------
    def tick(self, *, step: int | None) -> None:
        """The last progress step; one event per version the thread kept since the last tick."""
        if step is not None:
            self.step = step
        while self.results:
            rel, taken = self.results.popleft()
            if isinstance(taken, str):
                if rel not in self.warned:
                    self.warned.add(rel)
                    console.warning(f"ckptsup: {taken}")
                continue
            self._verified(rel, taken)

    def _verified(self, rel: str, taken: Taken) -> None:
        version, verdict = taken.version, taken.verdict
        if version is None or verdict is None:
            return
        self.emit(Event.SCRIPT_CHECKPOINT_VERIFIED, path=rel, bytes=verdict.bytes, seconds=round(verdict.seconds, 4),
                  step=version.step, kind=verdict.kind.value, version=version.name, kept=True)

    def args(self, script_args: list[str]) -> list[str]:
        """The script's arguments for the coming attempt: resume_args added when it resumes."""
        return [*script_args, *self.resume_args] if self.resume else list(script_args)

    def before_launch(self) -> str | None:
        """Check every file; put back, move aside, or say why the run must give up (the reason)."""
        self.tick(step=None)
        with self.lock:
            files = self.matched()
            resume = bool(files)
            for rel in files:
                outcome = self._check_one(rel)
                if isinstance(outcome, str):
                    return outcome
                resume = resume and outcome
            self.resume = resume
        self.tick(step=None)
        if self.resume and self.resume_args:
            console.info(f"ckptsup: the script resumes from {', '.join(files)} (verified): "
                         f"{len(self.resume_args)} resume argument(s) added")
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="script-checkpoint", daemon=True)
            self.thread.start()
        return None

    def _check_one(self, rel: str) -> bool | str:
        """True: whole (or put back); False: moved aside to start over; a str: the give-up reason."""
        keeper = self._keeper(rel)
        target = keeper.target
        verdict = script_file.check(target)
        if verdict.ok:
            st = os.stat(target)
            if keeper.holds(st.st_size, st.st_mtime_ns) is None:
                self._take(rel, (st.st_ino, st.st_size, st.st_mtime_ns), locked=True)
            return True
        problem = verdict.problem
        for version in keeper.versions():
            if not script_file.check(version.data).ok:
                continue
            aside = keeper.restore(version)
            st = os.stat(target)
            self.done.add((rel, (st.st_ino, st.st_size, st.st_mtime_ns)))
            self.emit(Event.SCRIPT_CHECKPOINT_RESTORED, path=rel, reason=problem[:400],
                      moved_to=aside.name if aside else "", version=version.name, step=version.step,
                      bytes=version.bytes)
            when = datetime.fromtimestamp(version.verified, timezone.utc).strftime("%H:%M:%S UTC")
            at = f"step {version.step}" if version.step is not None else when
            console.warning(f"ckptsup: {rel} is corrupt ({problem[:200]}): moved aside to "
                            f"{aside.name if aside else '(nothing)'}; put back the version verified at {at} "
                            f"({version.bytes} bytes)")
            return True
        kept = "none was verified in this run" if not keeper.versions() else "no kept copy checks whole either"
        if self.on_corrupt is OnCorrupt.START_OVER:
            aside = move_aside(target)
            self.emit(Event.SCRIPT_CHECKPOINT_REJECTED, path=rel, reason=problem[:400], moved_to=aside.name,
                      outcome="start_over")
            console.warning(f"ckptsup: {rel} is corrupt ({problem[:200]}) and {kept}: moved aside to {aside.name}; "
                            "the script starts over (script_checkpoint_on_corrupt = \"start-over\")")
            return False
        self.emit(Event.SCRIPT_CHECKPOINT_REJECTED, path=rel, reason=problem[:400], moved_to="", outcome="give_up")
        return (f"the script's checkpoint {rel} is corrupt ({problem[:200]}) and {kept}; restore or remove it, "
                "or set [supervisor] script_checkpoint_on_corrupt = \"start-over\" to start the script afresh")

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    # ---- the thread ------------------------------------------------------------------------------
    def _take(self, rel: str, ident: tuple[int, int, int], *, locked: bool = False) -> None:
        key = (rel, ident)
        if key in self.done:
            return
        if not locked:
            self.lock.acquire()
        try:
            if key in self.done:
                return
            self.done.add(key)
            keeper = self._keeper(rel)
            if keeper.holds(ident[1], ident[2]) is not None:
                return
            try:
                taken = keeper.take(step=self.step)
            except KeepError as err:
                self.results.append((rel, str(err)))
                return
            if taken.changed:
                self.done.discard(key)   # rewritten while copied: its close comes later
            self.results.append((rel, taken))
        finally:
            if not locked:
                self.lock.release()

    def _watch(self) -> None:
        lower_priority()   # this thread only: nice 10, idle I/O
        notify = Inotify()
        if not self.use_inotify:
            notify.close()
        try:
            while not self.stop.is_set():
                for pattern in self.patterns:
                    parent = os.path.dirname(os.path.join(self.cwd, pattern)) or self.cwd
                    for directory in (glob.glob(parent) if glob.has_magic(parent) else [parent]):
                        notify.watch(directory)
                closed = set()
                if notify.fd is not None:
                    for path in notify.wait(self.poll_s):
                        rel = self._is_ours(path)
                        if rel is not None:
                            closed.add(rel)
                elif self.stop.wait(self.poll_s):
                    break
                self._poll(closed)
        except Exception as err:   # the keeper must never take the supervisor down
            console.warning(f"ckptsup: the script checkpoint watcher stopped: {err}; the files are still checked "
                            "before each launch")
        finally:
            notify.close()

    def _poll(self, closed: set[str]) -> None:
        for rel in self.matched():
            try:
                st = os.stat(os.path.join(self.cwd, rel))
            except OSError:
                continue
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            before, self.seen[rel] = self.seen.get(rel), ident
            if rel in closed or before == ident:
                self._take(rel, ident)
            if self.stop.is_set():
                return

