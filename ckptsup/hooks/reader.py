"""Reading a checkpoint: nothing is trusted before the manifest vouches for it.

Before anything is unpickled: the directory passes the trust checks, the manifest parses, every
listed file is present with its size, the structure checks of level 2 pass, and DCP's `.metadata`
bytes hash to the manifest's metadata_hash. Those bytes (read once) are then unpickled with an
allow-list of exactly the globals DCP's metadata holds (pytorch#189308: DCP uses raw pickle.load),
and the result must be DCP's Metadata of the expected shape; anything else is a ValidationError,
so the resume falls back to an older checkpoint.

While loading, every item is read once (offset, length), hashed against the manifest, and only
then handed to torch.load(weights_only=True): one read, not two; a resharded load reads the saved
items it needs, never whole files. A mismatch raises ValidationError, so resume falls back.

With node-local copies (checkpoint/local_cache.py: same checkpoint, same size and hash as the
manifest), an item is read from the local file first; a local item that fails its hash (or a
local file that cannot be read) sends the rest of that file to the shared copy, with a warning,
so a bad cache never fails a resume or condemns a good checkpoint. `.metadata` is always the
shared copy.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import stat
from pathlib import Path
from typing import Any

from ..checkpoint.hashing import algorithm_of, hash_bytes, open_regular
from ..checkpoint.manifest import Manifest, load_manifest, read_nofollow
from ..checkpoint.trust import check_dir_trusted
from ..checkpoint.validate import RECORD_NAMES, check_level2, verify_item
from ..errors import CheckpointError, ValidationError
from .writer import item_key

log = logging.getLogger("ckptsup.hooks")

MAX_METADATA_BYTES = 1 << 30

# Exactly the globals a DCP `.metadata` pickle holds, recorded from real files (torch 2.13; see
# tests/test_hooks_metadata.py, which writes DCP checkpoints of a model, an optimizer, a
# torchtitan-like nested state and a DTensor with FileSystemWriter and with ckptsup's own writer,
# and records every global the unpickler is asked for): DCP's metadata dataclasses, the enum
# TensorProperties encodes a memory format with, torch.Size, the layout lookup DCP pickles
# torch.strided through, and pathlib paths (StorageMeta.checkpoint_id). Plus torch's dtype, layout
# and memory-format objects by name (a value, never a callable) and collections.OrderedDict.
# Nothing else: not the other classes of torch.distributed.checkpoint, some of which act when
# constructed (a stager's __init__ creates a directory), not builtins, not a module.
ALLOWED_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def load_metadata_bytes(data: bytes) -> Any:
    """DCP's Metadata from `.metadata` bytes (already hash-checked against the manifest), through
    the allow-list, then checked to be the shape DCP's load and our reader rely on. Anything else
    is a ValidationError: the checkpoint's content is bad (quarantine, fall back to an older one)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except MemoryError:   # a length far past the data's end: the C unpickler allocates it before reading
        raise ValidationError(f"DCP .metadata could not be read safely: it asks for more memory than its "
                              f"{len(data)} bytes could hold (a length past the end of the data)") from None
    except Exception as err:   # a crafted pickle can make any constructor it names raise anything
        raise ValidationError(f"DCP .metadata could not be read safely: {type(err).__name__}: {str(err)[:200]}") from None
    check_metadata_shape(metadata)
    return metadata


