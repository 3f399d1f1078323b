"""The supervisor loop in-process: a scripted agent step (FakeStep), a fake health checker and a
clock that advances on every read, so every policy path and every wait runs in milliseconds.
The real-process tier (test_supervisor_local.py, test_supervisor_slurm_*.py) keeps covering the
same paths through real agents, torchrun and Slurm."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import pytest

from ckptsup.config import load_config
from ckptsup.env import ExitStatus
from ckptsup import messages
from ckptsup.events import Event, read_events
from ckptsup.rundir import RunDir, RunStatus
from ckptsup.planning.accounting import account
from ckptsup.supervisor.job import loop as loop_mod
from ckptsup.supervisor.ops import restart_log
from ckptsup.supervisor.job.agent_step import Message, StepSignal
from ckptsup.supervisor.health.health import NodeHealth
from ckptsup.supervisor.job.loop import Job, Supervisor
from ckptsup.supervisor.job.placement import Placement
from ckptsup.supervisor.spec import LaunchSpec
from ckptsup.wire import MessageKind, Phase


class Clock:
    """Advances `tick` seconds on every read: waits end after a bounded number of reads."""

    def __init__(self, tick: float = 0.05) -> None:
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@dataclass
class Fault:
    kind: str              # crash | nan | sdc | hang | node_death | preempt | exit0 | teardown (bye, then never exits)
    step: int
    node: str = "n1"


@dataclass
class World:
    """Plays every attempt: ranks say hello and step from 0 to `steps`, unless the fault scripted
    for that launch (0 = the first) strikes at its step."""

    clock: Clock
    steps: int = 6
    nproc: int = 1
    faults: dict[int, Fault] = field(default_factory=dict)
    hello: dict[str, Any] = field(default_factory=dict)          # more of every hello body (the disk schedule)
    events: list[dict[str, Any]] = field(default_factory=list)   # rank 0's events, after the hellos
    launches: int = 0
    steps_made: list[int] = field(default_factory=list)  # how many step factories were called
    sent: list[tuple[int, MessageKind, dict[str, Any], Any]] = field(default_factory=list)  # step, kind, body, nodes
    hung: list[tuple[str, int]] = field(default_factory=list)  # (node, rank) whose processes outlive their bye
    fingerprint_s: float | None = None   # rank 0's step frames carry sdc_s = this x steps done (docs/sdc.md)
    agent_hello: dict[str, Any] | None = None   # each new step's agents say hello first, with this body

    def factory(self, *, nodes, inbox, argv, **_: Any) -> "FakeStep":
        self.steps_made.append(len(self.steps_made))
        step = FakeStep(world=self, nodes=tuple(nodes), inbox=inbox, step_id=100 + len(self.steps_made))
        for node in nodes if self.agent_hello is not None else ():
            step.put(MessageKind.AGENT_HELLO, node, **self.agent_hello)
        step.play(launch_nodes(LaunchSpec.read(argv[argv.index("--spec") + 1])))
        return step


def launch_nodes(spec: LaunchSpec) -> tuple[str, ...]:
    """The nodes that run ranks (the agent's rule: the others are spares in standby)."""
    return tuple(spec.node_addrs)


@dataclass
class FakeStep:
    world: World
    nodes: tuple[str, ...]
    inbox: Any
    step_id: int
    dead: set[str] = field(default_factory=set)
    running: bool = True
    active: tuple[str, ...] = ()   # the nodes of the current launch (the rest are spares)

    def put(self, m, node: str, **body: Any) -> None:
        self.inbox.put(Message.received(recv=self.world.clock(), m=m, body={"node": node, **body}, step_id=self.step_id))

    def play(self, launch: tuple[str, ...]) -> None:
        world = self.world
        fault = world.faults.get(world.launches)
        world.launches += 1
        self.active = tuple(n for n in launch if n in self.nodes)
        for node in self.nodes:
            if node not in self.dead:
                self.put(MessageKind.HB, node)
        ranks = [(node, i * world.nproc + r) for i, node in enumerate(launch) for r in range(world.nproc)
                 if node in self.nodes]
        for node, rank in ranks:
            self.put(MessageKind.HELLO, node, rank=rank, **world.hello)
            self.put(MessageKind.PHASE, node, rank=rank, phase=Phase.TRAIN, step=0)
        for record in world.events:
            self.put(MessageKind.EVENT, ranks[0][0], record=record)
        for step in range(world.steps):
            if fault is not None and step == fault.step:
                return self.strike(fault, ranks)
            for node, rank in ranks:
                cost = {"sdc_s": world.fingerprint_s * step} if world.fingerprint_s is not None and rank == 0 else {}
                self.put(MessageKind.STEP, node, rank=rank, step=step, step_time_s=0.01, loss_finite=True, **cost)
        if fault is not None and fault.kind == "exit0":
            return
        if fault is not None and fault.kind == "teardown":
            for node, rank in ranks:   # every rank closes, but their processes never exit (torchrun neither)
                self.put(MessageKind.BYE, node, rank=rank, status=0)
            world.hung = [(node, rank) for node, rank in ranks]
            return
        for node, rank in ranks:
            self.put(MessageKind.BYE, node, rank=rank, status=0)
        for node in self.active:
            self.put(MessageKind.TORCHRUN_EXIT, node, rc=0)

    def strike(self, fault: Fault, ranks: list[tuple[str, int]]) -> None:
        rank = next(r for n, r in ranks if n == fault.node)
        if fault.kind == "crash":
            self.put(MessageKind.RANK_EXIT, fault.node, rank=rank, rc=1, detail=f"rank {rank} exited rc=1")
        elif fault.kind == "nan":
            self.put(MessageKind.STEP, fault.node, rank=rank, step=fault.step, step_time_s=0.01, loss_finite=False)
        elif fault.kind == "sdc":   # the majority outvotes this rank; the replicas agreed 2 steps before
            for node, r in ranks:
                self.put(MessageKind.SDC, node, rank=r, step=fault.step, copies=len(ranks), disputed=[rank],
                         majority=True, fingerprint="0" * 32, agreed_step=fault.step - 2)
        elif fault.kind == "node_death":
            self.dead.add(fault.node)  # silent from now on; a peer's crash is the first symptom
            peer_node, peer = next((n, r) for n, r in ranks if n != fault.node)
            self.put(MessageKind.RANK_EXIT, peer_node, rank=peer, rc=1, detail="peer lost")
        elif fault.kind == "preempt":
            self.put(MessageKind.PREEMPT, fault.node, signal=int(signal.SIGTERM), budget_s=0)
        # hang: nothing more is said

    # -- the Step protocol --
    def send(self, msg: messages.Body, *, nodes=None) -> bool:
        m, body = msg.KIND, msg.to_body()
        self.world.sent.append((self.step_id, m, body, nodes))
        if not self.running:
            return False
        addressed = [n for n in (nodes if nodes is not None else self.nodes) if n in self.nodes]
        live = [n for n in addressed if n not in self.dead]
        if m is MessageKind.KILL:
            for node in live:
                survivors = [{"rank": r, "pid": 4000 + r, "host_pid": 9000 + r, "wchan": "futex_wait_queue"}
                             for n, r in self.world.hung if n == node]
                self.put(MessageKind.KILLED, node, kill_s=0.0, **({"survivors": survivors} if body.get("report") else {}))
                self.world.hung = [(n, r) for n, r in self.world.hung if n != node]
        elif m is MessageKind.RESTART:
            self.play(launch_nodes(LaunchSpec.from_json(body["spec"], source="test")))
        elif m is MessageKind.EXIT:
            self.dead.update(addressed)
        elif m is MessageKind.STOP_AT:
            for node in live:
                self.put(MessageKind.TORCHRUN_EXIT, node, rc=0, preempted=True)
        return True

    def alive(self) -> bool:
        return self.running

    def close(self, grace: float) -> int | None:
        self.running = False
        return 0



class FakeSlurm:
    def __init__(self) -> None:
        self.drained: list[str] = []

    def drain(self, node: str, reason: str) -> bool:
        self.drained.append(node)
        return True

    def job_info(self, job_id: str) -> None:   # a job Slurm does not know: no end time to price fewer nodes with
        return None

    def job_steps(self, job_id: str) -> list:   # the agents' step: gone once its agents have left
        self.step_polls = getattr(self, "step_polls", 0) + 1
        return []


def healthy(unhealthy: dict[str, str] | None = None, calls: list | None = None):
    bad = unhealthy or {}

    def check(nodes: list[str]) -> dict[str, NodeHealth]:
        if calls is not None:
            calls.append(list(nodes))
        return {n: NodeHealth(node=n, error=bad.get(n, "")) for n in nodes}

    return check


@pytest.fixture(autouse=True)
def fast_ticks(monkeypatch):
    monkeypatch.setattr(loop_mod, "TICK_S", 0.001)


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site.toml"
    path.write_text("[supervisor]\nhang_min_s = 3.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                    "[checkpoint]\nadaptive_interval = false\n[health]\nenabled = true\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(path))
    return path


def supervisor(tmp_path, world: World, *, nodes=("n1",), needed=1, in_slurm=False, health=None,
               flags: dict | None = None, slurm=None, gpus=0, requeue=None) -> Supervisor:
    resolved = load_config(flags={"supervisor.nproc_per_node": world.nproc, **(flags or {})})
    run = RunDir.create(tmp_path / "run")
    placement = Placement(job_id="77", nodes=tuple(nodes), addrs={n: "127.0.0.1" for n in nodes},
                          in_slurm=in_slurm, slurm=slurm, here="n1", gpus_per_node=gpus)
    job = Job(script=str(tmp_path / "train.py"), script_args=[], cwd=str(tmp_path), nodes_needed=needed)
    return Supervisor(resolved=resolved, job=job, run_dir=run, placement=placement, clock=world.clock,
                      sleep=lambda s: None, step_factory=world.factory, health_checker=health or healthy(),
                      requeue=requeue)


def names(tmp_path) -> list[str]:
    return [e["event"] for e in read_events(tmp_path / "run")]


def of(tmp_path, event: Event) -> list[dict]:
    return [e for e in read_events(tmp_path / "run") if e["event"] == event.value]


def test_a_clean_run_completes_on_its_first_launch(tmp_path, site):
    world = World(clock=Clock())
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    [launch] = of(tmp_path, Event.LAUNCH)
    assert launch["path"] == "initial" and of(tmp_path, Event.RUN_COMPLETE)[0]["step"] == 5
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.DONE


def test_a_crash_restarts_on_the_fast_path_without_a_health_check(tmp_path, site):
    calls: list = []
    world = World(clock=Clock(), faults={0: Fault("crash", 3)})
    assert supervisor(tmp_path, world, health=healthy(calls=calls)).run() is ExitStatus.DONE
    assert [e["path"] for e in of(tmp_path, Event.LAUNCH)] == ["initial", "fast"]
    assert len(world.steps_made) == 1  # the same agents restarted torchrun
    assert calls == [["n1"]]            # the start-up check only: a first crash is the software's
    [done] = of(tmp_path, Event.RESTART_DONE)
    assert done["kind"] == "crash" and set(done["phases"]) >= {"kill_s", "health_s", "launch_s"}


def test_ranks_that_never_exit_after_their_bye_are_killed_after_exit_grace_and_the_run_completes(tmp_path, site):
    world = World(clock=Clock(), nproc=2, faults={0: Fault("teardown", 99)})
    assert supervisor(tmp_path, world, flags={"supervisor.exit_grace_s": 2.0}).run() is ExitStatus.DONE
    [hang] = of(tmp_path, Event.TEARDOWN_HANG)
    assert [(r["node"], r["rank"], r["pid"], r["host_pid"], r["wchan"]) for r in hang["ranks"]] == [
        ("n1", 0, 4000, 9000, "futex_wait_queue"), ("n1", 1, 4001, 9001, "futex_wait_queue")]
    assert hang["nodes"] == ["n1"] and hang["exit_grace_s"] == 2.0 and 2.0 < hang["waited_s"] < 3.0
    kills = [body for _, m, body, _ in world.sent if m is MessageKind.KILL]
    assert kills == [{"grace": 0, "report": True}]   # the agent reports who was left, then kills the tree
    assert of(tmp_path, Event.RUN_COMPLETE)[0]["step"] == 5 and not of(tmp_path, Event.FAILURE_DETECTED)
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.DONE


def _tracker(*, hooked: bool, grace: float = 30.0):
    from ckptsup.supervisor.job.attempt import AttemptTracker

    config = load_config(flags={"supervisor.exit_grace_s": grace}).config.supervisor
    return AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=config, started=0.0, expect_hello=hooked)


