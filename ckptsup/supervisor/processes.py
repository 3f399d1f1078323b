"""Stopping processes: the one `terminate(proc, grace)` of the supervisor and the agent.

A stopped process (SIGSTOP, a debugger) never handles SIGTERM, so it gets SIGKILL at once instead
of costing the whole grace period. Children started in their own sessions (torchrun starts every
worker with start_new_session=True) are found through the process tree, not the process group.
"""

from __future__ import annotations

import enum
import signal
import subprocess
import time
from typing import Callable, Protocol

import psutil


def _is_stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): it answers nothing until continued."""
    try:
        return _is_stopped(psutil.Process(pid))
    except psutil.Error:
        return False


def pid_views(pid: int) -> tuple[int, int]:
    """(pid as seen here, pid in the outermost pid namespace this /proc shows). NSpid lists the
    outer pid first; a /proc mounted inside a node's own namespace (the dev cluster) shows only
    that namespace, so both are the same there."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh.read(8192).decode(errors="replace").splitlines():
                if line.startswith("NSpid:"):
                    return pid, int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return pid, pid


def where(pid: int) -> dict[str, str]:
    """What a stuck process waits in, where cheaply readable: its kernel wait channel and (root
    only) its kernel stack. Nothing here stops or ptraces the process."""
    out: dict[str, str] = {}
    for key, name, cap in (("wchan", "wchan", 128), ("stack", "stack", 2048)):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as fh:
                text = fh.read(cap).decode(errors="replace").strip()
        except OSError:
            continue
        if text and text != "0":
            out[key] = text
    return out


def tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its descendants (those alive now), parent first."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int) -> None:
    for proc in tree(pid):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class Child(Protocol):
    """A child process we wait on: a subprocess.Popen, or one the agent adopted from its zygote
    (supervisor/node/forked.py)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def terminate(proc: Child | int, grace: float, *, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> int | None:
    """Stop `proc` and every descendant: SIGTERM, wait up to `grace` seconds, then SIGKILL.
    Stopped processes and grace <= 0 go straight to SIGKILL. Returns proc's exit status when it
    is our child (a Child), else None."""
    pid = proc if isinstance(proc, int) else proc.pid
    members = tree(pid)
    if grace > 0:
        for member in members:
            try:
                member.send_signal(signal.SIGKILL if _is_stopped(member) else signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        deadline = clock() + grace
        while clock() < deadline and any(_alive(m) for m in members):
            if not isinstance(proc, int):
                proc.poll()
            sleep(0.02)
    for member in members:
        if _alive(member):
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
    if not isinstance(proc, int):
        try:
            return proc.wait(timeout=max(grace, 5.0))
        except subprocess.TimeoutExpired:
            return None
    deadline = clock() + 5.0  # not our children: gone or a zombie (its parent reaps it) is enough
    while clock() < deadline and any(_alive(m) for m in members):
        sleep(0.01)
    return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Liveness(enum.Enum):
    """What /proc says of a process that is not (yet) a zombie with an exit status."""

    RUNNING = "running"
    GONE = "gone"  # reaped: its exit status is no longer readable


RUNNING = Liveness.RUNNING
GONE = Liveness.GONE


def zombie_status(pid: int) -> "int | Liveness":
    """A dead rank's exit status while it is a zombie, read from /proc/PID/stat (field 52,
    Linux >= 3.5): exit code, or -signal. RUNNING while alive, GONE once reaped (torchrun, its
    parent, reaps it within its monitor interval)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    fields = data[data.rindex(")") + 2:].split()
    if fields[0] != "Z":
        return RUNNING
    try:
        wait_status = int(fields[49])
    except (IndexError, ValueError):
        return GONE
    if wait_status & 0x7F:
        return -(wait_status & 0x7F)
    return (wait_status >> 8) & 0xFF


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
