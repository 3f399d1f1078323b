"""Saves and resumes through the node-local cache tier, in one process (real torch, real DCP,
real files): the commit still happens on the shared tier, a resume reads the local copy only when
it is a copy of exactly that checkpoint, and a bad or unusable cache never costs a checkpoint.
The two-rank runs are in test_hooks_node_local.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir, small_tmpfs, train_steps

from ckptsup.checkpoint.local_cache import MARKER_NAME, LocalCopy
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.checkpoint.validate import validate

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def fast_housekeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


def use_local(monkeypatch: pytest.MonkeyPatch, path: Path) -> Path:
    monkeypatch.setenv("CKPTSUP_NODE_LOCAL_DIR", str(path))
    return path


def save_run(ck: Path, steps: int = 4, *, seed: int = 0, **kw):
    """Train `steps` steps saving every 2 (sync saves); returns the trained parts."""
    parts = make_parts(seed=seed)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False, **kw)
    assert run.resume() == 0
    train_steps(run, *parts, 0, steps)
    run.close()
    return parts


def resume(ck: Path) -> tuple[int, dict[str, int], tuple]:
    parts = make_parts(seed=99)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    try:
        return run.resume(), run.load_tiers, parts
    finally:
        run.close(final_save=False)


def assert_same_state(a: tuple, b: tuple) -> None:
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(pa, pb)
    sa, sb = a[1].state_dict(), b[1].state_dict()
    for pid in sa["state"]:
        for name, value in sa["state"][pid].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][pid][name])), f"optim {pid}.{name}"
    assert a[2].state_dict() == b[2].state_dict()


def local_step(local: Path, step: int) -> Path:
    return local / "local_rank_0" / f"step_{step}"


def test_a_save_commits_on_the_shared_tier_and_keeps_a_matching_local_copy(tmp_path: Path, monkeypatch) -> None:
    local = use_local(monkeypatch, tmp_path / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    save_run(ck)
    for step in (2, 4):
        assert validate(ck / f"step_{step}", level=2, record=False).ok   # `ckptsup ckpt verify --level 2`
        manifest = load_manifest(ck / f"step_{step}")
        copy = local_step(local, step)
        marker = LocalCopy.from_json((copy / MARKER_NAME).read_text(), source="marker")
        assert marker.checkpoint_id == manifest.checkpoint_id
        shards = [f for f in manifest.files if f.path != manifest.metadata_file]
        assert [(f.path, f.size, f.hash) for f in marker.files] == [(f.path, f.size, f.hash) for f in shards]
        for f in shards:
            assert (copy / f.path).read_bytes() == (ck / f"step_{step}" / f.path).read_bytes()
            assert os.stat(copy / f.path).st_mode & 0o777 == 0o600
        assert not (copy / ".metadata").exists()   # the pickle lives only on the shared tier
    assert not [p for p in (local / "local_rank_0").iterdir() if p.name.startswith(".tmp-")]


def test_resume_reads_the_local_copy_and_restores_the_saved_state(tmp_path: Path, monkeypatch) -> None:
    use_local(monkeypatch, tmp_path / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    trained = save_run(ck)
    step, tiers, resumed = resume(ck)
    assert step == 4
    assert tiers == {"read_local_files": 1, "read_shared_files": 0, "local_fallback_files": 0}
    assert_same_state(trained, resumed)


def test_a_flipped_bit_in_the_local_copy_falls_back_to_the_shared_file(tmp_path: Path, monkeypatch, caplog) -> None:
    local = use_local(monkeypatch, tmp_path / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    trained = save_run(ck)
    manifest = load_manifest(ck / "step_4")
    item = max(manifest.items, key=lambda it: it.length)
    path = local_step(local, 4) / item.file
    data = bytearray(path.read_bytes())
    data[item.offset + item.length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ckptsup.hooks"):
        step, tiers, resumed = resume(ck)
    assert step == 4
    assert tiers == {"read_local_files": 0, "read_shared_files": 1, "local_fallback_files": 1}
    assert_same_state(trained, resumed)
    assert "node-local copy" in caplog.text and "reading __0_0.distcp from the shared tier" in caplog.text
    assert (ck / "step_4").is_dir() and not (ck / "quarantine").exists()   # the good checkpoint is not condemned
    assert not path.exists()  # the bad cache entry is gone: the next resume reads shared without a warning


def test_an_unusable_local_dir_costs_one_warning_and_saves_go_to_the_shared_tier(tmp_path: Path, monkeypatch, caplog) -> None:
    (tmp_path / "not-a-dir").write_text("")
    use_local(monkeypatch, tmp_path / "not-a-dir" / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    with caplog.at_level(logging.WARNING, logger="ckptsup.hooks"):
        trained = save_run(ck, steps=6)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4", "step_6"]
    assert validate(ck / "step_6", level=2, record=False).ok
    warnings = [r.getMessage() for r in caplog.records if "node-local" in r.getMessage()]
    assert len(warnings) == 1 and "unusable" in warnings[0], warnings
    step, tiers, resumed = resume(ck)
    assert step == 6 and tiers["read_local_files"] == 0 and tiers["read_shared_files"] == 1
    assert_same_state(trained, resumed)


def test_another_runs_local_copy_of_the_same_step_is_not_used(tmp_path: Path, monkeypatch) -> None:
    local = use_local(monkeypatch, tmp_path / "local")
    ck_a = private_dir(tmp_path / "a") / "ck"
    ck_b = private_dir(tmp_path / "b") / "ck"
    trained_a = save_run(ck_a)
    save_run(ck_b)   # the same training again, same node-local dir: its copies replace run a's
    marker = LocalCopy.from_json((local_step(local, 4) / MARKER_NAME).read_text(), source="marker")
    manifest_a = load_manifest(ck_a / "step_4")
    assert marker.checkpoint_id == load_manifest(ck_b / "step_4").checkpoint_id != manifest_a.checkpoint_id
    # byte for byte the same files (deterministic training): only the checkpoint's identity tells them apart
    assert [(f.path, f.hash) for f in marker.files] == [(f.path, f.hash) for f in manifest_a.files if f.path != ".metadata"]
    step, tiers, resumed = resume(ck_a)
    assert step == 4
    assert tiers == {"read_local_files": 0, "read_shared_files": 1, "local_fallback_files": 0}
    assert_same_state(trained_a, resumed)


def test_local_retention_keeps_the_last_k_copies(tmp_path: Path, monkeypatch) -> None:
    local = use_local(monkeypatch, tmp_path / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    save_run(ck, steps=8, keep_last=2)
    assert sorted(p.name for p in (local / "local_rank_0").iterdir()) == ["step_6", "step_8"]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_6", "step_8"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    with small_tmpfs(tmp_path / "tmpfs", "48k") as mnt:
        yield mnt


def test_a_local_disk_filling_up_mid_save_fails_that_save_only(tiny_tmpfs: Path, tmp_path: Path, monkeypatch, caplog) -> None:
    """The free-space check passes (its estimate is forced to 0 here) but the real write runs out
    of space: that save fails like any failed save, and later saves skip the cache."""
    monkeypatch.setattr("ckptsup.hooks.local_stage.local_needed_bytes", lambda state_bytes: 0)
    use_local(monkeypatch, tiny_tmpfs / "local")
    ck = private_dir(tmp_path / "shared") / "ck"
    with caplog.at_level(logging.WARNING, logger="ckptsup.hooks"):
        trained = save_run(ck, steps=6)
    assert "step_2" not in os.listdir(ck)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_4", "step_6"]
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
    assert not list((tiny_tmpfs / "local" / "local_rank_0").iterdir())   # the failed staging is gone
    assert "for the rest of this run" in caplog.text
    step, _, resumed = resume(ck)
    assert step == 6
    assert_same_state(trained, resumed)


def test_a_failed_copy_to_the_shared_tier_is_told_apart_from_a_bad_local_disk(tiny_tmpfs: Path, tmp_path: Path) -> None:
    """Only the cache's own failures turn the cache off: a full shared tier is not its fault."""
    from ckptsup.hooks.writer import CopyTargetError, hash_file_and_items

    source = tmp_path / "shard"
    source.write_bytes(os.urandom(64 << 10))
    with pytest.raises(CopyTargetError, match="writing .*No space left"):
        hash_file_and_items(source, [], "xxh3-128", copy_to=tiny_tmpfs / "copy")
    with pytest.raises(OSError) as err:
        hash_file_and_items(tmp_path / "missing", [], "xxh3-128", copy_to=tmp_path / "copy")
    assert not isinstance(err.value, CopyTargetError)
    size, digest, _ = hash_file_and_items(source, [], "xxh3-128", copy_to=tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == source.read_bytes() and size == 64 << 10
    assert os.stat(tmp_path / "copy").st_mode & 0o777 == 0o600
