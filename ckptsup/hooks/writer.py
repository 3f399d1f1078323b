"""Sharded, asynchronous saves with the commit protocol (docs/checkpoint-core.md §Commit protocol).

Main thread (the only stall): copy the state into host buffers that are allocated once and reused
(pinned when the state lives on a GPU). Background thread, on a gloo process group of its own:
rank 0 makes the temporary directory and broadcasts its name; every rank writes its shards with
DCP, then reads its own files back once to hash each file and each DCP item (the check that DCP's
writer really wrote what its metadata claims, pytorch#191391); an all-gather of the reports makes a
failure on any rank a failure on every rank; rank 0 writes the manifest and commits (rename +
fsync) or aborts; a broadcast tells every rank the outcome. Every collective has the group's
timeout, so a dead peer fails the save instead of hanging it. Training goes on either way.

With a node-local directory (local_stage.py), a rank writes its shards there instead, and its one
read-back both hashes them and copies them into the shared temporary directory (fsync); the
commit on the shared tier is the same. After the commit the local files stay as a cached copy
for a restart on this node; when the local directory is unusable the rank writes to the shared
tier as above.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.commit import abort, commit, make_tmp_dir
from ..checkpoint.hashing import hash_file, hash_file_and_ranges
from ..checkpoint.local_cache import LocalCopy, manifest_digest
from ..checkpoint.manifest import METADATA_NAME, FileEntry, ItemEntry, Manifest
from ..env import TEST_SAVE_DELAY_S
from ..errors import CheckpointError
from .dcp_errors import failure_errors, one_line
from .dcp_writer import filesystem_writer
from .local_stage import LocalStaging

log = logging.getLogger("ckptsup.hooks")


def item_key(index: Any) -> str:
    """Manifest key of one DCP item (MetadataIndex): fqn@chunk-offsets."""
    offset = ",".join(str(int(o)) for o in (index.offset or ()))
    return f"{index.fqn}@{offset}"


@dataclass(kw_only=True)
class SaveResult:
    step: int
    ok: bool
    reason: str = ""
    path: str = ""
    stall_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0

    @property
    def total_s(self) -> float:
        return self.stall_s + self.write_s


class CopyTargetError(CheckpointError):
    """Writing the copy failed: the destination's fault (the shared tier), not the source's."""


def _to_target(path: Path, op: Callable[[], Any]) -> Any:
    try:
        return op()
    except OSError as err:
        raise CopyTargetError(f"writing {path}: {err.strerror or err}") from None


def hash_file_and_items(path: Path, items: list[tuple[str, int, int]], algorithm: str, *,
                        copy_to: Path | None = None) -> tuple[int, str, dict[str, str]]:
    """One sequential read of `path`: (size, file hash, {item key: hash}). `items` are
    (key, offset, length), non-overlapping. With copy_to, the same read also writes the bytes to
    that new file (0600, fsynced), so the hashes are of exactly what was copied; a failure to
    write it raises CopyTargetError."""
    fds: list[int] = []  # the copy, created once the source is open (a missing source is not the target's fault)

    def target() -> int:
        assert copy_to is not None   # only called with a copy to make
        if not fds:
            fds.append(_to_target(copy_to, lambda: os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)))
        return fds[0]

    def write(chunk: memoryview) -> None:
        assert copy_to is not None
        rest, out = chunk, target()
        while rest:
            rest = rest[_to_target(copy_to, lambda: os.write(out, rest)):]

    try:
        whole, size, hashes = hash_file_and_ranges(path, algorithm, [(off, length, algorithm) for _, off, length in items],
                                                    sink=None if copy_to is None else write)
        if copy_to is not None:
            out = target()  # an empty source still gets its (empty) copy
            _to_target(copy_to, lambda: os.fsync(out))
    finally:
        for fd in fds:
            os.close(fd)
    short = [(off, key, length) for key, off, length in items if off + length > size]
    if short:
        off, key, length = min(short)
        raise CheckpointError(f"{path.name} is {size} bytes but DCP says item {key} ends at "
                              f"{off + length}: the shard was not fully written")
    return size, whole, {key: h for (key, _, _), h in zip(items, hashes)}


def _private_writer(target: Path, *, thread_count: int) -> Any:
    """DCP's FileSystemWriter, creating every file 0600 and every directory 0700 from the start
    (DCP opens with the umask's 0644: a save interrupted before our chmod would leave readable
    shards)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class PrivateFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if "r" in mode and "+" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
            fd = os.open(path, flags, 0o600)
            with os.fdopen(fd, mode) as stream:
                yield stream

        def mkdir(self, path: Any) -> None:
            Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)

    writer = filesystem_writer(target, sync_files=True, thread_count=thread_count, overwrite=False)
    writer.fs = PrivateFileSystem()
    return writer


