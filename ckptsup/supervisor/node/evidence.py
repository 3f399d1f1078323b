"""What the node agent can see of its ranks without stopping them (docs/timeouts.md §Evidence):
CPU time and I/O from /proc, the process state, and on request every thread's Python stack.

A rank is its whole process tree: its DataLoader workers and any subprocess the script starts
work for it, so their CPU time and I/O are the rank's (a data stall computed or read in the
workers showed as an idle rank and was killed as a hang). Children already reaped count through
the rank's cutime/cstime and its /proc/PID/io (the kernel adds a reaped child's I/O to its
parent's), and each total is kept monotonic per process, so a worker exiting between two reads
never looks like a restart.

The agent is every rank's ancestor, so /proc/PID/io, /proc/PID/syscall and the stack dump signal
are allowed even under kernel.yama.ptrace_scope = 1. Cheap: per heartbeat, a stat, an io and a
children read per process of the tree (the children of the threads that ever forked are re-found
every RESCAN_S); a stack collection only when the supervisor suspects a hang.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ...stack_dump import STACK_SIGNAL
from ..processes import where

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DUMP_POLL_S = 0.5         # the agent's wait for the dumps (faulthandler writes at once; a process in D state or stopped never does)
STACK_MAX_BYTES = 16 << 10
RESCAN_S = 10.0           # every thread of a process is asked for its children this often (a subprocess started off the main thread)
MAX_DESCENDANTS = 256     # a tree walk's bound (a fork bomb costs the agent no more than this)


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """One heartbeat's reading of one rank: its process and every descendant."""

    cpu_s: float       # utime + stime of every thread of the tree, reaped children included
    io_bytes: int      # rchar + wchar (sockets and pipes count: a rank reading a file shows here)
    state: str         # the rank process's: R, S, D, T, t, Z, ...
    children: int = 0          # descendants alive (DataLoader workers, subprocesses)
    children_cpu_s: float = 0.0   # their share of cpu_s (the living ones')

    def to_wire(self) -> list[float | int | str]:
        return [round(self.cpu_s, 3), self.io_bytes, self.state, self.children, round(self.children_cpu_s, 3)]


@dataclass(frozen=True)
class _Stat:
    state: str
    own_s: float        # utime + stime
    reaped_s: float     # cutime + cstime: children it waited for


def _read(path: str, cap: int) -> bytes:
    """One small /proc file: a bare open and read (a buffered file object costs as much again)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, cap)
    finally:
        os.close(fd)


def _stat(pid: int) -> _Stat | None:
    try:
        stat = _read(f"/proc/{pid}/stat", 4096).decode(errors="replace")
        # the command may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        return _Stat(fields[0], (int(fields[11]) + int(fields[12])) / _TICK,
                     (int(fields[13]) + int(fields[14])) / _TICK)
    except (OSError, ValueError, IndexError):
        return None


def _io(pid: int) -> int:
    io = 0
    try:
        # rchar and wchar are the first two lines
        for line in _read(f"/proc/{pid}/io", 4096).split(b"\n", 2)[:2]:
            key, _, value = line.partition(b":")
            if key in (b"rchar", b"wchar"):
                io += int(value)
    except (OSError, ValueError):
        pass   # another user's process without CAP_SYS_PTRACE: CPU and state still tell
    return io


def _children_of(pid: int, tid: int) -> list[int]:
    try:
        return [int(c) for c in _read(f"/proc/{pid}/task/{tid}/children", 65536).split()]
    except (OSError, ValueError):
        return []


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []


@dataclass(kw_only=True)
class _Parents:
    """The threads of one process that had children at the last rescan (the main thread always)."""

    tids: set[int] = field(default_factory=set)
    scanned: float = -RESCAN_S


@dataclass(kw_only=True)
class TreeSampler:
    """Samples ranks as whole process trees, cheaply: the main thread's children every time, every
    other thread's only if it had any at the last rescan. One per agent; the per-pid memory (the
    monotonic floor, the rescans) is forgotten with the process."""

    clock: Callable[[], float] = time.monotonic
    parents: dict[int, _Parents] = field(default_factory=dict)
    floor: dict[int, tuple[float, int]] = field(default_factory=dict)   # rank pid -> highest (cpu_s, io) sent
    visited: set[int] = field(default_factory=set)   # every process walked since the last forget_except

    def descendants(self, pid: int) -> list[int]:
        now = self.clock()
        out: list[int] = []
        todo, seen = [pid], {pid}
        while todo and len(out) < MAX_DESCENDANTS:
            proc = todo.pop()
            self.visited.add(proc)
            known = self.parents.setdefault(proc, _Parents())
            if now - known.scanned >= RESCAN_S:
                known.scanned = now
                known.tids = {tid for tid in _threads(proc) if tid == proc or _children_of(proc, tid)}
            for tid in known.tids | {proc}:
                for child in _children_of(proc, tid):
                    if child not in seen:
                        seen.add(child)
                        out.append(child)
                        todo.append(child)
        return out[:MAX_DESCENDANTS]

    def sample(self, pid: int) -> RankSample | None:
        root = _stat(pid)
        if root is None:
            return None
        cpu, io = root.own_s + root.reaped_s, _io(pid)
        children, children_cpu = 0, 0.0
        for child in self.descendants(pid):
            got = _stat(child)
            if got is None:
                continue    # gone between the two reads: its parent's cutime has it, or soon will
            children += got.state != "Z"
            children_cpu += got.own_s + got.reaped_s
            io += _io(child)
        cpu += children_cpu
        last_cpu, last_io = self.floor.get(pid, (0.0, 0))
        cpu, io = max(cpu, last_cpu), max(io, last_io)   # a worker reaped between two reads is counted again soon
        self.floor[pid] = (cpu, io)
        return RankSample(cpu_s=cpu, io_bytes=io, state=root.state, children=children, children_cpu_s=children_cpu)

    def forget_except(self, ranks: set[int]) -> None:
        """Drop what is kept of processes that are neither these rank processes nor walked since
        the last call (exited workers, the ranks of an attempt that ended)."""
        for pid in [p for p in self.floor if p not in ranks]:
            del self.floor[pid]
        keep = ranks | self.visited
        for pid in [p for p in self.parents if p not in keep]:
            del self.parents[pid]
        self.visited = set()

    def blocked(self, pid: int) -> list[dict[str, object]]:
        """Each live descendant of the rank: pid, state and where it waits (a system call's name
        where /proc/PID/syscall says, else the kernel wait channel), for a data wait's detail."""
        out: list[dict[str, object]] = []
        for child in self.descendants(pid)[:16]:
            got = _stat(child)
            if got is None or got.state == "Z":
                continue
            out.append({"pid": child, "state": got.state, "in": waiting_in(child)})
        return out


