"""The pieces the supervisor loop (supervisor/job/loop.py) hands its concerns to, each on its own,
with fakes for the agents and for the loop's wait: the kill window (kill_window.py), the teardown
bound (teardown.py), the restart's record (restart_record.py), the ranks' events on their way to
the restart log (rank_events.py), the agents' start and the launch's hop to them (agent_start.py,
agent_launch.py), the clouds' reclaims (reclaims.py), the retuned collective timeout
(retuning.py), the tracker's news (tracker_news.py), a failed attempt's history entry
(unhooked.failed_attempt) and the memory tier's replica event (memory_peers.py). The loop's
whole story with them is tests/test_supervisor_loop.py's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptsup import messages
from ckptsup.config import Config
from ckptsup.events import Event
from ckptsup.rundir import RunState
from ckptsup.supervisor.job import rank_events, teardown
from ckptsup.supervisor.job.agent_launch import AgentLaunch
from ckptsup.supervisor.job.agent_set import AgentSet
from ckptsup.supervisor.job.agent_start import AgentStarts
from ckptsup.supervisor.job.agent_step import Message
from ckptsup.supervisor.job.detection import TeardownHang
from ckptsup.supervisor.job.kill_window import (KillAcks, KillWindow, ack_window_s, flight_recorder_kept,
                                                silent_nodes)
from ckptsup.supervisor.job.memory_peers import MemoryPeers
from ckptsup.supervisor.job.observations import Failure, FailureKind, Outcome, RecoveryPath, SupervisionLevel
from ckptsup.supervisor.job.reclaims import Reclaims
from ckptsup.supervisor.job.restart_record import RestartRecord, load_by_source
from ckptsup.supervisor.job.retuning import STEADY_AFTER_STEPS, Retuning, steady_timeouts
from ckptsup.supervisor.job.unhooked import failed_attempt, stepless_progress
from ckptsup.wire import MessageKind


SUP = replace(Config().supervisor, nproc_per_node=1)


# ---- fakes ----------------------------------------------------------------------------------------
@dataclass
class Step:
    """An agent step: what was sent to it, alive until told otherwise."""

    step_id: int
    nodes: tuple[str, ...]
    running: bool = True
    sent: list[tuple[Any, Any]] = field(default_factory=list)

    def send(self, msg, *, nodes=None) -> bool:
        self.sent.append((msg, nodes))
        return self.running

    def alive(self) -> bool:
        return self.running

    def close(self, grace: float) -> int | None:
        return 0



class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


class Waits:
    """The loop's _await, scripted: each wait is handed the messages queued for it, in order,
    until `done` accepts one or `until()` holds; every call is recorded with its deadline."""

    def __init__(self, *batches: list[Message]) -> None:
        self.batches = list(batches)
        self.calls: list[float] = []

    def __call__(self, done, deadline, until=lambda: False) -> bool:
        self.calls.append(deadline)
        for msg in self.batches.pop(0) if self.batches else []:
            if until():
                return True
            if done(msg):
                return True
        return until()


def agents_on(*nodes: str) -> tuple[AgentSet, Step]:
    agents, step = AgentSet(), Step(step_id=1, nodes=nodes)
    agents.add(step)
    return agents, step


def message(node: str, body: messages.Body, kind: MessageKind = MessageKind.KILLED) -> Message:
    return Message(recv=0.0, m=kind, body=body, step_id=1, node=node)


def placement(*, in_slurm: bool = True, down: set[str] | None = None, gpus: int = 0) -> Any:
    asked: list[list[str]] = []

    def slurmd_down(nodes, timeout_s):
        asked.append(list(nodes))
        return set(down or ()) & set(nodes)

    return SimpleNamespace(in_slurm=in_slurm, gpus_per_node=gpus, slurmd_down=slurmd_down, asked=asked)


def window(agents: AgentSet, waits: Waits, where: Any = None, config: Config | None = None) -> KillWindow:
    config = config or Config()
    return KillWindow(agents=agents, await_answers=waits, clock=Clock(), sup=config.supervisor, nccl=config.nccl,
                      placement=where or placement())


# ---- the kill window ---------------------------------------------------------------------------------
def test_the_ack_window_is_a_few_beats_never_past_the_silence_that_declares_a_node_down():
    sup = Config().supervisor
    assert ack_window_s(sup) == min(sup.node_silence_s, max(2.0, 3 * sup.heartbeat_interval_s))
    quick = SimpleNamespace(node_silence_s=1.5, heartbeat_interval_s=0.1)
    assert ack_window_s(quick) == 1.5   # type: ignore[arg-type]


def test_a_kill_read_as_a_liveness_probe_names_the_silent_nodes_unless_nobody_answered():
    assert silent_nodes(None, ["n1", "n2"]) == ([], [])
    assert silent_nodes(KillAcks(unacked={"n1", "n2"}), ["n1", "n2"]) == ([], [])   # our own link is the suspect
    acks = KillAcks(unacked={"n3", "n2"}, unreachable={"n3", "n9"})
    assert silent_nodes(acks, ["n1", "n2", "n3"]) == (["n2", "n3"], ["n3"])


def test_the_flight_recorder_is_waited_for_only_where_nccl_keeps_one():
    nccl = Config().nccl
    assert not flight_recorder_kept(nccl, 0)   # gloo on CPU: nothing to dump
    assert flight_recorder_kept(nccl, 8) is bool(nccl.dump_on_timeout and nccl.flight_recorder_entries > 0)


def test_kill_collects_acks_and_the_survivors_a_report_names():
    agents, step = agents_on("n1", "n2")
    waits = Waits([message("n1", messages.Killed(survivors=({"rank": 3, "pid": 7, "extra": "x"},))),
                   message("n2", messages.Killed())])
    acks = window(agents, waits).kill(["n1", "n2"], wait_for=["n1", "n2"], report=True)
    assert acks is not None and acks.unacked == set()
    assert acks.survivors == [{"node": "n1", "rank": 3, "pid": 7}]
    sent, nodes = step.sent[0]
    assert isinstance(sent, messages.Kill) and sent.report and sent.grace == 0
    assert len(waits.calls) == 1   # no probe: one wait, the whole window


def test_a_probing_kill_asks_the_silent_nodes_slurmd_after_the_first_acks():
    agents, _ = agents_on("n1", "n2", "n3")
    where = placement(down={"n3"})
    waits = Waits([message("n1", messages.Killed())], [message("n2", messages.Killed())])
    kills = window(agents, waits, where)
    assert kills.kill_attempt(("n1", "n2", "n3"), Failure(kind=FailureKind.CRASH, node="n1")) == (["n3"], ["n3"])
    assert where.asked == [["n2", "n3"]]   # silent KILL_ACK_S after the kill
    assert waits.calls[1] - waits.calls[0] > 1.0   # the probe's short wait first, then the ack window's


def test_a_dead_node_is_not_waited_for_and_no_agent_means_no_kill_sent():
    agents, _ = agents_on("n1", "n2")
    kills = window(agents, Waits([message("n1", messages.Killed())]))
    assert kills.kill_attempt(("n1", "n2"), Failure(kind=FailureKind.NODE_DOWN, node="n2")) == ([], [])
    gone, step = agents_on("n1")
    step.running = False
    local = window(gone, Waits(), placement(in_slurm=False))
    local.torchrun_pids.add(2 ** 22 + 12345)   # no such process: terminate() is a no-op for it
    assert local.kill(["n1"], wait_for=["n1"]) is None and local.torchrun_pids == set()


def test_stop_ranks_waits_for_every_torchrun_then_kills_and_says_the_last_step():
    agents, step = agents_on("n1", "n2")
    waits = Waits([message("n1", messages.TorchrunExit(rc=7, step=41), MessageKind.TORCHRUN_EXIT),
                   message("n2", messages.TorchrunExit(rc=7, step=42), MessageKind.TORCHRUN_EXIT)])
    tracker = SimpleNamespace(last_step=40, done_nodes=set())
    last = window(agents, waits).stop_ranks(active=("n1", "n2"), tracker=tracker, reason="cancelled", save=True,
                                            budget_s=3.0)
    assert last == 42
    assert [type(m).__name__ for m, _ in step.sent] == ["StopAt", "Kill"]


def test_the_flight_recorder_dump_waits_for_every_hung_rank():
    config = Config()
    if not flight_recorder_kept(config.nccl, 8):
        pytest.skip("the site's [nccl] keeps no flight recorder")
    agents, step = agents_on("n1")
    dumped = [message("n1", messages.EventRecord(record={"event": "fr_dumped", "rank": r}), MessageKind.EVENT)
              for r in (0, 1)]
    made: list[str] = []
    window(agents, Waits(dumped), placement(gpus=8), config).dump_flight_recorder(
        lambda: made.append("dir") or Path("/nowhere/fr"), [0, 1])
    assert made == ["dir"] and isinstance(step.sent[0][0], messages.DumpFr)
    nothing: list[str] = []
    window(agents, Waits(), placement(gpus=0), config).dump_flight_recorder(lambda: nothing.append("dir") or Path("x"), [0])
    assert nothing == []   # no recorder to dump: not even the attempt's directory is made


# ---- the teardown bound ----------------------------------------------------------------------------
class Emitted(list):
    def __call__(self, name: Event, **fields: Any) -> None:
        self.append((name, fields))


def test_a_teardown_hang_kills_names_and_ends_the_nodes_as_exited_zero():
    agents, _ = agents_on("n1")
    waits = Waits([message("n1", messages.Killed(survivors=({"rank": 1, "pid": 9}, {"rank": 0, "pid": 8})))])
    ended: list[str] = []
    tracker = SimpleNamespace(teardown_hang=lambda now: TeardownHang(nodes=("n1",), waited_s=31.23456),
                              teardown_done=lambda node: ended.append(node))
    emitted = Emitted()
    failure = teardown.end_teardown(tracker, kills=window(agents, waits), emit=emitted, clock=Clock(),  # type: ignore[arg-type]
                                    exit_grace_s=30.0)
    assert failure is None and ended == ["n1"]
    (name, fields), = emitted
    assert name is Event.TEARDOWN_HANG and [e["rank"] for e in fields["ranks"]] == [0, 1]
    assert fields["waited_s"] == 31.235 and fields["nodes"] == ["n1"]
    assert "rank 0 on n1 (pid 8), rank 1 on n1 (pid 9) had not exited 30s later" in \
        teardown.hang_line(fields["ranks"], ["n1"], 30.0)
    assert "torchrun on n1, n2 had not exited" in teardown.hang_line([], ["n1", "n2"], 30.0)


def test_teardown_errors_are_said_once_each():
    tracker = SimpleNamespace(teardown_errors=[{"node": "n1", "rc": 1}])
    emitted = Emitted()
    teardown.report_errors(tracker, emitted)  # type: ignore[arg-type]
    teardown.report_errors(tracker, emitted)  # type: ignore[arg-type]
    assert emitted == [(Event.TEARDOWN_ERROR, {"node": "n1", "rc": 1})]


# ---- the restart's record and the ranks' events --------------------------------------------------------
def test_restart_done_gathers_its_fields_from_the_decision_to_the_first_step():
    record = RestartRecord()
    assert record.done(recv=5.0, resume_step=0, phases={}) is None   # a start-up: no restart under way
    record.begin(detect=10.0, path=RecoveryPath.FAST, kind=FailureKind.CRASH, backoff_s=0.0, nodes=("n1", "n2"))
    record.new_launch()
    record.launched(True)
    record.launched(None)   # one node cold: the restart was not warm
    record.loaded({"memory": 3, "shared": 1})
    done = record.done(recv=12.5, resume_step=20, phases={"load_s": 0.4})
    assert done == {"restart_s": 2.5, "resume_step": 20, "phases": {"load_s": 0.4},
                    "load_by_source": {"memory": 0.3, "shared": 0.1}, "path": "fast", "kind": "crash",
                    "backoff_s": 0.0, "nodes": ["n1", "n2"], "warm": False}
    assert record.done(recv=13.0, resume_step=21, phases={}) is None   # written once
    assert load_by_source(None, {"shared": 1}) == {}


def test_rank_events_are_forwarded_with_what_they_tell_the_loop():
    assert rank_events.read("not a record").fate is rank_events.Fate.UNKNOWN
    assert rank_events.read({"event": "no_such_event"}).fate is rank_events.Fate.UNKNOWN
    assert rank_events.read({"event": "first_step", "step": 3}).fate is rank_events.Fate.OWN
    committed = rank_events.read({"event": "checkpoint_committed", "step": 40, "ts": 1.5, "mono": 2.0, "job_id": "j",
                                  "attempt": 0, "epoch": 1, "stall_s": 0.2, "write_s": 3, "rank": 0})
    assert committed.fate is rank_events.Fate.FORWARD and committed.name is Event.CHECKPOINT_COMMITTED
    assert committed.fields == {"step": 40, "stall_s": 0.2, "write_s": 3, "rank": 0, "rank_ts": 1.5}
    assert committed.tier == "committed" and committed.measured == {"stall_s": 0.2, "write_s": 3.0}
    loaded = rank_events.read({"event": "checkpoint_loaded", "step": 40, "files_by_source": {"shared": 2}})
    assert loaded.files_by_source == {"shared": 2} and loaded.measured == {} and loaded.tier is None
    assert rank_events.read({"event": "checkpoint_validated", "step": "40"}).tier is None   # a step that is no int


# ---- the agents' start, and the launch's hop to them ----------------------------------------------------
def hello(version: str | None = None, **kw: Any) -> messages.AgentHello:
    from ckptsup._version import __version__
    from ckptsup.wire import WIRE_VERSION

    return messages.AgentHello(version=version or __version__, wire=kw.pop("wire", WIRE_VERSION), **kw)


def test_agent_hellos_warn_once_per_version_and_say_when_a_containers_launch_is_up():
    starts = AgentStarts()
    starts.awaiting = {"n1", "n2"}
    first = starts.hello("n1", hello("0.0.1", age_s=0.5), recv=10.0, started=8.0)
    assert first.problem is None and first.note is not None and not first.all_up
    assert first.fields["container_s"] == 1.5 and first.fields["python_s"] == 0.5
    second = starts.hello("n2", hello("0.0.1"), recv=11.0, started=None)
    assert second.note is None and second.all_up and second.fields["container_s"] is None
    assert starts.heard
    assert AgentStarts().hello("n1", hello(wire=10 ** 6), recv=0.0, started=None).problem is not None


def test_a_step_that_never_started_ends_the_run_only_with_its_logs_reason(tmp_path):
    log = tmp_path / "agents.log"
    log.write_text("Traceback ...\nModuleNotFoundError: No module named 'ckptsup'\n")
    starts = AgentStarts()
    line = starts.never_started(rc=1, log=str(log))
    assert line is not None and "No module named 'ckptsup'" in line and "rc=1" in line
    assert starts.never_started(rc=1, log="") is None
    starts.heard = True
    assert starts.never_started(rc=1, log=str(log)) is None   # an agent spoke: the node's trouble, not the image's


def test_a_launch_restarts_the_live_agents_and_starts_steps_for_the_rest():
    agents, step = agents_on("n1", "n3")
    started: list[tuple[str, ...]] = []
    launch = AgentLaunch(agents=agents, memory_peers=None, allocation=("n1", "n2", "n3"), sup=SUP,
                         start_agents=lambda nodes, path: started.append(nodes))
    spec = SimpleNamespace(to_json=lambda: {"spec": 1})
    missing = launch.launch(("n1", "n2"), spares=["n3"], spec=spec, spec_path=Path("s"), attempt=4)  # type: ignore[arg-type]
    assert missing == ["n2"] and started == [("n2",)]   # an agent was up: no spare brought up
    restart, nodes = step.sent[0]
    assert isinstance(restart, messages.Restart) and restart.attempt == 4 and nodes == ["n1"]
    empty = AgentLaunch(agents=AgentSet(), memory_peers=None, allocation=("n1", "n2", "n3"), sup=SUP,
                        start_agents=lambda nodes, path: started.append(nodes))
    assert empty.launch(("n1", "n2"), spares=["n3"], spec=spec, spec_path=Path("s"), attempt=0) == ["n1", "n2"]  # type: ignore[arg-type]
    assert started[-1] == ("n1", "n2", "n3")   # the first launch brings the spares' agents up too


def test_memory_peers_go_to_the_live_agents_before_the_restart_and_again_on_a_new_address():
    agents, step = agents_on("n1", "n2")
    peers = MemoryPeers(replicas=1)
    launch = AgentLaunch(agents=agents, memory_peers=peers, allocation=("n1", "n2"), sup=SUP,
                         start_agents=lambda nodes, path: None)
    launch.peer_address("n1", "10.0.0.1:9")
    launch.peer_address("n2", "10.0.0.2:9")
    step.sent.clear()
    launch.launch(("n1", "n2"), spares=[], spec=SimpleNamespace(to_json=lambda: {}), spec_path=Path("s"), attempt=1)  # type: ignore[arg-type]
    kinds = [type(m).__name__ for m, _ in step.sent]
    assert kinds == ["MemoryPeers", "MemoryPeers", "Restart"]
    step.sent.clear()
    launch.peer_address("n2", "10.0.0.2:9")   # the same address: nobody needs telling
    assert step.sent == []


def test_the_memory_replicated_event_says_every_failure_and_a_step_once_all_ranks_are_stored():
    peers = MemoryPeers(replicas=1)
    for node in ("n1", "n2"):
        peers.on_peer(node, f"{node}:9")
    peers.launch(("n1", "n2"), 1)
    bad = messages.MemoryReplicated(step=5, rank=0, buddy="n2:9", ok=False, reason="x" * 400)
    assert peers.replicated_event("n1", bad, 2) == {"ok": False, "node": "n1", "step": 5, "rank": 0, "buddy": "n2:9",
                                                   "reason": "x" * 300}
    assert peers.replicated_event("n1", messages.MemoryReplicated(step=5, rank=0, buddy="n2:9", ok=True), 2) is None
    assert peers.replicated_event("n2", messages.MemoryReplicated(step=5, rank=1, buddy="n1:9", ok=True), 2) == \
        {"ok": True, "step": 5, "ranks": 2}


# ---- the clouds' reclaims -------------------------------------------------------------------------------
def reclaims(*, active: tuple[str, ...], spares: tuple[str, ...], can_requeue: bool = True) -> tuple[Reclaims, Any]:
    emitted, excluded = Emitted(), []
    operator = SimpleNamespace(replace=None, save_refusal=lambda tracker: "")
    state = RunState()
    agents, step = agents_on(*active, *spares)
    out = Reclaims(config=Config(), operator=operator, agents=agents, emit=emitted, clock=Clock(),  # type: ignore[arg-type]
                   exclude=lambda node, why: excluded.append(node), spares=lambda: spares,
                   run_state=lambda: state, can_requeue=can_requeue)
    return out, SimpleNamespace(emitted=emitted, excluded=excluded, operator=operator, step=step, state=state)


def notice(ahead_s: float = 120.0) -> messages.CloudNotice:
    return messages.CloudNotice(cloud="aws", action="terminate", deadline="2026-05-01T10:02:00Z", ahead_s=ahead_s)


def tracker_at(step: int) -> Any:
    return SimpleNamespace(current_step=lambda: step, step_window=SimpleNamespace(p99=lambda: 0.1))


def test_a_reclaimed_spare_is_excluded_and_a_training_node_moves_after_an_emergency_checkpoint():
    taken, seen = reclaims(active=("n1", "n2"), spares=("n3",))
    seen.state.measured.update(stall_s=0.1, write_s=0.2)
    taken.offer("n3", notice(), 100.0)
    taken.offer("n1", notice(), 100.0)
    assert taken.take(tracker_at(7), ("n1", "n2")) is None
    assert seen.excluded == ["n3"] and taken.reclaimed == {"n1", "n3"} and taken.heard == []
    pending = seen.operator.replace
    assert pending is not None and pending.node == "n1" and pending.after_step == 7 and pending.deadline is not None
    assert isinstance(seen.step.sent[-1][0], messages.SaveNow)
    assert [f["way"] for _, f in seen.emitted] == ["exclude", "save_and_move"]


def test_a_reclaim_with_nowhere_to_go_stops_the_run_as_a_preemption_and_later_notices_wait():
    taken, seen = reclaims(active=("n1", "n2"), spares=(), can_requeue=False)
    taken.offer("n1", notice(), 100.0)
    taken.offer("n2", notice(), 100.0)
    failure = taken.take(tracker_at(3), ("n1", "n2"))
    assert failure is not None and failure.kind is FailureKind.PREEMPTED and failure.step == 3
    assert taken.stop is not None and taken.stop[1] == pytest.approx(120.0, abs=1.0)
    assert [node for node, _, _ in taken.heard] == ["n2"]   # after a failure: its turn comes later


# ---- retuning: the steady collective timeout ---------------------------------------------------------------
def test_the_steady_timeout_only_ever_tightens_once_enough_steps_are_measured():
    config = Config()
    init = steady_timeouts(config, None, step_times=[0.1] * 20, save_s=None)
    assert init is None   # no launch timeouts to compare with
    agents, step = agents_on("n1")
    emitted = Emitted()
    tuning = Retuning(config=config, interval=SimpleNamespace(), agents=agents, emit=emitted, writer=lambda: None)  # type: ignore[arg-type]
    launched = tuning.launch(step_times=[], save_s=None)
    assert tuning.steady_pending
    tracker = SimpleNamespace(step_window=SimpleNamespace(samples=[0.01] * (STEADY_AFTER_STEPS - 1)),
                              hang_cap_s=None, save_allowance_s=None)
    tuning.on_steps(tracker, save_s=None)  # type: ignore[arg-type]
    assert tuning.steady_pending and step.sent == []
    tracker.step_window.samples.append(0.01)
    tuning.on_steps(tracker, save_s=None)  # type: ignore[arg-type]
    assert not tuning.steady_pending
    if emitted:   # the site's steady timeout is below its init one (the default's is)
        (name, fields), = emitted
        assert name is Event.COLLECTIVE_TIMEOUT_SET and fields["was_s"] == round(launched.collective_s, 3)
        assert isinstance(step.sent[0][0], messages.SetTimeout) and tracker.hang_cap_s == tuning.timeouts.hang_cap_s
        assert tuning.timeouts.collective_s < launched.collective_s
    tuning.on_steps(tracker, save_s=None)  # type: ignore[arg-type]
    assert len(emitted) <= 1   # once per launch


# ---- a failed attempt's history entry -------------------------------------------------------------------------
def test_a_failed_attempt_starts_where_it_resumed_or_at_its_first_line_or_progressed_otherwise():
    crash = Failure(kind=FailureKind.CRASH, node="n1")
    asked: list[bool] = []

    def progressed() -> bool:
        asked.append(True)
        return True

    hooked = SimpleNamespace(level=SupervisionLevel.HOOKS, expect_hello=True, resume_step=20, last_step=25, first_step=21)
    result = failed_attempt(hooked, attempt=3, failure=crash, progressed=progressed)  # type: ignore[arg-type]
    assert (result.attempt, result.outcome, result.start_step, result.last_step) == (3, Outcome.FAILED, 20, 25)
    lines = SimpleNamespace(level=SupervisionLevel.PROGRESS, expect_hello=False, resume_step=0, last_step=9, first_step=4)
    assert failed_attempt(lines, attempt=0, failure=crash, progressed=progressed).start_step == 4  # type: ignore[arg-type]
    assert asked == []   # steps were seen: nothing else asked
    quiet = SimpleNamespace(level=None, expect_hello=False, resume_step=0, last_step=None, first_step=None)
    result = failed_attempt(quiet, attempt=0, failure=crash, progressed=progressed)  # type: ignore[arg-type]
    assert result.level is SupervisionLevel.PROCESS and result.progress is True and asked == [True]
    assert stepless_progress(ran_s=100.0, init_timeout_s=60.0, newer=False) is False   # the directory says no
    assert stepless_progress(ran_s=100.0, init_timeout_s=60.0, newer=None) is True
    assert stepless_progress(ran_s=10.0, init_timeout_s=60.0, newer=None) is False


# ---- the tracker's news ---------------------------------------------------------------------------------------
def test_the_trackers_news_is_said_once_and_stacks_are_asked_of_the_running_nodes():
    from ckptsup.supervisor.job.tracker_news import TrackerNews

    agents, step = agents_on("n1", "n2")
    emitted = Emitted()
    asked: list[set[str]] = []
    tracker = SimpleNamespace(want_stacks=True, nodes=("n1", "n2"), done_nodes={"n2"},
                              asked_for_stacks=lambda now, nodes: asked.append(nodes),
                              restore_news=[SimpleNamespace(step=5, loss=9.0, before=1.0, basis="p99", detail="jump")],
                              busy_news=[SimpleNamespace(ranks=(0,), detail="in a collective")], busy_quiet_since=None,
                              busy_over_news=[((0,), 12.34567)])
    news = TrackerNews(emit=emitted, agents=agents, clock=Clock(), sup=SUP)
    news.after_check(tracker)  # type: ignore[arg-type]
    news.after_check(SimpleNamespace(**{**vars(tracker), "want_stacks": False}))  # type: ignore[arg-type]
    assert asked == [{"n1"}] and step.sent[0] == (messages.Stacks(), ["n1"])
    assert [name for name, _ in emitted] == [Event.RESTORE_LOSS_JUMP, Event.BUSY, Event.BUSY_OVER]
    assert emitted[2][1] == {"ranks": [0], "busy_s": 12.346}
