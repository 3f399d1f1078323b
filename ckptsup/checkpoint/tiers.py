"""Storage tiers (docs/checkpoint-core.md §Tiers): node-local directory -> shared file system ->
S3-compatible store, fastest first. The commit happens on the shared tier; every tier keeps the same
commit rule (a copy exists only once its manifest is in place, written last), so a half-copied step
is never mistaken for a checkpoint on any tier (orbax#394 is the counterexample).

Copies verify as they read: each file is hashed while it is copied and compared with the
manifest, so a tier never publishes bytes that differ from what was committed.

The `Tier` protocol, `TierKind`, `TierError` and `expand_tier_path` live in tier_base.py, which
s3tier.py builds on as well (re-exported here); this module imports s3tier.py only inside the
factory, `tiers_from_config`, so boto3 stays optional.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError, ManifestError
from .catalog import Status, list_checkpoints
from .commit import abort, commit, make_tmp_dir, step_dir_name
from .hashing import CHUNK, algorithm_of, new_hasher
from .manifest import Manifest, load_manifest
from .retention import delete_step_dir
from .tier_base import Tier, TierError, TierKind, expand_tier_path

__all__ = ["Tier", "TierError", "TierKind", "expand_tier_path", "copy_verified", "copy_step_dir", "LocalTier",
           "restore_source", "node_local_root", "tiers_from_config"]


def copy_verified(src: Path, dst: Path, expected_hash: str, *, size: int) -> None:
    """Copy src to a new file dst (0600), hashing what is read; raise when the bytes or the size
    differ from the manifest (the source went bad after commit)."""
    hasher = new_hasher(algorithm_of(expected_hash))
    copied = 0
    with open(src, "rb", buffering=0) as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                got = fin.readinto(view)
                if not got:
                    break
                hasher.update(view[:got])
                out = view[:got]
                while out:
                    out = out[os.write(fd, out):]
                copied += got
            os.fsync(fd)
        finally:
            os.close(fd)
    if copied != size:
        raise CheckpointError(f"{src}: {copied} bytes, manifest says {size}; not copying a damaged checkpoint")
    actual = hasher.hexdigest()
    if actual != expected_hash:
        raise CheckpointError(f"{src}: hash {actual} != {expected_hash}; not copying a damaged checkpoint")


def copy_step_dir(step_dir: Path, dest_checkpoint_dir: Path, manifest: Manifest | None = None) -> Path:
    """Copy a committed step dir into another checkpoint dir through the commit protocol (tmp
    dir, verified copies, manifest last, no-replace rename). Returns the new step dir."""
    manifest = manifest or load_manifest(step_dir)
    tmp = make_tmp_dir(dest_checkpoint_dir, step=manifest.step, attempt=manifest.attempt)
    try:
        for entry in manifest.files:
            dst = tmp / entry.path
            if "/" in entry.path:
                os.makedirs(dst.parent, mode=0o700, exist_ok=True)
            copy_verified(step_dir / entry.path, dst, entry.hash, size=entry.size)
        return commit(tmp, manifest, checkpoint_dir=dest_checkpoint_dir, fence=False)
    except BaseException:
        if tmp.exists():
            abort(tmp)
        raise


class LocalTier:
    """A directory tier: node-local cache or the shared file system."""

    def __init__(self, *, name: str, root: str | os.PathLike[str], kind: TierKind = TierKind.SHARED,
                 node: str = "", job_id: str = "") -> None:
        self.name = name
        self.kind = kind
        self.root = Path(expand_tier_path(str(root), node=node, job_id=job_id))

    def __repr__(self) -> str:
        return f"LocalTier({self.name}, {self.root})"

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def get_manifest(self, step: int) -> Manifest | None:
        try:
            return load_manifest(self.path(step))
        except ManifestError:
            return None

    def has_copy(self, step: int, manifest: Manifest, *, deep: bool = False) -> bool:
        mine = self.get_manifest(step)
        if mine is None or mine.checkpoint_id != manifest.checkpoint_id:
            return False
        for entry in manifest.files:
            try:
                if os.lstat(self.path(step) / entry.path).st_size != entry.size:
                    return False
            except FileNotFoundError:
                return False
        if deep:
            from .validate import check_level1
            problems, _ = check_level1(self.path(step), manifest)
            return not problems
        return True

    def put(self, step_dir: Path) -> None:
        manifest = load_manifest(step_dir)
        if self.has_copy(manifest.step, manifest):
            return
        copy_step_dir(Path(step_dir), self.root, manifest)

    def fetch(self, step: int, dest_dir: Path) -> Path:
        return copy_step_dir(self.path(step), Path(dest_dir))

    def list_steps(self) -> list[int]:
        return [i.step for i in list_checkpoints(self.root) if i.status in (Status.COMMITTED, Status.VALIDATED)]

    def delete(self, step: int) -> None:
        path = self.path(step)
        if path.exists():
            delete_step_dir(path)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free


def restore_source(step: int, tiers: Sequence[Tier], manifest: Manifest | None = None) -> Tier | None:
    """The fastest tier (first in `tiers`) holding a copy that matches the manifest. Without a
    manifest, the commit tier's (SHARED) is authoritative, else the first tier that has one."""
    if manifest is None:
        manifest = _authoritative_manifest(step, tiers)
        if manifest is None:
            return None
    for tier in tiers:
        try:
            if tier.has_copy(step, manifest):
                return tier
        except CheckpointError:
            continue  # a tier that cannot answer is not a source; the next one may be
    return None


def _authoritative_manifest(step: int, tiers: Sequence[Tier]) -> Manifest | None:
    ordered = sorted(tiers, key=lambda t: t.kind is not TierKind.SHARED)   # stable: shared first
    for tier in ordered:
        try:
            found = tier.get_manifest(step)
        except CheckpointError:
            continue
        if found is not None:
            return found
    return None


def node_local_root(storage, *, node: str = "", job_id: str = "") -> Path | None:
    """The node-local tier's directory from a config.StorageConfig ({node}, {job_id} expanded);
    None when the tier is off."""
    if not storage.node_local:
        return None
    return Path(expand_tier_path(storage.node_local.removeprefix("file://"), node=node, job_id=job_id))


def tiers_from_config(storage, *, shared_dir: str | os.PathLike[str], node: str = "", job_id: str = "") -> list[Tier]:
    """Tiers fastest first from a config.StorageConfig: node-local (if set), shared, S3 (if set)."""
    tiers: list[Tier] = []
    local = node_local_root(storage, node=node, job_id=job_id)
    if local is not None:
        tiers.append(LocalTier(name="node_local", root=local, kind=TierKind.NODE_LOCAL))
    tiers.append(LocalTier(name="shared", root=shared_dir, kind=TierKind.SHARED, node=node, job_id=job_id))
    if storage.object_store:
        from .s3tier import S3Tier

        tiers.append(S3Tier.from_config(storage, node=node, job_id=job_id))
    return tiers
