"""Children the agent adopts: processes its zygote (rankside/zygote.py) forked twice, which the
kernel reparents to the agent because the agent is a child subreaper (PR_SET_CHILD_SUBREAPER).
The agent waits on them as on a Popen (`ForkedChild`). Being a subreaper, it also inherits the
orphans of its descendants (a killed torchrun's workers, a dead rank's DataLoader workers):
`reap_orphans` collects their exit so that no zombie outlives them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from typing import IO, Iterable

import psutil

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def become_subreaper() -> bool:
    """Orphaned descendants (the zygote's grandchildren first of all) become our children.
    False where the kernel refuses (not Linux, or older than 3.4)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    try:
        flag = ctypes.c_int(0)
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 1
    except (OSError, AttributeError):
        return False


class ForkedChild:
    """A process the zygote forked and the kernel made our child: waited on, signalled and read
    like a subprocess.Popen (the parts the agent uses)."""

    def __init__(self, pid: int, *, stdout: IO[bytes] | None = None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = _GONE_UNSEEN   # not (or no longer) ours: reaped elsewhere
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(9)


# An adopted child reaped by someone else (reap_orphans never does: it skips known pids) has no
# status left to read; the agent reports it as killed, the worst case, so nothing is taken for clean.
_GONE_UNSEEN = -9


def children() -> list[int]:
    """Our children's pids: /proc/self/task/*/children (cheap; Linux >= 4.2 or
    CONFIG_PROC_CHILDREN), else a scan of every process's parent."""
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children", "rb") as fh:
                pids.extend(int(pid) for pid in fh.read().split())
    except (OSError, ValueError):
        try:
            return [child.pid for child in psutil.Process().children()]
        except psutil.Error:
            return []
    return pids


def reap_orphans(known: Iterable[int]) -> list[int]:
    """Collect our exited children that no handle of ours owns (adopted orphans): their pids.
    Known children are left to their handle's poll(), which reads their exit status."""
    keep = set(known)
    reaped = []
    for pid in children():
        if pid in keep:
            continue
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)   # a running child stays as it is
        except ChildProcessError:
            continue
        if done:
            reaped.append(done)
    return reaped
