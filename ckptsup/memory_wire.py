"""The memory channel (docs/contracts.md §Memory channel): bulk bytes between a rank and the memory
store of its node's agent, over a Unix socket in the agent's private directory.

One connection is one session. The server speaks first, a `challenge` with a fresh nonce; the
client answers `auth`. A header is a 4-byte length and JSON. Every header after the
challenge is signed and bound to the session's nonce
and a strictly increasing sequence number, so a header is good only once, in its own connection
(recorded traffic replays nowhere). A header may announce `length` payload bytes, which follow it
raw: the payload is not MACed (an HMAC over every byte of a checkpoint would cost a pass over it);
its integrity is the bundle manifest's per-file and per-item hashes, checked before a byte is
used. Lengths and nesting are bounded before anything is parsed; a peer that breaks the protocol
gets its connection closed, never an exception out of the server.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import mmap
import secrets
import socket
from dataclasses import dataclass
from typing import Any, Callable, TypeAlias

from .errors import CkptsupError
from .safe_io import loads_json

MAX_HEADER_BYTES = 16 << 20    # a header carries a bundle's manifest: its item index can be large
MAX_HEADER_DEPTH = 8
NONCE_HEX = 32
AUTH_CONTEXT = "ckptsup-memory-channel/1"


class MemoryOp(enum.StrEnum):
    CHALLENGE = "challenge"   # server -> client: {nonce}
    AUTH = "auth"             # client -> server: {role}
    PUT = "put"               # client -> server: {step, rank, checkpoint_id, manifest, sizes} + payload
    STORED = "stored"         # server -> client: {step, rank}
    LIST = "list"             # client -> server: {rank}
    HELD = "held"             # server -> client: {rank, held: [[step, checkpoint_id], ...]}
    GET = "get"               # client -> server: {step, rank}
    BUNDLE = "bundle"         # server -> client: {step, rank, checkpoint_id, manifest, sizes} + payload
    MISSING = "missing"       # server -> client: {step, rank}
    REFUSED = "refused"       # server -> client: {reason}


class MemoryChannelError(CkptsupError):
    """A broken, forged or replayed memory-channel message, or a peer that went away."""


def _mac(secret: bytes, nonce: str, op: str, seq: int, body_json: str) -> str:
    text = f"{AUTH_CONTEXT}\n{nonce}\n{op}\n{seq}\n{body_json}"
    return hmac.new(secret, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


LARGE_BYTES = 1 << 20


# Pre-fault a large buffer in one call (Linux): the receive then copies into present pages instead
# of taking a page fault every 4 KiB inside recv_into. n is bounded by the session's max_payload
# and announced in a MACed header, so only the authenticated peer decides how much this commits.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def receive_buffer(n: int) -> bytearray | mmap.mmap:
    """A writable buffer of n bytes. A large one is a private anonymous mapping: bytearray(n) would
    first write n zero bytes. Private, not mmap's default MAP_SHARED: a shared anonymous mapping is
    shmem, whose first-touch faults cost a third more CPU time than private pages (256 MiB received:
    0.21 s vs 0.16 s here, bench/bench_memory_tier.py), and a restored model's tensors adopt this
    buffer, so a worker forked after the resume must get copy-on-write pages, not shared ones."""
    if n < LARGE_BYTES:
        return bytearray(n)
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)


RELAY_CHUNK_BYTES = 4 << 20   # what a relay forwards at a time: the receive and the send overlap


# a bundle's bytes as they are held: received into a bytearray, or an anonymous mmap when large
Payload: TypeAlias = "bytes | bytearray | mmap.mmap"


def recv_exact(sock: socket.socket, n: int, *, forward: Callable[[memoryview], None] | None = None,
               chunk: int = RELAY_CHUNK_BYTES) -> bytearray | mmap.mmap:
    """Exactly n bytes, read straight into one writable buffer (a bundle is not copied again).
    With `forward`, each piece is handed on as soon as it is in (a relay: the next hop receives
    while this one still does, instead of after)."""
    out = receive_buffer(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, chunk) if forward else n - got)
        if k == 0:
            raise MemoryChannelError(f"the peer closed the memory channel after {got} of {n} bytes")
        if forward is not None:
            forward(view[got:got + k])
        got += k
    return out


SOCKET_BUFFER_BYTES = 4 << 20   # fewer system calls per bundle than the kernel's default


def tune(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _recv_header(sock: socket.socket, limit: int) -> bytes:
    """One header: a 4-byte big-endian length, then that many bytes of JSON (bounded before the
    bytes are read)."""
    size = int.from_bytes(recv_exact(sock, 4), "big")
    if size > limit:
        raise MemoryChannelError(f"a memory-channel header of {size} bytes (limit {limit})")
    return bytes(recv_exact(sock, size))   # small (bounded above): a copy costs nothing


@dataclass
class Session:
    """One authenticated memory-channel connection, from either end."""

    sock: socket.socket
    secret: bytes
    nonce: str = ""
    max_payload: int = 1 << 40
    _sent: int = 0
    _received: int = -1

    # ---- the handshake ------------------------------------------------------------------------
    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, *, max_payload: int) -> "tuple[Session, str]":
        """Server side: challenge, then the client's `auth`. → (session, the client's role)."""
        tune(sock)
        session = cls(sock=sock, secret=secret, nonce=secrets.token_hex(NONCE_HEX // 2), max_payload=max_payload)
        session._send_line({"op": MemoryOp.CHALLENGE, "nonce": session.nonce})
        op, body, _ = session.recv()
        if op is not MemoryOp.AUTH or not isinstance(body.get("role"), str):
            raise MemoryChannelError("the first message of a memory-channel client must be auth")
        return session, body["role"]

    @classmethod
    def connect(cls, sock: socket.socket, secret: bytes, *, role: str, max_payload: int) -> "Session":
        """Client side: read the challenge, answer with a signed `auth`."""
        tune(sock)
        line = _recv_header(sock, 256)
        hello = loads_json(line, what="memory-channel challenge", error=MemoryChannelError, max_depth=2)
        nonce = hello.get("nonce") if isinstance(hello, dict) else None
        if hello.get("op") != MemoryOp.CHALLENGE or not isinstance(nonce, str) or len(nonce) != NONCE_HEX:
            raise MemoryChannelError("the memory store did not send a challenge")
        session = cls(sock=sock, secret=secret, nonce=nonce, max_payload=max_payload)
        session.send(MemoryOp.AUTH, {"role": role})
        return session

    # ---- messages -----------------------------------------------------------------------------
    def send(self, op: MemoryOp, body: dict[str, Any], payload: Payload | memoryview | list[bytes] = b"") -> None:
        parts = payload if isinstance(payload, list) else [payload]
        self.send_header(op, body, length=sum(len(p) for p in parts))
        for part in parts:
            if len(part):   # no system call for nothing: a peer that already answered and closed would fail it
                self.sock.sendall(part)

    def send_header(self, op: MemoryOp, body: dict[str, Any], *, length: int) -> None:
        """The signed header announcing `length` payload bytes; the caller sends them raw after
        it (`sock.sendall`), all of them, or closes the connection."""
        body = {**body, "length": length}
        body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False)
        self._sent += 1
        line = {"op": str(op), "seq": self._sent, "body": body,
                "mac": _mac(self.secret, self.nonce, str(op), self._sent, body_json)}
        self._send_line(line)

    def _send_line(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
        if len(data) > MAX_HEADER_BYTES:
            raise MemoryChannelError(f"a memory-channel header of {len(data)} bytes is over the limit")
        self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def recv(self) -> tuple[MemoryOp, dict[str, Any], Payload]:
        """→ (op, body, payload). Raises MemoryChannelError on anything but a good next message."""
        kind, body, length = self.recv_header()
        return kind, body, recv_exact(self.sock, length) if length else bytearray()

    def recv_header(self) -> tuple[MemoryOp, dict[str, Any], int]:
        """The next header, checked → (op, body, payload length); the payload is still to be read
        (`recv_exact(session.sock, length)`)."""
        line = _recv_header(self.sock, MAX_HEADER_BYTES)
        frame = loads_json(line, what="memory-channel header", error=MemoryChannelError, max_depth=MAX_HEADER_DEPTH)
        try:
            op, seq, body, mac = frame["op"], frame["seq"], frame["body"], frame["mac"]
        except (KeyError, TypeError):
            raise MemoryChannelError("a malformed memory-channel header") from None
        if not (isinstance(op, str) and type(seq) is int and isinstance(body, dict) and isinstance(mac, str)):
            raise MemoryChannelError("a memory-channel header with fields of the wrong types")
        body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False)
        if not hmac.compare_digest(mac, _mac(self.secret, self.nonce, op, seq, body_json)):
            raise MemoryChannelError("a memory-channel header with a bad MAC (wrong secret, or not this session's)")
        if seq <= self._received:
            raise MemoryChannelError("a replayed memory-channel header")
        self._received = seq
        try:
            kind = MemoryOp(op)
        except ValueError:
            raise MemoryChannelError(f"unknown memory-channel op {op[:40]!r}") from None
        length = body.get("length", 0)
        if type(length) is not int or not 0 <= length <= self.max_payload:
            raise MemoryChannelError(f"a memory-channel payload of {length!r} bytes (limit {self.max_payload})")
        return kind, body, length
