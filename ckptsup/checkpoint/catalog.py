"""The checkpoint catalog: what checkpoint_dir holds and which one to resume from.

Choice is by step number and manifest, never by mtime or wall clock (clock skew;
docs/checkpoint-core.md §Validation). `.tmp-*` (interrupted saves), `.del-*` (being deleted) and
quarantine/ are never candidates.

    status      meaning                                   transitions
    INCOMPLETE  step_<N>/ without a (valid) manifest      -> (never trusted; GC after checks)
    COMMITTED   valid manifest, not validated yet         -> VALIDATED | REJECTED
    VALIDATED   validation.json ok for this checkpoint    -> REJECTED (a later check fails)
    REJECTED    validation.json records a failure         -> QUARANTINED
    QUARANTINED moved under quarantine/ (listed on demand)
"""

from __future__ import annotations

import collections
import enum
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence

from ..errors import CheckpointError, CkptsupError
from ..safe_io import read_json
from .commit import parse_step
from .manifest import MANIFEST_NAME, Manifest, check_no_symlink_components, load_manifest
from .validate import MAX_RECORD_BYTES, QUARANTINE_DIR, REASON_NAME, read_validation


class Status(enum.Enum):
    INCOMPLETE = "incomplete"
    COMMITTED = "committed"
    VALIDATED = "validated"
    REJECTED = "rejected"
    QUARANTINED = "quarantined"


@dataclass(kw_only=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: Manifest | None
    validation: dict[str, Any] | None
    status: Status
    problem: str = ""   # why INCOMPLETE / REJECTED, one line

    @property
    def validated_level(self) -> int:
        if self.status is not Status.VALIDATED or self.validation is None:
            return 0
        return int(self.validation.get("level", 0))

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "step": self.step, "path": str(self.path), "status": self.status.value,
            "validated_level": self.validated_level, "problem": self.problem,
            "checkpoint_id": m.checkpoint_id if m else None, "created_at": m.created_at if m else None,
            "bytes": m.total_bytes if m else None, "files": len(m.files) if m else None,
            "job_id": m.job_id if m else None, "attempt": m.attempt if m else None,
            "world_size": m.world_size if m else None, "validation": self.validation,
        }


class HasCopy(Protocol):
    name: str

    def has_copy(self, step: int, manifest: Manifest) -> bool: ...


_CACHE_SIZE = 64
_manifest_cache: "collections.OrderedDict[tuple, Manifest]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def _cached_manifest(path: Path) -> Manifest:
    """load_manifest, memoised on the manifest file's identity (device, inode, size, mtime): a
    committed manifest never changes in place, and retention/catalog calls after every commit
    would otherwise re-parse every (possibly multi-MB) item index. The symlink checks of
    load_manifest run on every call; only the parse is cached. Treat the result as read-only."""
    try:
        st = os.lstat(path / MANIFEST_NAME)
    except OSError:
        return load_manifest(path)   # raises the precise one-line error
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _manifest_cache.get(key)
        if hit is not None:
            _manifest_cache.move_to_end(key)
    if hit is not None:
        for entry in hit.files:   # cheap, and a symlink could have been planted since
            check_no_symlink_components(path, entry.path, source=str(path / MANIFEST_NAME))
        return hit
    manifest = load_manifest(path)
    with _cache_lock:
        _manifest_cache[key] = manifest
        while len(_manifest_cache) > _CACHE_SIZE:
            _manifest_cache.popitem(last=False)
    return manifest


