"""A daemon the dev cluster started, identified by PID *and* start time (a reused PID is never
mistaken for ours), and reaping of our own exited children."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22). Unlike
    psutil's create_time (boot time + this, where the boot time is re-read from /proc/stat and moves
    with every wall-clock adjustment: seen drifting > 1 s within an hour on a CI machine), it never
    changes for the life of the process. Raises psutil.NoSuchProcess when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    return int(stat[stat.rindex(b")") + 2:].split()[19])   # the fields after "pid (comm)" start at 3


@dataclass(frozen=True, kw_only=True)
class Daemon:
    name: str
    pid: int
    start_ticks: int

    def process(self) -> psutil.Process | None:
        """The live process, or None when it is gone (or the pid was reused)."""
        try:
            if start_ticks(self.pid) != self.start_ticks:
                return None
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                reap(self.pid)
                return None
            return proc
        except psutil.NoSuchProcess:
            return None


def reap(pid: int) -> None:
    """Collect our own exited child (a no-op for processes another `up` started)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
