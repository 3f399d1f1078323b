"""`ckptsup log`'s story (issue 40): the demo's run (tests/golden/demo_events.jsonl: 3 nodes + a
spare, n2 killed at step 22, a restart on the node path from memory) told in one screen, the
filters, --follow telling the same story as it happens, --all keeping the table, and the same
one line leading `ckptsup report` and `ckptsup status`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from ckptsup.cli import cli
from ckptsup.events import read_events
from ckptsup.planning.headline import headline
from ckptsup.supervisor.ops import story

DEMO = Path(__file__).parent / "golden" / "demo_events.jsonl"


def demo_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    shutil.copy(DEMO, run / "events.jsonl")
    return run


def log(*args: str) -> str:
    result = CliRunner().invoke(cli, ["log", *args], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def ev(what: str, t: float, attempt: int = 0, **fields) -> dict:
    return {"event": what, "ts": f"2026-01-01T00:{int(t) // 60:02d}:{t % 60:06.3f}+00:00", "mono": t, "job_id": "9",
            "attempt": attempt, **fields}


def test_the_demo_run_is_a_story_in_one_screen(tmp_path) -> None:
    out = log(str(demo_run(tmp_path)))
    lines = out.splitlines()
    assert len(lines) <= 40, out
    assert lines[0] == "ckptsup restart log — job 1"
    assert lines[1].startswith("resumed 3.9 s after n2 died, then ran to completion; ") and \
        lines[1].endswith(" % of the paid time lost to failures")
    body = [line.split(None, 3) for line in lines[2:-1]]   # time, attempt, kind, text
    assert [(a, k) for _, a, k, _ in body] == [("a0", "start"), ("a0", "start"), ("a0", "routine"), ("a0", "failure"),
                                               ("a1", "recovery"), ("a1", "routine"), ("a1", "end")], out
    text = {k: t for _, _, k, t in body}
    assert text["failure"] == ("n2 died (node down) at step 22, detected in 2.96s: agent did not answer the kill "
                               "(crash on n1 was the first symptom); blamed n2 (node_down): excluded, drained in Slurm")
    assert text["recovery"].startswith("restart 1: 3.87s to resume step 20 on the node path: n4 took over from n2 "
                                       "(nodes n1,n3,n4), loaded step 20 from own memory ×2, a buddy's memory ×1; "
                                       "kill 2.02s, health 0.00s, launch 1.63s, rendezvous 0.02s, load 0.06s")
    assert text["recovery"].endswith(", warm")
    assert body[5][3] == ("attempt 1: steps 20–149, 13 checkpoints committed every ~1.2s (stall p50 0.4ms), "
                          "1 validated, 13 memory saves replicated")
    assert body[2][3].startswith("attempt 0: steps 0–22, 2 checkpoints committed")
    assert body[0][3] == ("supervisor started for job 1; allocation: 4 nodes (n1,n2,n3,n4), 3 active + 1 spare, "
                          "0 GPU(s) a node")
    assert text["end"] == "run complete at step 149"
    assert lines[-1] == "(87 events told in 7 line(s); --all shows every event)"


def test_all_keeps_the_table_of_every_event(tmp_path) -> None:
    out = log(str(demo_run(tmp_path)), "--all")
    assert "ckptsup restart log" in out and out.count("memory_saved") == 15 and "step_progress" in out


def test_attempt_since_and_kind_choose_lines(tmp_path) -> None:
    run = str(demo_run(tmp_path))
    assert " a1 " not in log(run, "--attempt", "0") and "attempt 0: steps 0–22" in log(run, "--attempt", "0")
    only = log(run, "--kind", "failure").splitlines()[2:-1]
    assert len(only) == 1 and "n2 died" in only[0]
    both = log(run, "--kind", "failure", "--kind", "recovery").splitlines()[2:-1]
    assert [line.split()[2] for line in both] == ["failure", "recovery"]
    assert len(log(run, "--kind", "checkpoint").splitlines()[2:-1]) == 2   # the two attempts' folded saves
    after = log(run, "--since", "2026-12-06T04:50:00.74").splitlines()[2:-1]   # after the failure's detection
    assert [line.split()[2] for line in after] == ["recovery", "routine", "end"]
    events = json.loads(log(run, "--json", "--kind", "failure"))
    assert [e["event"] for e in events] == ["failure_detected", "failure_attributed", "node_excluded"]
    assert len(json.loads(log(run, "--json"))) == 87   # --json without a filter: unchanged


def test_a_bad_since_is_one_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", "from ckptsup.cli import main; main()", "log",
                           str(demo_run(tmp_path)), "--since", "yesterday-ish"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--since 'yesterday-ish' is neither" in proc.stderr


def test_since_reads_durations_times_of_today_and_iso_times() -> None:
    now = 1_800_000_000.0   # 2027-01-15T08:00:00Z
    assert story.since_cutoff("10m", now) == now - 600
    assert story.since_cutoff("07:30", now) == now - 1800
    assert story.since_cutoff("2027-01-15T07:59:00", now) == now - 60


def test_follow_tells_the_same_story_as_it_happens(tmp_path) -> None:
    run = demo_run(tmp_path)
    told = log(str(run), "-f").splitlines()
    assert told == log(str(run)).splitlines()[2:-1]   # the same lines, without the header, lead and footer


def test_a_preemption_and_a_requeue_are_told_with_the_next_allocation() -> None:
    events = [
        ev("supervisor_start", 0, resumed=False), ev("allocation", 0.1, node_names=["n1", "n2"], active=2, spares=0),
        ev("launch", 0.2, nodes=["n1", "n2"], path="initial", spares=[]), ev("first_step", 3, step=0, since_launch_s=2.8),
        ev("checkpoint_committed", 5, step=10, stall_s=0.002), ev("checkpoint_committed", 7, step=20, stall_s=0.004),
        ev("failure_detected", 8, kind="preempted", step=24, detect_s=0.0, detail="signal SIGTERM"),
        ev("preemption", 8.1, signal="preemption", budget_s=20.0, emergency_save=True),
        ev("checkpoint_committed", 9, step=25, stall_s=0.003),
        ev("requeue", 10, reason="preemption: preempted", by="supervisor", excluded=[]),
        ev("supervisor_start", 70, attempt=1, resumed=True, excluded=[]),
        ev("allocation", 70.1, attempt=1, node_names=["n1", "n3"], active=2, spares=0),
        ev("launch", 70.2, attempt=1, nodes=["n1", "n3"], path="initial", spares=[], resume_from="/c/step_25"),
        ev("checkpoint_loaded", 72, attempt=1, step=25, source="shared", files_by_source={"shared": 2}),
        ev("first_step", 73, attempt=1, step=25, since_launch_s=2.8),
        ev("run_complete", 90, attempt=1, step=49),
    ]
    texts = [(line.kind.value, line.text) for line in story.lines(events)]
    kinds = [k for k, _ in texts]
    assert kinds == ["start", "start", "routine", "failure", "requeue", "start", "start", "routine", "end"], texts
    assert texts[3][1].startswith("preempted at step 24") and texts[3][1].endswith(
        "preemption: budget 20.00s, emergency save; checkpoint step 25 committed after it (stall 3.0ms)")
    assert texts[2][1] == "attempt 0: steps 0–24, 2 checkpoints committed every ~2.0s (stall p50 3.0ms)"
    assert texts[4][1].startswith("requeued by supervisor: preemption: preempted")
    assert texts[5][1] == "supervisor back 60.0s after the requeue, resuming the run; allocation: 2 nodes (n1,n3), 2 active + 0 spare, 0 GPU(s) a node"
    assert texts[6][1].startswith("launch on n1,n3 (n3 in place of n2), loaded step 25 from the shared file system; "
                                  "first step 25")
    assert headline(events).startswith("requeued after the preemption, then ran to completion; ")


def test_a_hang_names_its_rank_and_its_evidence_and_a_rejected_checkpoint_joins_the_restart() -> None:
    events = [
        ev("supervisor_start", 0), ev("launch", 0.2, nodes=["n1"], path="initial"), ev("first_step", 1, step=0),
        ev("failure_detected", 30, kind="hang", node="n1", rank=1, step=12, detect_s=10.1,
           detail="rank 1 on n1: at train.py:40 in main"),
        ev("health_check", 31, node="n1", name="gpus", ok=True, detail="healthy"),
        ev("checkpoint_rejected", 31.5, attempt=1, step=10, level=2, reason="item hash mismatch"),
        ev("launch", 32, attempt=1, nodes=["n1"], path="fast", resume_from="/c/step_5"),
        ev("first_step", 34, attempt=1, step=5),
        ev("restart_done", 34, attempt=1, restart_s=4.0, resume_step=5, path="fast", phases={"kill_s": 0.1}),
        ev("give_up", 50, attempt=1, reason="crash loop"),
    ]
    texts = {line.kind.value: line.text for line in story.lines(events)}
    assert texts["failure"] == "rank 1 on n1 hung at step 12, detected in 10.10s: rank 1 on n1: at train.py:40 in main"
    assert texts["recovery"].startswith("restart 1: 4.00s to resume step 5 on the fast path: on n1; kill 0.10s; "
                                        "checkpoint step 10 REJECTED (level 2): item hash mismatch")
    assert texts["end"] == "gave up: crash loop"
    assert headline(events).startswith("resumed 4.0 s after rank 1 on n1 hung; ")


def test_without_a_failure_the_line_says_so_with_the_goodput() -> None:
    events = [ev("supervisor_start", 0), ev("allocation", 0.1, nodes=1, gpus_per_node=0, spares=0),
              ev("launch", 0.2, nodes=["n1"], path="initial"), ev("first_step", 1, step=0),
              ev("run_complete", 20, step=99)]
    assert headline(events).startswith("ran to completion without a failure; goodput ")


def test_hostile_text_in_a_story_line_stays_literal() -> None:
    evil = "n\x1b]0;pwned\x07[bold]x[/bold]"
    events = [ev("supervisor_start", 0), ev("failure_detected", 1, kind="node_down", node=evil, detect_s=3.0),
              ev("node_excluded", 1.1, node=evil, reason=evil, drained=True)]
    console = Console(record=True, width=300, force_terminal=False)
    story.render(events, console)
    out = console.export_text()
    assert "\x1b" not in out and "\x07" not in out and "n\\x1b]0;pwned\\x07[bold]x[/bold] died" in out


def test_report_and_status_lead_with_the_same_line(tmp_path) -> None:
    run = demo_run(tmp_path)
    line = headline(read_events(run))
    report = CliRunner().invoke(cli, ["report", str(run), "--json"])
    assert report.exit_code == 0 and json.loads(report.output)["story"] == line
    shown = CliRunner().invoke(cli, ["report", str(run)], env={"COLUMNS": "250"})
    assert shown.output.splitlines()[0] == line
    from ckptsup.supervisor.ops.cli_status import goodput, render

    st = {"job_id": "1", "attempt": 1, "epoch": 2, "status": "done", "nodes": {}, **goodput(run)}
    console = Console(record=True, width=250)
    console.print(render(st))
    assert st["story"] == line and console.export_text().splitlines()[0] == line


def test_phases_beyond_train_and_routine_trouble_are_in_the_fold() -> None:
    events = [ev("supervisor_start", 0), ev("launch", 0.2, nodes=["n1"], path="initial"), ev("first_step", 1, step=0),
              ev("phase", 2, phase="eval", was="train", step=20, rank=0), ev("phase", 50, phase="train", step=20, rank=0),
              ev("memory_replicated", 51, ok=False, node="n1", rank=0, step=30, reason="buddy gone"),
              ev("busy", 60, ranks=[0], detail="rank 0 at 100% CPU", silent_s=12.0), ev("busy_over", 70, ranks=[0]),
              ev("run_complete", 80, step=59)]
    texts = [(line.kind.value, line.text) for line in story.lines(events)]
    assert [k for k, _ in texts] == ["start", "start", "warning", "routine", "end"], texts
    assert texts[3][1] == ("attempt 0: steps 0–59, no checkpoint committed, 1 replica(s) NOT stored on a buddy, "
                           "rank 0 entered the eval phase 1x, 1 busy spell(s) over")


def test_the_share_lost_to_failures_counts_the_failures_badput_not_start_up_or_spares(tmp_path) -> None:
    from ckptsup.planning.accounting import account
    from ckptsup.planning.headline import FAILURE_BADPUT

    events = read_events(demo_run(tmp_path))
    acc = account(events)
    lost = sum(acc.badput_device_s[k] for k in FAILURE_BADPUT) / acc.paid_device_s
    assert "startup" not in FAILURE_BADPUT and "idle_spares" not in FAILURE_BADPUT and "restart_kill" in FAILURE_BADPUT
    assert 0.05 < lost < 1 - acc.useful_device_s / acc.paid_device_s   # detection and restart, not the spare's idling
    assert headline(events).endswith(f"; {lost * 100:.1f} % of the paid time lost to failures")