def check_metadata_shape(metadata: Any) -> None:
    """Refuse (ValidationError) an unpickled object that is not DCP's Metadata with the fields DCP's
    load planner and VerifyingReader use, of the types they expect: unpickling sets attributes
    from the file without any constructor, so a field may be missing or of any allowed type."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    def bad(what: str) -> ValidationError:
        return ValidationError(f"DCP .metadata is not DCP's checkpoint metadata: {what}")

    def is_size(value: Any, dims: int | None = None) -> bool:
        return (type(value) is torch.Size and all(type(d) is int and d >= 0 for d in value)
                and (dims is None or len(value) == dims))

    if type(metadata) is not Metadata:
        raise bad(f"it holds a {type(metadata).__name__}")
    fields = vars(metadata)
    entries, storage = fields.get("state_dict_metadata"), fields.get("storage_data")
    if type(entries) is not dict or type(storage) is not dict:
        raise bad("state_dict_metadata and storage_data must be dicts")
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise bad(f"a state_dict_metadata key is a {type(fqn).__name__}")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise bad(f"{fqn[:80]!r} is described by a {type(entry).__name__}")
        props: Any = getattr(entry, "properties", None)
        size: Any = getattr(entry, "size", None)
        chunks: Any = getattr(entry, "chunks", None)
        if (type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype)
                or not is_size(size) or type(chunks) is not list):
            raise bad(f"{fqn[:80]!r} has no valid dtype, size or chunk list")
        for chunk in chunks:
            if (type(chunk) is not ChunkStorageMetadata or not is_size(getattr(chunk, "offsets", None), len(size))
                    or not is_size(getattr(chunk, "sizes", None), len(size))):
                raise bad(f"{fqn[:80]!r} has a chunk that is not offsets and sizes of its {len(size)} dimensions")
    for index, info in storage.items():
        offset = getattr(index, "offset", None)
        if type(index) is not MetadataIndex or type(getattr(index, "fqn", None)) is not str or not (offset is None or is_size(offset)):
            raise bad("a storage_data key is not a MetadataIndex of a name and an offset")
        if (type(info) is not _StorageInfo or type(getattr(info, "relative_path", None)) is not str
                or type(getattr(info, "offset", None)) is not int or type(getattr(info, "length", None)) is not int):
            raise bad(f"storage of {index.fqn[:80]!r} is not a file, an offset and a length")
    storage_meta, version = fields.get("storage_meta"), fields.get("version")
    if storage_meta is not None and type(storage_meta) is not StorageMeta:
        raise bad(f"storage_meta is a {type(storage_meta).__name__}")
    if version is not None and type(version) is not str:
        raise bad(f"version is a {type(version).__name__}")


def preload_checks(step_dir: Path) -> Manifest:
    """Levels 1 (sizes, no hashing: the per-item hashes are checked while reading) and 2.
    Nothing is unpickled here. Raises a CheckpointError subclass with one line."""
    check_dir_trusted(step_dir, recursive=True, skip=RECORD_NAMES)
    manifest = load_manifest(step_dir)
    for entry in manifest.files:
        try:
            st = os.lstat(step_dir / entry.path)
        except FileNotFoundError:
            raise ValidationError(f"{step_dir.name}/{entry.path} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{step_dir.name}/{entry.path} is not a regular file")
        if st.st_size != entry.size:
            raise ValidationError(f"{step_dir.name}/{entry.path} is {st.st_size} bytes, the manifest says {entry.size}")
    problems = check_level2(step_dir, manifest)
    if problems:
        raise ValidationError(f"{step_dir.name}: {problems[0]}")
    if not manifest.metadata_file:
        raise ValidationError(f"{step_dir.name} has no DCP metadata; it is not a ckptsup training checkpoint")
    return manifest


def _file_reader_base():
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class VerifyingReader(_file_reader_base()):  # type: ignore[misc]
    """A DCP FileSystemReader that reads only what the manifest vouches for."""

    def __init__(self, step_dir: str | os.PathLike[str], manifest: Manifest | None = None, *,
                 adopt: bool = False) -> None:
        """adopt=True: the load targets are scratch buffers, so an item that fills a whole target
        replaces it instead of being copied into it (one memory pass less)."""
        super().__init__(step_dir)
        self.adopt = adopt
        self.step_dir = Path(step_dir)
        self.manifest = manifest if manifest is not None else preload_checks(self.step_dir)
        self.items = {item.key: item for item in self.manifest.items}
        self._metadata: Any = None
        self.bytes_read = 0
        self.local_files: dict[str, Path] = {}
        self.read_local: set[str] = set()
        self.read_shared: set[str] = set()
        self.local_fallbacks: set[str] = set()

    def use_local(self, files: dict[str, Path]) -> None:
        """Read these manifest files from their node-local copies (checkpoint.local_cache.find_local_files)."""
        self.local_files = {rel: path for rel, path in files.items() if rel != self.manifest.metadata_file}

    def tier_counts(self) -> dict[str, int]:
        """Files read from each tier (a file that fell back counts as shared)."""
        return {"read_local_files": len(self.read_local - self.read_shared), "read_shared_files": len(self.read_shared),
                "local_fallback_files": len(self.local_fallbacks)}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata is not used by ckptsup checkpoints")
        if self._metadata is None:
            name = self.manifest.metadata_file
            data = self._metadata_bytes()
            actual = hash_bytes(data, algorithm_of(self.manifest.metadata_hash))
            if actual != self.manifest.metadata_hash:
                raise ValidationError(f"{self.step_dir.name}/{name}: hash {actual} != {self.manifest.metadata_hash}; "
                                      "checkpoint is corrupt (nothing was unpickled)")
            metadata = load_metadata_bytes(data)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._check_index(metadata)
            self._metadata = metadata
        return self._metadata

    def _metadata_bytes(self) -> bytes:
        return read_nofollow(self.step_dir / self.manifest.metadata_file, limit=MAX_METADATA_BYTES)

    def _check_index(self, metadata: Any) -> None:
        """Every item DCP's metadata points at is an item the manifest hashed, at the same place."""
        for index, info in metadata.storage_data.items():
            item = self.items.get(item_key(index))
            if item is None or item.file != info.relative_path or item.offset != info.offset or item.length != info.length:
                raise ValidationError(f"{self.step_dir.name}: DCP item {item_key(index)} does not match the manifest's item index")
            if getattr(info, "transform_descriptors", None):
                raise ValidationError(f"{self.step_dir.name}: DCP stream transforms are not supported")

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Items in file order; a helper thread reads and hashes the next item while this one is
        deserialised, so the device read overlaps the CPU work. Each saved item is read once even
        when several requests (a resharded load) need parts of it."""
        import concurrent.futures

        from torch.futures import Future

        grouped: dict[str, tuple[Any, list[Any]]] = {}
        for req in plan.items:
            item = self.items[item_key(req.storage_index)]
            grouped.setdefault(item.key, (item, []))[1].append(req)
        order = sorted(grouped.values(), key=lambda pair: (pair[0].file, pair[0].offset))
        fds: dict[Path, int] = {}
        def fetch(item: Any) -> Any:
            return self._fetch_item(item, fds)

        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsup-read") as pool:
                ahead = pool.submit(fetch, order[0][0]) if order else None
                for i, (item, reqs) in enumerate(order):
                    assert ahead is not None   # submitted for every item of `order`
                    data = ahead.result()
                    ahead = pool.submit(fetch, order[i + 1][0]) if i + 1 < len(order) else None
                    self.bytes_read += len(data)
                    self._apply(data, item, reqs, planner)
        finally:
            for fd in fds.values():
                os.close(fd)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fetch_item(self, item: Any, fds: dict[Path, int]) -> Any:
        """One saved item's bytes (a uint8 tensor), hash-checked: from the node-local copy when
        there is a good one, else the shared copy."""
        import torch

        data = torch.empty(item.length, dtype=torch.uint8)  # not zero-filled, unlike bytearray
        view = memoryview(data.numpy())   # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs say otherwise
        local = self.local_files.get(item.file)
        if local is not None:
            try:
                _read_item(fds, local, view, item)
                self.read_local.add(item.file)
                return data
            except (ValidationError, OSError) as err:  # a bad cache: the shared copy decides
                del self.local_files[item.file]
                self.local_fallbacks.add(item.file)
                log.warning("ckptsup: node-local copy %s is unusable (%s); reading %s from the shared tier",
                            local, err, item.file)
                if isinstance(err, ValidationError):
                    _discard(local)  # a cache entry that fails its hash is worth nothing
        _read_item(fds, self.step_dir / item.file, view, item)
        self.read_shared.add(item.file)
        return data

    def _apply(self, data: Any, item: Any, reqs: list[Any], planner: Any) -> None:
        """Deserialise one verified item (a uint8 tensor) into every request that needs it."""
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        stored = None
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.numpy().tobytes()))
                continue
            if stored is None:
                stored = load_tensor_in_place(data)
            tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ValidationError(f"item {item.key}: stored size {tuple(tensor.size())} != expected {tuple(target.size())}")
            adopted = (self.adopt and len(reqs) == 1 and _fills(req, stored, target)
                       and hasattr(planner, "adopt_tensor") and planner.adopt_tensor(req, stored))
            if not adopted:
                target.copy_(tensor)
                planner.commit_tensor(req, target)


def _read_item(fds: dict[Path, int], path: Path, view: memoryview, item: Any) -> None:
    if path not in fds:
        fds[path] = open_regular(path)
    got = 0
    while got < item.length:
        n = os.preadv(fds[path], [view[got:]], item.offset + got)
        if n == 0:
            break
        got += n
    verify_item(view[:got], item)


def _discard(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError as err:
        log.warning("ckptsup: could not remove the bad node-local copy %s: %s", path, err)


class _BufferFile:
    """A read-only file over a buffer, without copying it (io.BytesIO copies a bytearray)."""

    def __init__(self, buffer: Any) -> None:
        self.view = memoryview(buffer)
        self.pos = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.pos + size)
        chunk = bytes(self.view[self.pos:end])
        self.pos = end
        return chunk

    def readinto(self, target: Any) -> int:
        n = min(len(target), len(self.view) - self.pos)
        memoryview(target)[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def load_tensor_in_place(data: Any) -> Any:
    """torch.load(weights_only=True) of one DCP item whose tensor storage stays inside `data` (as
    torch.load(mmap=True) does with a file): one memory pass less than torch.load, which copies
    every storage out of its zip record. `data` is a uint8 CPU tensor. Falls back to torch.load
    where torch's internals differ; the bytes were hash-verified before either runs."""
    import torch

    raw = data.numpy()
    try:
        from torch import _weights_only_unpickler
        from torch.serialization import _load, _open_zipfile_reader

        with _open_zipfile_reader(_BufferFile(raw)) as zipped:   # type: ignore[arg-type]  # torch's private reader takes any readable file
            return _load(zipped, "cpu", _weights_only_unpickler, overall_storage=data.untyped_storage())
    except (ImportError, AttributeError, TypeError):
        return torch.load(io.BytesIO(raw.tobytes()), map_location="cpu", weights_only=True)


def _fills(req: Any, stored: Any, target: Any) -> bool:
    """The stored item is exactly the whole (plain, CPU) target tensor."""
    import torch

    return (type(target) is torch.Tensor and target.device.type == "cpu" and stored.dtype == target.dtype
            and tuple(stored.shape) == tuple(target.shape) == tuple(req.lengths)
            and not any(req.storage_offsets) and not any(req.dest_offsets))


def _safe_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, but non-tensor items load with weights_only=True."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

        def adopt_tensor(self, read_item: Any, tensor: Any) -> bool:
            """Use the freshly loaded tensor as the value (see VerifyingReader(adopt=True)); only
            for a plain tensor value (a DTensor's local shard must stay inside its DTensor)."""
            import torch
            from torch.distributed.checkpoint._traverse import set_element

            fqn = read_item.dest_index.fqn
            if type(self.state_dict.get(fqn)) is not torch.Tensor:
                return False
            self.state_dict[fqn] = tensor
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], tensor)
            return True

    return SafeLoadPlanner


def safe_load_planner():
    return _safe_planner_class()()
