"""Rank side of the rank → agent channel (ckptsup/wire.py): a node-local Unix stream socket.

Up: hello, step, phase, nan, event, bye frames (HMAC'd with the per-job secret read from
CKPTSUP_SECRET_FILE). Down: stop_at, save_now, set_interval, dump_fr, read by a daemon thread.
The thread only records commands; the main thread acts on them at the next step_done. dump_fr is
the exception: the main thread may be blocked inside a collective (that is why the supervisor asks),
so the thread dumps torch's flight recorder itself. Without CKPTSUP_RANK_SOCKET every call is a
cheap no-op. With it, the channel must open: a missing or stale socket, or a missing, empty or
short secret, is a ConfigError line at attach() naming the variable (a rank of a supervised job
that trained without its agent would be invisible to the supervisor).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import messages, wire
from ..env import RANK_SOCKET, SECRET_FILE
from ..errors import ConfigError
from ..events import Event
from ..wire import MessageKind
from ..rundir import read_secret
from ..safe_io import encodable

CONNECT_TIMEOUT_S = 30.0   # the agent accepts at once; a full backlog must not hang attach()

log = logging.getLogger("ckptsup.hooks")


@dataclass
class Commands:
    """What the agent asked for; written by the reader thread, consumed by the main thread."""

    stop_at: messages.StopAt | None = None
    save_now: str | None = None
    interval: messages.SetInterval | None = None
    timeout_s: float | None = None      # a steady collective timeout to apply (set_timeout)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_save_now(self) -> str | None:
        with self.lock:
            reason, self.save_now = self.save_now, None
            return reason

    def take_interval(self) -> messages.SetInterval | None:
        with self.lock:
            interval, self.interval = self.interval, None
            return interval

    def take_timeout(self) -> float | None:
        if self.timeout_s is None:  # the common case, every step: no lock
            return None
        with self.lock:
            timeout, self.timeout_s = self.timeout_s, None
            return timeout


def _called(dump: Callable[[], Any]) -> Any:
    try:
        return dump()
    except RuntimeError:   # a recorder whose backend never started
        return b"{}"


def _first_with_entries(dumps: list[Any]) -> Any:
    for data in dumps:
        try:
            if json.loads(data).get("entries"):
                return data
        except (ValueError, TypeError, AttributeError):
            continue
    return dumps[0]


def dump_flight_recorder(directory: str | os.PathLike[str], rank: int) -> Path | None:
    """Write torch's flight-recorder trace (JSON where available) to <directory>/rank_<r>.json.
    Runs on the reader thread, so it works while the main thread waits in a collective."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    # NCCL's recorder and the one of the other backends (gloo) are separate: on an NCCL job
    # `_dump_fr_trace_json` is empty (seen on torch 2.11 / H200). The first with entries wins.
    dumps = [getattr(c10d, name) for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json") if hasattr(c10d, name)]
    suffix = "json"
    if not dumps:
        # an older torch's pickles: never unpickled here to look for entries, so the order stays as before
        dumps = [getattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)]
        suffix = "pkl"
    if not dumps:
        return None
    data = _first_with_entries([_called(dump) for dump in dumps]) if suffix == "json" else dumps[0]()
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = target / f"rank_{rank}.{suffix}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data if isinstance(data, bytes) else str(data).encode())
    return path


def _connect(path: str) -> socket.socket:
    """The agent's socket, connected; every failure is one ConfigError line naming the variable."""
    where = f"{RANK_SOCKET} {path}"
    fix = f"the agent that started this rank is gone or the variable is stale; start the job through ckptsup launch, or unset {RANK_SOCKET} to train unsupervised"
    encodable(path, what=RANK_SOCKET, error=ConfigError)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(path)
        sock.settimeout(None)
    except FileNotFoundError:
        sock.close()
        raise ConfigError(f"{where} does not exist: {fix}") from None
    except ConnectionRefusedError:
        sock.close()
        kind = "nobody listens on it" if Path(path).is_socket() else "it is not a socket"
        raise ConfigError(f"cannot connect to {where}: {kind}; {fix}") from None
    except (OSError, ValueError) as err:   # too long for AF_UNIX, permission denied, a timeout
        sock.close()
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"cannot connect to {where}: {reason}; {fix}") from None
    return sock


class RankChannel:
    def __init__(self, *, socket_path: str | None, secret_file: str | None, rank: int,
                 fr_dump_dir: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.rank = rank
        self.commands = Commands()
        self.fr_dump_dir = fr_dump_dir
        self._sock: socket.socket | None = None
        self._seq = int(clock() * 1_000_000)  # a restarted rank continues above its predecessor
        self._send_lock = threading.Lock()
        self.dropped = 0
        if socket_path and not secret_file:
            raise ConfigError(f"{RANK_SOCKET} is set but {SECRET_FILE} is not: both come from the ckptsup agent; "
                              f"start the job through ckptsup launch, or unset {RANK_SOCKET} to train unsupervised")
        self._secret = read_secret(secret_file, named_by=SECRET_FILE) if secret_file else b""
        self._reader = wire.FrameReader(secret=self._secret, sender="agent", on_drop=self._count_drop)
        if socket_path:
            self._sock = _connect(socket_path)
            threading.Thread(target=self._read_loop, name="ckptsup-channel", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def send(self, msg: messages.Body) -> None:
        if self._sock is None:
            return
        with self._send_lock:
            self._seq += 1
            frame = messages.encode(msg, seq=self._seq, secret=self._secret)
            try:
                self._sock.sendall(frame)
            except OSError as err:
                log.warning("ckptsup: lost the agent channel (%s); continuing without it", err)
                self._close()

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                # shutdown first: close() alone neither wakes the reader thread blocked in recv()
                # nor ends the connection while that recv() holds it
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._close()

    # ---- commands -----------------------------------------------------------------------------
    def _read_loop(self) -> None:
        sock, reader = self._sock, self._reader
        while sock is not None:
            try:
                data = sock.recv(65536)
                frames = reader.feed(data) if data else None
            except (OSError, wire.FrameError):
                return
            if frames is None:
                return
            for m, body in frames:
                self.handle(m, body)

    def handle_frame(self, line: bytes) -> None:
        """One frame from the agent (tests feed forged and replayed ones here)."""
        frame = self._reader.accept(line)
        if frame is not None:
            self.handle(*frame)

    def _count_drop(self) -> None:
        self.dropped += 1

    def handle(self, m: MessageKind, body: dict[str, Any]) -> None:
        """One command from the agent: its body typed here (a bad one is dropped and counted)."""
        try:
            cmd = messages.parse(m, body)
        except wire.FrameError:
            self._count_drop()
            return
        cmds = self.commands
        with cmds.lock:
            if isinstance(cmd, messages.StopAt):
                cmds.stop_at = cmd
            elif isinstance(cmd, messages.SaveNow):
                cmds.save_now = cmd.reason
            elif isinstance(cmd, messages.SetInterval):   # merged: a disk and a memory change may both wait for a sync
                cmds.interval = cmd if cmds.interval is None else cmds.interval.merged(cmd)
            elif isinstance(cmd, messages.SetTimeout):
                cmds.timeout_s = float(cmd.collective_s)
        if isinstance(cmd, messages.DumpFr):
            directory = cmd.path or self.fr_dump_dir
            if directory:
                try:
                    path = dump_flight_recorder(directory, self.rank)
                    self.send(messages.EventRecord(record={"event": Event.FR_DUMPED.value, "rank": self.rank,
                                                           "path": str(path)}))
                except (OSError, RuntimeError) as err:
                    log.warning("ckptsup: flight recorder dump failed: %s", err)
