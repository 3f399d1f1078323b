"""What the node agent can see of its ranks without stopping them (docs/timeouts.md §Evidence):
CPU time and I/O from /proc, the process state, and on request every thread's Python stack.

The agent is every rank's ancestor, so /proc/PID/io and the stack dump signal are allowed even
under kernel.yama.ptrace_scope = 1. Cheap: two small /proc reads per rank per heartbeat; a stack
collection only when the supervisor suspects a hang.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ...stack_dump import STACK_SIGNAL

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DUMP_POLL_S = 0.5         # the agent's wait for the dumps (faulthandler writes at once; a process in D state or stopped never does)
STACK_MAX_BYTES = 16 << 10


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """One heartbeat's reading of one rank process."""

    cpu_s: float       # utime + stime of every thread
    io_bytes: int      # rchar + wchar (sockets and pipes count: a rank reading a file shows here)
    state: str         # R, S, D, T, t, Z, ...

    def to_wire(self) -> list[float | int | str]:
        return [round(self.cpu_s, 3), self.io_bytes, self.state]


def sample(pid: int) -> RankSample | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read(4096).decode(errors="replace")
        # the command may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        state, cpu = fields[0], (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None
    io = 0
    try:
        with open(f"/proc/{pid}/io", "rb") as fh:
            for line in fh.read(4096).decode(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar"):
                    io += int(value)
    except (OSError, ValueError):
        pass   # another user's process without CAP_SYS_PTRACE: CPU and state still tell
    return RankSample(cpu_s=cpu, io_bytes=io, state=state)


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
