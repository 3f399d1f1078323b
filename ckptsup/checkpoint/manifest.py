"""manifest.json: the one thing about a checkpoint that is ever trusted
(docs/checkpoint-core.md §On disk).

It lists every file with its size and hash, DCP's item index (one entry per stored chunk: file,
offset, length, hash) and the hash of DCP's `.metadata`, so validation levels 1-2 never unpickle
anything. Parsing is strict: unknown keys, wrong types and any path that could leave the
checkpoint directory (absolute, `..`, backslashes, NUL, empty components) are refused with one
line naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..safe_io import encodable, loads_json, read_regular
from .hashing import HASH_ALGORITHMS

MANIFEST_NAME = "manifest.json"
VALIDATION_NAME = "validation.json"
METADATA_NAME = ".metadata"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20  # a manifest is JSON metadata; anything bigger is an attack or a bug
MAX_PATH_BYTES = 1024
MAX_INT = (1 << 63) - 1   # sizes, offsets, lengths, counters: what a file system and os.pread take
MAX_STEP = 10 ** 18 - 1   # step_<N> names have at most 18 digits (commit.parse_step)
# Files our own machinery writes into a step dir that the manifest does not (cannot) list.
RESERVED_NAMES = frozenset({MANIFEST_NAME, VALIDATION_NAME})


@dataclass(kw_only=True)
class FileEntry:
    path: str   # relative to the step dir, '/'-separated
    size: int
    hash: str   # "<algorithm>:<hex>"


@dataclass(kw_only=True)
class ItemEntry:
    key: str    # unique per stored chunk (e.g. "model.w@0,0")
    file: str   # relative path of the file holding the bytes
    offset: int
    length: int
    hash: str


@dataclass(kw_only=True)
class Manifest:
    step: int
    checkpoint_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    format_version: int = FORMAT_VERSION
    job_id: str = ""
    attempt: int = 0
    epoch: int = 0
    world_size: int = 1
    mesh: dict[str, Any] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)
    items: list[ItemEntry] = field(default_factory=list)
    metadata_file: str = METADATA_NAME  # "" when the checkpoint has no DCP metadata
    metadata_hash: str = ""
    hash_algorithm: str = "xxh3-128"
    versions: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # vars() instead of asdict(): the entries are flat, and asdict's deep copy dominates
        # for a 100k-item index.
        data["files"] = [vars(f) for f in self.files]
        data["items"] = [vars(it) for it in self.items]
        return json.dumps(data, sort_keys=True, allow_nan=False, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> "Manifest":
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{source}: {len(text)} bytes is larger than any real manifest; refusing it")
        data = loads_json(text, what=source, error=ManifestError)
        if _SURROGATE_ESCAPE.search(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")):
            _refuse_lone_surrogates(data, "manifest", source)   # only a \ud800-style escape can make one
        return _parse_manifest(data, source)

    @property
    def created_datetime(self) -> datetime:
        return parse_created_at(self.created_at)

    def file_map(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def parse_created_at(value: str) -> datetime:
    """An ISO-8601 timestamp as an aware UTC datetime (naive means UTC). ValueError when it is not
    one, or when it cannot be expressed in UTC (year 1 east of Greenwich, year 9999 west of it)."""
    when = datetime.fromisoformat(value)
    if when.tzinfo is None:
        return when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError(f"{value!r} lies outside the years 1-9999 in UTC") from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any, where: str, source: str) -> None:
    """A lone surrogate (JSON's \\ud800 escape unpaired) is no character: no file name, no output
    stream can take it. Refuse the manifest, naming where."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ManifestError(f"{source}: {at} holds a lone surrogate (an unpaired \\ud800-style escape); "
                                    "not a manifest ckptsup wrote") from None
        elif isinstance(item, dict):
            stack.extend((k, f"{at} key") for k in item)
            stack.extend((v, f"{at}.{k}" if isinstance(k, str) and k.isascii() else at) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))


