"""Directory tiers (node-local cache, shared FS) and the promoter's queue on real files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import list_checkpoints
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.checkpoint.promote import Promoter, PromotionResult
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.tiers import LocalTier, TierKind, expand_tier_path, tiers_from_config
from ckptsup.checkpoint.validate import validate
from ckptsup.config import StorageConfig
from ckptsup.errors import CheckpointError


def test_tier_paths_expand_node_and_job_id_and_refuse_other_fields() -> None:
    assert expand_tier_path("/scratch/{node}/ck-{job_id}", node="n3", job_id="77") == "/scratch/n3/ck-77"
    with pytest.raises(CheckpointError, match="only {node} and {job_id}"):
        expand_tier_path("/scratch/{user}", node="n3")


def test_a_local_copy_is_committed_like_the_original_and_verified_on_the_way(tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "shared", step=4)
    manifest = load_manifest(src)
    local = LocalTier(name="node_local", root=tmp_path / "{node}", kind=TierKind.NODE_LOCAL, node="n1")
    local.put(src)
    assert local.has_copy(4, manifest) and local.has_copy(4, manifest, deep=True)
    assert local.list_steps() == [4] and validate(local.path(4), level=2).ok
    local.put(src)                      # already there: nothing to do
    (local.path(4) / "__0_0.distcp").write_bytes(b"x" * manifest.files[1].size)  # same size, other bytes
    assert local.has_copy(4, manifest) and not local.has_copy(4, manifest, deep=True)


def test_a_damaged_source_is_not_copied_and_leaves_no_partial_step(tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "shared", step=2)
    data = bytearray((src / "__1_0.distcp").read_bytes())
    data[3] ^= 4
    (src / "__1_0.distcp").write_bytes(bytes(data))
    dest = LocalTier(name="dest", root=tmp_path / "dest")
    with pytest.raises(CheckpointError, match="damaged"):
        dest.put(src)
    assert list(dest.root.iterdir()) == []       # the temporary copy was removed


def test_a_tier_never_mixes_two_checkpoints_of_one_step(tmp_path: Path) -> None:
    a = write_synthetic(tmp_path / "a", step=6, seed=1)
    b = write_synthetic(tmp_path / "b", step=6, seed=2)
    dest = LocalTier(name="dest", root=tmp_path / "dest")
    dest.put(a)
    with pytest.raises(CheckpointError, match="refusing to mix"):
        dest.put(b)
    assert load_manifest(dest.path(6)).checkpoint_id == load_manifest(a).checkpoint_id


def test_tiers_from_config_orders_fastest_first(tmp_path: Path) -> None:
    cfg = StorageConfig(node_local=str(tmp_path / "{node}-{job_id}"))
    tiers = tiers_from_config(cfg, shared_dir=tmp_path / "shared", node="n2", job_id="9")
    assert [t.name for t in tiers] == ["node_local", "shared"]
    assert tiers[0].root == tmp_path / "n2-9"


def test_background_promotion_copies_node_local_checkpoints_to_the_shared_tier(tmp_path: Path) -> None:
    local = tmp_path / "local"
    shared = LocalTier(name="shared", root=tmp_path / "shared")
    results: list[PromotionResult] = []
    promoter = Promoter(destinations=[shared], on_result=results.append).start()
    for step in (10, 20):
        promoter.submit(write_synthetic(local, step=step))
    assert promoter.close(timeout_s=30)
    assert [(r.step, r.ok, r.tier) for r in results] == [(10, True, "shared"), (20, True, "shared")]
    assert [i.step for i in list_checkpoints(shared.root)] == [10, 20]
    assert [i.step for i in list_checkpoints(local)] == [10, 20]   # the source is never deleted


def test_a_full_queue_skips_the_oldest_waiting_and_never_blocks_the_caller(tmp_path: Path) -> None:
    gate = threading.Event()

    class SlowTier(LocalTier):
        def put(self, step_dir: Path) -> None:
            gate.wait(10)
            super().put(step_dir)

    dest = SlowTier(name="slow", root=tmp_path / "dest")
    results: list[PromotionResult] = []
    promoter = Promoter(destinations=[dest], queue_size=2, retries=1, on_result=results.append).start()
    dirs = [write_synthetic(tmp_path / "shared", step=s) for s in (1, 2, 3, 4)]
    promoter.submit(dirs[0])
    deadline = time.monotonic() + 5
    while promoter._current is None and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    for d in dirs[1:]:
        promoter.submit(d)                     # 2, 3 wait; 4 pushes 2 out
    assert time.monotonic() - start < 0.5
    assert promoter.in_flight() == {1, 3, 4}
    gate.set()
    assert promoter.close(timeout_s=30)
    skipped = [r.step for r in results if r.skipped]
    assert skipped == [2]
    assert sorted(r.step for r in results if r.ok) == [1, 3, 4]
    assert dest.list_steps() == [1, 3, 4]


def test_restore_source_without_a_manifest_trusts_the_shared_tiers_copy(tmp_path: Path) -> None:
    from ckptsup.checkpoint.tiers import restore_source

    shared = LocalTier(name="shared", root=tmp_path / "shared")
    local = LocalTier(name="node_local", root=tmp_path / "local", kind=TierKind.NODE_LOCAL)
    write_synthetic(local.root, step=3, seed=1)             # a stale cache of another checkpoint 3
    write_synthetic(shared.root, step=3, seed=2)
    assert restore_source(3, [local, shared]) is shared
    local.delete(3)
    local.put(shared.path(3))
    assert restore_source(3, [local, shared]) is local
    assert restore_source(4, [local, shared]) is None
