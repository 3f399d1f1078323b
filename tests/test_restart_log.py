"""`ckptsup log`: rendering literal events (human timeline and --json), and --follow."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from ckptsup.cli import cli
from ckptsup.events import EventWriter
from ckptsup.supervisor.ops import restart_log as timeline

E = [
    {"event": "supervisor_start", "ts": "2026-01-01T00:00:00.000+00:00", "mono": 1.0, "job_id": "7", "attempt": 0},
    {"event": "allocation", "ts": "2026-01-01T00:00:00.100+00:00", "mono": 1.1, "job_id": "7", "attempt": 0,
     "nodes": ["n1", "n2", "n3"], "gpus_per_node": 0, "spares": ["n4"]},
    {"event": "step_progress", "ts": "2026-01-01T00:00:05.000+00:00", "mono": 6.0, "job_id": "7", "attempt": 0,
     "step": 10, "step_time_s": 0.25},
    {"event": "failure_detected", "ts": "2026-01-01T00:00:10.000+00:00", "mono": 11.0, "job_id": "7", "attempt": 0,
     "kind": "node_down", "node": "n2", "rank": None, "detect_s": 5.4},
    {"event": "node_excluded", "ts": "2026-01-01T00:00:10.100+00:00", "mono": 11.1, "job_id": "7", "attempt": 0,
     "node": "n2", "reason": "node_down"},
    {"event": "restart_done", "ts": "2026-01-01T00:00:22.000+00:00", "mono": 23.0, "job_id": "7", "attempt": 1,
     "restart_s": 11.9, "resume_step": 8, "phases": {"kill_s": 0.5, "health_s": 1.0, "launch_s": 0.1,
                                                        "rendezvous_s": 3.0, "load_s": 2.0, "first_step_s": 5.3}},
    {"event": "requeue", "ts": "2026-01-01T00:01:00.000+00:00", "mono": 61.0, "job_id": "7", "attempt": 1,
     "epoch": 3, "reason": "batch_host_lost", "by": "watchdog", "excluded": ["n1", "n2"], "partition": "spanning"},
    {"event": "requeue_updated", "ts": "2026-01-01T00:01:04.000+00:00", "mono": 65.0, "job_id": "7", "attempt": 1,
     "epoch": 3, "ok": True, "wait_pending_s": 3.5, "update_s": 0.05, "total_s": 3.6, "excluded": ["n1", "n2"]},
    {"event": "run_complete", "ts": "2026-01-01T00:05:00.000+00:00", "mono": 5.0, "job_id": "7", "attempt": 2},
]


def test_describe_names_kind_node_and_detection_latency() -> None:
    assert timeline.describe(E[3]) == "node_down node n2, detected in 5.40s"


def test_describe_restart_lists_every_phase_in_order() -> None:
    text = timeline.describe(E[5])
    assert text.startswith("restarted in 11.90s, resume step 8")
    positions = [text.index(p) for p in ("kill", "health", "launch", "rendezvous", "load", "first_step")]
    assert positions == sorted(positions)


def test_describe_requeue_shows_who_why_and_exclusions() -> None:
    assert timeline.describe(E[6]) == "requeued by watchdog: batch_host_lost; excluded n1,n2; partition spanning"
    assert "3.60s after the requeue" in timeline.describe(E[7])


def test_describe_teardown_error_says_nothing_was_lost() -> None:
    event = {"event": "teardown_error", "ts": "2026-01-01T00:00:00+00:00", "mono": 0, "job_id": "1", "attempt": 0,
             "node": "n2", "rc": 1}
    assert timeline.describe(event).startswith("torchrun on n2 exited rc=1 after all its ranks finished")


def test_describe_interval_changed_says_which_level() -> None:
    assert timeline.describe({"event": "interval_changed", "interval_s": 120.0, "why": "x"}).startswith("checkpoint interval")
    line = timeline.describe({"event": "interval_changed", "level": "memory", "every_steps": 40, "interval_s": 8.0, "why": "y"})
    assert line.startswith("memory save interval 40 steps") and line.endswith(": y")


def test_unknown_events_fall_back_to_their_fields() -> None:
    event = {"event": "custom", "ts": "2026-01-01T00:00:00+00:00", "mono": 0, "job_id": "1", "attempt": 0, "x": 3}
    assert timeline.describe(event) == "x=3"


def test_rows_are_relative_to_the_first_event_by_wall_clock_and_hide_step_progress() -> None:
    rows = timeline.rows(E)
    assert [r.event for r in rows][:3] == ["supervisor_start", "allocation", "failure_detected"]
    assert rows[2].t_s == 10.0 and rows[-1].t_s == 300.0  # mono jumps across hosts; ts does not
    assert "step_progress" in [r.event for r in timeline.rows(E, show_all=True)]


def test_summary_collects_detection_restarts_exclusions_and_requeues() -> None:
    s = timeline.summarize(E)
    assert s.detect_stats() == {"min_s": 5.4, "median_s": 5.4, "max_s": 5.4}
    assert s.restarts[0]["phases"]["rendezvous_s"] == 3.0
    assert s.excluded == [("n2", "node_down")]
    assert s.requeues == [{"reason": "batch_host_lost", "by": "watchdog", "excluded": ["n1", "n2"],
                           "total_s": 3.6, "updated": True}]
    assert s.outcome == "complete"


def test_an_attributed_failure_is_summarized_with_its_own_kind_node_and_detection() -> None:
    """The demo: a survivor's crash is the first symptom (detected at once); the kill shows its peer's
    node dead, silent 3.1 s. The summary says node_down on n2, detected after 3.1 s, not 0.00 s."""
    events = E[:3] + [
        {"event": "failure_detected", "ts": "2026-01-01T00:00:10.000+00:00", "mono": 11.0, "job_id": "7", "attempt": 0,
         "kind": "crash", "node": "n1", "rank": 0, "detect_s": 0.0002},
        {"event": "failure_attributed", "ts": "2026-01-01T00:00:12.000+00:00", "mono": 13.0, "job_id": "7", "attempt": 0,
         "kind": "node_down", "node": "n2", "was_kind": "crash", "was_node": "n1", "detect_s": 3.1, "detail": "x"},
    ]
    s = timeline.summarize(events)
    assert [(f["kind"], f["node"]) for f in s.failures] == [("node_down", "n2")]
    assert s.detect_stats() == {"min_s": 3.1, "median_s": 3.1, "max_s": 3.1}


def test_summary_times_the_next_batch_run_from_the_requeue() -> None:
    later = E[:8] + [
        {"event": "supervisor_start", "ts": "2026-01-01T00:01:05.500+00:00", "mono": 2.0, "job_id": "7", "attempt": 2},
        {"event": "first_step", "ts": "2026-01-01T00:01:15.000+00:00", "mono": 11.5, "job_id": "7", "attempt": 2},
        {"event": "first_step", "ts": "2026-01-01T00:09:00.000+00:00", "mono": 99.0, "job_id": "7", "attempt": 3},
    ]
    (r,) = timeline.summarize(later).requeues
    assert r["back_s"] == 5.5 and r["first_step_s"] == 15.0
    console = Console(record=True, width=200)
    timeline.render(later, console)
    assert "supervisor back after 5.50s; first step after 15.00s" in console.export_text()


def test_render_prints_a_table_and_the_summary() -> None:
    console = Console(record=True, width=200)
    timeline.render(E, console)
    out = console.export_text()
    assert "ckptsup restart log" in out and "node_down node n2, detected in 5.40s" in out
    assert "outcome: complete" in out and "excluded: n2 (node_down)" in out
    assert "1 step_progress events hidden" in out


def write_events(run_dir: Path, events) -> None:
    run_dir.mkdir(mode=0o700, exist_ok=True)
    with open(run_dir / "events.jsonl", "w") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")


def test_log_json_prints_the_events_as_one_array(tmp_path) -> None:
    write_events(tmp_path / "run", E)
    result = CliRunner().invoke(cli, ["log", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == E


def test_log_human_output_shows_the_timeline(tmp_path) -> None:
    write_events(tmp_path / "run", E)
    result = CliRunner().invoke(cli, ["log", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "requeued by watchdog" in result.output and "restart 1: 11.90s to resume step 8" in result.output


def test_log_of_a_missing_run_dir_is_one_line(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", "log", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr


def test_log_follow_json_streams_lines_until_run_complete(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    writer = EventWriter(run_dir=run, job_id="7", attempt=0)

    def produce():
        for name in ("launch", "first_step", "run_complete"):
            time.sleep(0.3)
            writer.emit(name)

    thread = threading.Thread(target=produce)
    thread.start()
    result = CliRunner().invoke(cli, ["log", str(run), "--follow", "--json"])
    thread.join()
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["event"] for line in result.output.splitlines()] == ["launch", "first_step", "run_complete"]


def test_log_follow_all_prints_each_event_as_a_line(tmp_path) -> None:
    write_events(tmp_path / "run", E)
    result = CliRunner().invoke(cli, ["log", str(tmp_path / "run"), "-f", "--all"])
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == len(E) and "run_complete" in lines[-1]