def _msg(t: float, m: MessageKind, **body: Any) -> Message:
    return Message.received(recv=t, m=m, body={"node": "n1", **body}, step_id=1)


def test_the_exit_grace_never_cuts_a_rank_still_training():
    """Without hooks: rank 0 exited 0 at t=10, rank 1 prints progress lines until t=50: the grace
    runs from its last line. With hooks: one bye of two starts nothing."""
    tracker = _tracker(hooked=False, grace=60.0)
    for t in range(10):
        for rank in (0, 1):
            tracker.on_message(_msg(float(t), MessageKind.PROGRESS, rank=rank, step=t))
    assert tracker.on_message(_msg(10.0, MessageKind.RANK_EXIT, rank=0, rc=0, detail="")) is None
    for t in range(10, 51):
        tracker.on_message(_msg(float(t), MessageKind.PROGRESS, rank=1, step=t))
    tracker.on_message(_msg(94.0, MessageKind.HB))
    # 45 s without a line is past the 30 s hang timeout: a closing rank gets the stopping allowance instead
    assert tracker.teardown_since == 10.0 and tracker.check(95.0) is None
    assert tracker.teardown_hang(109.0) is None
    hang = tracker.teardown_hang(111.0)
    assert hang is not None and hang.nodes == ("n1",) and hang.waited_s == 101.0
    assert tracker.teardown_done("n1") is None and tracker.complete

    hooked = _tracker(hooked=True, grace=5.0)
    for rank in (0, 1):
        hooked.on_message(_msg(0.0, MessageKind.HELLO, rank=rank))
    hooked.on_message(_msg(1.0, MessageKind.BYE, rank=0, status=0))
    assert hooked.teardown_hang(1000.0) is None   # rank 1 never said bye: it may still be training
    hooked.on_message(_msg(2.0, MessageKind.BYE, rank=1, status=0))
    assert hooked.teardown_hang(6.9) is None and hooked.teardown_hang(7.1) is not None


