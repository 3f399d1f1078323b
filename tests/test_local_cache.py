"""The node-local cache tier's bookkeeping (checkpoint/local_cache.py) on real files: which local
files may stand in for a committed checkpoint's, trust, confinement, staging and retention."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from ckptsup.checkpoint.local_cache import (MARKER_NAME, LocalCacheUnusable, LocalCopy, NodeLocalCache,
                                            find_local_files, manifest_digest, matching_files)
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.errors import CheckpointError


def private(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def cached(tmp_path: Path, step: int = 4, *, local_rank: int = 0, keep_last: int = 3) -> tuple[Path, Path, NodeLocalCache]:
    """A committed synthetic checkpoint on the 'shared' tier and a published local copy of its
    shard files (as a rank's save leaves them). Returns (shared step dir, local root, cache)."""
    shared = write_synthetic(private(tmp_path / "shared"), step=step)
    manifest = load_manifest(shared)
    cache = NodeLocalCache(tmp_path / "local", local_rank=local_rank, keep_last=keep_last)
    staging = cache.stage(step=step, attempt=0, need_bytes=0)
    shards = [f for f in manifest.files if f.path != manifest.metadata_file]
    for entry in shards:
        (staging / entry.path).write_bytes((shared / entry.path).read_bytes())
        os.chmod(staging / entry.path, 0o600)
    cache.publish(staging, LocalCopy(step=step, checkpoint_id=manifest.checkpoint_id,
                                     manifest_hash=manifest_digest(shared, manifest.hash_algorithm), files=shards))
    return shared, tmp_path / "local", cache


def test_local_files_of_the_same_checkpoint_are_found(tmp_path: Path) -> None:
    shared, root, _ = cached(tmp_path)
    manifest = load_manifest(shared)
    found = find_local_files(root, shared, manifest)
    shards = sorted(f.path for f in manifest.files if f.path != manifest.metadata_file)
    assert sorted(found) == shards and shards
    assert all(found[rel].read_bytes() == (shared / rel).read_bytes() for rel in found)
    assert manifest.metadata_file not in found


def test_matching_needs_the_same_checkpoint_the_same_manifest_bytes_and_the_same_file() -> None:
    from ckptsup.checkpoint.manifest import FileEntry, Manifest

    files = [FileEntry(path="__0_0.distcp", size=10, hash="xxh3-128:aa"), FileEntry(path=".metadata", size=5, hash="xxh3-128:bb")]
    manifest = Manifest(step=4, files=files, metadata_hash="xxh3-128:bb")
    marker = LocalCopy(step=4, checkpoint_id=manifest.checkpoint_id, manifest_hash="xxh3-128:cc", files=list(files))
    assert [f.path for f in matching_files(marker, manifest, "xxh3-128:cc")] == ["__0_0.distcp"]  # never .metadata
    assert matching_files(marker, manifest, "xxh3-128:dd") == []                                # other manifest bytes
    assert matching_files(dataclasses.replace(marker, checkpoint_id="x"), manifest, "xxh3-128:cc") == []
    assert matching_files(dataclasses.replace(marker, step=5), manifest, "xxh3-128:cc") == []
    other_bytes = dataclasses.replace(marker, files=[FileEntry(path="__0_0.distcp", size=10, hash="xxh3-128:ee")])
    assert matching_files(other_bytes, manifest, "xxh3-128:cc") == []
    assert matching_files(marker, manifest, "") == []


def test_a_copy_of_another_checkpoint_at_the_same_step_is_not_used(tmp_path: Path) -> None:
    shared, root, _ = cached(tmp_path / "a")
    other = write_synthetic(private(tmp_path / "b" / "shared"), step=4)   # another run's step 4
    assert find_local_files(root, other, load_manifest(other)) == {}
    assert find_local_files(root, shared, load_manifest(shared))


def test_a_rewritten_manifest_with_the_same_checkpoint_id_is_not_matched(tmp_path: Path) -> None:
    shared, root, _ = cached(tmp_path)
    path = shared / "manifest.json"
    os.chmod(path, 0o600)
    path.write_text(path.read_text().replace('"extra":{}', '"extra":{"x":1}'))
    assert find_local_files(root, shared, load_manifest(shared)) == {}


def test_a_marker_naming_a_path_outside_its_directory_is_refused(tmp_path: Path) -> None:
    text = LocalCopy(step=1, checkpoint_id="c", manifest_hash="h", files=[]).to_json()
    bad = text.replace('"files": []', '"files": [{"hash": "xxh3-128:aa", "path": "../../etc/passwd", "size": 3}]')
    with pytest.raises(CheckpointError, match="may only name files inside"):
        LocalCopy.from_json(bad, source="m")
    with pytest.raises(CheckpointError, match="keys"):
        LocalCopy.from_json('{"step": 1}', source="m")


@pytest.mark.parametrize("damage", ["group_writable_root", "group_writable_copy", "symlinked_file", "hard_linked_file"])
def test_an_untrusted_local_dir_is_not_read(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    shared, root, cache = cached(tmp_path)
    local_step = cache.own / "step_4"
    shard = next(p for p in local_step.iterdir() if p.suffix == ".distcp")
    if damage == "group_writable_root":
        os.chmod(root, 0o770)
    elif damage == "group_writable_copy":
        os.chmod(local_step, 0o770)
    elif damage == "symlinked_file":
        target = tmp_path / "elsewhere"
        os.rename(shard, target)
        os.symlink(target, shard)
    else:
        os.link(shard, tmp_path / "second-name")
    with caplog.at_level(logging.WARNING, logger="ckptsup.checkpoint"):
        assert find_local_files(root, shared, load_manifest(shared)) == {}
    assert "node-local" in caplog.text


def test_a_local_file_of_the_wrong_size_is_not_used(tmp_path: Path) -> None:
    shared, root, cache = cached(tmp_path)
    shard = next(p for p in (cache.own / "step_4").iterdir() if p.suffix == ".distcp")
    with open(shard, "ab") as f:
        f.write(b"x")
    assert shard.name not in find_local_files(root, shared, load_manifest(shared))


def test_no_local_dir_or_a_missing_one_gives_nothing(tmp_path: Path) -> None:
    shared = write_synthetic(private(tmp_path / "shared"), step=1)
    assert find_local_files(None, shared, load_manifest(shared)) == {}
    assert find_local_files(tmp_path / "absent", shared, load_manifest(shared)) == {}


def test_staging_refuses_an_unusable_dir_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(LocalCacheUnusable) as err:
        NodeLocalCache(tmp_path / "file" / "local", local_rank=0, keep_last=3).stage(step=1, attempt=0, need_bytes=0)
    assert "\n" not in str(err.value)
    open_root = private(tmp_path / "open")
    os.chmod(open_root, 0o777)
    with pytest.raises(LocalCacheUnusable, match="writable by group or others"):
        NodeLocalCache(open_root, local_rank=0, keep_last=3).stage(step=1, attempt=0, need_bytes=0)
    with pytest.raises(LocalCacheUnusable, match="MB free"):
        NodeLocalCache(tmp_path / "small", local_rank=0, keep_last=3).stage(step=1, attempt=0, need_bytes=1 << 60)


def test_staging_is_private_and_clears_a_killed_saves_leftovers(tmp_path: Path) -> None:
    cache = NodeLocalCache(tmp_path / "local", local_rank=2, keep_last=3)
    first = cache.stage(step=1, attempt=0, need_bytes=0)
    (first / "__2_0.distcp").write_bytes(b"half")
    second = cache.stage(step=2, attempt=1, need_bytes=0)   # the first save's process died
    assert not first.exists() and second.is_dir()
    assert second.parent.name == "local_rank_2"
    assert oct(os.stat(second).st_mode & 0o777) == oct(0o700) == oct(os.stat(tmp_path / "local").st_mode & 0o777)


def test_local_retention_keeps_the_last_k_and_drops_unmarked_dirs(tmp_path: Path) -> None:
    cache = NodeLocalCache(tmp_path / "local", local_rank=0, keep_last=2)
    for step in (1, 2, 3, 4):
        staging = cache.stage(step=step, attempt=0, need_bytes=0)
        cache.publish(staging, LocalCopy(step=step, checkpoint_id=f"id{step}", manifest_hash="h", files=[]))
        if step == 2:
            private(cache.own / "step_9")    # junk: no marker, can never be used
    assert sorted(p.name for p in cache.own.iterdir()) == ["step_3", "step_4"]
    assert (cache.own / "step_4" / MARKER_NAME).is_file()


def test_publishing_replaces_another_checkpoints_copy_of_the_same_step(tmp_path: Path) -> None:
    cache = NodeLocalCache(tmp_path / "local", local_rank=0, keep_last=3)
    for checkpoint_id in ("old-run", "new-run"):
        staging = cache.stage(step=5, attempt=0, need_bytes=0)
        cache.publish(staging, LocalCopy(step=5, checkpoint_id=checkpoint_id, manifest_hash="h", files=[]))
    assert [m.checkpoint_id for _, m in cache.copies()] == ["new-run"]
