"""The memory tier, rank side (docs/training.md §The memory tier).

Every `[memory] every_steps` steps each rank stages its state (the stall, as for a disk save),
then on a background thread serialises it with DCP into memory — a single-process save of this
rank's own state (its DTensor shards; all of it for a replicated model) with the global side
state included, so the bundle restores this rank alone — hashes every file and item into a bundle
manifest, and hands the bundle to its node's agent over the memory channel. The agent holds it; a
crash of the rank loses nothing.

On resume every rank lists what its agent holds; the ranks agree on the newest step whose bundle
every rank has with the same checkpoint id (one save of one attempt: never a mix of versions); when
that step is not older than the newest disk checkpoint, each rank loads its bundle through
BundleReader (every item hash-checked before torch sees it, `.metadata` hash-checked before the
allow-list unpickler runs) and the ranks agree on the outcome, all or nothing. Anything else —
no agent, a different world size, a refused or corrupt bundle — falls back to the disk tiers.
A memory save never waits for the previous one: when it is still in flight, this one is skipped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import logging
import socket
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from ..checkpoint.hashing import hash_bytes
from ..checkpoint.manifest import METADATA_NAME, FileEntry, ItemEntry, Manifest
from ..errors import CheckpointError, ValidationError
from ..memory_wire import MemoryChannelError, MemoryOp, Session
from ..rundir import read_secret
from ..env import SECRET_FILE
from .dcp_errors import failure_errors, one_line
from .dcp_writer import filesystem_writer
from .reader import MAX_METADATA_BYTES, VerifyingReader
from .writer import Stager, item_key

log = logging.getLogger("ckptsup.hooks")

CONNECT_TIMEOUT_S = 10.0
BUNDLE_ROOT = PurePosixPath("/ckptsup-memory")


def memory_checkpoint_id(*, job_id: str, attempt: int, epoch: int, step: int) -> str:
    """The same on every rank without a collective: one memory save of one attempt (a UUID, as
    every manifest's checkpoint_id)."""
    digest = hashlib.sha256(f"ckptsup-memory/{job_id}/{epoch}/{attempt}/{step}".encode()).hexdigest()
    return str(uuid.UUID(hex=digest[:32]))


# ---- serialising into memory ----------------------------------------------------------------------

class _KeptBytes(io.BytesIO):
    """A file DCP writes into memory: its bytes land in `files` when it is closed (DCP may close
    the stream itself)."""

    def __init__(self, files: dict[str, bytes], name: str) -> None:
        super().__init__()
        self._files, self._name = files, name

    def close(self) -> None:
        if not self.closed:
            self._files[self._name] = self.getvalue()
        super().close()


def _memory_writer(files: dict[str, bytes]) -> Any:
    """DCP's FileSystemWriter over a dict: every file it would create is kept as bytes."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class DictFileSystem(FileSystemBase):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if "r" in mode:
                yield io.BytesIO(files[str(path)])
                return
            stream = _KeptBytes(files, str(path))
            yield stream
            stream.close()

        def concat_path(self, path: Any, suffix: str) -> Any:
            return PurePosixPath(path) / suffix

        def rename(self, path: Any, new_path: Any) -> None:
            files[str(new_path)] = files.pop(str(path))

        def init_path(self, path: Any) -> Any:
            return PurePosixPath(path)

        def mkdir(self, path: Any) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def exists(self, path: Any) -> bool:
            return str(path) in files

        def rm_file(self, path: Any) -> None:
            files.pop(str(path), None)

        def ls(self, path: Any) -> list[str]:
            return [name for name in files if name.startswith(str(path))]

    writer = filesystem_writer(str(BUNDLE_ROOT), sync_files=False, thread_count=1, overwrite=True)
    writer.fs = DictFileSystem()   # DCP's FileSystem interface, in memory
    writer.path = BUNDLE_ROOT
    return writer


@dataclass(frozen=True)
class Bundle:
    manifest: Manifest
    data: dict[str, Any]       # file name -> its bytes (bytes, or a view of the received buffer)
    source: str = "memory"     # where the agent had it: its own store, or a peer's (peer_memory)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.data.values())


def serialize(state: dict[str, Any], *, step: int, checkpoint_id: str, algorithm: str,
              extra: dict[str, Any]) -> Bundle:
    """This rank's state as a single-process DCP checkpoint in memory, with its manifest."""
    import torch.distributed.checkpoint as dcp

    raw: dict[str, bytes] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        metadata = dcp.save(state, storage_writer=_memory_writer(raw), no_dist=True)
    data = {PurePosixPath(name).relative_to(BUNDLE_ROOT).as_posix(): blob for name, blob in raw.items()}
    if METADATA_NAME not in data:
        raise CheckpointError("the in-memory DCP save wrote no .metadata")
    items: list[ItemEntry] = []
    for index, info in metadata.storage_data.items():
        blob = data[info.relative_path]
        chunk = memoryview(blob)[info.offset:info.offset + info.length]
        items.append(ItemEntry(key=item_key(index), file=info.relative_path, offset=int(info.offset),
                               length=int(info.length), hash=hash_bytes(chunk, algorithm)))
    files = [FileEntry(path=name, size=len(blob), hash=hash_bytes(blob, algorithm)) for name, blob in sorted(data.items())]
    manifest = Manifest(step=step, checkpoint_id=checkpoint_id, world_size=1, files=files, items=items,
                        metadata_file=METADATA_NAME, metadata_hash=next(f.hash for f in files if f.path == METADATA_NAME),
                        hash_algorithm=algorithm, extra={"memory": True, **extra})
    return Bundle(manifest=manifest, data=data)


# ---- reading a bundle -------------------------------------------------------------------------------

class BundleReader(VerifyingReader):
    """VerifyingReader over a bundle's bytes: the same checks (sizes, `.metadata` hash before the
    allow-list unpickler, the item index, every item's hash before torch.load)."""

    def __init__(self, bundle: Bundle) -> None:
        for entry in bundle.manifest.files:
            blob = bundle.data.get(entry.path)
            if blob is None:
                raise ValidationError(f"memory bundle of step {bundle.manifest.step} lacks {entry.path}")
            if len(blob) != entry.size:
                raise ValidationError(f"memory bundle of step {bundle.manifest.step}: {entry.path} is {len(blob)} "
                                      f"bytes, its manifest says {entry.size}")
        if len(bundle.data.get(METADATA_NAME, b"")) > MAX_METADATA_BYTES:
            raise ValidationError("memory bundle: .metadata larger than any real one")
        super().__init__(Path("memory") / f"step_{bundle.manifest.step}", bundle.manifest, adopt=True)
        self.bundle = bundle
        self.read_memory: set[str] = set()

    def _metadata_bytes(self) -> bytes:
        return bytes(self.bundle.data[self.manifest.metadata_file])

    def _fetch_item(self, item: Any, fds: dict[Path, int]) -> Any:
        import torch

        from ..checkpoint.validate import verify_item

        view = memoryview(self.bundle.data[item.file])[item.offset:item.offset + item.length]
        verify_item(view, item)
        self.read_memory.add(item.file)
        if not view.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        # the item's tensors may keep living in the received (writable) buffer, adopt=True: no
        # copy; a read-only one is copied, since an optimizer state loaded from it is written to
        return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


# ---- the channel to the agent -----------------------------------------------------------------------

class MemoryClient:
    """One rank's connection to its agent's memory store (opened per use: a save every N steps
    and one resume do not need a standing connection)."""

    def __init__(self, *, socket_path: str, secret_file: str | None, rank: int) -> None:
        self.socket_path = socket_path
        self.secret = read_secret(secret_file, named_by=SECRET_FILE) if secret_file else b""
        self.rank = rank

    @contextlib.contextmanager
    def session(self) -> Any:
        """One authenticated exchange with the agent. A connection it drops mid-exchange is a
        MemoryChannelError, as a short read is (a clean-clone run saw BrokenPipeError escape a get)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(self.socket_path)
            sock.settimeout(None)
            try:
                yield Session.connect(sock, self.secret, role=f"rank{self.rank}", max_payload=1 << 40)
            except ConnectionError as e:   # broken pipe, reset: no timeout is set after the connect
                raise MemoryChannelError(f"the agent closed the memory channel mid-exchange: {e}") from None
        finally:
            sock.close()

    def put(self, bundle: Bundle) -> None:
        names = [f.path for f in bundle.manifest.files]
        with self.session() as s:
            s.send(MemoryOp.PUT, {"step": bundle.manifest.step, "rank": self.rank,
                                  "checkpoint_id": bundle.manifest.checkpoint_id, "manifest": bundle.manifest.to_json(),
                                  "sizes": [len(bundle.data[n]) for n in names]},
                   [bundle.data[n] for n in names])
            op, body, _ = s.recv()
        if op is not MemoryOp.STORED:
            raise CheckpointError(f"the agent did not keep the memory bundle: {body.get('reason', op.value)}")

    def _list(self) -> dict[str, Any]:
        """The store's `held` answer for this rank ({} for any other answer)."""
        with self.session() as s:
            s.send(MemoryOp.LIST, {"rank": self.rank})
            op, body, _ = s.recv()
        return body if op is MemoryOp.HELD else {}

    def held(self) -> list[tuple[int, str]]:
        rows = self._list().get("held")
        if not isinstance(rows, list):
            return []
        return [(r[0], r[1]) for r in rows if isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                and isinstance(r[1], str)]

    def stored_bytes(self) -> int:
        """What the agent's store holds now, every rank's and every replica together (0 when it
        cannot say): memory a fit check must not count as taken by the job."""
        try:
            value = self._list().get("bytes")
        except (MemoryChannelError, OSError):
            return 0
        return value if type(value) is int and value >= 0 else 0

    def get(self, step: int, *, from_peers: bool = False) -> Bundle:
        """This rank's bundle of `step`: its agent's copy, or (`from_peers`: that copy was refused)
        a copy the agent fetches from the peer agents that hold one."""
        with self.session() as s:
            s.send(MemoryOp.GET, {"step": step, "rank": self.rank, **({"from": "peers"} if from_peers else {})})
            op, body, payload = s.recv()
        if op is not MemoryOp.BUNDLE:
            raise ValidationError(f"the agent holds no memory bundle of step {step} for rank {self.rank}")
        manifest = Manifest.from_json(str(body.get("manifest", "")), source=f"memory bundle of step {step}")
        sizes = body.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(manifest.files) or sum(sizes) != len(payload):
            raise ValidationError(f"memory bundle of step {step}: its payload does not split into its manifest's files")
        data, at, whole = {}, 0, memoryview(payload)
        for entry, size in zip(manifest.files, sizes):
            data[entry.path] = whole[at:at + size]   # views of the one received buffer, no copies
            at += size
        if manifest.step != step or manifest.checkpoint_id != body.get("checkpoint_id"):
            raise ValidationError(f"memory bundle of step {step} is labelled step {manifest.step}")
        source = "peer_memory" if body.get("source") == "peer_memory" else "memory"
        return Bundle(manifest=manifest, data=data, source=source)


# ---- the rank's memory saves ------------------------------------------------------------------------

@dataclass(kw_only=True)
class MemorySaveResult:
    step: int
    ok: bool
    stall_s: float
    write_s: float = 0.0
    bytes: int = 0
    reason: str = ""


AUTO_SHARE = 0.5   # of the node's available memory: the rest stays for the job itself


def fit_budget(available_bytes: int, *, keep: int, local_ranks: int, replicas: int) -> int:
    """`[memory] max_bytes = auto`: the largest bundle a rank may hand its agent so that every copy
    fits in half of what the node has available: the agent keeps `keep` bundles per rank and takes
    one more before it drops the oldest, for each rank on the node, and holds as many of each buddy
    node's ranks for every replica."""
    copies = (keep + 1) * max(local_ranks, 1) * (1 + replicas)
    return int(available_bytes * AUTO_SHARE) // copies


class MemorySaver:
    """One memory save in flight at a time; a save due while one is in flight is skipped.
    `max_bytes`: a larger bundle turns the tier off for this rank (0 = no limit); a callable is
    asked once, at the first save, when the model and optimizer already take their memory."""

    def __init__(self, client: MemoryClient, *, algorithm: str, max_bytes: "int | Callable[[], tuple[int, str]]",
                 on_result: Callable[[MemorySaveResult], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.algorithm = algorithm
        self.max_bytes = max_bytes
        self.why_limit = "" if callable(max_bytes) else f"[memory] max_bytes = {max_bytes}"
        self.on_result = on_result
        self.clock = clock
        self.stager = Stager()
        self.disabled = ""
        self.skipped = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsup-memory")
        self._inflight: concurrent.futures.Future | None = None

    def _limit(self) -> tuple[int, str]:
        if callable(self.max_bytes):
            self.max_bytes, self.why_limit = self.max_bytes()
        return self.max_bytes, self.why_limit

    def save(self, *, step: int, checkpoint_id: str, device_state: dict[str, Any], side_state: dict[str, Any],
             extra: dict[str, Any]) -> bool:
        if self.disabled:
            return False
        if self._inflight is not None and not self._inflight.done():
            self.skipped += 1
            return False
        start = self.clock()
        staged = self.stager.stage(device_state)
        staged.update(side_state)
        stall = self.clock() - start
        self._inflight = self._pool.submit(self._run, step, checkpoint_id, staged, stall, extra)
        return True

    def _run(self, step: int, checkpoint_id: str, staged: dict[str, Any], stall: float, extra: dict[str, Any]) -> None:
        start = self.clock()
        try:
            bundle = serialize(staged, step=step, checkpoint_id=checkpoint_id, algorithm=self.algorithm, extra=extra)
            limit, why = self._limit()
            if limit and bundle.nbytes > limit:
                # said once, by on_result's warning: later saves return at once
                self.disabled = (f"a memory bundle of {bundle.nbytes} bytes is over {why}: the memory tier is off "
                                 "for this rank; set [memory] max_bytes (bytes, 0 = no limit) to keep it on")
                raise CheckpointError(self.disabled)
            self.client.put(bundle)
            result = MemorySaveResult(step=step, ok=True, stall_s=stall, write_s=self.clock() - start, bytes=bundle.nbytes)
        except failure_errors() + (MemoryChannelError, OSError) as err:
            result = MemorySaveResult(step=step, ok=False, stall_s=stall, write_s=self.clock() - start,
                                      reason=one_line(err))
        self.on_result(result)

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def newest_common(held_by_rank: list[list[tuple[int, str]]]) -> tuple[int, str] | None:
    """The newest (step, checkpoint id) every rank holds."""
    if not held_by_rank:
        return None
    common = set(map(tuple, held_by_rank[0]))
    for held in held_by_rank[1:]:
        common &= set(map(tuple, held))
    return max(common) if common else None   # type: ignore[return-value]