def test_too_few_healthy_nodes_at_start_requeues_inside_slurm_excluding_them(tmp_path, site, monkeypatch):
    asked: list = []
    def requeue(r):
        asked.append((r.reason, list(r.exclude)))
    slurm = FakeSlurm()
    world = World(clock=Clock())
    sv = supervisor(tmp_path, world, nodes=("n1", "n2"), needed=2, in_slurm=True, slurm=slurm,
                    health=healthy({"n2": "disk full"}), requeue=requeue)
    assert sv.run() is ExitStatus.REQUEUE
    assert world.steps_made == []  # nothing was launched
    assert asked == [("1 healthy node(s), 2 needed", ["n2"])]
    [excluded] = of(tmp_path, Event.NODE_EXCLUDED)
    assert excluded["node"] == "n2" and excluded["reason"] == "health: disk full" and slurm.drained == ["n2"]


def test_too_few_healthy_nodes_at_start_gives_up_outside_slurm(tmp_path, site):
    world = World(clock=Clock())
    assert supervisor(tmp_path, world, health=healthy({"n1": "no GPU"})).run() is ExitStatus.GIVE_UP
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert give_up["reason"] == "0 healthy node(s), 1 needed" and world.steps_made == []


def test_an_unhealthy_node_at_start_is_replaced_by_a_spare(tmp_path, site):
    world = World(clock=Clock())
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm(),
                    health=healthy({"n1": "bad"}))
    assert sv.run() is ExitStatus.DONE
    assert of(tmp_path, Event.LAUNCH)[0]["nodes"] == ["n2", "n3"]


