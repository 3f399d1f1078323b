"""SDC, NaN replays and restore-loss jumps in `ckptsup report`, `ckptsup status` and the live
Prometheus textfile (planning/sdc_report.py, docs/sdc.md §Where to see it): the derivation on
hand-written events (junk included: never a traceback), every renderer, and the supervisor's side
(the sdc frame's agreed_step and rank 0's sdc_s into the events) on the in-process loop."""
from __future__ import annotations

import json
import math
import random
import re

import pytest

from ckptsup.events import EVENTS_FILE, Event, read_events
from ckptsup.planning.goodput_report import build_report, prom_text, render_html, render_terminal
from ckptsup.planning.sdc_report import (AgreedBasis, Outcome, fingerprint_seconds, incidents, prom_metrics,
                                         sdc_line, sdc_lines, sdc_summary)
from ckptsup.supervisor.job.prom_live import live_text
from ckptsup.messages import Sdc
from ckptsup.supervisor.job.sdc import sdc_failure, sdc_fields
from ckptsup.wire import FrameError

from test_supervisor_loop import Clock, Fault, FakeSlurm, World, fast_ticks, site, supervisor  # noqa: F401

T0 = 1_700_000_000.0


def ev(name, attempt=0, t=0.0, **fields):
    import datetime as dt

    ts = dt.datetime.fromtimestamp(T0 + t, dt.timezone.utc).isoformat()
    return {"event": name, "ts": ts, "mono": 1000.0 + t, "job_id": "J", "attempt": attempt, **fields}


def chained() -> list[dict]:
    """The real test's run (tests/test_sdc_real.py): a flip caught at step 24 (agreed at 19), resumed
    from step_20; a flip caught at the save of step 40 (step 39, agreed at 34), that checkpoint refused,
    resumed from step_30; both on the one node, nothing to replace it."""
    return [
        ev("supervisor_start", t=0), ev("allocation", t=0, nodes=1, gpus_per_node=0, spares=0, active=1),
        ev("launch", t=1, nodes=["h"], path="initial", world_size=3), ev("first_step", t=2, step=0),
        ev("step_progress", t=7, step=20, sdc_s=0.01),
        ev("failure_detected", t=10, kind="sdc", node="h", rank=1, step=24, ranks=[1], nodes=["h"], agreed_step=19,
           detect_s=0.0, sdc_s=0.02, detail="replicas disagree at step 24: rank(s) 1 on h differ"),
        ev("launch", 1, t=11, nodes=["h"], path="fast"), ev("first_step", 1, t=12, step=20),
        ev("restart_done", 1, t=12, resume_step=20, restart_s=2.0),
        ev("checkpoint_committed", 1, t=14, step=30, stall_s=0.01),
        ev("failure_detected", 1, t=20, kind="sdc", node="h", rank=2, step=39, ranks=[2], nodes=["h"], agreed_step=34,
           detect_s=0.0, sdc_s=0.03),
        ev("checkpoint_rejected", 1, t=21, step=40, level=2, reason="replicas disagreed at step 40 (ranks 2 in dispute)"),
        ev("launch", 2, t=22, nodes=["h"], path="fast"), ev("first_step", 2, t=23, step=30),
        ev("restart_done", 2, t=23, resume_step=30, restart_s=2.0),
        ev("restore_loss_jump", 2, t=24, step=31, loss=9.0, before=1.0, basis="same step"),
        ev("run_complete", 2, t=30, step=59, sdc_s=0.04),
    ]


def test_the_chained_run_shows_two_incidents_their_bounds_the_rollback_and_the_fingerprint_cost():
    s = sdc_summary(chained())
    assert s["incidents"] == 2 and s["by_outcome"] == {"transient": 2}
    first, second = s["list"]
    assert (first["step"], first["ranks"], first["nodes"], first["outcome"]) == (24, [1], ["h"], "transient")
    assert (first["agreed_step"], first["detect_lag_steps"], first["agreed_basis"]) == (19, 5, "check")
    assert (first["resume_step"], first["rolled_back_steps"]) == (20, 5)     # steps 20..24 run again
    assert (second["detect_lag_steps"], second["resume_step"], second["rolled_back_steps"]) == (5, 30, 10)
    assert s["detect_lag_steps_max"] == 5 and s["rolled_back_steps"] == 15 and s["checkpoints_refused"] == 1
    # per attempt the largest cumulative sdc_s: 0.02 + 0.03 + 0.04
    assert s["fingerprint_s"] == pytest.approx(0.09)
    train = 8 + 8 + 7   # first_step -> failure / run_complete, per attempt
    assert s["fingerprint_share"] == pytest.approx(0.09 / train, rel=1e-3)
    assert s["restore_loss_jumps"] == 1 and s["nan"]["incidents"] == 0


