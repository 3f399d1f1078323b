"""The node-local cache tier (docs/checkpoint-core.md §Node-local cache): ranks write their shards
on the node's own disk first, the save's background thread copies them to the shared tier (where the
commit happens), and a restart on the same node reads a file's local copy when it belongs to the
very checkpoint being loaded.

Layout: one directory per local rank, so no two processes ever write the same path:

    <node_local>/local_rank_<k>/.tmp-step_<N>-<attempt>-<uuid>/   a save being written
    <node_local>/local_rank_<k>/step_<N>/                         this rank's files of a committed
                                                                  checkpoint + local_copy.json

`local_copy.json` names the checkpoint (step, checkpoint_id, the hash of the committed
manifest's bytes) and lists the files it holds with size and hash. It is not a manifest: a local
step dir holds only what its rank wrote, so it is never a checkpoint by itself (the catalog and
the tools see no manifest there); the shared tier's manifest stays the one thing trusted. A
reader takes a local file only when the marker names the same checkpoint, the file's size and
hash equal the shared manifest's and the directories pass the trust checks; even then each item
is hashed as it is read, with the shared copy as the fallback. `.metadata` (a pickle) is never
read from here.

The cache is best effort: missing, untrusted, read-only or too small for the next save means a
save straight to the shared tier; anything about a local copy that does not match means a read
from the shared one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import CheckpointError
from ..safe_io import loads_json
from .commit import abort, find_step_dirs, make_tmp_dir, parse_step, remove_interrupted, step_dir_name
from .durable import fsync_dir, write_file_durable
from .hashing import hash_bytes
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, check_relpath, parse_created_at, read_nofollow
from .retention import Candidate, delete_step_dir, plan_retention
from .trust import check_dir_trusted, private_mkdir

log = logging.getLogger("ckptsup.checkpoint")

MARKER_NAME = "local_copy.json"
WRITER_DIR_PREFIX = "local_rank_"
_WRITER_DIR_RE = re.compile(r"^local_rank_\d{1,6}$")
MAX_MARKER_BYTES = 64 << 20
# room kept beyond the state's size: DCP's per-item headers and the marker
SLACK_FRACTION, SLACK_BYTES = 0.1, 1 << 20


class LocalCacheUnusable(CheckpointError):
    """The node-local directory cannot take this save (one line naming why)."""


def manifest_digest(step_dir: Path, algorithm: str) -> str:
    """Hash of a committed step dir's manifest.json bytes: the checkpoint's identity for the cache
    (checkpoint_id alone is a claim; the bytes are what was committed)."""
    return hash_bytes(read_nofollow(Path(step_dir) / MANIFEST_NAME, limit=MAX_MANIFEST_BYTES), algorithm)


@dataclass(kw_only=True)
class LocalCopy:
    """The marker of one local step dir."""

    step: int
    checkpoint_id: str
    manifest_hash: str
    files: list[FileEntry]
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "checkpoint_id": self.checkpoint_id, "manifest_hash": self.manifest_hash,
                           "created_at": self.created_at, "files": [vars(f) for f in self.files]}, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: bytes | str, *, source: str) -> "LocalCopy":
        """Strict: wrong keys or types, or a path that could leave the step dir, raise CheckpointError."""
        data = loads_json(text, what=source, error=CheckpointError)
        keys = {"step", "checkpoint_id", "manifest_hash", "created_at", "files"}
        if not isinstance(data, dict) or set(data) != keys:
            raise CheckpointError(f"{source}: expected exactly the keys {', '.join(sorted(keys))}")
        if (type(data["step"]) is not int or not all(isinstance(data[k], str) for k in keys - {"step", "files"})
                or not isinstance(data["files"], list)):
            raise CheckpointError(f"{source}: a field has the wrong type")
        try:
            parse_created_at(data["created_at"])
        except ValueError:
            raise CheckpointError(f"{source}: created_at is not an ISO-8601 timestamp") from None
        files = []
        for raw in data["files"]:
            if (not isinstance(raw, dict) or set(raw) != {"path", "size", "hash"} or type(raw["size"]) is not int
                    or not isinstance(raw["hash"], str)):
                raise CheckpointError(f"{source}: a files entry is not {{path, size, hash}}")
            files.append(FileEntry(path=check_relpath(raw["path"], what="files", source=source), size=raw["size"], hash=raw["hash"]))
        return cls(step=data["step"], checkpoint_id=data["checkpoint_id"], manifest_hash=data["manifest_hash"],
                   files=files, created_at=data["created_at"])


def matching_files(marker: LocalCopy, manifest: Manifest, manifest_hash: str) -> list[FileEntry]:
    """Pure: the marker's files that are exactly the manifest's (same checkpoint, same bytes
    committed, same path, size and hash). Never DCP's .metadata: the pickle is only ever read
    from the manifest-checked shared copy."""
    if (marker.step != manifest.step or marker.checkpoint_id != manifest.checkpoint_id
            or not manifest_hash or marker.manifest_hash != manifest_hash):
        return []
    committed = manifest.file_map()
    return [f for f in marker.files
            if f.path != manifest.metadata_file and f.path in committed
            and (committed[f.path].size, committed[f.path].hash) == (f.size, f.hash)]


def local_needed_bytes(state_bytes: int) -> int:
    return int(state_bytes * (1 + SLACK_FRACTION)) + SLACK_BYTES


# ---- the write side ---------------------------------------------------------------------------

class NodeLocalCache:
    """One local rank's directory in the node-local tier."""

    def __init__(self, root: str | os.PathLike[str], *, local_rank: int, keep_last: int) -> None:
        self.root = Path(root)
        self.own = self.root / f"{WRITER_DIR_PREFIX}{local_rank}"
        self.keep_last = keep_last

    def stage(self, *, step: int, attempt: int, need_bytes: int) -> Path:
        """A fresh private staging dir for one save. Raises LocalCacheUnusable (one line)."""
        try:
            private_mkdir(self.root)
            private_mkdir(self.own)
            # only this local rank writes here and one save is in flight at a time: any other
            # temporary dir is a killed save's, taking space the new one needs
            remove_interrupted(self.own)
            free = shutil.disk_usage(self.own).free
            if free < need_bytes:
                raise LocalCacheUnusable(f"{self.own} has {free / 1e6:.1f} MB free, a save needs about {need_bytes / 1e6:.1f} MB")
            return make_tmp_dir(self.own, step=step, attempt=attempt)
        except LocalCacheUnusable:
            raise
        except (CheckpointError, OSError) as err:
            raise LocalCacheUnusable(str(err) or type(err).__name__) from None

    def publish(self, staging: Path, marker: LocalCopy) -> Path:
        """Keep a committed save's staging dir as step_<N> (marker first, then the rename), and
        prune to the last keep_last copies. A copy of another checkpoint at the same step (an
        earlier run) is replaced: the shared tier's commit decides what step_<N> is."""
        write_file_durable(staging / MARKER_NAME, marker.to_json().encode())
        fsync_dir(staging)
        for old in find_step_dirs(self.own, marker.step):
            delete_step_dir(old)
        target = self.own / step_dir_name(marker.step)
        os.rename(staging, target)
        fsync_dir(self.own)
        self.prune()
        return target

    def discard(self, staging: Path) -> None:
        try:
            abort(staging)
        except (CheckpointError, OSError) as err:
            log.warning("ckptsup: could not remove the node-local staging dir %s: %s", staging, err)

    def copies(self) -> list[tuple[Path, LocalCopy | None]]:
        """This local rank's step dirs with their markers (None: unreadable, never usable)."""
        out = []
        for name in sorted(os.listdir(self.own)):
            if parse_step(name) is None:
                continue
            path = self.own / name
            out.append((path, _read_marker(path)))
        return out

    def prune(self) -> list[int]:
        """Keep the last keep_last local copies (retention's own plan: no dailies in a cache);
        a step dir without a readable marker can never be used and goes too. Returns steps deleted."""
        copies = self.copies()
        cands = [Candidate(step=m.step, created_at=parse_created_at(m.created_at)) for _, m in copies if m is not None]
        _, delete = plan_retention(cands, keep_last=self.keep_last, keep_daily_days=0, now=datetime.now(timezone.utc))
        doomed = set(delete)
        deleted = []
        for path, marker in copies:
            step = parse_step(path.name)
            if marker is None or marker.step in doomed or marker.step != step:
                delete_step_dir(path)
                if step is not None:
                    deleted.append(step)
        return deleted