def test_a_silent_node_after_the_kill_is_attributed_node_down_and_a_spare_takes_over(tmp_path, site):
    slurm = FakeSlurm()
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=slurm)
    assert sv.run() is ExitStatus.DONE
    [detected] = of(tmp_path, Event.FAILURE_DETECTED)
    assert detected["kind"] == "crash" and detected["node"] == "n1"
    [attributed] = of(tmp_path, Event.FAILURE_ATTRIBUTED)
    assert (attributed["kind"], attributed["node"], attributed["was_kind"]) == ("node_down", "n2", "crash")
    assert [e["path"] for e in of(tmp_path, Event.LAUNCH)] == ["initial", "node"]
    assert of(tmp_path, Event.LAUNCH)[1]["nodes"] == ["n1", "n3"] and slurm.drained == ["n2"]
    # the first step ran an agent on the spare too: the survivor's and the spare's agents took
    # the new launch, no step was started, and the dead node's agent was let go
    assert len(world.steps_made) == 1
    assert [nodes for _, m, _, nodes in world.sent if m is MessageKind.RESTART] == [["n1", "n3"]]
    assert [nodes for _, m, _, nodes in world.sent if m is MessageKind.EXIT][:1] == [["n2"]]
    state = RunDir(path=tmp_path / "run").load_state()
    assert state.failures[-1]["kind"] == "node_down" and "n2" in state.excluded_nodes
    events = read_events(tmp_path / "run")
    assert [(f["kind"], f["node"]) for f in restart_log.summarize(events).failures] == [("node_down", "n2")]
    assert "it was node_down on n2 (detected as crash)" in restart_log.describe(attributed)
    assert account(events).failures == {"node_down": 1}
    # a step of 3 nodes reports its end without a tree: nothing in Slurm waits for n2, nor does the exit
    assert getattr(slurm, "step_polls", 0) == 0 and not of(tmp_path, Event.AGENT_STEPS_FINISHED)


@pytest.mark.parametrize("keep_it_spare, first, second", [(False, ["n1", "n2"], ["n1", "n3"]),
                                                          (True, ["n2", "n3"], ["n3", "n1"])])
def test_the_batch_host_is_the_last_spare_with_batch_host_spare(tmp_path, site, keep_it_spare, first, second):
    # n1 runs the supervisor; with the knob it trains only once no other spare is left
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm(),
                    flags={"supervisor.batch_host_spare": keep_it_spare})
    assert sv.run() is ExitStatus.DONE
    launches = of(tmp_path, Event.LAUNCH)
    assert [e["nodes"] for e in launches] == [first, second]
    assert launches[0]["spares"] == (["n1"] if keep_it_spare else ["n3"])


def test_a_hang_is_detected_by_the_clock_and_its_suspect_is_health_checked(tmp_path, site):
    calls: list = []
    world = World(clock=Clock(tick=0.25), faults={0: Fault("hang", 2)})
    assert supervisor(tmp_path, world, health=healthy(calls=calls)).run() is ExitStatus.DONE
    [failure] = of(tmp_path, Event.FAILURE_DETECTED)
    assert failure["kind"] == "hang"
    assert calls == [["n1"], ["n1"]]  # start-up, then the hung node
    assert [e["path"] for e in of(tmp_path, Event.LAUNCH)] == ["initial", "fast"]


def test_a_hung_node_that_fails_its_check_is_excluded_and_replaced(tmp_path, site):
    calls: list = []
    state = {"checked": 0}

    def check(nodes):
        calls.append(list(nodes))
        state["checked"] += 1
        bad = "n1" if state["checked"] > 1 else None  # healthy at start, sick after the hang
        return {n: NodeHealth(node=n, error="gpu fell off the bus" if n == bad else "") for n in nodes}

    world = World(clock=Clock(tick=0.25), faults={0: Fault("hang", 2)})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm(),
                    health=check)
    assert sv.run() is ExitStatus.DONE
    [excluded] = of(tmp_path, Event.NODE_EXCLUDED)
    assert excluded["node"] == "n1" and excluded["reason"] == "health: gpu fell off the bus"
    assert of(tmp_path, Event.LAUNCH)[1]["nodes"] == ["n2", "n3"]


def test_preemption_goes_through_decide_stops_the_ranks_and_requeues(tmp_path, site, monkeypatch):
    asked: list = []
    def requeue(r):
        asked.append(r.reason)
    world = World(clock=Clock(), faults={0: Fault("preempt", 3)})
    sv = supervisor(tmp_path, world, nodes=("n1",), in_slurm=True, slurm=FakeSlurm(), requeue=requeue)
    assert sv.run() is ExitStatus.PREEMPTED
    assert [m for _, m, _, _ in world.sent][:2] == [MessageKind.STOP_AT, MessageKind.KILL]
    assert len(asked) == 1 and asked[0].startswith("preemption")
    assert of(tmp_path, Event.PREEMPTION) and RunDir(path=tmp_path / "run").load_state().failures == []


def test_a_stop_signal_to_the_supervisor_is_a_preemption_outside_slurm_too(tmp_path, site):
    world = World(clock=Clock(), faults={0: Fault("hang", 3)})
    sv = supervisor(tmp_path, world)
    original = sv._pump

    def pump():
        if sv.tracker is not None and sv.tracker.last_step == 2:
            sv.stop_signal = signal.SIGUSR1
        return original()

    sv._pump = pump  # type: ignore[method-assign]
    assert sv.run() is ExitStatus.PREEMPTED
    [preemption] = of(tmp_path, Event.PREEMPTION)
    assert preemption["signal"] == "time_limit"
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.STOPPED


