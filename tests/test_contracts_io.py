"""Events log, wire frames and run directory: the shared I/O contracts (real files)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ckptsup import wire
from ckptsup.errors import ConfigError
from ckptsup.events import Event, EventWriter, follow_events, read_events
from ckptsup.rundir import RunDir, RunState, ensure_private_dir, read_epoch


def test_events_carry_required_fields_and_epoch(tmp_path: Path) -> None:
    writer = EventWriter(run_dir=tmp_path, job_id="42", attempt=1, epoch=3)
    writer.emit(Event.FAILURE_DETECTED, kind="crash", node="n2", rank=1, detect_s=0.4)
    writer.close()
    (event,) = read_events(tmp_path)
    assert {k: event[k] for k in ("event", "job_id", "attempt", "epoch", "kind")} == {
        "event": "failure_detected", "job_id": "42", "attempt": 1, "epoch": 3, "kind": "crash"}
    assert isinstance(event["mono"], float) and event["ts"].endswith("+00:00")
    assert stat.S_IMODE(os.stat(tmp_path / "events.jsonl").st_mode) == 0o600


def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    writer = EventWriter(run_dir=tmp_path, job_id="1", attempt=0)
    writer.emit(Event.LAUNCH)
    writer.close()
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('["not", "an", "event"]\n{"event": "x"}\n{"event": "launch", "ts": "t", "mo')
    assert [e["event"] for e in read_events(tmp_path)] == ["launch"]


def test_follow_yields_appended_events(tmp_path: Path) -> None:
    writer = EventWriter(run_dir=tmp_path, job_id="1", attempt=0)
    writer.emit(Event.LAUNCH)
    writer.emit(Event.FIRST_STEP)
    names = [e["event"] for e in follow_events(tmp_path, poll_s=0.01, stop_after_idle_s=0.05)]
    assert names == ["launch", "first_step"]


def test_wire_roundtrip_and_rejections() -> None:
    secret = b"s" * 32
    frame = wire.encode("step", {"rank": 1, "step": 7}, seq=3, secret=secret)
    assert wire.decode(frame, secret=secret) == ("step", 3, {"rank": 1, "step": 7})
    with pytest.raises(wire.FrameError, match="bad MAC"):
        wire.decode(frame, secret=b"other")
    tampered = json.loads(frame)
    tampered["body"]["step"] = 8
    with pytest.raises(wire.FrameError, match="bad MAC"):
        wire.decode(json.dumps(tampered), secret=secret)
    for junk in [b"", b"{", b"[]", b'{"m": 1}', b"x" * (wire.MAX_FRAME_BYTES + 1)]:
        with pytest.raises(wire.FrameError):
            wire.decode(junk, secret=secret)
    guard = wire.ReplayGuard()
    assert guard.accept("r0", 1) and guard.accept("r0", 2)
    assert not guard.accept("r0", 2) and not guard.accept("r0", 1)
    assert guard.accept("r1", 1)


def test_run_dir_is_private_with_secret_and_atomic_state(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.secret_path.stat().st_mode) == 0o600
    assert len(run.read_secret()) == 64
    run.save_state(RunState(attempt=2, epoch=5, excluded_nodes={"n2": "node_down"}))
    assert read_epoch(run.path) == 5
    assert run.load_state().excluded_nodes == {"n2": "node_down"}
    assert stat.S_IMODE(run.state_path.stat().st_mode) == 0o600


def test_lease_age(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    assert run.lease_age_s() is None
    run.renew_lease(epoch=1, host="n1")
    age = run.lease_age_s()
    assert age is not None and 0 <= age < 5
    assert run.lease_age_s(now=json.loads(run.lease_path.read_text())["renewed"] + 30) == pytest.approx(30)


def test_world_writable_dir_is_refused_with_fix(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="chmod go-w"):
        ensure_private_dir(loose)


def test_corrupt_state_is_one_line(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    run.state_path.write_text("{not json")
    with pytest.raises(ConfigError, match="move it aside"):
        run.load_state()


def test_readable_secret_is_refused(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    run.secret_path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        run.read_secret()


def test_run_status_round_trips_as_an_enum_and_unknown_status_is_one_line(tmp_path: Path) -> None:
    from ckptsup.rundir import RunStatus

    run = RunDir.create(tmp_path / "run")
    run.save_state(RunState(status=RunStatus.REQUEUED))
    assert json.loads(run.state_path.read_text())["status"] == "requeued"
    assert run.load_state().status is RunStatus.REQUEUED
    run.state_path.write_text(json.dumps({"status": "exploded"}))
    with pytest.raises(ConfigError, match="unknown run status 'exploded'"):
        run.load_state()


def test_frame_reader_joins_split_frames_and_drops_forged_replayed_and_floods() -> None:
    secret = b"k" * 32
    drops = []
    reader = wire.FrameReader(secret=secret, sender="rank", on_drop=lambda: drops.append(1))
    one = wire.encode("step", {"step": 1}, seq=1, secret=secret)
    two = wire.encode("step", {"step": 2}, seq=2, secret=secret)
    assert reader.feed(one[:10]) == []
    assert reader.feed(one[10:] + two + b"\n") == [("step", {"step": 1}), ("step", {"step": 2})]
    assert reader.feed(two + wire.encode("step", {}, seq=3, secret=b"bad")) == []
    assert len(drops) == 2  # the replay and the forgery
    with pytest.raises(wire.FrameError, match="flood"):
        reader.feed(b"x" * (4 * wire.MAX_FRAME_BYTES + 1))
    assert len(drops) == 3
