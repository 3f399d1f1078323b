"""The ranks' socket, the node agent's side (docs/contracts.md §Wire frames): a node-local Unix
socket in a 0700 directory where the ranks send HMAC'd frames.

The socket is a boundary. A connection is a rank only once it sent an authenticated `hello`
(good MAC, a well-typed body, a sequence number fresh for that rank and pid); until then its
frames are dropped, and its end is logged (one line per UNAUTH_LOG_EVERY_S, with a count) and
reported to nobody. Replays are refused per rank identity, across connections. Every body is
typed (messages.parse) before it is passed on; a kind that is not a rank's to send is dropped.
Whatever arrives, the socket goes on; only a rank that said hello can, by leaving without `bye`,
make a crash report (`on_lost`).

What a rank frame means is the agent's: `RankSocket` hands each accepted one to `on_frame`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import selectors
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from ... import messages, wire
from ... import console
from ...wire import Hop, MessageKind
from ..processes import terminate

HELLO_TIMEOUT_S = 10.0   # a connection without an authenticated hello by then is closed (ranks say it at once)
MAX_UNAUTHENTICATED = 64  # connections waiting for their hello; beyond, the oldest is closed
UNAUTH_LOG_EVERY_S = 10.0
SOCKET_DIR_PREFIX = "ckptsup-agent-"


def socket_dir_prefix(host: str | None = None, pid: int | None = None, pidns: str | None = None) -> str:
    """`ckptsup-agent-<host>-<pid namespace>-<pid>-`: whose directory it is, so that the next agent
    on this host can remove those of killed agents (a SIGKILL skips our cleanup). The pid namespace
    is part of the name because a pid means something only inside its own: two dev clusters on one
    machine both have a node "n1" sharing /tmp, and their agents must not sweep each other's."""
    return f"{_host_prefix(host, pidns)}{pid or os.getpid()}-"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _host_prefix(host: str | None, pidns: str | None = None) -> str:
    # a long FQDN is cut: the socket's whole path must stay within AF_UNIX's 108 bytes
    return f"{SOCKET_DIR_PREFIX}{(host or socket.gethostname())[:40]}-{pidns or _pid_namespace()}-"


def sweep_stale_socket_dirs(tmp: Path | None = None, host: str | None = None,
                            alive: Callable[[int], bool] = psutil.pid_exists, pidns: str | None = None) -> list[Path]:
    """Remove this host's agent socket directories whose agent is gone. Only our own uid's, only
    this host's (nodes may share /tmp while their pid numbers are their own), never one whose pid
    is alive (a reused pid keeps a stale directory, the safe side)."""
    tmp = tmp or Path(tempfile.gettempdir())
    prefix = _host_prefix(host, pidns)
    removed = []
    for path in tmp.glob(f"{prefix}*"):
        # exactly <pid>-<mkdtemp's 8 characters>: host "n1" must not claim host "n1-2"'s directories
        match = re.fullmatch(r"(\d+)-[a-z0-9_]{8}", path.name[len(prefix):])
        try:
            if not match or path.is_symlink() or path.lstat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass(kw_only=True)
class RankConn:
    sock: socket.socket
    reader: wire.FrameReader
    opened: float = 0.0
    peer_pid: int | None = None   # the kernel's word (SO_PEERCRED), not the hello's
    rank: int | None = None       # set by an authenticated hello only: until then, no rank
    pid: int | None = None
    said_bye: bool = False

    @property
    def sender(self) -> str:
        """The replay guard's key: the rank's identity, the same on every connection it opens."""
        return f"rank {self.rank} pid {self.pid}"


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    except (AttributeError, OSError, struct.error):
        return None
    return pid if pid > 0 else None


@dataclass(kw_only=True)
class RateLimitedLog:
    """One stderr line per `every_s` at most, with how many things happened since the last one."""

    every_s: float
    clock: Callable[[], float] = time.monotonic
    last: float = -math.inf
    pending: int = 0

    def note(self, what: Callable[[int], str]) -> None:
        self.pending += 1
        self.flush(what)

    def flush(self, what: Callable[[int], str]) -> None:
        now = self.clock()
        if self.pending and now - self.last >= self.every_s:
            console.warning(f"ckptsup agent: {what(self.pending)}", err=True)
            self.last, self.pending = now, 0


def _unauth_line(count: int) -> str:
    return (f"{count} connection(s) to the rank socket ended without an authenticated hello; ignored "
            f"(not ranks of this job; at most one such line per {UNAUTH_LOG_EVERY_S:g}s)")