def test_a_hangup_to_the_supervisor_stops_it_like_a_preemption(tmp_path, site):
    """A real SIGHUP (a closed terminal, an ssh session that ends) mid-run: a preemption event,
    the ranks told to stop, state `stopped`, exit PREEMPTED — not a dead supervisor leaving the
    run `running`. (The test's own handler catches the signal if the supervisor has none.)"""
    import os

    caught: list[int] = []
    before = signal.signal(signal.SIGHUP, lambda signum, frame: caught.append(signum))
    try:
        world = World(clock=Clock(), faults={0: Fault("hang", 3)})
        sv = supervisor(tmp_path, world)
        original = sv._pump

        def pump():
            if sv.tracker is not None and sv.tracker.last_step == 2 and not caught and sv.stop_signal is None:
                os.kill(os.getpid(), signal.SIGHUP)
                caught.append(0)
            return original()

        sv._pump = pump  # type: ignore[method-assign]
        assert sv.run() is ExitStatus.PREEMPTED
        assert signal.getsignal(signal.SIGHUP) is not sv._on_signal  # put back as it was
    finally:
        signal.signal(signal.SIGHUP, before)
    [preemption] = of(tmp_path, Event.PREEMPTION)
    assert preemption["signal"] == "preemption"
    assert [m for _, m, _, _ in world.sent][:1] == [MessageKind.STOP_AT]
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.STOPPED


def test_dead_agents_turn_the_fast_path_into_the_node_path(tmp_path, site):
    world = World(clock=Clock(), faults={0: Fault("crash", 2)})
    sv = supervisor(tmp_path, world)
    original = world.factory

    def factory(**kw):
        step = original(**kw)
        if len(world.steps_made) == 1:
            step.running_after_kill = False
            send = step.send

            def send_then_die(msg, *, nodes=None):
                ok = send(msg, nodes=nodes)
                if msg.KIND is MessageKind.KILL:
                    step.running = False
                    step.inbox.put(Message.received(recv=world.clock(), m=StepSignal.EOF, body={"rc": 1},
                                           step_id=step.step_id))
                return ok

            step.send = send_then_die  # type: ignore[method-assign]
        return step

    sv.step_factory = factory
    assert sv.run() is ExitStatus.DONE
    assert [e["path"] for e in of(tmp_path, Event.LAUNCH)] == ["initial", "node"]
    assert len(world.steps_made) == 2


def test_the_same_crash_at_the_same_step_gives_up_as_a_user_error(tmp_path, site):
    world = World(clock=Clock(), faults={i: Fault("crash", 3) for i in range(5)})
    assert supervisor(tmp_path, world).run() is ExitStatus.GIVE_UP
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert "user error: crash at step 3 3 times in a row" in give_up["reason"] and give_up["kind"] == "user_error"
    assert [e["kind"] for e in of(tmp_path, Event.FAILURE_ATTRIBUTED)] == ["user_error"] * 3
    assert account(read_events(tmp_path / "run")).failure_count == 0  # none of them is the hardware's
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.GAVE_UP


