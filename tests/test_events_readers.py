"""events.jsonl is read by `ckptsup log`, `ckptsup report` and the supervisor at a restart: bad
lines (an `event` that is not a name, a 100,000-deep line, a huge line, torn or foreign lines) are
skipped and counted, naive and aware timestamps mix (naive means UTC), and a bad file (a
directory, a FIFO) is one line naming it — never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptsup.cli import cli
from ckptsup.errors import CkptsupError
from ckptsup import events as events_mod
from ckptsup.events import EVENTS_FILE, follow_events, parse_line, read_events
from ckptsup.supervisor.ops import restart_log as timeline

BASE = {"mono": 1.0, "job_id": "7", "attempt": 0}


def ev(name, ts, **fields):
    return {"event": name, "ts": ts, **BASE, **fields}


GOOD = [
    ev("supervisor_start", "2026-01-01T00:00:00+00:00"),
    ev("allocation", "2026-01-01T00:00:01Z", nodes=["n1"], gpus_per_node=1, spares=[]),
    ev("launch", "2026-01-01T00:00:02", nodes=["n1"], path="initial"),            # naive: UTC
    ev("first_step", "2026-01-01T00:00:04+00:00", step=0),
    ev("failure_detected", "2026-01-01T00:00:10", kind="crash", node="n1", rank=0, detect_s=0.5),
    ev("restart_done", "2026-01-01T01:00:12+01:00", restart_s=2.0, resume_step=3,   # 00:00:12 UTC
       phases={"kill_s": 0.5, "first_step_s": 1.5}),
    ev("requeue", "2026-01-01T00:00:20", reason="preempted", by="supervisor", excluded=[]),
    ev("supervisor_start", "2026-01-01T00:00:30Z"),
    ev("first_step", "2026-01-01T00:00:33", step=3),
    ev("run_complete", "2026-01-01T00:00:40+00:00", step=9),
]
BAD_LINES = [
    json.dumps({**GOOD[1], "event": ["allocation"]}),          # a list: TypeError in a set lookup
    json.dumps({**GOOD[1], "event": {"name": "x"}}),
    json.dumps({**GOOD[1], "event": 7}),
    "[" * 100_000 + "]" * 100_000,                              # RecursionError in json.loads
    '{"event":"launch","ts":"x","mono":1,"job_id":"7","attempt":0,"deep":' + "[" * 50_000 + "]" * 50_000 + "}",
    "x" * (3 << 20),                                            # a 3 MB line
    "garbage{",
    "[1, 2]",
    json.dumps({"event": "launch"}),                            # missing the required fields
]


def write(run: Path, lines: list[str], *, torn: str = "") -> Path:
    run.mkdir(mode=0o700, exist_ok=True)
    path = run / EVENTS_FILE
    path.write_text("".join(line + "\n" for line in lines) + torn)
    return path


def mixed() -> list[str]:
    """The good events with a bad line after each of the first ones."""
    out = []
    for i, e in enumerate(GOOD):
        out.append(json.dumps(e))
        if i < len(BAD_LINES):
            out.append(BAD_LINES[i])
    return out


def test_parse_line_refuses_non_names_deep_and_huge_lines_without_raising() -> None:
    for line in BAD_LINES:
        assert parse_line(line) is None
    assert parse_line(json.dumps(GOOD[0])) == GOOD[0]
    assert parse_line(b'{"event":"launch","ts":"t","mono":NaN,"job_id":"7","attempt":0}')["event"] == "launch"


def test_read_events_skips_and_counts_bad_lines(tmp_path) -> None:
    write(tmp_path / "run", mixed(), torn='{"event":"run_compl')
    stats = events_mod.ReadStats()
    assert read_events(tmp_path / "run", stats=stats) == GOOD
    assert stats.skipped == len(BAD_LINES) + 1   # and the torn last line
    assert read_events(tmp_path / "run") == GOOD


def test_a_huge_line_is_skipped_without_being_held(tmp_path) -> None:
    run = tmp_path / "run"
    path = write(run, [json.dumps(GOOD[0])])
    with open(path, "a") as fh:
        fh.write("y" * (8 << 20) + "\n" + json.dumps(GOOD[-1]) + "\n")
    stats = events_mod.ReadStats()
    assert read_events(run, stats=stats) == [GOOD[0], GOOD[-1]] and stats.skipped == 1


def test_a_restart_log_that_is_a_directory_or_a_fifo_is_one_line(tmp_path) -> None:
    (tmp_path / "dir" / EVENTS_FILE).mkdir(parents=True)
    with pytest.raises(CkptsupError, match=r"cannot read .*events.jsonl: it is a directory"):
        read_events(tmp_path / "dir")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / EVENTS_FILE)
    with pytest.raises(CkptsupError, match="it is a FIFO"):   # and the open does not block
        read_events(tmp_path / "fifo")
    with pytest.raises(CkptsupError, match="it is a directory"):
        next(follow_events(tmp_path / "dir", poll_s=0.01, stop_after_idle_s=0.05))
    assert read_events(tmp_path / "missing") == []


def test_follow_events_skips_bad_lines_and_keeps_following(tmp_path) -> None:
    run = tmp_path / "run"
    path = write(run, [json.dumps(GOOD[0]), BAD_LINES[0], BAD_LINES[3]])

    def produce():
        time.sleep(0.1)
        with open(path, "a") as fh:
            fh.write("z" * (3 << 20))            # a huge line arriving in pieces
            fh.flush()
            time.sleep(0.05)
            fh.write("z" * 10 + "\n" + json.dumps(GOOD[-1])[:20])
            fh.flush()
            time.sleep(0.05)
            fh.write(json.dumps(GOOD[-1])[20:] + "\n")

    thread = threading.Thread(target=produce)
    thread.start()
    stats = events_mod.ReadStats()
    got = list(follow_events(run, poll_s=0.01, stop_after_idle_s=0.5, stats=stats))
    thread.join()
    assert got == [GOOD[0], GOOD[-1]] and stats.skipped == 3


@pytest.fixture
def new_york(monkeypatch):
    """A local time zone that is not UTC: a naive timestamp read as local time would be 5 h off."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_rows_and_summary_mix_naive_and_aware_timestamps_as_utc(new_york) -> None:
    rows = timeline.rows(GOOD, show_all=True)
    assert [r.t_s for r in rows] == [0.0, 1.0, 2.0, 4.0, 10.0, 12.0, 20.0, 30.0, 33.0, 40.0]
    [requeue] = timeline.summarize(GOOD).requeues
    assert requeue["back_s"] == 10.0 and requeue["first_step_s"] == 13.0