def sample(pid: int) -> RankSample | None:
    """One process alone (no tree, no memory): a stand-alone reading."""
    root = _stat(pid)
    if root is None:
        return None
    return RankSample(cpu_s=root.own_s, io_bytes=_io(pid), state=root.state)


# the system calls a blocked worker is found in, by number (/proc/PID/syscall's first field)
_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 17: "pread64", 19: "readv", 23: "select", 35: "nanosleep",
               43: "accept", 45: "recvfrom", 47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep",
               232: "epoll_wait", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4", 257: "openat"},
    "aarch64": {63: "read", 64: "write", 65: "readv", 67: "pread64", 72: "pselect6", 73: "ppoll", 98: "futex",
                101: "nanosleep", 115: "clock_nanosleep", 22: "epoll_pwait", 202: "accept", 207: "recvfrom",
                212: "recvmsg", 242: "accept4", 260: "wait4", 56: "openat"},
}.get(platform.machine(), {})


def waiting_in(pid: int) -> str:
    """'read()' for a process blocked in a read system call; else its kernel wait channel; '' when
    it runs (or nothing is readable)."""
    try:
        with open(f"/proc/{pid}/syscall", "rb") as fh:
            first = fh.read(256).split(maxsplit=1)[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        first = ""
    if first.isdigit() and int(first) in _SYSCALLS:
        return f"{_SYSCALLS[int(first)]}()"
    if first == "running":
        return ""
    return where(pid).get("wchan", "")


def catches(pid: int, signum: int = STACK_SIGNAL) -> bool:
    """Whether `pid` has a handler for `signum` (SigCgt): only then is it safe to send."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh.read(8192).decode(errors="replace").splitlines():
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def take_stacks(rank_pids: Mapping[int, int], files: Mapping[int, Path], *,
                wait_s: float = DUMP_POLL_S) -> dict[int, str]:
    """Ask every rank that installed the dump (stack_dump.install) for its stacks; the new text of
    each one's file, by rank. Ranks without the handler, stopped or gone are left out."""
    asked: dict[int, int] = {}
    for rank, pid in rank_pids.items():
        path = files.get(rank)
        if path is None or not catches(pid):
            continue
        try:
            before = path.stat().st_size
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        asked[rank] = before
    got: dict[int, str] = {}
    sizes = dict(asked)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank, before in list(asked.items()):
            size = _size(files[rank])
            if size > before and size == sizes[rank]:   # grown, then still for one poll: the dump is whole
                got[rank] = _new_text(files[rank], before)
                del asked[rank]
            sizes[rank] = size
    for rank, before in asked.items():   # a late or partial dump: what is there
        if text := _new_text(files[rank], before):
            got[rank] = text
    return got


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_text(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(STACK_MAX_BYTES).decode(errors="replace")
    except OSError:
        return ""