def test_a_nan_that_follows_the_data_gives_up_at_the_replay_without_draining_anything(tmp_path, site):
    # replay before blame (docs/sdc.md §NaN): the first NaN resumes on the same nodes; the same NaN
    # on the same rank there is the data's: give up, nothing drained (it used to drain n1)
    slurm = FakeSlurm()
    world = World(clock=Clock(), faults={0: Fault("nan", 4, node="n1"), 1: Fault("nan", 4, node="n1"),
                                         2: Fault("nan", 4, node="n1")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3", "n4"), needed=2, in_slurm=True, slurm=slurm)
    assert sv.run() is ExitStatus.GIVE_UP
    assert slurm.drained == []
    assert [e["nodes"] for e in of(tmp_path, Event.LAUNCH)] == [["n1", "n2"], ["n1", "n2"]]
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert "follows the data" in give_up["reason"] and "step 4" in give_up["reason"]
    assert give_up["kind"] == "user_error"


def test_a_nan_that_follows_a_node_excludes_it_after_the_replay(tmp_path, site):
    slurm = FakeSlurm()
    world = World(clock=Clock(), faults={0: Fault("nan", 2, node="n1"), 1: Fault("nan", 4, node="n1")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3", "n4"), needed=2, in_slurm=True, slurm=slurm)
    assert sv.run() is ExitStatus.DONE
    assert slurm.drained == ["n1"]
    assert [e["nodes"] for e in of(tmp_path, Event.LAUNCH)] == [["n1", "n2"], ["n1", "n2"], ["n2", "n3"]]


def test_the_restart_budget_is_honoured(tmp_path, site):
    world = World(clock=Clock(), faults={i: Fault("crash", i + 1) for i in range(5)})
    sv = supervisor(tmp_path, world, flags={"supervisor.max_restarts": 2})
    assert sv.run() is ExitStatus.GIVE_UP
    assert "restart budget spent (2 of supervisor.max_restarts=2)" in of(tmp_path, Event.GIVE_UP)[0]["reason"]


@pytest.mark.parametrize("fault, command, gpus", [
    (Fault("crash", 2), MessageKind.KILL, 0),
    (Fault("hang", 2), MessageKind.DUMP_FR, 1),  # the allocation's GPUs: NCCL keeps a flight recorder
], ids=["kill-wait", "flight-recorder-wait"])
def test_ranks_events_are_forwarded_during_every_wait(tmp_path, site, fault, command, gpus):
    world = World(clock=Clock(tick=0.25), faults={0: fault})
    sv = supervisor(tmp_path, world, gpus=gpus)
    original = world.factory

    def factory(**kw):
        step = original(**kw)
        send = step.send

        def send_and_report(msg, *, nodes=None):
            if msg.KIND is command:
                step.put(MessageKind.EVENT, "n1", record={"event": "checkpoint_committed", "step": 1, "stall_s": 0.5})
                step.put(MessageKind.EVENT, "n1", record={"event": "fr_dumped", "rank": 0, "path": "x"})
                step.put(MessageKind.EVENT, "n1", record={"event": "from_a_newer_ckptsup", "rank": 0})
            return send(msg, nodes=nodes)

        step.send = send_and_report  # type: ignore[method-assign]
        return step

    sv.step_factory = factory
    assert sv.run() is ExitStatus.DONE
    assert [e["step"] for e in of(tmp_path, Event.CHECKPOINT_COMMITTED)] == [1]
    assert len(of(tmp_path, Event.FR_DUMPED)) == 1
    assert "from_a_newer_ckptsup" not in names(tmp_path)  # dropped with a log line, not a crash
    assert RunDir(path=tmp_path / "run").load_state().measured["stall_s"] == 0.5


def test_the_allocation_event_and_the_flight_recorder_follow_the_allocations_gpus_not_the_config(tmp_path, site):
    world = World(clock=Clock(tick=0.25), faults={0: Fault("hang", 2)})
    sent = []
    sv = supervisor(tmp_path, world, in_slurm=True, flags={"sbatch.gpus_per_node": 8}, gpus=0)
    original = world.factory

    def factory(**kw):
        step = original(**kw)
        send = step.send
        step.send = lambda msg, *, nodes=None: (sent.append(msg.KIND), send(msg, nodes=nodes))[1]
        return step

    sv.step_factory = factory
    assert sv.run() is ExitStatus.DONE
    [allocation] = of(tmp_path, Event.ALLOCATION)
    assert allocation["gpus_per_node"] == 0 and allocation["ranks_per_node"] == 1
    assert MessageKind.DUMP_FR not in sent  # gloo on a GPU-less allocation has no flight recorder
    assert MessageKind.KILL in sent


def test_the_allocation_event_reports_the_placements_gpus(tmp_path, site):
    world = World(clock=Clock(), nproc=2)
    assert supervisor(tmp_path, world, gpus=2).run() is ExitStatus.DONE
    [allocation] = of(tmp_path, Event.ALLOCATION)
    assert allocation["gpus_per_node"] == 2 and allocation["ranks_per_node"] == 2


def test_step_times_are_kept_in_state_json_and_set_the_next_allocations_timeouts(tmp_path, site):
    world = World(clock=Clock(), steps=12)
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    kept = RunDir(path=tmp_path / "run").load_state().measured["step_times"]
    assert kept and all(x == 0.01 for x in kept)
    sv = supervisor(tmp_path, World(clock=Clock()))  # the next allocation of the same run
    env = {}
    original = sv._spec

    def spec(nodes, resume_from, timeouts):
        env.update(timeouts=timeouts)
        return original(nodes, resume_from, timeouts)

    sv._spec = spec  # type: ignore[method-assign]
    sv.run()
    timeouts = env["timeouts"]
    assert timeouts.collective_s < timeouts.collective_init_s  # two-phase from the first launch


def test_a_first_launch_gets_its_steady_collective_timeout_once_steps_are_measured(tmp_path, site):
    world = World(clock=Clock(), steps=loop_mod.STEADY_AFTER_STEPS + 5)
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    sent = [body for _, m, body, _ in world.sent if m is MessageKind.SET_TIMEOUT]
    [event] = of(tmp_path, Event.COLLECTIVE_TIMEOUT_SET)
    assert sent == [{"collective_s": event["collective_s"]}]
    assert event["collective_s"] < event["was_s"] and event["steps"] == loop_mod.STEADY_AFTER_STEPS


def test_a_launch_that_knew_its_step_times_sends_no_second_timeout(tmp_path, site):
    world = World(clock=Clock(), steps=loop_mod.STEADY_AFTER_STEPS + 5, faults={0: Fault("crash", 13)})
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    assert len([m for _, m, _, _ in world.sent if m is MessageKind.SET_TIMEOUT]) == 1  # the first launch only


@pytest.mark.parametrize("size", [2, 7])
def test_a_dead_node_without_a_spare_requeues_excluding_it(tmp_path, site, monkeypatch, size):
    asked: list = []
    def requeue(r):
        asked.append((r.reason, list(r.exclude)))
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    slurm = FakeSlurm()
    nodes = tuple(f"n{i}" for i in range(1, size + 1))
    sv = supervisor(tmp_path, world, nodes=nodes, needed=size, in_slurm=True, slurm=slurm, requeue=requeue)
    assert sv.run() is ExitStatus.REQUEUE
    assert asked == [(f"{size - 1} healthy node(s) left, {size} needed", ["n2"])]
    assert RunDir(path=tmp_path / "run").load_state().excluded_nodes == {"n2": "node_down"}
    exits = [i for i, (_, m, _, _) in enumerate(world.sent) if m is MessageKind.EXIT]
    assert exits and all(m is not MessageKind.RESTART for _, m, _, _ in world.sent[exits[-1]:])   # the agents left
    if size < 7:   # no tree: Slurm holds nothing of the step for n2 (step_completion.py)
        assert getattr(slurm, "step_polls", 0) == 0 and not of(tmp_path, Event.AGENT_STEPS_FINISHED)
        return
    # 7 nodes report up a tree that waits a minute for n2: before the requeue Slurm is asked until it
    # lists no agents' step; once, not again at the exit
    [finished] = of(tmp_path, Event.AGENT_STEPS_FINISHED)
    assert finished["lost"] == ["n2"] and finished["finished"] and slurm.step_polls == 1
    assert "Slurm finished the agents' step that lost n2 after" in restart_log.describe(finished)


def test_a_refused_requeue_gives_up_with_slurms_reason(tmp_path, site, monkeypatch):
    from ckptsup.supervisor.job.requeue import RequeueRefused

    def refuse(request):
        raise RequeueRefused("job 77 is not requeueable (--no-requeue); resubmit it")

    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2"), needed=2, in_slurm=True, slurm=FakeSlurm(), requeue=refuse)
    assert sv.run() is ExitStatus.GIVE_UP
    assert of(tmp_path, Event.GIVE_UP)[-1]["reason"] == "job 77 is not requeueable (--no-requeue); resubmit it"
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.GAVE_UP


def test_restarts_without_progress_back_off(tmp_path, site):
    slept: list = []
    world = World(clock=Clock(), faults={0: Fault("crash", 0), 1: Fault("crash", 0, node="n1")})
    sv = supervisor(tmp_path, world, flags={"supervisor.backoff_initial_s": 2.0,
                                            "supervisor.crash_loop_threshold": 5})
    sv.sleep = slept.append
    assert sv.run() is ExitStatus.DONE
    assert slept == [2.0]  # none before the first restart, 2 s before the second in a row
    assert len(of(tmp_path, Event.LAUNCH)) == 3
    assert [e["backoff_s"] for e in of(tmp_path, Event.RESTART_DONE)] == [2.0]  # the first never stepped


def test_an_untrusted_checkpoint_dir_stops_the_run_and_records_why(tmp_path, site):
    from ckptsup.checkpoint.trust import CheckpointDirUntrusted

    world = World(clock=Clock())
    sv = supervisor(tmp_path, world)
    sv.ckpt_dir.mkdir(mode=0o700)
    sv.ckpt_dir.chmod(0o777)
    with pytest.raises(CheckpointDirUntrusted) as err:
        sv.run()
    assert err.value.exit_code == ExitStatus.USAGE and world.steps_made == []
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert give_up["reason"] == str(err.value)
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.GAVE_UP


def test_the_next_allocation_starts_from_the_earlier_ones_failures_and_costs(tmp_path, site):
    flags = {"checkpoint.adaptive_interval": True}
    world = World(clock=Clock(), faults={0: Fault("crash", 2), 1: Fault("preempt", 3)})
    first = supervisor(tmp_path, world, flags=flags)
    original = world.factory

    def factory(**kw):
        step = original(**kw)
        step.put(MessageKind.EVENT, "n1", record={"event": "checkpoint_committed", "step": 1, "stall_s": 2.0,
                                                  "write_s": 3.0})
        return step

    first.step_factory = factory
    assert first.run() is ExitStatus.PREEMPTED
    second = supervisor(tmp_path, World(clock=Clock()), flags=flags)
    second._start()
    try:
        adaptive = second.interval._adaptive
        assert adaptive is not None and adaptive.failures == 1  # the crash; the preemption is no failure
        assert list(adaptive.stalls) == [2.0]
        seeded = second.interval.current_s()
        assert seeded == pytest.approx(adaptive.target()[0], rel=1e-6)  # exposure keeps accruing meanwhile
        assert seeded != second.config.checkpoint.save_every_s  # the seeded interval, not the default
    finally:
        second.lease_stop.set()
        second.writer.close()


def test_the_load_phase_is_split_by_the_sources_files_came_from():
    from ckptsup.supervisor.job.loop import load_by_source

    files = {"memory": 2, "peer_memory": 2, "node_local": 0, "shared": 0, "object": 0}
    assert load_by_source(1.0, files) == {"memory": 0.5, "peer_memory": 0.5}
    assert load_by_source(0.3, {"shared": 3, "object": 1, "bad": "x", 7: 2}) == {"object": 0.075, "shared": 0.225}
    assert load_by_source(None, files) == {} and load_by_source(1.0, {}) == {} and load_by_source(1.0, {"shared": 0}) == {}


@pytest.mark.parametrize(("hello", "expected"), [
    ({"save_every_steps": 20, "save_every_s": 1800.0}, 20),   # attach(save_every_steps=20): only the hello says it
    ({}, None),                                               # a rank that says nothing: the tuner's own bound
], ids=["schedule-in-hello", "no-schedule"])
def test_a_relaunch_keeps_the_memory_schedule_under_the_disk_schedule_the_ranks_said(tmp_path, site, hello, expected):
    import json

    memory_saved = {"event": "memory_saved", "step": 10, "ok": True, "stall_s": 0.05, "write_s": 0.01, "bytes": 1}
    world = World(clock=Clock(), faults={0: Fault("crash", 3)}, hello=hello, events=[memory_saved])
    sv = supervisor(tmp_path, world, flags={"checkpoint.adaptive_interval": True})
    assert sv.run() is ExitStatus.DONE
    changes = [e for e in of(tmp_path, Event.INTERVAL_CHANGED) if e.get("level") == "memory"]
    relaunch = json.loads((tmp_path / "run" / "attempt-1" / "launch.json").read_text())
    every = int(relaunch["env"]["CKPTSUP_MEMORY_EVERY_STEPS"])
    if expected is None:   # Young's at this MTBF is hours: without the ranks' word it runs far past 20 steps
        assert every > 20 and changes
        return
    assert every == expected and changes and all(c["every_steps"] <= expected for c in changes), changes
    assert RunDir(path=tmp_path / "run").load_state().measured["rank_save_every_steps"] == 20   # kept for a requeue
    # the next allocation's first launch, before any hello: seeded from the costs, held to the kept schedule
    second = supervisor(tmp_path, World(clock=Clock()), flags={"checkpoint.adaptive_interval": True})
    second._start()
    try:
        assert second.interval.memory_every_steps() == 20
    finally:
        second.lease_stop.set()
        second.writer.close()


@pytest.mark.parametrize("horizon_s, continued", [(600.0, True), (6 * 3600.0, False)])
def test_a_dead_node_with_min_nodes_continues_on_the_survivors_or_requeues_by_price(
        tmp_path, site, monkeypatch, horizon_s, continued):
    """issue 24 part 3: 3 active nodes, no spare, min_nodes 2 (--nnodes 2:3). 1/3 of a 600 s
    horizon is less than the 900 s queue wait: continue on 2 (world size 2, the node path, no
    requeue); 1/3 of 6 h is more: the requeue of today. Either way the restart log says why."""
    asked: list = []
    def requeue(r):
        asked.append((r.reason, list(r.exclude)))
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n3")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=3, in_slurm=True, slurm=FakeSlurm(),
                    flags={"supervisor.min_nodes": 2, "supervisor.shrink_horizon_s": horizon_s,
                           "supervisor.requeue_wait_s": 900.0}, requeue=requeue)
    status = sv.run()
    [choice] = of(tmp_path, Event.SHRINK_DECIDED)
    assert (choice["survivors"], choice["nodes"], choice["min_nodes"]) == (2, 3, 2)
    assert (choice["horizon_s"], choice["horizon_source"]) == (horizon_s, "configured")
    assert (choice["queue_wait_s"], choice["queue_wait_source"]) == (900.0, "configured")
    assert choice["restart_source"] == "measured" and choice["requeue_restart_source"] == "measured"  # the first launch's start-up
    line = restart_log.describe(choice)
    if continued:
        assert status is ExitStatus.DONE and asked == []
        assert choice["choice"] == "continue" and choice["continue_cost_s"] < choice["requeue_cost_s"]
        launches = of(tmp_path, Event.LAUNCH)
        assert [(e["nodes"], e["path"], e["world_size"]) for e in launches] == [
            (["n1", "n2", "n3"], "initial", 3), (["n1", "n2"], "node", 2)]
        [restart] = [body for _, m, body, _ in world.sent if m is MessageKind.RESTART]
        assert LaunchSpec.from_json(restart["spec"], source="test").nnodes == 2   # torchrun --nnodes 2
        assert line.startswith("continue on fewer nodes (2 of 3 left, min 2): continue on 2 of 3 nodes")
    else:
        assert status is ExitStatus.REQUEUE and choice["choice"] == "requeue"
        [(reason, exclude)] = asked
        assert exclude == ["n3"] and reason.startswith("2 healthy node(s) left, requeue rather than 2 of 3 nodes")
        assert line.startswith("requeue (2 of 3 left, min 2): requeue rather than")
    assert RunDir(path=tmp_path / "run").load_state().excluded_nodes == {"n3": "node_down"}



@pytest.mark.parametrize("slurmd_up", [False, True])
def test_a_silent_node_whose_slurmd_does_not_answer_is_dead_at_once_and_one_that_answers_gets_the_window(
        tmp_path, site, slurmd_up):
    """Issue 38: the node path waited ~2 s for the kill ack of a dead node's agent. Now the nodes
    still silent KILL_ACK_S after the kill have their slurmd asked: one that does not answer is dead
    at once; one that answers (a live node whose agent is slow) keeps the whole ack window."""
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm())
    asked: list[list[str]] = []

    def slurmd_down(nodes, timeout_s):
        asked.append(list(nodes))
        return set() if slurmd_up else set(nodes)

    sv.placement.slurmd_down = slurmd_down   # the probe's seam (slurm/client.py slurmd_answers; real: the dev cluster)
    assert sv.run() is ExitStatus.DONE
    assert asked == [["n2"]]   # only the silent node is asked, once
    [attributed] = of(tmp_path, Event.FAILURE_ATTRIBUTED)
    assert attributed["node"] == "n2" and ("nor its slurmd" in attributed["detail"]) is not slurmd_up
    [done] = of(tmp_path, Event.RESTART_DONE)
    window = min(4.0, max(2.0, 3 * 0.5))   # site: node_silence_s 4, heartbeat 0.5
    assert (done["phases"]["kill_s"] < window / 2) is not slurmd_up, done["phases"]