def inspect_step(path: Path) -> CheckpointInfo:
    """Classify one step_<N> directory (reads the manifest and validation.json, nothing else)."""
    step = parse_step(path.name)
    if step is None:
        raise ValueError(f"{path.name} is not a step_<N> directory")
    if path.is_symlink() or not path.is_dir():
        return CheckpointInfo(step=step, path=path, manifest=None, validation=None, status=Status.INCOMPLETE,
                              problem="not a real directory")
    try:
        manifest = _cached_manifest(path)
    except CkptsupError as err:
        return CheckpointInfo(step=step, path=path, manifest=None, validation=None, status=Status.INCOMPLETE, problem=str(err))
    if manifest.step != step:
        return CheckpointInfo(step=step, path=path, manifest=manifest, validation=None, status=Status.REJECTED,
                              problem=f"manifest says step {manifest.step} but the directory is {path.name}")
    validation = read_validation(path)
    if validation is not None and validation.get("checkpoint_id") not in (manifest.checkpoint_id, "", None):
        validation = None  # recorded for another checkpoint that once had this name: stale
    if validation is None:
        status, problem = Status.COMMITTED, ""
    elif validation.get("ok") is True:
        status, problem = Status.VALIDATED, ""
    else:
        problems = validation.get("problems") or ["validation failed"]
        status, problem = Status.REJECTED, str(problems[0])
    return CheckpointInfo(step=step, path=path, manifest=manifest, validation=validation, status=status, problem=problem)


def list_checkpoints(checkpoint_dir: str | os.PathLike[str], *, include_quarantined: bool = False) -> list[CheckpointInfo]:
    """Every step_<N> in checkpoint_dir, oldest step first."""
    checkpoint_dir = Path(checkpoint_dir)
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    infos = [inspect_step(checkpoint_dir / name) for name in names if parse_step(name) is not None]
    if include_quarantined:
        infos.extend(_quarantined(checkpoint_dir / QUARANTINE_DIR))
    infos.sort(key=lambda info: (info.step, info.status is not Status.QUARANTINED))
    return infos


def _quarantined(qdir: Path) -> Iterable[CheckpointInfo]:
    if not qdir.is_dir() or qdir.is_symlink():
        return []
    out = []
    for name in sorted(os.listdir(qdir)):
        step = parse_step(name.split("-", 1)[0])
        path = qdir / name
        if step is None or not path.is_dir():
            continue
        out.append(CheckpointInfo(step=step, path=path, manifest=None, validation=read_validation(path),
                                  status=Status.QUARANTINED, problem=_reason(path)))
    return out


def _reason(path: Path) -> str:
    try:
        data = read_json(path / REASON_NAME, max_bytes=MAX_RECORD_BYTES, what="quarantine reason",
                         error=CheckpointError, follow_symlinks=False)
    except (OSError, CkptsupError):
        return ""
    return str(data.get("reason", "")) if isinstance(data, dict) else ""


def _newest_first(checkpoint_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """step_<N> paths, highest step first, without reading anything: the latest_* lookups stop
    at the first match instead of parsing every manifest (an item index can be megabytes)."""
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return iter(())
    steps = sorted(((parse_step(n), n) for n in names if parse_step(n) is not None), reverse=True)
    return (Path(checkpoint_dir) / name for _, name in steps)


def latest_committed(checkpoint_dir: str | os.PathLike[str]) -> CheckpointInfo | None:
    """Newest checkpoint with a valid manifest that no validation rejected."""
    for path in _newest_first(checkpoint_dir):
        info = inspect_step(path)
        if info.status in (Status.COMMITTED, Status.VALIDATED):
            return info
    return None


def latest_validated(checkpoint_dir: str | os.PathLike[str], min_level: int = 2) -> CheckpointInfo | None:
    """Newest checkpoint whose recorded validation passed at min_level or above."""
    for path in _newest_first(checkpoint_dir):
        recorded = read_validation(path)   # cheap pre-filter before parsing the manifest
        if not recorded or recorded.get("ok") is not True or int(recorded.get("level", 0)) < min_level:
            continue
        info = inspect_step(path)
        if info.validated_level >= min_level:
            return info
    return None


def latest_durable(checkpoint_dir: str | os.PathLike[str], tiers: Sequence[HasCopy] = ()) -> CheckpointInfo | None:
    """Newest usable checkpoint that is present, matching its manifest, on the slowest configured
    tier (the last of `tiers`). With no slower tier the shared checkpoint_dir is the durable one."""
    for path in _newest_first(checkpoint_dir):
        info = inspect_step(path)
        if info.status not in (Status.COMMITTED, Status.VALIDATED) or info.manifest is None:
            continue
        if not tiers or tiers[-1].has_copy(info.step, info.manifest):
            return info
    return None
