"""The commit protocol (docs/checkpoint-core.md §Commit protocol): write into a unique temporary
directory, describe every file with size and hash, write manifest.json (fsync), rename the directory
to step_<N> without ever replacing an existing one, fsync the parent. A directory without a valid
manifest is never a checkpoint.

Two writers on one directory cannot mix shards: each writes its own temporary directory, the
rename is RENAME_NOREPLACE, and an existing step_<N> from another checkpoint_id is refused. A
writer lock (O_EXCL file with pid, host, epoch) refuses a second live writer up front, and the
fencing epoch (run dir state, and the lock) refuses a zombie attempt's commit.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointError, FencedError, ManifestError
from .hashing import hash_file, hash_file_and_ranges
from .manifest import MANIFEST_NAME, RESERVED_NAMES, FileEntry, ItemEntry, Manifest, load_manifest
from .trust import check_dir_trusted, private_mkdir
# The file primitives and the writer lock have their own modules; their names stay importable
# from here, where callers first found them.
from .durable import fsync_dir, rename_noreplace, write_file_durable  # noqa: F401
from .writerlock import (LOCK_NAME, LockHolder, WriterLock, WriterLockedError,  # noqa: F401
                         may_take_over, pid_alive, read_lock)

TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step_(\d{1,18})$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    """step_<N> (zero-padded or not) -> N; anything else (tmp dirs, quarantine) -> None."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None

# ---- the protocol ---------------------------------------------------------------------------

def make_tmp_dir(checkpoint_dir: str | os.PathLike[str], *, step: int, attempt: int) -> Path:
    """Create checkpoint_dir (0700) if needed, check it is trusted, and create a unique
    `.tmp-step_<N>-<attempt>-<uuid>/` (0700) inside it."""
    checkpoint_dir = private_mkdir(Path(checkpoint_dir))
    tmp = checkpoint_dir / f"{TMP_PREFIX}{step_dir_name(step)}-{attempt}-{uuid.uuid4().hex}"
    os.mkdir(tmp, 0o700)
    return tmp


def describe_file(tmp_dir: Path, relpath: str, algorithm: str) -> FileEntry:
    full = Path(tmp_dir) / relpath
    st = os.lstat(full)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{full} is not a regular file; a checkpoint holds only regular files")
    return FileEntry(path=relpath, size=st.st_size, hash=hash_file(full, algorithm))


def describe_files(tmp_dir: str | os.PathLike[str], algorithm: str = "xxh3-128", *, workers: int = 4) -> list[FileEntry]:
    """Size and hash of every file under tmp_dir (sorted by path), except the files ckptsup
    itself writes (manifest.json, validation.json). Refuses symlinks and special files. A few
    threads hash files at once (reads and hashes release the GIL)."""
    tmp_dir = Path(tmp_dir)
    names = [rel for rel in sorted(_walk_files(tmp_dir)) if rel not in RESERVED_NAMES]
    if workers <= 1 or len(names) <= 1:
        return [describe_file(tmp_dir, rel, algorithm) for rel in names]
    with ThreadPoolExecutor(max_workers=min(workers, len(names)), thread_name_prefix="ckptsup-hash") as pool:
        return list(pool.map(lambda rel: describe_file(tmp_dir, rel, algorithm), names))


def _walk_files(top: Path, prefix: str = "") -> list[str]:
    out = []
    with os.scandir(top) as it:
        for entry in it:
            rel = f"{prefix}{entry.name}"
            if entry.is_symlink():
                raise CheckpointError(f"{entry.path} is a symlink; a checkpoint holds only regular files")
            if entry.is_dir(follow_symlinks=False):
                out.extend(_walk_files(Path(entry.path), rel + "/"))
            else:
                out.append(rel)
    return out


def describe_files_and_items(tmp_dir: str | os.PathLike[str], algorithm: str,
                             chunks: dict[str, list[tuple[str, int, int]]], *, workers: int = 4) -> tuple[list[FileEntry], list[ItemEntry]]:
    """Like describe_files, plus the item index: `chunks` maps a file's relative path to its
    (key, offset, length) chunks (DCP's storage_data). Each file is read once; the file and all
    its items are hashed in that read."""
    tmp_dir = Path(tmp_dir)
    names = [rel for rel in sorted(_walk_files(tmp_dir)) if rel not in RESERVED_NAMES]

    def one(rel: str) -> tuple[FileEntry, list[ItemEntry]]:
        full = tmp_dir / rel
        if not stat.S_ISREG(os.lstat(full).st_mode):
            raise CheckpointError(f"{full} is not a regular file; a checkpoint holds only regular files")
        mine = chunks.get(rel, [])
        whole, size, hashes = hash_file_and_ranges(full, algorithm, [(off, length, algorithm) for _, off, length in mine])
        for (key, off, length), value in zip(mine, hashes):
            if off + length > size:
                raise CheckpointError(f"{rel}: chunk {key!r} [{off}, +{length}) runs past the end of the file ({size} bytes)")
        items = [ItemEntry(key=key, file=rel, offset=off, length=length, hash=value) for (key, off, length), value in zip(mine, hashes)]
        return FileEntry(path=rel, size=size, hash=whole), items

    unknown = sorted(set(chunks) - set(names))
    if unknown:
        raise CheckpointError(f"chunks name files that were not written: {', '.join(unknown[:3])}")
    if workers > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(names)), thread_name_prefix="ckptsup-hash") as pool:
            described = list(pool.map(one, names))
    else:
        described = [one(rel) for rel in names]
    return [f for f, _ in described], [it for _, items in described for it in items]


