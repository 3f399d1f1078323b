"""The agent's memory store (docs/training.md §The memory tier): each local rank's newest memory
bundles, held in the agent's own memory so that a rank crash loses none of them, served back to the
ranks of the next attempt over the memory channel (memory_wire.py, a Unix socket in the agent's
private directory).

With peers (`PeerLinks`): every bundle a local rank puts is replicated to each buddy agent's
store on other nodes, over TCP (`tcp_listener`: the node's own address, a port the kernel picks,
the same authenticated memory channel); a rank asking for a bundle its agent lacks (a spare that
took over a dead node's ranks), or whose copy here it refused (`get` with `from: peers`), gets it
from the agents the supervisor named as its sources, relayed while it arrives, and the answer says
`peer_memory`.

The store never interprets a bundle: it keeps the manifest text and the payload as they came and
hands both back; the rank checks every byte against the manifest's hashes before using any. It
keeps the newest `keep` bundles per rank (one memory save in flight while the previous one is the
restore point), and refuses a bundle over `max_bytes`.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...env import TEST_FLIP_MEMORY
from ...memory_wire import MemoryChannelError, MemoryOp, Payload, Session, recv_exact
from ...messages import MemoryReplicated

log = logging.getLogger("ckptsup.agent")

MAX_CLIENTS = 256       # concurrent connections: a node runs a few ranks; more is not a rank of ours
ACCEPT_POLL_S = 0.5
PEER_CONNECT_TIMEOUT_S = 3.0
PEER_IO_TIMEOUT_S = 120.0   # a replica of a large bundle takes a while; a hung peer must not hold a thread forever


class FlipMode(enum.StrEnum):
    """CKPTSUP_TEST_FLIP_MEMORY: which bundles the store flips a bit of."""

    ALL = "1"
    OWN = "own"           # the bundles this node's ranks put (their replicas elsewhere stay intact)
    REPLICA = "replica"   # the replicas it keeps for other nodes' ranks

    @classmethod
    def parse(cls, raw: str) -> "FlipMode | None":
        if not raw:
            return None
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(f"{TEST_FLIP_MEMORY}={raw!r}: use 1, own or replica") from None

    def applies(self, *, replica: bool) -> bool:
        return self is FlipMode.ALL or (self is FlipMode.REPLICA) == replica


@dataclass(frozen=True)
class Held:
    step: int
    rank: int
    checkpoint_id: str
    manifest: str          # the bundle manifest's JSON, as the rank sent it
    sizes: tuple[int, ...] # payload split: one size per manifest file, in order
    payload: Payload

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class MemoryStore:
    def __init__(self, *, keep: int = 2, max_bytes: int = 0, flip: "FlipMode | None" = None) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self.flip = flip   # fault injection for tests (CKPTSUP_TEST_FLIP_MEMORY); never in production
        self._lock = threading.Lock()
        self._by_rank: dict[int, dict[int, Held]] = {}

    def put(self, held: Held, *, replica: bool = False) -> str | None:
        """Keep `held` (replacing the same step; `replica`: a peer agent's copy of another node's
        rank); None, or why it was refused."""
        if self.max_bytes and held.nbytes > self.max_bytes:
            return f"a bundle of {held.nbytes} bytes is over [memory] max_bytes = {self.max_bytes}"
        if self.flip is not None and self.flip.applies(replica=replica) and held.payload:
            payload = bytearray(held.payload)
            payload[len(payload) - 1 - len(payload) // 3] ^= 0x10   # inside the shard (files go in name order: .metadata, then the larger shard)
            held = Held(step=held.step, rank=held.rank, checkpoint_id=held.checkpoint_id, manifest=held.manifest,
                        sizes=held.sizes, payload=payload)
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


def unix_listener(path: str | os.PathLike[str]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)      # the socket file 0600 from its creation (the dir is 0700 too)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    return sock


def tcp_listener(addr: str) -> socket.socket:
    """The node's own address (never 0.0.0.0), a port the kernel picks."""
    if addr in ("", "0.0.0.0", "::"):
        raise ValueError(f"the replica listener needs the node's own address, not {addr!r}")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    return sock


