"""Validation levels 1-2, quarantine and fallback on real files (the corruption matrix of
issue 3 / reliability.md §4 rows 8-10). Shards are written by plain Python through the real
commit path (ckptsup.checkpoint.synthetic); no torch."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import Status, latest_committed, latest_validated, list_checkpoints
from ckptsup.checkpoint.hashing import hash_bytes
from ckptsup.checkpoint.manifest import MANIFEST_NAME, VALIDATION_NAME
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.validate import quarantine, validate, verify_item
from ckptsup.errors import ValidationError


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    d = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_synthetic(d, step=step)
    for step in (10, 20):
        assert validate(d / f"step_{step}", level=2).ok
    return d


def _rewrite_manifest(step_dir: Path, mutate) -> None:
    data = json.loads((step_dir / MANIFEST_NAME).read_text())
    mutate(data)
    (step_dir / MANIFEST_NAME).write_text(json.dumps(data))


def test_a_clean_checkpoint_passes_levels_1_and_2_and_is_recorded(ckdir: Path) -> None:
    result = validate(ckdir / "step_30", level=2)
    assert result.ok and result.level_passed == 2 and result.problems == []
    recorded = json.loads((ckdir / "step_30" / VALIDATION_NAME).read_text())
    assert recorded["ok"] is True and recorded["level"] == 2
    assert latest_validated(ckdir).step == 30


def flip_bit(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    pos = rng.randrange(len(data) * 8)
    data[pos // 8] ^= 1 << (pos % 8)
    path.write_bytes(bytes(data))
    return pos


def test_a_flipped_bit_is_rejected_naming_the_file_and_resume_falls_back(ckdir: Path) -> None:
    flip_bit(ckdir / "step_30" / "__1_0.distcp", random.Random(1))
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok
    assert any("__1_0.distcp" in p and "hash" in p for p in result.problems)
    assert latest_validated(ckdir).step == 20


def test_a_truncated_shard_is_rejected_by_size(ckdir: Path) -> None:
    shard = ckdir / "step_30" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    result = validate(ckdir / "step_30", level=1)
    assert not result.ok and any("__0_0.distcp: size" in p and "truncated" in p for p in result.problems)
    assert latest_validated(ckdir).step == 20


def test_a_missing_file_is_rejected(ckdir: Path) -> None:
    (ckdir / "step_30" / ".metadata").unlink()
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok and any(".metadata: missing" in p for p in result.problems)


def test_a_missing_manifest_means_not_a_checkpoint(ckdir: Path) -> None:
    (ckdir / "step_30" / MANIFEST_NAME).unlink()
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok and "never committed" in result.problems[0]
    info = {i.step: i for i in list_checkpoints(ckdir)}[30]
    assert info.status is Status.INCOMPLETE
    assert latest_committed(ckdir).step == 20


@pytest.mark.parametrize("bad_path", ["../x", "/etc/passwd", "a/../../x", "a\\..\\x", "./a", "a//b", ""])
def test_a_manifest_naming_a_path_outside_its_directory_is_rejected(ckdir: Path, bad_path: str) -> None:
    def mutate(data):
        data["files"][0]["path"] = bad_path
    _rewrite_manifest(ckdir / "step_30", mutate)
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok and "path" in result.problems[0]
    assert latest_committed(ckdir).step == 20  # INCOMPLETE: the manifest itself is refused


def test_a_symlinked_shard_is_rejected_even_when_its_content_matches(ckdir: Path, tmp_path: Path) -> None:
    shard = ckdir / "step_30" / "__0_0.distcp"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok and "symlink" in result.problems[0]
    assert {i.step: i.status for i in list_checkpoints(ckdir)}[30] is Status.INCOMPLETE


def test_a_symlinked_manifest_is_refused(ckdir: Path, tmp_path: Path) -> None:
    real = ckdir / "step_30" / MANIFEST_NAME
    moved = tmp_path / "m.json"
    moved.write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(moved)
    result = validate(ckdir / "step_30", level=1)
    assert not result.ok and "symlink" in result.problems[0]


def test_an_unlisted_extra_file_is_rejected(ckdir: Path) -> None:
    (ckdir / "step_30" / "__9_0.distcp").write_bytes(b"from another writer")
    result = validate(ckdir / "step_30", level=1)
    assert not result.ok and any("__9_0.distcp: present but not listed" in p for p in result.problems)


def test_level2_rejects_items_outside_their_file_or_overlapping(ckdir: Path) -> None:
    def mutate(data):
        data["items"][1]["offset"] = data["items"][0]["offset"] + 1          # overlaps item 0
        data["items"][2]["offset"] = 10**9                                    # past the end
    _rewrite_manifest(ckdir / "step_30", mutate)
    result = validate(ckdir / "step_30", level=2)
    assert result.level_passed == 1 and not result.ok
    assert any("overlap" in p for p in result.problems)
    assert any("runs past the end" in p for p in result.problems)


def test_level2_rejects_a_metadata_hash_that_does_not_match(ckdir: Path) -> None:
    def mutate(data):
        data["metadata_hash"] = hash_bytes(b"another checkpoint's metadata")
    _rewrite_manifest(ckdir / "step_30", mutate)
    result = validate(ckdir / "step_30", level=2)
    assert not result.ok and any("metadata_hash" in p for p in result.problems)


def test_level2_rejects_a_manifest_whose_step_differs_from_the_directory(ckdir: Path) -> None:
    os.rename(ckdir / "step_30", ckdir / "step_40")
    result = validate(ckdir / "step_40", level=2)
    assert not result.ok and any("step 30" in p for p in result.problems)


def test_100_random_bit_flips_are_all_detected(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    step_dir = write_synthetic(d, step=1, ranks=2, items_per_rank=8, item_bytes=2048)
    files = sorted(p for p in step_dir.iterdir() if p.name not in (MANIFEST_NAME, VALIDATION_NAME))
    rng = random.Random(1234)
    detected = 0
    for _ in range(100):
        target = rng.choice(files)
        original = target.read_bytes()
        flip_bit(target, rng)
        result = validate(step_dir, level=2, record=False)
        detected += (not result.ok) and any(target.name in p for p in result.problems)
        target.write_bytes(original)
    assert detected == 100
    assert validate(step_dir, level=2).ok  # restored: the check itself is not flaky


def test_verify_item_accepts_the_right_bytes_and_rejects_a_flip(tmp_path: Path) -> None:
    from ckptsup.checkpoint.manifest import load_manifest

    step_dir = write_synthetic(tmp_path / "ck", step=3)
    manifest = load_manifest(step_dir)
    item = manifest.items[5]
    with open(step_dir / item.file, "rb") as f:
        f.seek(item.offset)
        data = bytearray(f.read(item.length))
    verify_item(data, item)
    data[7] ^= 0x10
    with pytest.raises(ValidationError, match="hash"):
        verify_item(data, item)
    with pytest.raises(ValidationError, match="read"):
        verify_item(data[:-1], item)


def test_quarantine_moves_a_bad_checkpoint_aside_with_its_reason_and_never_deletes(ckdir: Path) -> None:
    flip_bit(ckdir / "step_30" / "__0_0.distcp", random.Random(2))
    result = validate(ckdir / "step_30", level=2)
    dest = quarantine(ckdir / "step_30", result.problems[0])
    assert not (ckdir / "step_30").exists()
    assert dest.parent == ckdir / "quarantine" and dest.name.startswith("step_30-")
    assert (dest / "__0_0.distcp").exists()
    assert "hash" in json.loads((dest / "quarantine_reason.json").read_text())["reason"]
    assert [i.step for i in list_checkpoints(ckdir)] == [10, 20]
    q = [i for i in list_checkpoints(ckdir, include_quarantined=True) if i.status is Status.QUARANTINED]
    assert [i.step for i in q] == [30] and "hash" in q[0].problem


def test_a_passing_level1_recheck_keeps_an_earlier_higher_level(ckdir: Path) -> None:
    path = ckdir / "step_20" / VALIDATION_NAME
    data = json.loads(path.read_text())
    data["level"] = 3
    path.write_text(json.dumps(data))
    assert validate(ckdir / "step_20", level=1).ok
    assert json.loads(path.read_text())["level"] == 3


def test_level3_runs_the_test_load_in_a_separate_process_and_reports_its_failure(ckdir: Path, tmp_path: Path) -> None:
    script = tmp_path / "testload.py"
    script.write_text("import sys\nprint('boom: cannot load ' + sys.argv[1], file=sys.stderr)\nsys.exit(3)\n")
    result = validate(ckdir / "step_30", level=3, testload_command=[sys.executable, str(script)])
    assert not result.ok and result.level_passed == 2
    assert "exit 3" in result.problems[0] and "boom" in result.problems[0] and "step_30" in result.problems[0]


def test_level3_passes_when_the_test_load_exits_0_and_a_hung_one_times_out(ckdir: Path, tmp_path: Path) -> None:
    ok = tmp_path / "ok.py"
    ok.write_text("import sys, pathlib\nsys.exit(0 if (pathlib.Path(sys.argv[1]) / 'manifest.json').exists() else 1)\n")
    result = validate(ckdir / "step_30", level=3, testload_command=[sys.executable, str(ok)])
    assert result.ok and result.level_passed == 3
    assert latest_validated(ckdir, min_level=3).step == 30
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(60)\n")
    result = validate(ckdir / "step_20", level=3, testload_command=[sys.executable, str(hang)], testload_timeout_s=1)
    assert not result.ok and "within 1 s" in result.problems[0]


def test_levels_1_and_2_and_the_catalog_never_unpickle_metadata(tmp_path: Path) -> None:
    """A .metadata pickle that would create a canary file when unpickled, with a manifest that
    vouches for it: levels 1-2, the catalog and retention read JSON only, so it never runs."""
    import pickle

    from ckptsup.checkpoint.commit import commit, describe_files, make_tmp_dir
    from ckptsup.checkpoint.hashing import hash_file
    from ckptsup.checkpoint.manifest import Manifest
    from ckptsup.checkpoint.retention import apply_retention

    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    payload = pickle.dumps(Evil())
    ckdir = tmp_path / "ck"
    tmp = make_tmp_dir(ckdir, step=1, attempt=0)
    (tmp / ".metadata").write_bytes(payload)
    (tmp / "__0_0.distcp").write_bytes(b"\0" * 64)
    commit(tmp, Manifest(step=1, files=describe_files(tmp), metadata_hash=hash_file(tmp / ".metadata")), checkpoint_dir=ckdir)
    assert validate(ckdir / "step_1", level=2).ok
    assert latest_validated(ckdir).step == 1 and list_checkpoints(ckdir)[0].manifest is not None
    apply_retention(ckdir, keep_last=1, keep_daily_days=0)
    assert not canary.exists()
    pickle.loads(payload)      # the payload is live: this is what a blind unpickle would do
    assert canary.exists()


def test_level2_rejects_entries_hashed_with_another_algorithm_than_the_manifest_says(tmp_path: Path) -> None:
    step_dir = write_synthetic(tmp_path / "ck", step=1, algorithm="crc32")
    def mutate(data):
        data["hash_algorithm"] = "sha256"   # claims sha256, but every entry is crc32
    _rewrite_manifest(step_dir, mutate)
    assert validate(step_dir, level=1).ok
    result = validate(step_dir, level=2)
    assert not result.ok and "not hashed with the manifest's sha256" in result.problems[0]
    result = validate(step_dir, level=1, algorithm="crc32")
    assert not result.ok and "sha256, but crc32 was required" in result.problems[0]


def test_item_hashes_are_checked_in_the_level1_read_and_reported_at_level2(tmp_path: Path) -> None:
    step_dir = write_synthetic(tmp_path / "ck", step=1)
    def mutate(data):
        data["items"][3]["hash"] = hash_bytes(b"not these bytes")   # a writer bug in the index
    _rewrite_manifest(step_dir, mutate)
    assert validate(step_dir, level=1).ok          # the files are intact...
    result = validate(step_dir, level=2)           # ...the index is not: structure, level 2
    assert not result.ok and result.level_passed == 1
    assert "item index is wrong" in result.problems[0] and "layer3" in result.problems[0]


def test_hash_file_and_ranges_matches_separate_hashes(tmp_path: Path) -> None:
    from ckptsup.checkpoint.hashing import CHUNK, hash_file_and_ranges

    data = os.urandom(2 * CHUNK + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [(CHUNK - 10, 20, "crc32"), (0, 100, "xxh3-128"), (2 * CHUNK, 12345, "sha256"), (500, 0, "xxh3-128"), (100, CHUNK, "xxh3-128")]
    whole, size, parts = hash_file_and_ranges(path, "xxh3-128", ranges)
    assert whole == hash_bytes(data) and size == len(data)
    assert parts == [hash_bytes(data[o:o + n], a) for o, n, a in ranges]


def test_concurrent_validations_of_one_checkpoint_all_pass_and_record_cleanly(tmp_path: Path) -> None:
    import threading

    step_dir = write_synthetic(tmp_path / "ck", step=1, items_per_rank=64, item_bytes=8192)
    results = []
    threads = [threading.Thread(target=lambda: results.append(validate(step_dir, level=2))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r.ok for r in results), [r.problems for r in results]
    assert json.loads((step_dir / VALIDATION_NAME).read_text())["ok"] is True
    assert not [p for p in step_dir.iterdir() if p.name.endswith(".tmp")]


def test_check_present_finds_missing_truncated_and_symlinked_files_without_hashing(ckdir: Path) -> None:
    from ckptsup.checkpoint.manifest import load_manifest
    from ckptsup.checkpoint.validate import check_present

    step = ckdir / "step_30"
    manifest = load_manifest(step)
    assert check_present(step, manifest) == []
    first, second, third = (step / f.path for f in manifest.files[:3])
    first.unlink()
    with open(second, "r+b") as fh:
        fh.truncate(1)
    third.unlink()
    third.symlink_to(ckdir / "step_20" / manifest.files[2].path)
    problems = check_present(step, manifest)
    assert len(problems) == 3
    assert "missing" in problems[0] and "size 1 !=" in problems[1] and "not a regular file" in problems[2]