def find_step_dirs(checkpoint_dir: Path, step: int) -> list[Path]:
    """Every entry of checkpoint_dir naming this step (step_7 and step_0007 are the same step)."""
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    return [checkpoint_dir / n for n in names if parse_step(n) == step]


def commit(tmp_dir: str | os.PathLike[str], manifest: Manifest, *,
           checkpoint_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str] | None = None,
           fence: bool = True) -> Path:
    """Publish tmp_dir as checkpoint_dir/step_<N>. Returns the committed path.

    Refuses (FencedError) when manifest.epoch is older than the run's epoch or the writer lock's;
    refuses (CheckpointError) when step_<N> exists from another checkpoint_id. Idempotent when
    the same checkpoint was already committed. fence=False is for copying an already committed
    checkpoint between tiers (its epoch is history, not a claim to write)."""
    tmp_dir = Path(tmp_dir)
    checkpoint_dir = check_dir_trusted(Path(checkpoint_dir))
    if tmp_dir.parent.resolve() != checkpoint_dir.resolve() or not tmp_dir.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{tmp_dir} is not a temporary directory of {checkpoint_dir}; create it with make_tmp_dir()")
    if fence:
        _check_fencing(manifest, checkpoint_dir=checkpoint_dir, run_dir=run_dir)
    target = checkpoint_dir / step_dir_name(manifest.step)
    existing = _existing_same_step(checkpoint_dir, manifest)
    if existing is not None:
        abort(tmp_dir)  # a retried commit of a checkpoint that is already published
        return existing
    write_file_durable(tmp_dir / MANIFEST_NAME, manifest.to_json().encode())
    fsync_dir(tmp_dir)
    try:
        rename_noreplace(tmp_dir, target)
    except FileExistsError:
        existing = _existing_same_step(checkpoint_dir, manifest)
        if existing is not None:
            abort(tmp_dir)
            return existing
        raise CheckpointError(f"{target} appeared while committing; another writer raced for step {manifest.step}") from None
    fsync_dir(checkpoint_dir)
    return target


def _check_fencing(manifest: Manifest, *, checkpoint_dir: Path, run_dir: str | os.PathLike[str] | None) -> None:
    if run_dir is not None:
        from ..errors import ConfigError
        from ..rundir import read_epoch  # the run dir is optional: plain `python train.py` has none

        try:
            current = read_epoch(run_dir)
        except ConfigError as err:
            # a damaged state.json must not cost this checkpoint: the checkpoint dir's writer lock
            # below still fences zombies (it holds the epoch of whoever writes here)
            logging.getLogger("ckptsup").warning("ckptsup: fencing by the writer lock only: %s", err)
            current = manifest.epoch
        if manifest.epoch < current:
            raise FencedError(f"commit of step {manifest.step} refused: this attempt has fencing epoch {manifest.epoch} but the run is at "
                              f"epoch {current} (a newer attempt took over); this process is a zombie and must exit")
    holder = read_lock(checkpoint_dir / LOCK_NAME)
    if holder is not None and holder.epoch > manifest.epoch:
        raise FencedError(f"commit of step {manifest.step} refused: {checkpoint_dir} is held by epoch {holder.epoch} "
                          f"(pid {holder.pid} on {holder.host}); this attempt (epoch {manifest.epoch}) is a zombie and must exit")


def _existing_same_step(checkpoint_dir: Path, manifest: Manifest) -> Path | None:
    """Return an existing committed dir of this same checkpoint_id; raise if the step exists
    from another checkpoint (never mix, never replace); None when the step is free."""
    for path in find_step_dirs(checkpoint_dir, manifest.step):
        try:
            other = load_manifest(path)
        except ManifestError:
            raise CheckpointError(f"{path} exists without a valid manifest; move it aside (`ckptsup ckpt verify {path}` explains) before saving step {manifest.step} again") from None
        if other.checkpoint_id == manifest.checkpoint_id:
            return path
        raise CheckpointError(f"{path} already holds checkpoint {other.checkpoint_id} (job {other.job_id or '?'}, attempt {other.attempt}); "
                              f"refusing to mix it with checkpoint {manifest.checkpoint_id}. Another writer uses this directory?")
    return None


def abort(tmp_dir: str | os.PathLike[str]) -> None:
    """Remove a failed save's temporary directory (only ever a `.tmp-*` dir)."""
    tmp_dir = Path(tmp_dir)
    if not tmp_dir.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"refusing to remove {tmp_dir}: not a temporary checkpoint directory")
    if tmp_dir.is_symlink():
        tmp_dir.unlink()
        return
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)


def remove_interrupted(checkpoint_dir: str | os.PathLike[str], *, lock: WriterLock | None = None,
                       min_age_s: float = 0.0, now: float | None = None, keep: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
    """Remove `.tmp-*` (interrupted saves) and `.del-*` (interrupted deletes) left in
    checkpoint_dir. Only the directory's writer may do this while a writer exists: pass the
    WriterLock you hold; without one, a live lock holder makes this a no-op. Entries younger
    than min_age_s (mtime) and those in `keep` (your own save in progress) are left alone."""
    checkpoint_dir = check_dir_trusted(Path(checkpoint_dir))
    holder = read_lock(checkpoint_dir / LOCK_NAME)
    if holder is not None and not (lock is not None and lock.still_ours()):
        same_host = holder.host == socket.gethostname()
        if not same_host or pid_alive(holder.pid):
            return []
    now = time.time() if now is None else now
    removed = []
    for name in sorted(os.listdir(checkpoint_dir)):
        if not name.startswith((TMP_PREFIX, ".del-")):
            continue
        path = checkpoint_dir / name
        if path in keep:
            continue
        st = os.lstat(path)
        if now - st.st_mtime < min_age_s:
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    if removed:
        fsync_dir(checkpoint_dir)
    return removed
