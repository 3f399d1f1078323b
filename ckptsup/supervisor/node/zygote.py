"""The agent's handle on its zygote (rankside/zygote.py): one pre-imported interpreter per node
that forks the next launch's torchrun and its warm rank interpreters, so a restart pays neither
python's nor torch's start-up, and the node pays torch's import once instead of once per rank
and per launch. Its children become the agent's (supervisor/node/forked.py), so a zygote that is
stopped, stuck or dead holds up no launch: the agent starts cold instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from ...env import PREFIX, ForkKind
from ..processes import is_stopped, terminate
from .forked import ForkedChild, become_subreaper

FORK_TIMEOUT_S = 5.0   # a ready zygote forks in tens of milliseconds; one that does not answer is discarded
REPLY_MAX = 1 << 16


class Zygote:
    """A running `python -m ckptsup.rankside.zygote` and its control socket."""

    def __init__(self, proc: subprocess.Popen, control: socket.socket, env: dict[str, str]) -> None:
        self.proc = proc
        self.control = control
        self.env = env            # the environment torch was imported with (the warm ranks' at import)
        self.is_ready = False
        self.broken = False       # it failed a request: discard it
        self.buffer = b""

    @classmethod
    def start(cls, *, env: dict[str, str], cwd: str) -> Zygote | None:
        """Start one; None where its children could not become ours (no subreaper: not Linux)."""
        if not become_subreaper():
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "ckptsup.rankside.zygote", "--control", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, env)

    def imported_with(self, env: dict[str, str], *, per_attempt: Iterable[str] = ()) -> bool:
        """Whether its imports saw `env`. What the supervisor exports for each attempt (`per_attempt`:
        ckptsup's variables, the NCCL timeouts and flight-recorder paths) is read when a rank attaches
        or creates its process group, never at import: a new attempt keeps its zygote."""
        ignore = set(per_attempt)
        return _import_env(self.env, ignore) == _import_env(env, ignore)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def dead(self) -> bool:
        """It exited, failed a request, or is stopped (it would never answer)."""
        return self.broken or self.proc.poll() is not None or is_stopped(self.proc.pid)

    def ready(self) -> bool:
        """Its imports are done and it can fork now."""
        if not self.is_ready and not self.dead():
            line = self._line(blocking=False)
            self.is_ready = bool(line and line.get("ready"))
        return self.is_ready and not self.dead()

    def fork_warm(self, *, listen: Path, local_rank: int, cwd: str) -> ForkedChild | None:
        """A warm rank interpreter listening on `listen` (None: the zygote failed; discard it)."""
        pid = self._ask({"kind": ForkKind.WARM, "listen": str(listen), "local_rank": local_rank, "cwd": cwd}, [])
        return ForkedChild(pid) if pid is not None else None

    def fork_torchrun(self, *, argv: list[str], env: dict[str, str], cwd: str) -> ForkedChild | None:
        """torchrun with this argv, environment and cwd; its stdout and stderr are one pipe, the
        returned child's `stdout` (None: the zygote failed; discard it)."""
        r, w = os.pipe()
        try:
            pid = self._ask({"kind": ForkKind.TORCHRUN, "argv": argv, "env": env, "cwd": cwd}, [w])
        finally:
            os.close(w)
        if pid is None:
            os.close(r)
            return None
        return ForkedChild(pid, stdout=os.fdopen(r, "rb"))

    def close(self) -> None:
        self.control.close()   # its end reads EOF and exits; SIGKILL covers a stopped or busy one
        terminate(self.proc, 0)

    def _ask(self, request: dict[str, Any], fds: list[int]) -> int | None:
        if not self.ready():
            return None
        try:
            self.control.settimeout(FORK_TIMEOUT_S)
            socket.send_fds(self.control, [json.dumps(request).encode() + b"\n"], fds)
            reply = self._line(blocking=True)
        except OSError:
            reply = None
        finally:
            if self.control.fileno() >= 0:
                self.control.setblocking(False)
        pid = reply.get("pid") if reply else None
        if not isinstance(pid, int) or pid <= 0:
            self.broken = True
            return None
        return pid

    def _line(self, *, blocking: bool) -> dict[str, Any] | None:
        """The next JSON line from the zygote (None: none yet, or garbage)."""
        while b"\n" not in self.buffer:
            try:
                data = self.control.recv(REPLY_MAX)
            except (BlockingIOError, InterruptedError):
                if blocking:
                    continue
                return None
            except OSError:
                self.broken = True
                return None
            if not data:
                self.broken = True   # it exited
                return None
            self.buffer += data
            if len(self.buffer) > REPLY_MAX:
                self.broken = True
                return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            body = json.loads(line)
        except ValueError:
            self.broken = True
            return None
        return body if isinstance(body, dict) else None


def _import_env(env: dict[str, str], ignore: set[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(PREFIX) and k not in ignore}