@pytest.mark.parametrize("phases", [[1, 2], "fast", 3, True, None, {"kill_s": "x", "odd": [1]}])
def test_a_restart_with_phases_of_any_type_renders(phases) -> None:
    import io

    from rich.console import Console

    events = [GOOD[0], {**GOOD[5], "phases": phases}, {**GOOD[1], "event": "step_progress"}]
    timeline.render(events, Console(file=io.StringIO()))
    timeline.render(events, Console(file=io.StringIO()), show_all=True)


def test_rows_of_records_whose_event_is_not_a_name_render() -> None:
    rows = timeline.rows([GOOD[0], {**GOOD[1], "event": ["x"]}, {**GOOD[1], "event": {"a": 1}}])
    assert [r.event for r in rows][0] == "supervisor_start" and len(rows) == 3


def test_log_skips_bad_lines_and_says_how_many(tmp_path) -> None:
    write(tmp_path / "run", mixed())
    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", "log", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "run complete" in proc.stdout
    assert f"skipped {len(BAD_LINES)} line(s)" in proc.stderr and proc.stderr.count("\n") == 1
    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", "log", str(tmp_path / "run"),
                           "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout) == GOOD


def test_log_follow_skips_bad_lines(tmp_path) -> None:
    write(tmp_path / "run", mixed())
    result = CliRunner().invoke(cli, ["log", str(tmp_path / "run"), "--follow", "--json"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in lines] == GOOD


@pytest.mark.parametrize("command", [["log"], ["log", "--json"], ["log", "--follow"], ["report"], ["report", "--json"]])
def test_a_restart_log_that_is_a_directory_is_one_line_for_every_reader(tmp_path, command) -> None:
    (tmp_path / "run" / EVENTS_FILE).mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", command[0],
                           str(tmp_path / "run"), *command[1:]], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read" in lines[0] and "directory" in lines[0], proc.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_report_skips_bad_lines_and_says_how_many(tmp_path, as_json) -> None:
    write(tmp_path / "run", mixed())
    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", "report", str(tmp_path / "run"),
                           *(["--json"] if as_json else [])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and f"skipped {len(BAD_LINES)} line(s)" in proc.stderr
    if as_json:
        report = json.loads(proc.stdout)
        assert report["wall_s"] > 0


