"""The agent's memory store (docs/training.md §The memory tier): each local rank's newest memory
bundles, held in the agent's own memory so that a rank crash loses none of them, served back to the
ranks of the next attempt over the memory channel (memory_wire.py, a Unix socket in the agent's
private directory).

The store never interprets a bundle: it keeps the manifest text and the payload as they came and
hands both back; the rank checks every byte against the manifest's hashes before using any. It
keeps the newest `keep` bundles per rank (one memory save in flight while the previous one is the
restore point), and refuses a bundle over `max_bytes`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..memory_wire import MemoryChannelError, MemoryOp, Session

log = logging.getLogger("ckptsup.agent")

MAX_CLIENTS = 256       # concurrent connections: a node runs a few ranks; more is not a rank of ours
ACCEPT_POLL_S = 0.5


@dataclass(frozen=True)
class Held:
    step: int
    rank: int
    checkpoint_id: str
    manifest: str          # the bundle manifest's JSON, as the rank sent it
    sizes: tuple[int, ...] # payload split: one size per manifest file, in order
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class MemoryStore:
    def __init__(self, *, keep: int = 2, max_bytes: int = 0) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_rank: dict[int, dict[int, Held]] = {}

    def put(self, held: Held) -> str | None:
        """Keep `held` (replacing the same step); None, or why it was refused."""
        if self.max_bytes and held.nbytes > self.max_bytes:
            return f"a bundle of {held.nbytes} bytes is over [memory] max_bytes = {self.max_bytes}"
        with self._lock:
            steps = self._by_rank.setdefault(held.rank, {})
            steps[held.step] = held
            for old in sorted(steps)[:-self.keep]:
                del steps[old]
        return None

    def held(self, rank: int) -> list[tuple[int, str]]:
        with self._lock:
            return [(s, h.checkpoint_id) for s, h in sorted(self._by_rank.get(rank, {}).items())]

    def get(self, step: int, rank: int) -> Held | None:
        with self._lock:
            return self._by_rank.get(rank, {}).get(step)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for steps in self._by_rank.values() for h in steps.values())


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if type(value) is not int or value < 0:
        raise MemoryChannelError(f"memory-channel field {key!r} must be a non-negative integer")
    return value


class MemoryServer:
    """Serves a MemoryStore on a Unix socket: one thread accepts, one thread per connection.
    Nothing a client sends can raise out of it: a broken session is closed and logged."""

    def __init__(self, path: str | os.PathLike[str], *, secret: bytes, store: MemoryStore,
                 on_stored: Callable[[Held], None] | None = None) -> None:
        self.path = Path(path)
        self.secret = secret
        self.store = store
        self.on_stored = on_stored or (lambda held: None)
        self.max_payload = store.max_bytes or (1 << 40)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self._thread: threading.Thread | None = None

    def start(self) -> "MemoryServer":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)      # the socket file 0600 from its creation (the dir is 0700 too)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(64)
        sock.settimeout(ACCEPT_POLL_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="ckptsup-memory", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            if not self._clients.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ckptsup-memory-client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(None)
                session, role = Session.accept(conn, self.secret, max_payload=self.max_payload)
                while not self._stop.is_set():
                    op, body, payload = session.recv()
                    self._answer(session, op, body, payload)
        except (MemoryChannelError, OSError) as err:
            if "closed the memory channel" not in str(err):
                log.warning("ckptsup agent: memory channel closed: %s", err)
        finally:
            self._clients.release()

    def _answer(self, session: Session, op: MemoryOp, body: dict[str, Any], payload: bytes) -> None:
        match op:
            case MemoryOp.PUT:
                sizes = body.get("sizes")
                manifest, cid = body.get("manifest"), body.get("checkpoint_id")
                if (not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes)
                        or sum(sizes) != len(payload) or not isinstance(manifest, str) or not isinstance(cid, str)):
                    raise MemoryChannelError("a put whose sizes, manifest or checkpoint id do not fit its payload")
                held = Held(step=_int(body, "step"), rank=_int(body, "rank"), checkpoint_id=cid, manifest=manifest,
                            sizes=tuple(sizes), payload=payload)
                refused = self.store.put(held)
                if refused is not None:
                    session.send(MemoryOp.REFUSED, {"reason": refused})
                    return
                self.on_stored(held)
                session.send(MemoryOp.STORED, {"step": held.step, "rank": held.rank})
            case MemoryOp.LIST:
                rank = _int(body, "rank")
                session.send(MemoryOp.HELD, {"rank": rank, "held": [list(h) for h in self.store.held(rank)]})
            case MemoryOp.GET:
                step, rank = _int(body, "step"), _int(body, "rank")
                held = self.store.get(step, rank)
                if held is None:
                    session.send(MemoryOp.MISSING, {"step": step, "rank": rank})
                    return
                session.send(MemoryOp.BUNDLE, {"step": step, "rank": rank, "checkpoint_id": held.checkpoint_id,
                                               "manifest": held.manifest, "sizes": list(held.sizes)}, held.payload)
            case _:
                raise MemoryChannelError(f"a client may not send {op.value}")
