"""The commit protocol on real files: tmp dir -> manifest -> no-replace rename; two writers;
fencing; manifest parsing and the trust boundary."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import Status, latest_committed, list_checkpoints
from ckptsup.checkpoint.commit import (
    LOCK_NAME, WriterLock, WriterLockedError, abort, commit, describe_files, make_tmp_dir, parse_step,
    rename_noreplace, step_dir_name,
)
from ckptsup.checkpoint.hashing import HASH_ALGORITHMS, hash_bytes, hash_file, new_hasher
from ckptsup.checkpoint.manifest import FileEntry, Manifest, load_manifest
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.trust import check_dir_trusted
from ckptsup.errors import CheckpointError, FencedError, ManifestError, TrustError
from ckptsup.rundir import RunDir, RunState


def _tmp_with_shard(ckdir: Path, *, step: int, payload: bytes, attempt: int = 0) -> tuple[Path, Manifest]:
    tmp = make_tmp_dir(ckdir, step=step, attempt=attempt)
    (tmp / "__0_0.distcp").write_bytes(payload)
    return tmp, Manifest(step=step, metadata_file="", files=describe_files(tmp), attempt=attempt)


def test_step_names_round_trip_and_padded_names_parse() -> None:
    assert step_dir_name(42) == "step_42"
    assert parse_step("step_42") == 42 and parse_step("step_0042") == 42
    for name in (".tmp-step_4-0-abc", "step_", "step_x", "quarantine", "step_4-2026"):
        assert parse_step(name) is None


def test_hashes_are_self_describing_and_ranges_hash_like_bytes(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    for algorithm in HASH_ALGORITHMS:
        whole = hash_file(path, algorithm)
        assert whole.startswith(algorithm + ":") and whole == hash_bytes(data, algorithm)
        assert hash_file(path, algorithm, offset=1000, length=5000) == hash_bytes(data[1000:6000], algorithm)
        hasher = new_hasher(algorithm)
        hasher.update(data[:10])
        hasher.update(data[10:])
        assert hasher.hexdigest() == whole
    with pytest.raises(CheckpointError, match="past the end"):
        hash_file(path, offset=99_000, length=5000)


def test_commit_publishes_the_tmp_dir_with_a_private_manifest(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    tmp, manifest = _tmp_with_shard(ckdir, step=7, payload=b"abc")
    assert stat.S_IMODE(ckdir.stat().st_mode) == 0o700 and stat.S_IMODE(tmp.stat().st_mode) == 0o700
    assert tmp.name.startswith(".tmp-step_7-0-")
    final = commit(tmp, manifest, checkpoint_dir=ckdir)
    assert final == ckdir / "step_7" and not tmp.exists()
    assert stat.S_IMODE((final / "manifest.json").stat().st_mode) == 0o600
    assert load_manifest(final) == manifest
    assert latest_committed(ckdir).step == 7


def test_an_interrupted_save_is_never_a_checkpoint(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    write_synthetic(ckdir, step=1)
    tmp, _ = _tmp_with_shard(ckdir, step=2, payload=b"half written")   # no commit: the process died
    assert [i.step for i in list_checkpoints(ckdir)] == [1]
    abort(tmp)
    assert not tmp.exists()
    with pytest.raises(CheckpointError, match="not a temporary"):
        abort(ckdir / "step_1")


def test_two_writers_of_one_step_cannot_mix_shards(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    tmp_a, man_a = _tmp_with_shard(ckdir, step=5, payload=b"writer A")
    tmp_b, man_b = _tmp_with_shard(ckdir, step=5, payload=b"writer B")
    commit(tmp_a, man_a, checkpoint_dir=ckdir)
    with pytest.raises(CheckpointError, match="refusing to mix"):
        commit(tmp_b, man_b, checkpoint_dir=ckdir)
    assert (ckdir / "step_5" / "__0_0.distcp").read_bytes() == b"writer A"
    assert load_manifest(ckdir / "step_5").checkpoint_id == man_a.checkpoint_id
    assert tmp_b.exists()   # B's data is left for B to abort, never merged


def test_racing_commits_of_one_step_publish_exactly_one_whole_checkpoint(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    pairs = [_tmp_with_shard(ckdir, step=9, payload=f"writer {i}".encode()) for i in range(8)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(pairs))

    def go(tmp: Path, manifest: Manifest) -> None:
        barrier.wait()
        try:
            commit(tmp, manifest, checkpoint_dir=ckdir)
            outcomes.append(manifest.checkpoint_id)
        except CheckpointError:
            outcomes.append("refused")

    threads = [threading.Thread(target=go, args=pair) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "refused"]
    assert len(winners) == 1
    published = load_manifest(ckdir / "step_9")
    assert published.checkpoint_id == winners[0]
    winner_payload = next(m for _, m in pairs if m.checkpoint_id == winners[0]).files[0].hash
    assert hash_file(ckdir / "step_9" / "__0_0.distcp") == winner_payload


def test_rename_noreplace_refuses_even_an_empty_target_dir(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # a plain rename(2) would silently replace this
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")


def test_recommitting_the_same_checkpoint_is_idempotent(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    tmp, manifest = _tmp_with_shard(ckdir, step=3, payload=b"x")
    first = commit(tmp, manifest, checkpoint_dir=ckdir)
    retry = make_tmp_dir(ckdir, step=3, attempt=0)
    assert commit(retry, manifest, checkpoint_dir=ckdir) == first
    assert not retry.exists()


def test_a_zombie_attempt_with_an_old_epoch_cannot_commit(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    run.save_state(RunState(attempt=2, epoch=2))
    ckdir = tmp_path / "ck"
    tmp, manifest = _tmp_with_shard(ckdir, step=4, payload=b"zombie")
    manifest.epoch = 1
    with pytest.raises(FencedError, match="epoch 1 .* epoch 2"):
        commit(tmp, manifest, checkpoint_dir=ckdir, run_dir=run.path)
    assert not (ckdir / "step_4").exists()
    manifest.epoch = 2
    assert commit(tmp, manifest, checkpoint_dir=ckdir, run_dir=run.path).name == "step_4"


def test_a_corrupt_state_json_does_not_cost_the_commit_and_the_lock_still_fences(tmp_path: Path, caplog) -> None:
    run = RunDir.create(tmp_path / "run")
    run.state_path.write_text('{"epoch": "not json')
    ckdir = tmp_path / "ck"
    tmp, manifest = _tmp_with_shard(ckdir, step=4, payload=b"x")
    manifest.epoch = 3
    assert commit(tmp, manifest, checkpoint_dir=ckdir, run_dir=run.path).name == "step_4"
    assert "fencing by the writer lock only" in caplog.text and "state.json is corrupt" in caplog.text
    with WriterLock(ckdir, epoch=5):   # a newer attempt holds the checkpoint dir: the zombie is refused
        tmp, manifest = _tmp_with_shard(ckdir, step=5, payload=b"zombie")
        manifest.epoch = 3
        with pytest.raises(FencedError, match="held by epoch 5"):
            commit(tmp, manifest, checkpoint_dir=ckdir, run_dir=run.path)


def test_a_second_live_writer_is_refused_by_the_lock(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    ckdir.mkdir(mode=0o700)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (ckdir / LOCK_NAME).write_text(json.dumps({"pid": child.pid, "host": os.uname().nodename, "epoch": 0, "job_id": "other", "token": "t"}))
        with pytest.raises(WriterLockedError, match=f"pid {child.pid}"):
            WriterLock(ckdir, epoch=0).acquire()
    finally:
        child.kill()
        child.wait()
    # the holder is gone (same host, dead pid): the lock is taken over
    with WriterLock(ckdir, epoch=0) as lock:
        assert lock.still_ours()
    assert not (ckdir / LOCK_NAME).exists()


def test_a_newer_epoch_takes_the_lock_and_fences_the_older_writer(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    old = WriterLock(ckdir.parent / "ck", epoch=1)
    ckdir.mkdir(mode=0o700)
    old.acquire()
    new = WriterLock(ckdir, epoch=2).acquire()   # same live pid, newer epoch: takes over
    assert new.still_ours() and not old.still_ours()
    tmp, manifest = _tmp_with_shard(ckdir, step=8, payload=b"late")
    manifest.epoch = 1
    with pytest.raises(FencedError, match="held by epoch 2"):
        commit(tmp, manifest, checkpoint_dir=ckdir)
    old.release()   # must not remove the new holder's lock
    assert new.still_ours()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("step"), "missing field 'step'"),
    (lambda d: d.update(step="7"), "'step' must be int"),
    (lambda d: d.update(step=True), "got bool"),
    (lambda d: d.update(format_version=99), "format_version 99 is not supported"),
    (lambda d: d.update(surprise=1), "unknown manifest field"),
    (lambda d: d.update(checkpoint_id="nope"), "not a UUID"),
    (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
    (lambda d: d["files"][0].update(hash="md5:abc"), "not '<algorithm>:<hex>'"),
    (lambda d: d["files"][0].update(size=-1), "must be >= 0"),
    (lambda d: d["items"][0].update(file="../../etc/shadow"), "leaves or re-enters"),
    (lambda d: d["files"][0].update(path="manifest.json"), "ckptsup writes itself"),
])
def test_malformed_manifests_are_refused_with_one_line(tmp_path: Path, mutate, message: str) -> None:
    step_dir = write_synthetic(tmp_path / "ck", step=1)
    data = json.loads((step_dir / "manifest.json").read_text())
    mutate(data)
    with pytest.raises(ManifestError, match=message) as err:
        Manifest.from_json(json.dumps(data), source="m.json")
    assert "\n" not in str(err.value)


def test_non_json_deep_or_nan_manifests_are_refused(tmp_path: Path) -> None:
    for text in ("{", "[" * 100_000 + "]" * 100_000, '{"format_version": NaN}'):
        with pytest.raises(ManifestError):
            Manifest.from_json(text, source="m.json")


def test_untrusted_directories_are_refused_with_the_fix(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    write_synthetic(d, step=1)
    os.chmod(d, 0o777)
    with pytest.raises(TrustError, match="chmod -R go-w"):
        check_dir_trusted(d)
    with pytest.raises(TrustError, match="writable by group"):
        make_tmp_dir(d, step=2, attempt=0)
    os.chmod(d, 0o700)
    (d / "step_2").symlink_to(d / "step_1")
    with pytest.raises(TrustError, match="symlink"):
        check_dir_trusted(d)
    assert [i.step for i in list_checkpoints(d) if i.status is not Status.INCOMPLETE] == [1]


def test_a_checkpoint_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    step_dir = write_synthetic(tmp_path / "ck", step=1)
    someone_else = os.getuid() + 1   # as that user, our files are foreign
    with pytest.raises(TrustError, match=f"owned by uid {os.getuid()}, not you .uid {someone_else}"):
        check_dir_trusted(step_dir, recursive=True, uid=someone_else)
    if os.getuid() == 0:   # root can make a really foreign file: checked for real too
        os.chown(step_dir / "__0_0.distcp", 65534, 65534)
        with pytest.raises(TrustError, match="owned by uid 65534"):
            check_dir_trusted(step_dir, recursive=True)


def test_interrupted_saves_are_cleaned_only_by_the_writer_and_never_a_save_in_progress(tmp_path: Path) -> None:
    from ckptsup.checkpoint.commit import remove_interrupted

    ckdir = tmp_path / "ck"
    write_synthetic(ckdir, step=1)
    stale, _ = _tmp_with_shard(ckdir, step=2, payload=b"dead writer")
    mine, _ = _tmp_with_shard(ckdir, step=3, payload=b"in progress")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:   # another live writer holds the dir: not ours to clean
        (ckdir / LOCK_NAME).write_text(json.dumps({"pid": child.pid, "host": os.uname().nodename, "epoch": 0}))
        assert remove_interrupted(ckdir) == [] and stale.exists()
    finally:
        child.kill()
        child.wait()
    (ckdir / LOCK_NAME).unlink()
    with WriterLock(ckdir, epoch=0) as lock:
        assert remove_interrupted(ckdir, lock=lock, min_age_s=3600) == []   # too young
        assert remove_interrupted(ckdir, lock=lock, keep={mine}) == [stale]
    assert mine.exists() and not stale.exists()
    assert [i.step for i in list_checkpoints(ckdir)] == [1]


def test_describe_and_hash_refuse_symlinks_in_a_save(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    tmp, _ = _tmp_with_shard(ckdir, step=1, payload=b"data")
    (tmp / "sneaky.distcp").symlink_to("/etc/hostname")
    with pytest.raises(CheckpointError, match="symlink"):
        describe_files(tmp)
    with pytest.raises(OSError):
        hash_file(tmp / "sneaky.distcp")   # O_NOFOLLOW: never hashes what a link points at


def test_nested_files_are_described_and_committed(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    tmp = make_tmp_dir(ckdir, step=2, attempt=1)
    (tmp / "rank0").mkdir()
    (tmp / "rank0" / "shard.bin").write_bytes(b"nested")
    entries = describe_files(tmp, "sha256")
    assert [(e.path, e.size) for e in entries] == [("rank0/shard.bin", 6)] and entries[0].hash.startswith("sha256:")
    final = commit(tmp, Manifest(step=2, metadata_file="", files=entries, hash_algorithm="sha256"), checkpoint_dir=ckdir)
    from ckptsup.checkpoint.validate import validate

    assert validate(final, level=2).ok


def test_describe_files_and_items_hashes_files_and_chunks_in_one_pass(tmp_path: Path) -> None:
    from ckptsup.checkpoint.commit import describe_files_and_items
    from ckptsup.checkpoint.validate import validate

    ckdir = tmp_path / "ck"
    tmp = make_tmp_dir(ckdir, step=5, attempt=0)
    a, b = os.urandom(3000), os.urandom(5000)
    (tmp / "__0_0.distcp").write_bytes(a + b)
    (tmp / ".metadata").write_bytes(b"meta")
    files, items = describe_files_and_items(tmp, "xxh3-128", {"__0_0.distcp": [("w@0", 0, 3000), ("b@0", 3000, 5000)]})
    assert [f.path for f in files] == [".metadata", "__0_0.distcp"]
    assert [(i.key, i.hash) for i in items] == [("w@0", hash_bytes(a)), ("b@0", hash_bytes(b))]
    commit(tmp, Manifest(step=5, files=files, items=items, metadata_hash=files[0].hash), checkpoint_dir=ckdir)
    assert validate(ckdir / "step_5", level=2).ok
    tmp2 = make_tmp_dir(ckdir, step=6, attempt=0)
    (tmp2 / "x").write_bytes(b"12")
    with pytest.raises(CheckpointError, match="runs past the end"):
        describe_files_and_items(tmp2, "xxh3-128", {"x": [("k", 0, 3)]})
    with pytest.raises(CheckpointError, match="not written"):
        describe_files_and_items(tmp2, "xxh3-128", {"y": [("k", 0, 1)]})


@pytest.mark.parametrize("content", [
    '{"pid": "abc", "host": "h", "epoch": 1}', '{"pid": 5, "host": "h", "epoch": "1"}', "[1, 2]", "{torn",
    '{"pid": 5, "host": ["h"], "epoch": 1}',
])
def test_a_garbled_or_mistyped_lock_reads_as_an_unknown_writer(tmp_path: Path, content: str) -> None:
    from ckptsup.checkpoint.writerlock import read_lock

    (tmp_path / LOCK_NAME).write_text(content)
    holder = read_lock(tmp_path / LOCK_NAME)
    assert holder is not None and holder.pid == -1 and holder.epoch == 0


@pytest.mark.parametrize("pid", [0, -1, -12345])
def test_pid_zero_or_negative_is_never_alive(pid: int) -> None:
    """kill(2) reads 0 and negative pids as process groups: they never name one writer."""
    from ckptsup.checkpoint.writerlock import pid_alive

    assert pid_alive(pid) is False
    assert pid_alive(os.getpid()) is True