def _read_marker(step_dir: Path) -> LocalCopy | None:
    try:
        return LocalCopy.from_json(read_nofollow(step_dir / MARKER_NAME, limit=MAX_MARKER_BYTES), source=str(step_dir / MARKER_NAME))
    except (CheckpointError, OSError):
        return None


# ---- the read side ----------------------------------------------------------------------------

def find_local_files(root: str | os.PathLike[str] | None, step_dir: Path, manifest: Manifest) -> dict[str, Path]:
    """{relative path: local file} of the node-local copies of exactly the checkpoint in step_dir
    (whose manifest is `manifest`, already checked). Never raises: a local tier that is missing,
    untrusted or holds another checkpoint gives fewer (or no) files, with a warning when it is
    something a person should fix."""
    if root is None:
        return {}
    root = Path(root)
    if not root.exists():
        return {}
    try:
        check_dir_trusted(root)
        digest = manifest_digest(step_dir, manifest.hash_algorithm)
        writers = sorted(n for n in os.listdir(root) if _WRITER_DIR_RE.match(n))
    except (CheckpointError, OSError) as err:
        log.warning("ckptsup: not reading the node-local tier %s: %s", root, err)
        return {}
    found: dict[str, Path] = {}
    for name in writers:
        try:
            local_steps = find_step_dirs(check_dir_trusted(root / name), manifest.step)
        except (CheckpointError, OSError) as err:
            log.warning("ckptsup: not using the node-local dir %s: %s", root / name, err)
            continue
        for local_step in local_steps:
            try:
                check_dir_trusted(local_step, recursive=True)
            except CheckpointError as err:
                log.warning("ckptsup: not using the node-local copy %s: %s", local_step, err)
                continue
            marker = _read_marker(local_step)
            if marker is None:
                continue
            for entry in matching_files(marker, manifest, digest):
                path = local_step / entry.path
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size == entry.size:
                    found.setdefault(entry.path, path)
    return found

