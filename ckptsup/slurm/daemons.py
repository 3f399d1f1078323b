"""A daemon the dev cluster started, identified by PID *and* start time (a reused PID is never
mistaken for ours), and reaping of our own exited children."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True, kw_only=True)
class Daemon:
    name: str
    pid: int
    create_time: float

    def process(self) -> psutil.Process | None:
        """The live process, or None when it is gone (or the pid was reused)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 1.0:
                return None
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
