"""A script's own checkpoint file: the torch-free check (checkpoint/script_file.py) on real
torch.save, legacy pickle and safetensors files, torn and changed; the keeper of verified versions
(checkpoint/script_keep.py) and the supervisor component that restores before a launch
(supervisor/job/script_checkpoint.py), on real files."""
from __future__ import annotations

import json
import os
import stat
import time
import struct
from pathlib import Path

import pytest
import torch

from ckptsup.checkpoint import script_file
from ckptsup.checkpoint.script_keep import Keeper, all_versions
from ckptsup.config import load_config
from ckptsup.errors import ConfigError
from ckptsup.events import Event
from ckptsup.supervisor.job.script_checkpoint import OnCorrupt, ScriptCheckpoints


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"step": seed, "model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "opt": {"lr": 0.1, "m": torch.zeros(64, 64)}}


def one_line(verdict: script_file.Verdict) -> str:
    line = verdict.line("f")
    assert "\n" not in line and line
    return line


# ---- the check ----------------------------------------------------------------------------------

def test_a_torch_save_file_is_whole_and_every_truncation_of_it_is_not(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(state(), path)
    verdict = script_file.check(path)
    assert verdict.ok and verdict.kind is script_file.Kind.ZIP and verdict.entries >= 4, verdict
    data = path.read_bytes()
    torn = tmp_path / "torn.pt"
    for cut in sorted({*range(0, len(data), max(1, len(data) // 200)), len(data) - 1, len(data) - 21, 1, 30}):
        torn.write_bytes(data[:cut])
        got = script_file.check(torn)
        assert not got.ok, f"cut at {cut} of {len(data)} passed"
        one_line(got)
    torn.write_bytes(data[: len(data) // 2])
    assert "no end-of-central-directory record" in script_file.check(torn).problem


def test_a_flipped_byte_in_a_member_is_named_by_its_crc(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(state(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10   # inside a tensor's bytes: the zip's structure stays
    path.write_bytes(bytes(data))
    verdict = script_file.check(path)
    assert not verdict.ok and "CRC-32" in verdict.problem and "entry '" in verdict.problem, verdict
    loaded = torch.load(path)   # torch.load reads it without a word: only the CRC tells
    assert not all(torch.equal(loaded["model"][k], state()["model"][k]) for k in ("w", "b")) or \
        not torch.equal(loaded["opt"]["m"], state()["opt"]["m"])


def test_a_legacy_pickle_is_read_whole_and_torn_in_its_pickles_is_not(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(state(), path, _use_new_zipfile_serialization=False)
    verdict = script_file.check(path)
    assert verdict.ok and verdict.kind is script_file.Kind.PICKLE, verdict
    data = path.read_bytes()
    for cut in (1, 10, 40, 200):   # inside the magic, protocol, sys_info and object pickles
        path.write_bytes(data[:cut])
        got = script_file.check(path)
        assert not got.ok and "STOP" in got.problem or "missing" in got.problem, (cut, got)


def test_garbage_and_empty_files_named_pt_are_not_checkpoints(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(os.urandom(4096).replace(b"\x80", b"\x00").replace(b"PK", b"pk"))
    assert "neither a zip" in script_file.check(path).problem
    path.write_bytes(b"")
    assert "empty" in script_file.check(path).problem
    other = tmp_path / "notes.txt"
    other.write_bytes(b"any bytes")
    assert script_file.check(other).ok   # any other file: a full read and its size


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    header, at, blobs = {}, 0, []
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        at += len(blob)
        blobs.append(blob)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def test_a_safetensors_file_written_by_hand_and_its_faults(tmp_path):
    path = tmp_path / "model.safetensors"
    good = safetensors_bytes({"w": ("F32", [4, 4], bytes(64)), "b": ("BF16", [3], bytes(6))})
    path.write_bytes(good)
    verdict = script_file.check(path)
    assert verdict.ok and verdict.kind is script_file.Kind.SAFETENSORS and verdict.entries == 2, verdict
    try:   # the library agrees where it is installed
        from safetensors import safe_open
        with safe_open(str(path), "pt") as fh:
            assert sorted(fh.keys()) == ["b", "w"]
    except ImportError:
        pass
    cases = {
        "torn": (good[:-3], "torn"),
        "header torn": (good[:20], "runs past the end"),
        "shape": (safetensors_bytes({"w": ("F32", [4, 5], bytes(64))}), "data_offsets span"),
        "dtype": (safetensors_bytes({"w": ("F33", [4], bytes(16))}), "unknown dtype"),
        "json": (struct.pack("<Q", 4) + b"{nop" + bytes(8), "not JSON"),
        "trailing": (good + b"xx", "trailing bytes"),
    }
    for what, (data, expected) in cases.items():
        path.write_bytes(data)
        got = script_file.check(path)
        assert not got.ok and expected in got.problem, (what, got)
        one_line(got)


def test_crc32_combine_joins_the_crcs_of_two_pieces():
    import random
    import zlib
    rng = random.Random(3)
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(0, 2000)), rng.randbytes(rng.randrange(0, 2000))
        assert script_file.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.fixture(params=["libdeflate", "zlib"])
def crc_backend(request, monkeypatch):
    """Each CRC-32 the check can use: libdeflate (where the system has it) and zlib's, the fallback."""
    if request.param == "zlib":
        monkeypatch.setattr(script_file, "_FAST", [None])
    elif script_file._fast_crc() is None:
        pytest.skip("no libdeflate.so.0 here")
    assert script_file.crc_backend() == request.param
    return request.param


@pytest.mark.parametrize("threads", [1, 3])
def test_a_long_entry_split_over_threads_gives_the_same_verdicts(tmp_path, monkeypatch, crc_backend, threads):
    """Pieces of 4 KiB (entries of 8 KiB or more split): a whole file, a flipped byte in a long
    entry, every cut, with one thread or three, libdeflate or zlib."""
    monkeypatch.setattr(script_file, "UNIT", 4096)
    monkeypatch.setattr(script_file, "STRIPE_MIN", 8192)
    monkeypatch.setattr(script_file, "CHUNK", 1536)   # pieces read in several chunks, the last short
    path = tmp_path / "ckpt.pt"
    g = torch.Generator().manual_seed(5)
    torch.save({"big": torch.randn(50_001, generator=g), "small": torch.randn(7, generator=g)}, path)
    verdict = script_file.check(path, threads=threads)
    assert verdict.ok and verdict.entries >= 4, verdict
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01   # inside the big tensor's bytes
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(flipped))
    got = script_file.check(bad, threads=threads)
    assert not got.ok and "CRC-32" in got.problem and "data/0" in got.problem, got
    for cut in (len(data) - 1, len(data) - 22, len(data) // 2, 100):
        bad.write_bytes(data[:cut])
        assert not script_file.check(bad, threads=threads).ok, cut


def test_a_file_that_ends_inside_a_split_range_names_where_it_ends(tmp_path, monkeypatch, crc_backend):
    """The split scan raises what the one-thread scan raises: the first byte missing."""
    import zlib
    monkeypatch.setattr(script_file, "UNIT", 4096)
    monkeypatch.setattr(script_file, "STRIPE_MIN", 8192)
    path = tmp_path / "blob"
    body = os.urandom(50_000)
    path.write_bytes(body)
    fd = os.open(path, os.O_RDONLY)
    try:
        problems = []
        for threads in (1, 3):
            reader = script_file._Reader(fd, len(body), threads=threads)
            try:
                assert reader.scan(7, 40_000) == zlib.crc32(body[7:40_007])
                with pytest.raises(script_file.Corrupt) as err:
                    reader.scan(100, 60_000)   # 10,100 bytes past the end
                problems.append(str(err.value))
            finally:
                reader.close()
        assert problems[0] == problems[1] and "ends at byte 50000" in problems[0], problems
    finally:
        os.close(fd)


# ---- the keeper ---------------------------------------------------------------------------------

def test_versions_are_kept_bounded_private_and_a_torn_one_is_not_kept(tmp_path):
    run, target = tmp_path / "run", tmp_path / "out" / "ckpt.pt"
    target.parent.mkdir()
    keeper = Keeper(run_dir=run, target=target, path="out/ckpt.pt", keep=2)
    for i in range(4):
        torch.save(state(i), target)
        taken = keeper.take(step=i * 10)
        assert taken.version is not None and taken.verdict is not None and taken.verdict.ok
    kept = keeper.versions()
    assert [v.step for v in kept] == [30, 20]          # the newest 2
    assert stat.S_IMODE(os.stat(keeper.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(keeper.dir.parent).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in keeper.dir.iterdir())
    assert torch.load(kept[0].data)["step"] == 3
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    taken = keeper.take(step=40)
    assert taken.version is None and taken.verdict is not None and not taken.verdict.ok
    assert [v.step for v in keeper.versions()] == [30, 20]
    assert [v.step for v in all_versions(run)] == [30, 20]


def test_the_copy_in_chunks_with_write_back_is_the_file(tmp_path, monkeypatch):
    from ckptsup.checkpoint import script_keep
    monkeypatch.setattr(script_keep, "COPY_CHUNK", 4096)
    src, dst = tmp_path / "src", tmp_path / "dst"
    body = os.urandom(4096 * 5 + 123)
    src.write_bytes(body)
    for use_range in (True, False):
        if not use_range:
            monkeypatch.delattr(os, "copy_file_range")
        dst.unlink(missing_ok=True)
        s_fd, d_fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            script_keep.copy_file(s_fd, d_fd, len(body))
            os.fsync(d_fd)
        finally:
            os.close(s_fd)
            os.close(d_fd)
        assert dst.read_bytes() == body


def test_the_keepers_thread_lowers_only_itself():
    import threading
    from ckptsup.checkpoint.script_keep import lower_priority
    got: list = []
    main_policy, main_nice = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)

    def run() -> None:
        got.append(lower_priority())
        got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "nice 10" in got[0] and got[1] == 10 and "SCHED_IDLE" not in got[0], got
    assert os.sched_getscheduler(0) == main_policy and os.getpriority(os.PRIO_PROCESS, 0) == main_nice


def test_restore_moves_the_corrupt_file_aside_and_puts_the_copy_back_atomically(tmp_path):
    run, target = tmp_path / "run", tmp_path / "ckpt.pt"
    keeper = Keeper(run_dir=run, target=target, path="ckpt.pt", keep=2)
    torch.save(state(7), target)
    os.chmod(target, 0o644)
    mtime = os.stat(target).st_mtime_ns
    version = keeper.take(step=70).version
    assert version is not None
    good = target.read_bytes()
    target.write_bytes(good[:100])
    aside = keeper.restore(version)
    assert aside is not None and aside.name.startswith("ckpt.pt.corrupt-") and aside.read_bytes() == good[:100]
    assert target.read_bytes() == good and os.stat(target).st_mtime_ns == mtime
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no temporary left
    assert keeper.holds(len(good), mtime) is not None   # the file put back is that version


def supervisor_part(tmp_path: Path, events: list, **kw) -> ScriptCheckpoints:
    def emit(name: Event, **fields):
        events.append((name, fields))
    options = dict(patterns=["out/ckpt.pt"], cwd=str(tmp_path), run_dir=tmp_path / "run", keep=2,
                   on_corrupt=OnCorrupt.GIVE_UP, resume_args=["--init_from=resume"], emit=emit, poll_s=0.05)
    options.update(kw)
    return ScriptCheckpoints(**options)


def test_before_launch_restores_a_torn_file_and_adds_the_resume_args(tmp_path):
    events: list = []
    part = supervisor_part(tmp_path, events)
    try:
        assert part.before_launch() is None and part.args(["--x"]) == ["--x"]   # no file yet: a fresh start
        (tmp_path / "out").mkdir()
        torch.save(state(1), tmp_path / "out" / "ckpt.pt")
        assert part.before_launch() is None and part.args(["--x"]) == ["--x", "--init_from=resume"]
        assert [n for n, _ in events] == [Event.SCRIPT_CHECKPOINT_VERIFIED]
        good = (tmp_path / "out" / "ckpt.pt").read_bytes()
        (tmp_path / "out" / "ckpt.pt").write_bytes(good[: len(good) // 2])
        assert part.before_launch() is None
        restored = [f for n, f in events if n is Event.SCRIPT_CHECKPOINT_RESTORED]
        assert len(restored) == 1 and restored[0]["path"] == "out/ckpt.pt"
        assert "no end-of-central-directory" in restored[0]["reason"]
        assert (tmp_path / "out" / "ckpt.pt").read_bytes() == good
        assert (tmp_path / "out" / restored[0]["moved_to"]).exists()
        assert part.args([]) == ["--init_from=resume"]
    finally:
        part.close()


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "stat-poll"])
def test_the_watcher_keeps_each_closed_version_once(tmp_path, inotify):
    """inotify's close-write, or the stat poll alone (what sees another node's writes)."""
    events: list = []
    part = supervisor_part(tmp_path, events, inotify=inotify)
    (tmp_path / "out").mkdir()
    try:
        assert part.before_launch() is None   # starts the watcher
        for i in range(3):
            torch.save(state(i), tmp_path / "out" / "ckpt.pt")
            deadline = time.monotonic() + 10
            while len(events) < i + 1 and time.monotonic() < deadline:
                part.tick(step=i)
                time.sleep(0.02)
        time.sleep(0.3)
        part.tick(step=None)
    finally:
        part.close()
    verified = [f for n, f in events if n is Event.SCRIPT_CHECKPOINT_VERIFIED]
    assert len(verified) == 3, events
    assert all(f["kind"] == "torch.save zip" and f["kept"] for f in verified)
    assert len(all_versions(tmp_path / "run")) == 2


def test_no_verified_copy_gives_up_in_one_line_or_starts_over(tmp_path):
    events: list = []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(os.urandom(1000).replace(b"\x80", b"").replace(b"PK", b""))
    part = supervisor_part(tmp_path, events)
    reason = part.before_launch()
    part.close()
    assert reason is not None and "\n" not in reason
    assert "out/ckpt.pt is corrupt" in reason and "start-over" in reason, reason
    assert (tmp_path / "out" / "ckpt.pt").exists()   # left for the user to look at
    assert events[-1][0] is Event.SCRIPT_CHECKPOINT_REJECTED and events[-1][1]["outcome"] == "give_up"

    events.clear()
    part = supervisor_part(tmp_path, events, on_corrupt=OnCorrupt.START_OVER)
    assert part.before_launch() is None
    part.close()
    assert not (tmp_path / "out" / "ckpt.pt").exists() and part.args([]) == []
    moved = [p for p in (tmp_path / "out").iterdir() if ".corrupt-" in p.name]
    assert len(moved) == 1 and events[-1][1]["outcome"] == "start_over"


def test_the_knobs_are_checked_at_the_edge(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[supervisor]\nscript_checkpoint = "out/ckpt.pt"\nresume_args = "--init_from=resume"\n')
    sup = load_config(job_config=job).config.supervisor
    assert sup.script_checkpoint == ["out/ckpt.pt"] and sup.script_checkpoint_keep == 2
    assert sup.script_checkpoint_on_corrupt == "give-up"
    job.write_text('[supervisor]\nscript_checkpoint_on_corrupt = "retry"\n')
    with pytest.raises(ConfigError, match="script_checkpoint_on_corrupt.*give-up, start-over"):
        load_config(job_config=job)
    job.write_text('[supervisor]\nresume_args = "--init_from=resume"\n')
    with pytest.raises(ConfigError, match="needs supervisor.script_checkpoint"):
        ScriptCheckpoints.from_config(load_config(job_config=job).config, cwd=str(tmp_path), run_dir=tmp_path,
                                      emit=lambda *a, **k: None)
