"""The S3 tier and background promotion against a real moto_server on 127.0.0.1 (started here, on
a free port, with dummy credentials): round trip, commit marker last, a stopped object store
(retries; the shared copy stays) and its restart (promoted)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import latest_durable
from ckptsup.checkpoint.manifest import MANIFEST_NAME, load_manifest
from ckptsup.checkpoint.promote import Promoter, PromotionResult
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.tiers import LocalTier, TierKind, restore_source
from ckptsup.checkpoint.validate import validate
from ckptsup.errors import CheckpointError

from s3_helpers import BUCKET, free_port as _free_port, make_bucket as _make_bucket, moto  # noqa: F401 - moto is a fixture

pytestmark = pytest.mark.s3


@pytest.fixture
def s3tier(moto, request):
    from ckptsup.checkpoint.s3tier import S3Tier

    _make_bucket(moto)
    return S3Tier(url=f"s3://{BUCKET}/{request.node.name[:40]}/{{job_id}}", endpoint_url=moto.url, job_id="j1")


def test_s3_round_trip_writes_the_manifest_last_and_restores_a_verified_copy(tmp_path: Path, s3tier) -> None:
    shared = tmp_path / "shared"
    step_dir = write_synthetic(shared, step=5, item_bytes=70_000)
    manifest = load_manifest(step_dir)
    calls: list[str] = []
    original_put_object = s3tier.client.put_object

    def spy(**kw):
        calls.append(kw["Key"])
        return original_put_object(**kw)

    s3tier.client.put_object = spy
    s3tier.put(step_dir)
    assert calls[-1].endswith(f"step_5/{MANIFEST_NAME}") and s3tier.prefix.endswith("/j1")
    assert s3tier.has_copy(5, manifest) and s3tier.list_steps() == [5]
    restored = s3tier.fetch(5, tmp_path / "restore")
    assert restored == tmp_path / "restore" / "step_5"
    assert validate(restored, level=2).ok
    for f in manifest.files:
        assert (restored / f.path).read_bytes() == (step_dir / f.path).read_bytes()


def test_s3_listing_ignores_a_step_without_its_commit_marker_and_delete_uncommits_first(tmp_path: Path, s3tier) -> None:
    for step in (1, 2):
        s3tier.put(write_synthetic(tmp_path / "shared", step=step))
    s3tier.client.delete_object(Bucket=s3tier.bucket, Key=s3tier.key(2, MANIFEST_NAME))  # an interrupted upload
    assert s3tier.list_steps() == [1]
    with pytest.raises(CheckpointError, match="no manifest"):
        s3tier.fetch(2, tmp_path / "restore")
    s3tier.delete(1)
    assert s3tier.list_steps() == []
    left = s3tier.client.list_objects_v2(Bucket=s3tier.bucket, Prefix=s3tier.key(1)).get("KeyCount", 0)
    assert left == 0


def test_a_damaged_source_is_never_published_to_s3(tmp_path: Path, s3tier) -> None:
    step_dir = write_synthetic(tmp_path / "shared", step=3)
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="damaged"):
        s3tier.put(step_dir)
    assert s3tier.list_steps() == []


def test_restore_reads_the_fastest_tier_holding_a_matching_copy(tmp_path: Path, s3tier) -> None:
    shared = LocalTier(name="shared", root=tmp_path / "shared")
    local = LocalTier(name="node_local", root=tmp_path / "local-{node}", kind=TierKind.NODE_LOCAL, node="n1")
    step_dir = write_synthetic(shared.root, step=7)
    manifest = load_manifest(step_dir)
    s3tier.put(step_dir)
    tiers = [local, shared, s3tier]
    assert restore_source(7, tiers, manifest) is shared         # not cached locally yet
    local.put(step_dir)
    assert local.root == tmp_path / "local-n1"
    assert restore_source(7, tiers, manifest) is local
    (local.path(7) / "__1_0.distcp").write_bytes(b"short")      # a stale/damaged cache
    assert restore_source(7, tiers, manifest) is shared
    shutil.rmtree(shared.path(7))
    assert restore_source(7, tiers, manifest) is s3tier
    assert latest_durable(tmp_path / "shared", [local, shared, s3tier]) is None   # gone from shared


def test_promotion_survives_a_stopped_object_store_and_completes_after_restart(tmp_path: Path, moto) -> None:
    from ckptsup.checkpoint.s3tier import S3Tier

    _make_bucket(moto)
    tier = S3Tier(url=f"s3://{BUCKET}/outage", endpoint_url=moto.url, connect_timeout_s=1, read_timeout_s=5)
    shared = tmp_path / "shared"
    step_dir = write_synthetic(shared, step=11, item_bytes=50_000)
    manifest = load_manifest(step_dir)
    results: list[PromotionResult] = []
    promoter = Promoter(destinations=[tier], queue_size=2, retries=60, on_result=results.append,
                        wait_initial_s=0.1, wait_max_s=0.5).start()
    moto.stop()
    try:
        promoter.submit(step_dir)
        time.sleep(2.0)                       # several failed attempts while the store is down
        assert promoter.in_flight() == {11} and results == []
        assert (step_dir / "__0_0.distcp").exists()     # the shared copy stays
    finally:
        moto.start()
        _make_bucket(moto)                    # moto keeps state in memory: a restarted store is empty
    assert promoter.drain(timeout_s=60)
    promoter.close()
    assert len(results) == 1 and results[0].ok and results[0].attempts > 1, results
    assert results[0].bytes == manifest.total_bytes
    assert tier.has_copy(11, manifest)
    assert latest_durable(shared, [tier]).step == 11
    assert validate(step_dir, level=2).ok


def test_promotion_gives_up_after_its_retries_and_keeps_the_source(tmp_path: Path) -> None:
    from ckptsup.checkpoint.s3tier import S3Tier

    dead = S3Tier(url=f"s3://{BUCKET}/dead", endpoint_url=f"http://127.0.0.1:{_free_port()}", connect_timeout_s=0.5)
    step_dir = write_synthetic(tmp_path / "shared", step=4)
    sleeps: list[float] = []
    promoter = Promoter(destinations=[dead], retries=3, sleep=sleeps.append, wait_initial_s=1.0)
    result = promoter.promote_one(step_dir, dead)
    assert not result.ok and result.attempts == 3 and len(sleeps) == 2
    assert sleeps[1] >= sleeps[0]  # exponential backoff, injected sleep
    assert "EndpointConnectionError" in result.error or "Connect" in result.error
    assert validate(step_dir, level=2).ok


def test_retention_runs_per_tier_on_s3_with_an_injected_clock(tmp_path: Path, s3tier) -> None:
    from datetime import datetime, timedelta, timezone

    from ckptsup.checkpoint.retention import apply_tier_retention

    now = datetime(2026, 5, 1, tzinfo=timezone.utc)
    for step in range(1, 7):
        s3tier.put(write_synthetic(tmp_path / "shared", step=step, created_at=now - timedelta(days=30 - step)))
    result = apply_tier_retention(s3tier, keep_last=2, keep_daily_days=0, clock=lambda: now,
                                  validated={2}, protected={3})
    assert result.deleted == [1, 4] and s3tier.list_steps() == [2, 3, 5, 6]


def test_multipart_uploads_left_by_a_killed_promotion_are_aborted(tmp_path: Path, s3tier) -> None:
    key = s3tier.key(9, "__0_0.distcp")
    upload = s3tier.client.create_multipart_upload(Bucket=s3tier.bucket, Key=key)
    s3tier.client.upload_part(Bucket=s3tier.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)
    from datetime import timedelta

    # moto reports a fixed Initiated date, so "now" is taken relative to what the server says
    initiated = s3tier.client.list_multipart_uploads(Bucket=s3tier.bucket, Prefix=s3tier.prefix)["Uploads"][0]["Initiated"]
    assert s3tier.abort_incomplete_uploads(older_than_s=3600, now=initiated + timedelta(minutes=10)) == 0  # maybe live
    assert s3tier.abort_incomplete_uploads(older_than_s=3600, now=initiated + timedelta(hours=2)) == 1
    left = s3tier.client.list_multipart_uploads(Bucket=s3tier.bucket, Prefix=s3tier.prefix).get("Uploads", [])
    assert left == [] and s3tier.list_steps() == []


def test_a_large_file_goes_up_in_parts_and_comes_back_verified(tmp_path: Path, s3tier, monkeypatch) -> None:
    from boto3.s3.transfer import TransferConfig

    s3tier.transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=2)
    step_dir = write_synthetic(tmp_path / "shared", step=12, ranks=1, items_per_rank=3, item_bytes=4 << 20)  # 12 MiB shard
    manifest = load_manifest(step_dir)
    s3tier.put(step_dir)
    head = s3tier.client.head_object(Bucket=s3tier.bucket, Key=s3tier.key(12, "__0_0.distcp"))
    assert "-" in head["ETag"]      # a multipart ETag: "<md5>-<parts>"
    assert s3tier.has_copy(12, manifest)
    assert validate(s3tier.fetch(12, tmp_path / "back"), level=2).ok


def test_an_unreachable_object_store_is_one_tier_error_and_restore_skips_it(tmp_path: Path) -> None:
    from ckptsup.checkpoint.s3tier import S3Tier
    from ckptsup.checkpoint.tiers import TierError

    dead = S3Tier(url=f"s3://{BUCKET}/x", endpoint_url=f"http://127.0.0.1:{_free_port()}", connect_timeout_s=0.5)
    shared = LocalTier(name="shared", root=tmp_path / "shared")
    manifest = load_manifest(write_synthetic(shared.root, step=2))
    with pytest.raises(TierError, match=r"s3://ckpts/x: EndpointConnectionError") as err:
        dead.list_steps()
    assert "\n" not in str(err.value)
    assert restore_source(2, [dead, shared], manifest) is shared


@pytest.mark.parametrize("url", ["s3://AKIAXXXX:s3cr3t@bucket/p", "s3://B/p", "https://bucket/p", "s3://"])
def test_bad_object_store_urls_are_refused_without_echoing_credentials(url: str) -> None:
    from ckptsup.checkpoint.s3tier import parse_s3_url

    with pytest.raises(CheckpointError, match="is not s3://bucket") as err:
        parse_s3_url(url)
    assert "s3cr3t" not in str(err.value) and "AKIA" not in str(err.value)


def test_housekeeper_promotes_each_commit_to_s3_and_prunes_it_there(tmp_path: Path, s3tier) -> None:
    from ckptsup.checkpoint.housekeeping import Housekeeper
    from ckptsup.events import Event

    events: list[tuple[Event, dict]] = []
    keeper = Housekeeper(checkpoint_dir=tmp_path / "shared", slower_tiers=[s3tier], keep_last=2, keep_daily_days=0,
                         test_load_every=0, emit=lambda e, f: events.append((e, f)), promote_wait_initial_s=0.05)
    for step in (1, 2, 3, 4):
        keeper.after_commit(write_synthetic(tmp_path / "shared", step=step))
    assert keeper.close(timeout_s=60)
    promoted = [f for e, f in events if e is Event.CHECKPOINT_PROMOTED]
    assert all(f["ok"] or f["skipped"] for f in promoted) and {f["step"] for f in promoted if f["ok"]} >= {4}
    assert s3tier.list_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "shared").glob("step_*")) == ["step_3", "step_4"]