def _refuse_nonfinite(value: Any, key: str, source: str) -> Any:
    """mesh / versions / extra are free-form JSON: a float like 1e400 parses as infinity."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ManifestError(f"{source}: field {key!r} holds a non-finite number")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


# ---- strict parsing -------------------------------------------------------------------------

def check_relpath(path: Any, *, what: str, source: str) -> str:
    """A path inside a checkpoint: relative, '/'-separated, no '..', '.', empty components,
    backslashes or NUL. Returns it unchanged, else raises ManifestError."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{source}: {what} path must be a non-empty string, got {path!r}")
    problem = None
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestError(f"{source}: {what} path {path[:80]!r} holds a lone surrogate and cannot be a file name; "
                            "a manifest may only name files inside its step directory") from None
    if len(encoded) > MAX_PATH_BYTES:
        problem = "is too long"
    elif path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        problem = "is absolute"
    elif "\\" in path or "\x00" in path:
        problem = "contains a backslash or NUL"
    elif any(part in ("", ".", "..") for part in path.split("/")):
        problem = "leaves or re-enters its directory ('..', '.' or an empty component)"
    elif path in RESERVED_NAMES:
        problem = "names a file ckptsup writes itself"
    if problem:
        raise ManifestError(f"{source}: {what} path {path[:80]!r} {problem}; a manifest may only name files inside its step directory")
    return path


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    if key not in data:
        raise ManifestError(f"{source}: missing field {key!r}")
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a manifest saying step=true is malformed.
    if isinstance(value, bool) and bool not in kinds:
        raise ManifestError(f"{source}: field {key!r} must be {kinds[0].__name__}, got bool")
    if not isinstance(value, kinds):
        raise ManifestError(f"{source}: field {key!r} must be {kinds[0].__name__}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ManifestError(f"{source}: field {key!r} is not finite")
    return value


def _number(value: int) -> str:
    """An integer for a message: JSON allows 4,300 digits, a line does not need them."""
    text = str(value)
    return text if len(text) <= 24 else f"a {len(text.lstrip('-'))}-digit {'negative ' if value < 0 else ''}number"


def _non_negative(value: int, key: str, source: str, *, limit: int = MAX_INT) -> int:
    if value < 0:
        raise ManifestError(f"{source}: field {key!r} must be >= 0, got {_number(value)}")
    if value > limit:
        raise ManifestError(f"{source}: field {key!r} is {len(str(value))} digits long, past any real value (at most {limit})")
    return value


_HASH_RE = re.compile(r"^(?:%s):[0-9a-f]{1,128}\Z" % "|".join(re.escape(a) for a in HASH_ALGORITHMS))


def _check_hash(value: str, key: str, source: str) -> str:
    if not _HASH_RE.match(value):
        raise ManifestError(f"{source}: {key} {value[:60]!r} is not '<algorithm>:<hex>' with algorithm in {', '.join(HASH_ALGORITHMS)}")
    return value


def _check_keys(data: dict[str, Any], allowed: set[str], what: str, source: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:   # names of any length and characters: shown short, on one line
        shown = [k if k.isascii() and k.isidentifier() and len(k) <= 64 else repr(k)[:40] for k in unknown[:3]]
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise ManifestError(f"{source}: unknown {what} field(s) {', '.join(shown)}{more}; valid: {', '.join(sorted(allowed))}")


_FILE_KEYS = {f.name for f in dataclasses.fields(FileEntry)}
_ITEM_KEYS = {f.name for f in dataclasses.fields(ItemEntry)}
_MANIFEST_KEYS = {f.name for f in dataclasses.fields(Manifest)}


def _parse_file(raw: Any, i: int, source: str) -> FileEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: files[{i}] must be an object")
    _check_keys(raw, _FILE_KEYS, f"files[{i}]", source)
    path = check_relpath(_need(raw, "path", str, source), what=f"files[{i}]", source=source)
    size = _non_negative(_need(raw, "size", int, source), f"files[{i}].size", source)
    return FileEntry(path=path, size=size, hash=_check_hash(_need(raw, "hash", str, source), f"files[{i}].hash", source))


def _parse_items(raws: list[Any], source: str) -> list[ItemEntry]:
    """Items with a fast path: an index can hold 100k+ entries, and the general checks below
    (with their precise error messages) run only for an entry the fast path does not accept."""
    checked: set[str] = set()
    out = []
    match = _HASH_RE.match
    for i, raw in enumerate(raws):
        if type(raw) is dict and raw.keys() == _ITEM_KEYS:
            key, file, offset, length, value = raw["key"], raw["file"], raw["offset"], raw["length"], raw["hash"]
            if (type(key) is str and type(file) is str and file in checked and type(offset) is int
                    and 0 <= offset <= MAX_INT and type(length) is int and 0 <= length <= MAX_INT
                    and type(value) is str and match(value)):
                out.append(ItemEntry(key=key, file=file, offset=offset, length=length, hash=value))
                continue
        out.append(_parse_item(raw, i, source, checked))
    return out


def _parse_item(raw: Any, i: int, source: str, checked_paths: set[str]) -> ItemEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: items[{i}] must be an object")
    if raw.keys() != _ITEM_KEYS:
        _check_keys(raw, _ITEM_KEYS, f"items[{i}]", source)
    file = _need(raw, "file", str, source)
    if file not in checked_paths:  # many items share a file: check each path once
        checked_paths.add(check_relpath(file, what=f"items[{i}].file", source=source))
    return ItemEntry(
        key=_need(raw, "key", str, source),
        file=file,
        offset=_non_negative(_need(raw, "offset", int, source), f"items[{i}].offset", source),
        length=_non_negative(_need(raw, "length", int, source), f"items[{i}].length", source),
        hash=_check_hash(_need(raw, "hash", str, source), f"items[{i}].hash", source),
    )


def _parse_manifest(data: Any, source: str) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: top level must be a JSON object")
    version = _need(data, "format_version", int, source)
    if version != FORMAT_VERSION:
        raise ManifestError(f"{source}: format_version {_number(version)} is not supported (this ckptsup reads {FORMAT_VERSION}); upgrade ckptsup")
    _check_keys(data, _MANIFEST_KEYS, "manifest", source)
    checkpoint_id = _need(data, "checkpoint_id", str, source)
    try:
        uuid.UUID(checkpoint_id)
    except ValueError:
        raise ManifestError(f"{source}: checkpoint_id {checkpoint_id[:60]!r} is not a UUID") from None
    hash_algorithm = _need(data, "hash_algorithm", str, source)
    if hash_algorithm not in HASH_ALGORITHMS:
        raise ManifestError(f"{source}: hash_algorithm {hash_algorithm[:40]!r} unknown; valid: {', '.join(HASH_ALGORITHMS)}")
    created_at = _need(data, "created_at", str, source)
    try:
        parse_created_at(created_at)
    except ValueError as err:
        raise ManifestError(f"{source}: created_at {created_at[:60]!r} is not an ISO-8601 timestamp in UTC's range "
                            f"({str(err)[:80]})") from None
    files = [_parse_file(raw, i, source) for i, raw in enumerate(_need(data, "files", list, source))]
    seen: set[str] = set()
    for entry in files:
        if entry.path in seen:
            raise ManifestError(f"{source}: file {entry.path!r} is listed twice")
        seen.add(entry.path)
    metadata_file = _need(data, "metadata_file", str, source)
    metadata_hash = _need(data, "metadata_hash", str, source)
    if metadata_file:
        check_relpath(metadata_file, what="metadata_file", source=source)
        _check_hash(metadata_hash, "metadata_hash", source)
    world_size = _non_negative(_need(data, "world_size", int, source), "world_size", source)
    if world_size < 1:
        raise ManifestError(f"{source}: world_size must be >= 1, got {world_size}")
    return Manifest(
        format_version=version,
        checkpoint_id=checkpoint_id,
        step=_non_negative(_need(data, "step", int, source), "step", source, limit=MAX_STEP),
        job_id=_need(data, "job_id", str, source),
        attempt=_non_negative(_need(data, "attempt", int, source), "attempt", source),
        epoch=_non_negative(_need(data, "epoch", int, source), "epoch", source),
        world_size=world_size,
        mesh=_refuse_nonfinite(_need(data, "mesh", dict, source), "mesh", source),
        files=files,
        items=_parse_items(_need(data, "items", list, source), source),
        metadata_file=metadata_file,
        metadata_hash=metadata_hash,
        hash_algorithm=hash_algorithm,
        versions=_refuse_nonfinite(_need(data, "versions", dict, source), "versions", source),
        created_at=created_at,
        extra=_refuse_nonfinite(_need(data, "extra", dict, source), "extra", source),
    )


# ---- reading from a step dir ----------------------------------------------------------------

def read_nofollow(path: Path, *, limit: int, what: str = "checkpoint file") -> bytes:
    """Read a regular file of at most `limit` bytes without following a symlink at its last
    component (safe_io.read_regular: a FIFO or device never blocks or floods the read).
    FileNotFoundError passes through; anything else is one ManifestError line."""
    try:
        return read_regular(path, max_bytes=limit, what=what, error=ManifestError, follow_symlinks=False)
    except ManifestError as err:
        if "is a symlink" in str(err):
            raise ManifestError(f"{path} is a symlink; a checkpoint must not contain symlinks") from None
        raise


def check_no_symlink_components(step_dir: Path, relpath: str, *, source: str) -> None:
    """Refuse when the step dir or any existing component of relpath inside it is a symlink.
    A missing component is left for validation (size/hash) to report."""
    current = Path(step_dir)
    if current.is_symlink():
        raise ManifestError(f"{source}: {current} is a symlink; a checkpoint must not contain symlinks")
    for part in relpath.split("/"):
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise ManifestError(f"{source}: {relpath!r} goes through symlink {current.name!r}; a checkpoint must not contain symlinks")


def load_manifest(step_dir: str | os.PathLike[str]) -> Manifest:
    """Read and strictly parse <step_dir>/manifest.json. Refuses a symlinked step dir or manifest,
    and any listed file reached through a symlink. Raises ManifestError (one line)."""
    step_dir = encodable(step_dir, what="checkpoint directory", error=ManifestError)
    path = step_dir / MANIFEST_NAME
    source = str(path)
    if step_dir.is_symlink():
        raise ManifestError(f"{step_dir} is a symlink; a checkpoint directory must be a real directory")
    try:
        text = read_nofollow(path, limit=MAX_MANIFEST_BYTES, what="manifest")
    except FileNotFoundError:
        raise ManifestError(f"{step_dir}: no {MANIFEST_NAME}; it was never committed (an interrupted save) and is not a checkpoint") from None
    manifest = Manifest.from_json(text, source=source)
    for entry in manifest.files:
        check_no_symlink_components(step_dir, entry.path, source=source)
    return manifest