def _file_owner(relative_path: str, world_size: int) -> int:
    """DCP names rank r's files __<r>_<n>.distcp; anything else is hashed by rank 0."""
    if relative_path.startswith("__"):
        head = relative_path[2:].split("_", 1)[0]
        if head.isdigit() and int(head) < world_size:
            return int(head)
    return 0


class Stager:
    """Copies the live state into host buffers allocated on first use and reused while the
    structure (keys, shapes, dtypes) stays the same; pinned when the state is on a GPU."""

    def __init__(self) -> None:
        self._signature: Any = None
        self._buffers: dict[str, Any] | None = None

    @staticmethod
    def _signature_of(state: Any) -> Any:
        import torch

        if isinstance(state, dict):
            return tuple((k, Stager._signature_of(v)) for k, v in state.items())
        if isinstance(state, (list, tuple)):
            return tuple(Stager._signature_of(v) for v in state)
        if isinstance(state, torch.Tensor):
            return ("T", tuple(state.shape), str(state.dtype), str(state.device), type(state).__name__)
        return type(state).__name__

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        signature = self._signature_of(state)
        on_gpu = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in _leaves(state))
        if signature != self._signature or self._buffers is None:
            self._buffers = _create_cpu_state_dict(state, pin_memory=on_gpu)
            self._signature = signature
        staged = _copy_state_dict(state, self._buffers, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        return staged


def _leaves(obj: Any):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


@dataclass(kw_only=True)
class WriterConfig:
    checkpoint_dir: Path
    rank: int
    world_size: int
    job_id: str
    attempt: int
    epoch: int
    run_dir: str | None
    algorithm: str = "xxh3-128"
    thread_count: int = 1
    mesh: dict[str, Any] = field(default_factory=dict)
    node_local_dir: Path | None = None   # the node-local cache tier; None = off
    local_rank: int = 0
    keep_local: int = 3                  # local copies kept (checkpoint.keep_last)


class CheckpointWriter:
    """One save in flight at a time. `save(..., blocking=False)` stages, then returns; the outcome
    arrives through `on_result` (called on the background thread) and `wait()`."""

    def __init__(self, config: WriterConfig, *, process_group: Any, on_result: Callable[[SaveResult], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pg = process_group
        self.on_result = on_result
        self.clock = clock
        self.stager = Stager()
        self.local = LocalStaging(config.node_local_dir, rank=config.rank, local_rank=config.local_rank,
                                  keep_last=config.keep_local)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsup-save")
        self._inflight: concurrent.futures.Future | None = None
        self.last: SaveResult | None = None

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save (if any) finished; its result."""
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        return self.last

    def save(self, *, step: int, device_state: dict[str, Any], side_state: dict[str, Any],
             blocking: bool, extra_meta: dict[str, Any] | None = None) -> SaveResult | None:
        start = self.clock()
        self.wait()  # buffers are reused: the previous save must be done with them
        staged = self.stager.stage(device_state)
        staged.update(side_state)
        stall_s = self.clock() - start
        job = lambda: self._run(step, staged, stall_s, extra_meta or {})  # noqa: E731
        self._inflight = self._pool.submit(job)
        if blocking:
            return self.wait()
        return None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)

    # ---- background ---------------------------------------------------------------------------
    def _run(self, step: int, staged: dict[str, Any], stall_s: float, extra_meta: dict[str, Any]) -> SaveResult:
        start = self.clock()
        try:
            path, nbytes = self._write_and_commit(step, staged, extra_meta)
            result = SaveResult(step=step, ok=True, path=str(path), stall_s=stall_s,
                                write_s=self.clock() - start, bytes=nbytes)
        except failure_errors() as err:
            # gloo timeouts, DCP's CheckpointException, storage errors: the save failed, training goes on
            reason = one_line(err)
            result = SaveResult(step=step, ok=False, reason=reason, stall_s=stall_s, write_s=self.clock() - start)
        self.last = result
        self.on_result(result)
        return result

    def _collective(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as err:
            raise CheckpointError(f"save collective {name} failed ({str(err).splitlines()[0][:200]}); "
                                  "a peer rank died or timed out") from None

    def _broadcast(self, value: Any) -> Any:
        if self.pg is None:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.pg))
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if self.pg is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.config.world_size
        self._collective("all_gather", lambda: dist.all_gather_object(out, value, group=self.pg))
        return out

    def _write_and_commit(self, step: int, staged: dict[str, Any], extra_meta: dict[str, Any]) -> tuple[Path, int]:
        cfg = self.config
        made: tuple[str | None, str] = (None, "")
        if cfg.rank == 0:
            try:
                made = (str(make_tmp_dir(cfg.checkpoint_dir, step=step, attempt=cfg.attempt)), "")
            except (CheckpointError, OSError) as err:
                made = (None, str(err))
        tmp_name, tmp_error = self._broadcast(made)
        if tmp_name is None:
            raise CheckpointError(f"could not create the temporary directory: {tmp_error}")
        tmp = Path(tmp_name)
        staging = self.local.begin(step=step, attempt=cfg.attempt, state_bytes=_state_bytes(staged))
        kept = False
        local_error: str | None = None
        try:
            report, local_error = self._write_shards(step, tmp, staged, staging)
            reports = self._all_gather(report)
            failed = list(dict.fromkeys(rep["error"] for rep in reports if not rep["ok"]))  # DCP repeats one cause on every rank
            outcome: tuple[bool, str, int, tuple[str, str]] = (False, "", 0, ("", ""))
            if cfg.rank == 0:
                outcome = self._commit_or_abort(step, tmp, reports, failed, extra_meta)
            ok, detail, nbytes, (checkpoint_id, manifest_hash) = self._broadcast(outcome)
            if ok and staging is not None and manifest_hash:
                self.local.committed(staging, LocalCopy(step=step, checkpoint_id=checkpoint_id, manifest_hash=manifest_hash,
                                                        files=[FileEntry(**f) for f in report["files"]]))
                kept = True
        finally:
            if staging is not None and not kept:
                self.local.failed(staging, here=local_error)
        if not ok:
            raise CheckpointError(detail)
        return Path(detail), nbytes

    def _write_shards(self, step: int, tmp: Path, staged: dict[str, Any], staging: Path | None) -> tuple[dict[str, Any], str | None]:
        """Write this rank's shards into tmp, or into the node-local staging dir and from there
        into tmp. Returns (report, this rank's own node-local failure, if that is what failed)."""
        import torch.distributed.checkpoint as dcp

        cfg = self.config
        target = tmp if staging is None else staging
        try:
            writer = _private_writer(target, thread_count=cfg.thread_count)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
                metadata = dcp.save(staged, storage_writer=writer, process_group=self.pg, no_dist=self.pg is None)
            # fault injection for tests (kill during an async save); never set in production
            delay = float(os.environ.get(TEST_SAVE_DELAY_S, "0") or 0)
            if delay > 0:
                print(f"ckptsup-test: rank {cfg.rank} delaying the commit of step {step}", file=sys.stderr, flush=True)
                time.sleep(delay)
            described = self._describe_own(target, metadata, copy_to=None if staging is None else tmp)
            if staging is not None and cfg.rank == 0:
                # DCP's coordinator wrote .metadata next to its shards: the commit hashes it on the shared tier
                hash_file_and_items(staging / METADATA_NAME, [], cfg.algorithm, copy_to=tmp / METADATA_NAME)
                os.unlink(staging / METADATA_NAME)  # the pickle is only ever read from the shared copy
            return {"ok": True, "error": "", "local": staging is not None, **described}, None
        except failure_errors() as err:
            on_shared = staging is None or isinstance(err, CopyTargetError)
            text = one_line(err) + _space_hint(tmp if on_shared else target)
            log.error("ckptsup: rank %d failed writing step %d%s: %s", cfg.rank, step,
                      "" if staging is None else " (via the node-local dir)", text)
            here = text if not on_shared and _failed_on(err, cfg.rank) else None
            return {"ok": False, "error": text, "local": staging is not None}, here

    def _describe_own(self, tmp: Path, metadata: Any, *, copy_to: Path | None = None) -> dict[str, Any]:
        cfg = self.config
        per_file: dict[str, list[tuple[str, int, int]]] = {}
        for index, info in metadata.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"DCP stream transforms ({info.transform_descriptors}) are not supported")
            per_file.setdefault(info.relative_path, []).append((item_key(index), int(info.offset), int(info.length)))
        files: list[dict[str, Any]] = []
        items: list[dict[str, Any]] = []
        for rel, entries in sorted(per_file.items()):
            if _file_owner(rel, cfg.world_size) != cfg.rank:
                continue
            os.chmod(tmp / rel, 0o600)  # DCP creates files with the umask's mode
            size, fhash, ihash = hash_file_and_items(tmp / rel, entries, cfg.algorithm,
                                                     copy_to=None if copy_to is None else copy_to / rel)
            files.append({"path": rel, "size": size, "hash": fhash})
            items.extend({"key": key, "file": rel, "offset": off, "length": length, "hash": ihash[key]}
                         for key, off, length in entries)
        return {"files": files, "items": items, "storage_files": sorted(per_file)}

    def _commit_or_abort(self, step: int, tmp: Path, reports: list[dict[str, Any]], failed: list[str],
                         extra_meta: dict[str, Any]) -> tuple[bool, str, int, tuple[str, str]]:
        """(ok, committed path or the reason, bytes, (checkpoint_id, manifest hash) for the
        ranks' node-local copies)."""
        cfg = self.config
        try:
            if failed:
                raise CheckpointError("; ".join(failed))
            files = [FileEntry(**f) for rep in reports for f in rep["files"]]
            items = [ItemEntry(**it) for rep in reports for it in rep["items"]]
            described = {f.path for f in files}
            missing = sorted(set(reports[0]["storage_files"]) - described)
            if missing:
                raise CheckpointError(f"no rank described {', '.join(missing[:3])}")
            os.chmod(tmp / METADATA_NAME, 0o600)
            meta_hash = hash_file(tmp / METADATA_NAME, cfg.algorithm)
            files.append(FileEntry(path=METADATA_NAME, size=os.path.getsize(tmp / METADATA_NAME), hash=meta_hash))
            manifest = Manifest(step=step, job_id=cfg.job_id, attempt=cfg.attempt, epoch=cfg.epoch,
                                world_size=cfg.world_size, mesh=dict(cfg.mesh), files=files, items=items,
                                metadata_file=METADATA_NAME, metadata_hash=meta_hash,
                                hash_algorithm=cfg.algorithm, versions=_versions(), extra=extra_meta)
            path = commit(tmp, manifest, checkpoint_dir=cfg.checkpoint_dir, run_dir=cfg.run_dir)
        except (CheckpointError, OSError) as err:
            try:
                abort(tmp)
            except (CheckpointError, OSError) as abort_err:
                log.error("ckptsup: could not remove %s: %s", tmp, abort_err)
            return False, str(err).splitlines()[0][:300] if str(err) else type(err).__name__, 0, ("", "")
        identity = ("", "")
        if any(rep.get("local") for rep in reports):
            try:  # committed whatever happens here: without the hash, ranks just keep no local copy
                identity = (manifest.checkpoint_id, manifest_digest(path, cfg.algorithm))
            except (CheckpointError, OSError) as err:
                log.warning("ckptsup: could not read back the manifest of step %d for the node-local copies: %s", step, err)
        return True, str(path), manifest.total_bytes, identity


def _failed_on(err: BaseException, rank: int) -> bool:
    """Whether this rank's own part failed: DCP reports every rank's failure on every rank
    (CheckpointException.failures); any other error is this rank's own."""
    failures = getattr(err, "failures", None)
    return rank in failures if isinstance(failures, dict) else True


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds (a DTensor counts its local shard): what its save writes at most."""
    import torch

    total = 0
    for leaf in _leaves(state):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
            total += local.numel() * local.element_size()
    return total


def _space_hint(directory: Path) -> str:
    """torch.save hides ENOSPC behind 'unexpected pos'; say what the file system says."""
    try:
        st = os.statvfs(directory.parent)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free < 16 << 20 or free < 0.01 * st.f_blocks * st.f_frsize:
        return f" (only {free / 1e6:.1f} MB free on {directory.parent}: storage full?)"
    return ""


def _versions() -> dict[str, str]:
    import torch

    from .._version import __version__

    return {"torch": torch.__version__, "ckptsup": __version__}
