"""Phases in milliseconds: the eval allowance (detection, the attempt view), ckptsup.phase() and
phase_heartbeat() over a real rank channel to a stand-in agent, rank 0's phase events, the time
per phase from the restart log, and the knob's validation. Real runs: tests/test_phase_local.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import ckptsup
from ckptsup.config import ConfigError, SupervisorConfig, load_config
from ckptsup.env import RankEnv
from ckptsup.events import Event
from ckptsup.hooks import phase as phases
from ckptsup.hooks.rank_link import StepLink
from ckptsup.planning.phase_time import phase_times, phases_line
from ckptsup.supervisor.job.agent_step import Message
from ckptsup.supervisor.job.attempt import AttemptTracker
from ckptsup.supervisor.job.detection import RankView, allowance, detect_hang
from ckptsup.supervisor.job.observations import FailureKind
from ckptsup.wire import MessageKind, Phase

from hooks_helpers import FakeAgent

CFG = SupervisorConfig(hang_timeout_s=30, eval_timeout_s=600.0, node_silence_s=1e9)


# ---- the supervisor side (pure) ---------------------------------------------------------------

def test_the_eval_phase_has_its_own_allowance_and_lends_it_to_the_ranks_waiting_for_it():
    assert allowance(Phase.EVAL, CFG, 30.0) == 600.0
    assert allowance(Phase.TRAIN, CFG, 30.0) == 30.0
    assert allowance(Phase.TRAIN, CFG, 30.0, peer_in_eval=True) == 600.0
    assert allowance(Phase.LOAD, CFG, 30.0, peer_in_eval=True) == CFG.load_timeout_s   # only training ranks wait


def view(r: int, phase: Phase, last: float) -> RankView:
    return RankView(rank=r, node="n1", phase=phase, phase_since=last, last_step=9, last_progress=last)


def test_a_quiet_eval_is_no_hang_until_its_timeout_and_a_hang_after():
    ranks = [view(0, Phase.EVAL, 100.0), view(1, Phase.EVAL, 100.0)]
    assert detect_hang(ranks, now=145.0, config=CFG, train_timeout_s=30.0) is None
    hang = detect_hang(ranks, now=701.0, config=CFG, train_timeout_s=30.0)
    assert hang is not None and hang.kind is FailureKind.HANG and "phase eval" in hang.detail


def test_rank_0_evaluating_keeps_the_others_waiting_in_a_barrier_alive():
    ranks = [view(0, Phase.EVAL, 100.0), view(1, Phase.TRAIN, 100.0)]
    assert detect_hang(ranks, now=145.0, config=CFG, train_timeout_s=30.0) is None
    # the same wait without anyone in eval is a hang at the train timeout
    alone = [view(0, Phase.TRAIN, 100.0), view(1, Phase.TRAIN, 100.0)]
    assert detect_hang(alone, now=145.0, config=CFG, train_timeout_s=30.0) is not None


def msg(t: float, m: MessageKind, **body) -> Message:
    return Message.received(recv=t, m=m, body={"node": "n1", **body}, step_id=1)


def tracker(config: SupervisorConfig = CFG) -> AttemptTracker:
    tr = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=1, config=config, started=0.0)
    tr.on_message(msg(0.0, MessageKind.HELLO, rank=0, checkpoints=False))
    for step in range(3):
        tr.on_message(msg(1.0 + step, MessageKind.STEP, rank=0, step=step, step_time_s=1.0))
    return tr


def test_a_phase_frame_repeated_is_a_heartbeat_in_the_phase_that_keeps_its_start():
    tr = tracker(SupervisorConfig(hang_timeout_s=30, eval_timeout_s=20.0, node_silence_s=1e9))
    tr.on_message(msg(10.0, MessageKind.PHASE, rank=0, phase="eval", step=3))
    assert tr.ranks[0].phase is Phase.EVAL and tr.ranks[0].phase_since == 10.0
    for t in (25.0, 40.0):
        tr.on_message(msg(t, MessageKind.PHASE, rank=0, phase="eval", step=3))
        assert tr.ranks[0].phase_since == 10.0 and tr.ranks[0].last_progress == t
    assert tr.check(59.0) is None                     # 19 s after the last heartbeat
    hang = tr.check(61.0)                             # 21 s: past eval_timeout_s
    assert hang is not None and hang.kind is FailureKind.HANG and "phase eval" in hang.detail
    tr.on_message(msg(62.0, MessageKind.PHASE, rank=0, phase="train", step=3))
    assert tr.ranks[0].phase is Phase.TRAIN and tr.check(80.0) is None and tr.check(93.0) is not None


# ---- the rank side: ckptsup.phase over a real channel ------------------------------------------

@pytest.fixture
def link(tmp_path: Path, monkeypatch):
    agent = FakeAgent(tmp_path)
    for key, value in agent.env().items():
        monkeypatch.setenv(key, value)
    step_link = StepLink(env=RankEnv.from_environ(), rank=0, world_size=1, checkpoints=False)
    emitted: list[tuple[Event, dict]] = []
    step_link.phases.emit = lambda name, **fields: emitted.append((name, fields))
    assert phases.current() is step_link.phases
    yield agent, step_link, emitted
    step_link.bye(0)
    assert phases.current() is None


def frames(agent: FakeAgent, n: int, proc=None) -> list[dict]:
    import time

    deadline = time.monotonic() + 10
    while len(agent.of("phase")) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return agent.of("phase")


def test_phase_sends_eval_then_the_phase_before_and_rank_0_records_each_change(link):
    agent, step_link, emitted = link
    step_link.step(4, 0.1)
    with ckptsup.phase("eval") as p:
        p.beat()                      # throttled: the entry itself was a sign of life a moment ago
        ckptsup.phase_heartbeat()
    got = frames(agent, 2)
    assert [(f["phase"], f["step"]) for f in got] == [("eval", 5), ("train", 5)]
    assert [(name, f["phase"], f.get("was")) for name, f in emitted] == [
        (Event.PHASE, "eval", "train"), (Event.PHASE, "train", "eval")]


def test_phase_heartbeats_are_throttled_and_nothing_outside_an_eval(link):
    agent, step_link, _ = link
    now = [0.0]
    step_link.phases.clock = lambda: now[0]
    ckptsup.phase_heartbeat()         # training: a step is the heartbeat
    with ckptsup.phase("eval"):
        for t in (0.2, 0.5, 1.1, 1.5, 2.2):
            now[0] = t
            ckptsup.phase_heartbeat()
    got = frames(agent, 4)
    assert [f["phase"] for f in got] == ["eval", "eval", "eval", "train"]   # entry, 1.1, 2.2, exit


def test_phases_nest_and_a_decorated_function_is_one(link):
    agent, step_link, emitted = link
    step_link.step(0, None)

    @ckptsup.phase("eval")
    def evaluate() -> int:
        with ckptsup.phase("eval"):
            return 7

    assert evaluate() == 7 and evaluate() == 7
    assert [f["phase"] for f in frames(agent, 8)] == ["eval", "eval", "eval", "train"] * 2
    assert [f["phase"] for _, f in emitted] == ["eval", "train"] * 2   # events only on a change


def test_phase_without_an_agent_does_nothing_and_an_unknown_phase_is_one_line():
    assert phases.current() is None
    with ckptsup.phase("eval"):
        ckptsup.phase_heartbeat()
    with pytest.raises(ConfigError) as err:
        ckptsup.phase("compile")
    assert "unknown phase" in str(err.value) and "\n" not in str(err.value)


# ---- time per phase from the restart log --------------------------------------------------------

def ev(name: str, t: float, **fields) -> dict:
    from datetime import datetime, timezone

    ts = datetime.fromtimestamp(1_800_000_000 + t, timezone.utc).isoformat()
    return {"event": name, "ts": ts, "mono": 1000.0 + t, "job_id": "j", "attempt": 0, **fields}


def test_time_per_phase_runs_from_each_phase_event_to_the_next_and_stops_at_a_failure():
    events = [ev("supervisor_start", 0), ev("launch", 1, nodes=["n1"]),
              ev("phase", 3, phase="init"), ev("phase", 4, phase="load"), ev("phase", 6, phase="train"),
              ev("first_step", 7, step=0),
              ev("phase", 20, phase="eval", was="train"), ev("phase", 65, phase="train", was="eval"),
              ev("failure_detected", 80, kind="hang", detect_s=5.0),
              ev("launch", 90, nodes=["n1"]), ev("first_step", 92, step=10),     # a heartbeat rank: no phase events
              ev("phase", 100, phase="eval", was="train"), ev("phase", 110, phase="train"),
              ev("run_complete", 120, step=20)]
    times = phase_times(events)
    assert list(times) == ["init", "load", "train", "eval"]
    assert times == {"init": 3.0 + 2.0, "load": 2.0, "train": 14.0 + 10.0 + 8.0 + 10.0, "eval": 45.0 + 10.0}
    line = phases_line(times)
    assert line.startswith("init 5.0s (") and "eval 55.0s" in line
    assert phases_line({}) == "-"


def test_a_live_runs_open_phase_counts_to_now():
    events = [ev("supervisor_start", 0), ev("launch", 0, nodes=["n1"]), ev("first_step", 2, step=0),
              ev("phase", 10, phase="eval")]
    assert phase_times(events) == {"init": 2.0, "train": 8.0, "eval": 0.0}   # entered at the last event
    assert phase_times(events, until=1_800_000_000 + 40.0)["eval"] == pytest.approx(30.0, abs=0.01)


# ---- the knob ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,problem", [("0", "must be > 0"), ("-5", "must be > 0"), ("nan", "finite"),
                                           ("1e9", "must be at most"), ('"long"', "")])
def test_eval_timeout_is_validated_at_load_with_one_line(tmp_path: Path, value: str, problem: str):
    job = tmp_path / "job.toml"
    job.write_text(f"[supervisor]\neval_timeout_s = {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(job_config=job, env={})
    message = str(err.value)
    assert "supervisor.eval_timeout_s" in message and problem in message and "\n" not in message
    job.write_text("[supervisor]\neval_timeout_s = 45\n")
    assert load_config(job_config=job, env={}).config.supervisor.eval_timeout_s == 45
    assert math.isclose(load_config(env={}).config.supervisor.eval_timeout_s, 600.0)


def test_the_step_after_an_eval_is_not_timed_so_the_hang_timeout_stays_a_steps(link):
    agent, step_link, _ = link
    assert step_link.tick(10.0) is None and step_link.tick(10.5) == 0.5
    with ckptsup.phase("eval"):
        pass
    assert step_link.tick(60.0) is None      # 49.5 s of evaluation in between: not a step time
    assert step_link.tick(60.5) == 0.5