class MemoryServer:
    """Serves a MemoryStore on a listening socket (Unix for the node's ranks, TCP for the peer
    agents): one thread accepts, one thread per connection. Nothing a client sends can raise out
    of it: a broken session is closed and logged."""

    def __init__(self, listener: socket.socket, *, secret: bytes, store: MemoryStore,
                 peers: "PeerLinks | None" = None) -> None:
        self.secret = secret
        self.store = store
        self.peers = peers
        self.max_payload = store.max_bytes or (1 << 40)
        self._sock = listener
        self.path = Path(listener.getsockname()) if listener.family == socket.AF_UNIX else None
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """host:port of a TCP server."""
        host, port = self._sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> "MemoryServer":
        self._sock.listen(64)
        self._sock.settimeout(ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._accept_loop, name="ckptsup-memory", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        if self.path is not None:
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
                    self._answer(session, role, op, body, payload)
        except (MemoryChannelError, OSError) as err:
            if "closed the memory channel" not in str(err):
                log.warning("ckptsup agent: memory channel closed: %s", err)
        finally:
            self._clients.release()

    def _answer(self, session: Session, role: str, op: MemoryOp, body: dict[str, Any], payload: Payload) -> None:
        match op:
            case MemoryOp.PUT:
                held = held_from_body(body, payload)
                refused = self.store.put(held, replica=not role.startswith("rank"))
                if refused is not None:
                    session.send(MemoryOp.REFUSED, {"reason": refused})
                    return
                session.send(MemoryOp.STORED, {"step": held.step, "rank": held.rank})
                if self.peers is not None and role.startswith("rank"):   # a replica is not replicated again
                    self.peers.replicate(held)
            case MemoryOp.LIST:
                rank = _int(body, "rank")
                listed: set[tuple[int, str]] = {(h[0], h[1]) for h in self.store.held(rank)}
                if self.peers is not None and role.startswith("rank"):
                    listed |= self.peers.held(rank)
                session.send(MemoryOp.HELD, {"rank": rank, "held": [list(h) for h in sorted(listed)],
                                             "bytes": self.store.total_bytes()})
            case MemoryOp.GET:
                step, rank = _int(body, "step"), _int(body, "rank")
                # "from": "peers" — the rank refused this store's copy (its hashes did not match)
                own = body.get("from") != "peers"
                found = self.store.get(step, rank) if own else None
                if found is None and self.peers is not None and role.startswith("rank"):
                    relayed = self.peers.fetch(step, rank, relay_to=session)   # on to the rank as it arrives
                    if relayed is not None:
                        self.store.put(relayed, replica=True)   # this node's copy from now on (replacing a bad one)
                        return
                if found is None:
                    session.send(MemoryOp.MISSING, {"step": step, "rank": rank})
                    return
                session.send(MemoryOp.BUNDLE, {**_put_body(vars(found)), "source": "memory"}, found.payload)
            case _:
                raise MemoryChannelError(f"a client may not send {op.value}")


def held_from_body(body: dict[str, Any], payload: Payload) -> Held:
    fields = bundle_fields(body, len(payload))
    return Held(**fields, payload=payload)


def bundle_fields(body: dict[str, Any], length: int) -> dict[str, Any]:
    """A put's or bundle's header fields, checked against its payload's length (before a byte of
    the payload is read, for a relay)."""
    sizes, manifest, cid = body.get("sizes"), body.get("manifest"), body.get("checkpoint_id")
    if (not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes)
            or sum(sizes) != length or not isinstance(manifest, str) or not isinstance(cid, str)):
        raise MemoryChannelError("a bundle whose sizes, manifest or checkpoint id do not fit its payload")
    return {"step": _int(body, "step"), "rank": _int(body, "rank"), "checkpoint_id": cid, "manifest": manifest,
            "sizes": tuple(sizes)}


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class PeerLinks:
    """This agent's links to the other agents' stores: the buddies it replicates to, and for each
    rank it may be asked about but lacks, the agents that may hold it (set by the supervisor's
    memory_peers command). Replication runs on one background thread, newest bundle first (an
    older one still queued for the same rank is dropped), each bundle to every buddy in turn;
    its outcomes, one per buddy, wait in `take()` for the agent's loop to report."""

    def __init__(self, *, secret: bytes, node: str, connect_timeout_s: float = PEER_CONNECT_TIMEOUT_S) -> None:
        self.secret = secret
        self.node = node
        self.connect_timeout_s = connect_timeout_s
        self.buddies: list[str] = []
        self.sources: dict[int, list[str]] = {}
        self._lock = threading.Lock()
        self._queue: dict[int, Held] = {}        # rank -> the newest bundle waiting to go to the buddies
        self._wake = threading.Event()
        self._notes: list[MemoryReplicated] = []
        self._thread = threading.Thread(target=self._replicate_loop, name="ckptsup-replica", daemon=True)
        self._thread.start()

    def set(self, *, buddies: list[str], sources: dict[int, list[str]]) -> None:
        with self._lock:
            self.buddies, self.sources = list(buddies), sources

    def replicate(self, held: Held) -> None:
        with self._lock:
            if not self.buddies:
                return
            self._queue[held.rank] = held
        self._wake.set()

    def take(self) -> list[MemoryReplicated]:
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def _replicate_loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                batch, self._queue = list(self._queue.values()), {}
                buddies = list(self.buddies)
            for held in batch:
                for buddy in buddies:
                    note = self._put(buddy, held)
                    with self._lock:
                        self._notes.append(note)

    def _put(self, buddy: str, held: Held) -> MemoryReplicated:
        """One replica of `held` on `buddy`'s store: the memory_replicated note of its outcome."""
        start = time.monotonic()
        try:
            with self._session(buddy) as session:
                session.send(MemoryOp.PUT, _put_body(vars(held)), held.payload)
                op, body, _ = session.recv()
            ok, reason = op is MemoryOp.STORED, "" if op is MemoryOp.STORED else str(body.get("reason", op.value))
        except (MemoryChannelError, OSError, ValueError) as err:
            ok, reason = False, str(err)[:200]
        return MemoryReplicated(step=held.step, rank=held.rank, buddy=buddy, ok=ok, bytes=held.nbytes,
                                replicate_s=round(time.monotonic() - start, 6), reason=None if ok else reason)

    @contextlib.contextmanager
    def _session(self, addr: str) -> Any:
        host, port = _split_addr(addr)
        sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        try:
            sock.settimeout(PEER_IO_TIMEOUT_S)
            yield Session.connect(sock, self.secret, role=f"replica:{self.node}", max_payload=1 << 40)
        finally:
            sock.close()

    def held(self, rank: int) -> builtins.set[tuple[int, str]]:   # (this class has a `set` method)
        """What the rank's source agents hold of it (an unreachable one holds nothing)."""
        with self._lock:
            addrs = list(self.sources.get(rank, []))
        found: set[tuple[int, str]] = set()
        for addr in addrs:
            try:
                with self._session(addr) as session:
                    session.send(MemoryOp.LIST, {"rank": rank})
                    op, body, _ = session.recv()
            except (MemoryChannelError, OSError, ValueError) as err:
                log.warning("ckptsup agent: memory source %s of rank %d is unreachable: %s", addr, rank, err)
                continue
            rows = body.get("held") if op is MemoryOp.HELD else None
            for row in rows if isinstance(rows, list) else []:
                if isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], str):
                    found.add((row[0], row[1]))
        return found

    def fetch(self, step: int, rank: int, *, relay_to: Session | None = None) -> Held | None:
        """The rank's bundle from the first source that has it. With `relay_to` (the asking rank's
        session), it goes on to the rank as `bundle` (`source: peer_memory`) piece by piece while it
        arrives, not after (store-and-forward doubled a peer restore's time); a source that fails
        after the header went on raises (the rank's connection closes: its load fails whole)."""
        with self._lock:
            addrs = list(self.sources.get(rank, []))
        for addr in addrs:
            relaying = False
            try:
                with self._session(addr) as session:
                    session.send(MemoryOp.GET, {"step": step, "rank": rank})
                    op, body, length = session.recv_header()
                    if op is not MemoryOp.BUNDLE:
                        continue
                    fields = bundle_fields(body, length)
                    if relay_to is not None:
                        relay_to.send_header(MemoryOp.BUNDLE, {**_put_body(fields), "source": "peer_memory"},
                                             length=length)
                        relaying = True
                    payload = recv_exact(session.sock, length,
                                         forward=relay_to.sock.sendall if relay_to is not None else None)
                return Held(**fields, payload=payload)
            except (MemoryChannelError, OSError, ValueError) as err:
                if relaying:
                    raise MemoryChannelError(f"memory source {addr} of rank {rank} failed mid-bundle: {err}") from None
                log.warning("ckptsup agent: memory source %s of rank %d failed: %s", addr, rank, err)
        return None