class RankSocket:
    """The listening socket `<dir>/ranks.sock` (0600 in a fresh 0700 directory, which the agent
    also lends to the memory socket and the warm pool) and its connections, read in the agent's
    selector: each selector key's data is the callable that serves it."""

    def __init__(self, *, secret: bytes, sel: selectors.BaseSelector, on_frame: Callable[[RankConn, messages.Body], None],
                 on_lost: Callable[[RankConn], None], on_drop: Callable[[], None]) -> None:
        self.secret = secret
        self.sel = sel
        self.on_frame = on_frame   # an accepted frame of a rank (its hello included), typed
        self.on_lost = on_lost     # a rank's connection ended without `bye`
        self.on_drop = on_drop     # a frame dropped (counted in the heartbeat)
        self.guard = wire.ReplayGuard()   # keyed by rank identity, across connections
        self.unauth_log = RateLimitedLog(every_s=UNAUTH_LOG_EVERY_S)
        self.seq = 0
        sweep_stale_socket_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=socket_dir_prefix()))  # 0700
        self.path = self.dir / "ranks.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self.server.listen(256)
        self.server.setblocking(False)
        self.sel.register(self.server, selectors.EVENT_READ, self._accept)
        self.conns: dict[socket.socket, RankConn] = {}

    def ranks(self) -> set[int]:
        """The ranks connected now (each said hello)."""
        return {c.rank for c in self.conns.values() if c.rank is not None}

    def stopped(self) -> set[int]:
        """Connected ranks whose process is stopped (state T: SIGSTOP, a debugger)."""
        out = set()
        for conn in self.conns.values():
            if conn.pid is None or conn.rank is None:
                continue
            try:
                if psutil.Process(conn.pid).status() == psutil.STATUS_STOPPED:
                    out.add(conn.rank)
            except (psutil.Error, ValueError, OverflowError):
                pass
        return out

    def send(self, msg: messages.Body) -> None:
        """A command to every rank that said hello (not to whoever connected)."""
        for conn in list(self.conns.values()):
            if conn.rank is None:
                continue
            self.seq += 1
            try:
                conn.sock.sendall(messages.encode(msg, seq=self.seq, secret=self.secret))
            except (OSError, wire.FrameError):
                pass  # that rank is going away; its EOF is handled by the reader

    def drop_all(self) -> None:
        """Close every connection, reporting none (the ranks are being killed). A rank that
        escaped the launcher's tree is killed here: only the process at the other end."""
        for conn in list(self.conns.values()):
            if conn.rank is not None and conn.pid is not None and conn.pid == conn.peer_pid != os.getpid():
                terminate(conn.pid, 0)
            self._close(conn, report=False)

    def expire(self, now: float) -> None:
        """Close connections that said no hello within HELLO_TIMEOUT_S; say how many ended so."""
        for conn in [c for c in self.conns.values() if c.rank is None and now - c.opened > HELLO_TIMEOUT_S]:
            self._close(conn, report=True)
        self.unauth_log.flush(_unauth_line)

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- the selector's callbacks --------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:  # out of descriptors: the next tick tries again
            console.warning(f"ckptsup agent: cannot accept a rank connection: {err.strerror or err}", err=True)
            return
        sock.setblocking(False)
        waiting = sorted((c for c in self.conns.values() if c.rank is None), key=lambda c: c.opened)
        for stale in waiting[:max(0, len(waiting) - MAX_UNAUTHENTICATED + 1)]:
            self._close(stale, report=True)  # many connections that never say hello: drop the oldest
        conn = RankConn(sock=sock, opened=time.monotonic(), peer_pid=_peer_pid(sock),
                        reader=wire.FrameReader(secret=self.secret, sender="rank", on_drop=self.on_drop))
        self.conns[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, lambda: self._read(conn))

    def _close(self, conn: RankConn, *, report: bool) -> None:
        if self.conns.pop(conn.sock, None) is None:
            return
        self.sel.unregister(conn.sock)
        conn.sock.close()
        if conn.rank is None:
            if report:
                self.unauth_log.note(_unauth_line)  # anyone may connect and leave: no rank, no report
            return
        if report and not conn.said_bye:
            self.on_lost(conn)

    def _read(self, conn: RankConn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn, report=True)
            return
        try:
            lines = conn.reader.lines(data)
        except wire.FrameError:
            self._close(conn, report=True)  # a flood is not a rank of ours
            return
        for line in lines:
            if conn.sock not in self.conns:
                return
            frame = conn.reader.verified(line)
            if frame is not None:
                self._frame(conn, *frame)

    def _frame(self, conn: RankConn, m: MessageKind, seq: int, body: dict[str, Any]) -> None:
        if wire.HOPS.get(m) is not Hop.RANK_TO_AGENT:
            self.on_drop()  # an agent's or the supervisor's kind: not a rank's to send
            return
        if conn.rank is not None and (m == MessageKind.HELLO or not self.guard.accept(conn.sender, seq)):
            self.on_drop()  # a second hello, or a replay
            return
        if conn.rank is None and m != MessageKind.HELLO:
            self.on_drop()  # nothing counts before an authenticated hello
            return
        try:
            msg = messages.parse(m, body)   # the body's types, the ones the supervisor relies on
        except wire.FrameError:
            self.on_drop()
            return
        if isinstance(msg, messages.Hello):
            # a well-typed hello and a sequence number fresh for that rank and pid (a replayed
            # hello on a new connection is refused) make the connection a rank
            conn.rank, conn.pid = msg.rank, msg.pid
            if not self.guard.accept(conn.sender, seq):
                conn.rank = conn.pid = None
                self.on_drop()
                return
        elif isinstance(msg, messages.RankScoped) and conn.rank is not None:   # (it is: a hello came first)
            if msg.rank == messages.NO_RANK:
                msg = dataclasses.replace(msg, rank=conn.rank)   # absent: the hello's
            elif msg.rank != conn.rank:
                self.on_drop()  # another rank's identity
                return
        if isinstance(msg, messages.Bye):
            conn.said_bye = True
        self.on_frame(conn, msg)