def test_without_an_agreed_step_the_bound_runs_from_the_attempts_start():
    events = [ev("launch", t=1, nodes=["a", "b"]), ev("first_step", t=2, step=100),
              ev("failure_detected", t=5, kind="sdc", step=104, ranks=[0, 1], nodes=["a", "b"])]
    [i] = incidents(events)
    assert (i.agreed_step, i.agreed_basis, i.detect_lag_steps) == (99, AgreedBasis.START, 5)
    assert i.outcome is Outcome.PENDING and i.resume_step is None and i.rolled_back_steps is None


@pytest.mark.parametrize("after, outcome, excluded", [
    ([ev("node_excluded", node="b", reason="sdc: replicas disagreed at step 9; the majority outvoted this node's"),
      ev("launch", 1, nodes=["a", "c"]), ev("restart_done", 1, resume_step=5)], Outcome.EXCLUDED, ["b"]),
    ([ev("launch", 1, nodes=["c", "b"]), ev("restart_done", 1, resume_step=5)], Outcome.SWAPPED, []),
    ([ev("launch", 1, nodes=["a", "b"]), ev("restart_done", 1, resume_step=5), ev("step_progress", 1, step=30)],
     Outcome.TRANSIENT, []),
    ([ev("launch", 1, nodes=["a", "b"]), ev("restart_done", 1, resume_step=5),
      ev("failure_detected", 1, kind="sdc", step=9, ranks=[0, 1], nodes=["a", "b"])], Outcome.REPLAYED, []),
    ([ev("give_up", reason="replicas disagreed twice", kind="sdc")], Outcome.GAVE_UP, []),
    ([ev("requeue", reason="2 healthy node(s) left")], Outcome.REQUEUED, []),
    ([], Outcome.PENDING, []),
])
def test_what_followed_an_incident_is_its_outcome(after, outcome, excluded):
    events = [ev("launch", nodes=["a", "b"]), ev("first_step", step=0),
              ev("failure_detected", kind="sdc", step=9, ranks=[0, 1], nodes=["a", "b"]), *after]
    first = incidents(events)[0]
    assert first.outcome is outcome and list(first.excluded) == excluded


def test_nan_replays_are_counted_transient_data_or_the_nodes():
    events = [
        ev("launch", nodes=["a"]), ev("first_step", step=0),
        ev("failure_detected", kind="nan", node="a", rank=0, step=4),                    # replayed, then again at 4
        ev("launch", 1, nodes=["a"]), ev("restart_done", 1, resume_step=0),
        ev("failure_detected", 1, kind="nan", node="a", rank=0, step=4),                 # the data's
        ev("failure_attributed", 1, kind="user_error", was_kind="nan", node="a"), ev("give_up", 1, reason="x"),
    ]
    s = sdc_summary(events)
    assert s["nan"]["by_outcome"] == {"replayed": 1, "data": 1} and s["incidents"] == 0
    events = [
        ev("launch", nodes=["a", "b"]), ev("failure_detected", kind="nan", node="a", rank=0, step=2),
        ev("launch", 1, nodes=["a", "b"]), ev("restart_done", 1, resume_step=0),
        ev("failure_detected", 1, kind="nan", node="a", rank=0, step=4),                 # past 2: transient
        ev("node_excluded", 1, node="a", reason="nan: non-finite loss at steps 2 and 4 on this node"),
        ev("launch", 2, nodes=["b", "c"]), ev("restart_done", 2, resume_step=0),
    ]
    s = sdc_summary(events)
    assert s["nan"]["by_outcome"] == {"transient": 1, "excluded": 1}
    assert [i["excluded"] for i in s["nan"]["list"]] == [[], ["a"]]


def test_a_run_without_fingerprints_or_incidents_says_so():
    s = sdc_summary([ev("launch", nodes=["a"]), ev("run_complete", step=9)])
    assert s["incidents"] == 0 and s["fingerprint_s"] is None and s["fingerprint_share"] is None
    assert s["rolled_back_steps"] == 0 and s["detect_lag_steps_max"] is None
    assert "fingerprints not measured" in sdc_line(s)
    assert dict(sdc_lines(s))["fingerprint cost (rank 0)"].startswith("not measured")


JUNK = [None, True, -3, 2.5, float("nan"), float("inf"), "7", "", "x\x1b[31m", [], [1, "a", None], {"a": 1},
        [[1]], 10**30]