_HEADER_KEYS = ("step", "rank", "checkpoint_id", "manifest", "sizes")


def _put_body(fields: Any) -> dict[str, Any]:
    """A put's or bundle's header: from a Held's fields (`vars(held)`) or bundle_fields' dict."""
    return {key: list(fields[key]) if key == "sizes" else fields[key] for key in _HEADER_KEYS}


class NodeMemory:
    """The node agent's memory tier (docs/training.md §The memory tier): one store for the agent's
    life (a restart's ranks resume from it, so a rank crash loses no bundle), served to the
    node's ranks on `<directory>/memory.sock` and to the peer agents on TCP at `addr` (the node's
    own address), replicated to the buddies the supervisor names (`peers`)."""

    def __init__(self, *, keep: int, max_bytes: int, secret: bytes, node: str, directory: Path, addr: str,
                 flip: FlipMode | None) -> None:
        store = MemoryStore(keep=keep, max_bytes=max_bytes, flip=flip)
        self.peers = PeerLinks(secret=secret, node=node)
        self.ranks = MemoryServer(unix_listener(directory / "memory.sock"), secret=secret, store=store,
                                  peers=self.peers).start()
        self.replicas = MemoryServer(tcp_listener(addr), secret=secret, store=store).start()

    def close(self) -> None:
        for server in (self.ranks, self.replicas):
            server.close()