def test_report_of_mixed_timestamps_counts_wall_clock_as_utc(new_york) -> None:
    from ckptsup.planning.goodput_report import build_report

    events = [{**e, "mono": None} for e in GOOD]   # no monotonic clock: the wall clock places every event
    report = build_report(events, price_per_gpu_hour=1.0, gpu_mtbf_hours=1000.0)
    assert report["wall_s"] == pytest.approx(30.0)  # 0 → 20 s, then 30 → 40 s after the requeue


# ---- the ops commands: a run directory whose files are not ckptsup's is one line ------------------

def _main(capsys, argv: list[str]) -> tuple[int, list[str]]:
    from ckptsup.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return int(exit_.value.code or 0), capsys.readouterr().err.strip().splitlines()


def test_requeue_with_a_restart_log_that_is_a_directory_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from test_requeue import FakeSlurm

    from ckptsup.rundir import RunDir
    from ckptsup.slurm.client import SlurmClient

    rd = RunDir.create(tmp_path / "run")
    (rd.path / EVENTS_FILE).mkdir()
    monkeypatch.setattr(SlurmClient, "from_config", classmethod(lambda cls, *a, **k: FakeSlurm()))
    code, err = _main(capsys, ["requeue", "--run-dir", str(rd.path), "--job-id", "42", "--reason", "test"])
    assert code != 0 and len(err) == 1, err
    assert "events.jsonl" in err[0] and "directory" in err[0].lower() and "Traceback" not in err[0]


def test_watchdog_with_a_state_file_nested_too_deep_is_one_line(tmp_path, capsys) -> None:
    from ckptsup.rundir import RunDir

    rd = RunDir.create(tmp_path / "run")
    (rd.path / "config.json").write_text("{}")
    rd.state_path.write_text("[" * 100_000 + "]" * 100_000)
    code, err = _main(capsys, ["watchdog", "--run-dir", str(rd.path), "--job-id", "42", "--poll-s", "0.01"])
    assert code != 0 and len(err) == 1 and "Traceback" not in err[0], err
    assert str(rd.path) in err[0]


def test_kinds_a_reader_skips_are_left_unparsed_counted_apart_from_bad_lines(tmp_path) -> None:
    """`ckptsup log` and the goodput report read past the per-node notes (98 % of a day's log at
    16,384 nodes) without parsing them: EventWriter's compact lines of those kinds are counted in
    `left_out`; another writer's spaced line of such a kind is still parsed and returned."""
    from ckptsup.events import EVENTS_FILE, Event, EventWriter, ReadStats, read_events

    writer = EventWriter(run_dir=tmp_path, job_id="7", attempt=0)
    writer.emit(Event.SUPERVISOR_START)
    for node in ("n1", "n2", "n3"):
        writer.emit(Event.WARM_READY, node=node, interpreters=8)
    writer.emit(Event.AGENT_STARTED, node="n1", version="0")
    writer.close()
    with open(tmp_path / EVENTS_FILE, "a") as fh:
        fh.write('{"event": "warm_ready", "ts": "2026-12-06T00:00:00", "mono": 1.0, "job_id": "7", "attempt": 0, "node": "n4"}\n')
        fh.write("not an event\n")
        fh.write('{"event":"run_complete","ts":"2026-12-06T00:00:01","mono":2.0,"job_id":"7","attempt":0,"step":9}\n')
    stats = ReadStats()
    events = read_events(tmp_path, stats=stats, skip=frozenset({"warm_ready", "agent_started"}))
    assert [(e["event"], e.get("node")) for e in events] == [("supervisor_start", None), ("warm_ready", "n4"),
                                                             ("run_complete", None)]
    assert (stats.left_out, stats.skipped) == (4, 1)
    assert len(read_events(tmp_path)) == 7   # nothing skipped unless asked