def test_junk_in_every_field_is_never_a_traceback():
    rng = random.Random(23)
    keys = ("event", "kind", "step", "ranks", "nodes", "rank", "node", "agreed_step", "sdc_s", "resume_step",
            "reason", "attempt", "was_kind", "ts", "mono")
    names = [e.value for e in Event] + ["failure_detected"] * 10
    for _ in range(300):
        events = []
        for _ in range(rng.randrange(1, 12)):
            record = {"event": rng.choice(names), "kind": rng.choice(["sdc", "nan", "crash"])}
            for key in rng.sample(keys, rng.randrange(len(keys))):
                record[key] = rng.choice(JUNK + names[:3] if key == "event" else JUNK)
            events.append(record)
        events.append(rng.choice(JUNK))   # not even a dict
        s = sdc_summary(events)
        json.dumps(s, allow_nan=False)   # JSON-ready: no NaN, no member reprs
        sdc_lines(s), sdc_line(s), prom_metrics(s)
    assert sdc_lines("junk") == [] and sdc_line(None) == "SDC: -" and prom_metrics(7) == []


def test_sdc_s_is_the_largest_per_attempt_and_ignores_strings_and_negatives():
    events = [ev("step_progress", 0, sdc_s=1.0), ev("step_progress", 0, sdc_s=0.5), ev("step_progress", 1, sdc_s="9"),
              ev("step_progress", 1, sdc_s=-1), ev("run_complete", 2, sdc_s=0.25), ev("step_progress", 3, sdc_s=True)]
    assert fingerprint_seconds(events) == pytest.approx(1.25)
    assert fingerprint_seconds([ev("step_progress")]) is None


# ---- renderers ------------------------------------------------------------------------------------
def report(events):
    return build_report(events, price_per_gpu_hour=2.0, gpu_mtbf_hours=20000.0)


def test_the_terminal_report_has_an_sdc_table():
    from rich.console import Console

    console = Console(record=True, width=200)
    render_terminal(report(chained()), console)
    out = console.export_text()
    assert "silent data corruption (SDC)" in out
    assert "SDC incidents" in out and "2 (transient 2)" in out
    assert "step 24, ranks 1 on h: transient; flip within 5 step(s) before detection (last agreed step 19)" in out
    assert "5 step(s) rolled back (resumed at 20)" in out and "SDC steps rolled back" in out
    assert "restore-loss jumps" in out and "checkpoints refused (replicas disagreed)" in out


def test_the_html_report_has_an_sdc_section_and_node_names_are_data(tmp_path):
    events = chained()
    events[5] = {**events[5], "nodes": ["<b>h</b>\x1b[2J"]}
    page_path = tmp_path / "r.html"
    render_html(report(events), page_path)
    page = page_path.read_text()
    assert "<h2>Silent data corruption (SDC), NaN and restores</h2>" in page
    assert "&lt;b&gt;h&lt;/b&gt;\\x1b[2J" in page and "<b>h</b>" not in page


SAMPLE = re.compile(r'^ckptsup_[a-z_]+\{job_id="[^"]*"(,[a-z]+="[^"]*")*\} -?[0-9.e+-]+$')


def exposition_ok(text: str) -> None:
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line
    assert text.count("# TYPE ") == text.count("# HELP ")


def test_the_reports_prom_and_the_live_textfile_carry_the_same_sdc_metrics():
    events = chained()
    summary = sdc_summary(events)
    for text in (prom_text(report(events)), live_text({"job_id": "J", "status": "running"}, None, summary)):
        exposition_ok(text)
        assert 'ckptsup_sdc_incidents_total{job_id="J"} 2' in text
        assert 'ckptsup_sdc_outcomes_total{job_id="J",outcome="transient"} 2' in text
        assert 'ckptsup_sdc_detect_lag_steps{job_id="J"} 5' in text
        assert 'ckptsup_sdc_rolled_back_steps_total{job_id="J"} 15' in text
        assert 'ckptsup_sdc_fingerprint_seconds_total{job_id="J"} 0.09' in text
        assert 'ckptsup_sdc_checkpoints_refused_total{job_id="J"} 1' in text
        assert 'ckptsup_nan_incidents_total{job_id="J"} 0' in text
        assert 'ckptsup_restore_loss_jumps_total{job_id="J"} 1' in text
        assert "# TYPE ckptsup_sdc_incidents_total counter" in text and "# TYPE ckptsup_sdc_detect_lag_steps gauge" in text
        value = float(re.search(r"^ckptsup_sdc_fingerprint_ratio\{[^}]*\} (\S+)$", text, re.M).group(1))
        assert 0 < value < 1
    quiet = live_text({"job_id": "J"}, None)   # no summary yet: none of them, nothing else changes
    assert "sdc_" not in quiet


def test_the_status_line_and_the_status_command(tmp_path):
    from ckptsup.supervisor.ops import cli_status

    line = sdc_line(sdc_summary(chained()))
    assert line.startswith("SDC 2 (transient 2), flip to detection <= 5 steps, 15 steps rolled back, fingerprints 90ms")
    assert line.endswith("; NaN 0; restore-loss jumps 1")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in chained()))
    got = cli_status.goodput(run)
    assert got["sdc"]["incidents"] == 2 and got["sdc"]["rolled_back_steps"] == 15
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(cli_status.render({"job_id": "J", "nodes": {}, **got}))
    assert "SDC 2 (transient 2)" in console.export_text()


# ---- the supervisor's side ---------------------------------------------------------------------------
def test_the_sdc_frames_agreed_step_and_ranks_reach_the_event_fields():
    nodes = {0: "n1", 1: "n2", 2: "n3"}
    f = sdc_failure(Sdc.from_body({"step": 24, "copies": 3, "disputed": [1], "majority": True, "agreed_step": 19}), node="n1",
                    nodes_of=nodes)
    assert sdc_fields(f) == {"ranks": [1], "nodes": ["n2"], "agreed_step": 19}
    with pytest.raises(FrameError):   # a bool is no agreed step: the frame's type refuses it
        Sdc.from_body({"step": 9, "copies": 2, "disputed": [0, 1], "majority": False, "agreed_step": True})
    f = sdc_failure(Sdc.from_body({"step": 9, "copies": 2, "disputed": [0, 1], "majority": False}), node="n1",
                    nodes_of=nodes)
    assert sdc_fields(f) == {"ranks": [0, 1], "nodes": ["n1", "n2"]}   # no agreed step
    from ckptsup.supervisor.job.observations import Failure, FailureKind

    assert sdc_fields(Failure(kind=FailureKind.CRASH, step=3)) == {}


def test_the_agent_relays_an_sdc_frame_and_a_step_only_with_good_new_fields():
    from ckptsup.messages import parse
    from ckptsup.wire import MessageKind

    def _rank_body_ok(m, body):   # the agent relays a rank frame only with a body its type takes
        try:
            return parse(m, body) is not None
        except FrameError:
            return False

    base = {"step": 9, "copies": 3, "disputed": [1], "majority": True}
    assert _rank_body_ok(MessageKind.SDC, {**base, "agreed_step": 4}) and _rank_body_ok(MessageKind.SDC, base)
    assert not _rank_body_ok(MessageKind.SDC, {**base, "agreed_step": "4"})
    assert not _rank_body_ok(MessageKind.SDC, {**base, "agreed_step": -1})
    assert _rank_body_ok(MessageKind.STEP, {"step": 9, "sdc_s": 0.5})
    for bad in ("0.5", float("nan"), True):
        assert not _rank_body_ok(MessageKind.STEP, {"step": 9, "sdc_s": bad})


def test_the_loop_writes_the_incident_and_rank_0s_fingerprint_cost_and_status_shows_them(tmp_path, site):
    # three copies on three nodes and a spare: rank 1 outvoted at step 4, n2 excluded, n4 takes over
    world = World(clock=Clock(), steps=8, faults={0: Fault("sdc", 4, node="n2")}, fingerprint_s=0.001)
    prom = tmp_path / "live.prom"
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3", "n4"), needed=3, in_slurm=True, slurm=FakeSlurm(),
                    flags={"report.prom_textfile": str(prom)})
    sv.run()
    events = read_events(tmp_path / "run")
    [failure] = [e for e in events if e["event"] == "failure_detected"]
    assert (failure["kind"], failure["step"], failure["ranks"], failure["nodes"]) == ("sdc", 4, [1], ["n2"])
    assert failure["agreed_step"] == 2 and failure["sdc_s"] == pytest.approx(0.003)   # rank 0's last step: 3
    [done] = [e for e in events if e["event"] == "run_complete"]
    assert done["sdc_s"] == pytest.approx(0.007)
    s = sdc_summary(events)
    [incident] = s["list"]
    assert incident["outcome"] == "excluded" and incident["excluded"] == ["n2"]
    assert incident["detect_lag_steps"] == 2 and incident["rolled_back_steps"] == 5   # no checkpoint: from 0
    assert s["fingerprint_s"] == pytest.approx(0.010)
    text = prom.read_text()
    assert 'ckptsup_sdc_incidents_total{job_id="77"} 1' in text
    assert 'ckptsup_sdc_outcomes_total{job_id="77",outcome="excluded"} 1' in text
    assert 'ckptsup_sdc_rolled_back_steps_total{job_id="77"} 5' in text
    from ckptsup.supervisor.ops.cli_status import snapshot

    st = snapshot(tmp_path / "run")
    assert st["sdc"]["incidents"] == 1 and st["sdc"]["by_outcome"] == {"excluded": 1}
    assert not math.isnan(st["sdc"]["fingerprint_s"])


def test_contracts_md_lists_exactly_the_sdc_metrics():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "contracts.md").read_text(encoding="utf-8")
    section = text.split("\n## Prometheus metrics\n", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `ckptsup_([a-z_]+)` \| (counter|gauge) \|", section, re.M)
    assert documented == [(name, kind) for name, _, kind, _ in prom_metrics(sdc_summary([]))]
    for outcome in Outcome:
        assert f"`{outcome.value}`" in section
