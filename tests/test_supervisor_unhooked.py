"""The supervisor loop in-process with scripts that never say hello (docs/drop-in.md): scripted
agents that report only processes and, optionally, progress lines. The real tier is
test_drop_in_local.py and test_drop_in_slurm.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptsup.env import ExitStatus
from ckptsup.events import Event
from ckptsup.rundir import RunDir
from ckptsup.supervisor.job.attempt import AttemptTracker
from ckptsup.supervisor.job.observations import SupervisionLevel
from ckptsup.supervisor.job.unhooked import uses_hooks
from ckptsup.wire import MessageKind

from test_supervisor_loop import Clock, Fault, FakeStep, World, fast_ticks, of, site, supervisor  # noqa: F401


@dataclass
class UnhookedWorld(World):
    lines: bool = True          # rank 0 prints progress lines
    idle_reads: int = 0         # clock reads to let pass before the first line (past the init allowance)
    saves_in: Any = None        # a directory the script writes a file into at each start

    def factory(self, *, nodes, inbox, **_: Any) -> "UnhookedStep":  # one node, local mode
        self.steps_made.append(len(self.steps_made))
        step = UnhookedStep(world=self, nodes=tuple(nodes), inbox=inbox, step_id=100 + len(self.steps_made))
        step.play(tuple(nodes))
        return step


class UnhookedStep(FakeStep):
    def play(self, launch: tuple[str, ...]) -> None:
        world = self.world
        fault = world.faults.get(world.launches)
        world.launches += 1
        node = self.nodes[0]
        if world.saves_in is not None:
            (world.saves_in / f"step_{world.launches}.pt").write_text("x")
        self.put(MessageKind.HB, node)
        for _ in range(world.idle_reads):
            world.clock()
        self.put(MessageKind.HB, node)
        for step in range(1, world.steps + 1):
            if fault is not None and step == fault.step:
                if fault.kind == "crash":
                    self.put(MessageKind.TORCHRUN_EXIT, node, rc=1, step=None)
                elif fault.kind == "preempt":
                    self.put(MessageKind.PREEMPT, node, signal=15, budget_s=0)
                return  # hang: nothing more is said
            if world.lines:
                self.put(MessageKind.PROGRESS, node, rank=0, step=step)
        if fault is not None and fault.kind == "exit0":
            return  # torchrun exits 0 only when the stop reaches the ranks (send below)
        self.put(MessageKind.TORCHRUN_EXIT, node, rc=0, step=None)

    def send(self, msg, *, nodes=None) -> bool:
        m = msg.KIND
        if m is MessageKind.STOP_AT and self.running:
            self.world.sent.append((self.step_id, m, msg.to_body(), nodes))
            self.put(MessageKind.TORCHRUN_EXIT, self.nodes[0], rc=0, step=None, stopped=True)
            return True
        return super().send(msg, nodes=nodes)


def test_a_script_that_never_says_hello_is_not_killed_and_its_lines_are_its_steps(tmp_path, site):
    world = UnhookedWorld(clock=Clock(), steps=8, idle_reads=200)   # 10 s of silence first
    sv = supervisor(tmp_path, world, flags={"supervisor.init_timeout_s": 2.0})
    sv.job.expects_hello = False
    assert sv.run() is ExitStatus.DONE
    assert not of(tmp_path, Event.FAILURE_DETECTED)
    assert [e["level"] for e in of(tmp_path, Event.SUPERVISION_LEVEL)] == ["progress"]
    assert of(tmp_path, Event.FIRST_STEP)[0]["step"] == 1 and of(tmp_path, Event.RUN_COMPLETE)[0]["step"] == 8


def test_a_hooked_script_that_never_says_hello_is_still_a_hang(tmp_path, site):
    world = UnhookedWorld(clock=Clock(), steps=8, idle_reads=200, lines=False,
                          faults={i: Fault("hang", 1) for i in range(5)})
    sv = supervisor(tmp_path, world, flags={"supervisor.init_timeout_s": 2.0, "supervisor.max_restarts": 1})
    assert sv.job.expects_hello
    assert sv.run() is ExitStatus.GIVE_UP
    [first, *_] = of(tmp_path, Event.FAILURE_DETECTED)
    assert first["kind"] == "hang" and "ranks started within supervisor.init_timeout_s=2s" in first["detail"]


def test_crashes_at_different_seen_steps_are_no_crash_loop_and_never_step_0(tmp_path, site):
    world = UnhookedWorld(clock=Clock(), steps=8, faults={0: Fault("crash", 3), 1: Fault("crash", 5),
                                                          2: Fault("crash", 7)})
    sv = supervisor(tmp_path, world)
    sv.job.expects_hello = False
    assert sv.run() is ExitStatus.DONE
    assert [f["step"] for f in of(tmp_path, Event.FAILURE_DETECTED)] == [3, 5, 7]   # last line's step + 1
    assert not of(tmp_path, Event.GIVE_UP)
    levels = [f.get("level") for f in RunDir(path=tmp_path / "run").load_state().failures]
    assert levels == ["progress"] * 3


def test_crashes_without_any_step_have_no_step_and_give_up_only_for_no_progress(tmp_path, site):
    world = UnhookedWorld(clock=Clock(), steps=8, lines=False, faults={i: Fault("crash", 2) for i in range(5)})
    sv = supervisor(tmp_path, world)
    sv.job.expects_hello = False
    assert sv.run() is ExitStatus.GIVE_UP
    failures = of(tmp_path, Event.FAILURE_DETECTED)
    assert len(failures) == 3 and all(f["step"] is None for f in failures)
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert "no progress across 3 attempts" in give_up["reason"] and "at step" not in give_up["reason"]


def test_a_newer_file_in_progress_dir_is_progress(tmp_path, site):
    (tmp_path / "own-ckpt").mkdir()
    world = UnhookedWorld(clock=Clock(), steps=8, lines=False, faults={i: Fault("crash", 2) for i in range(4)},
                          saves_in=tmp_path / "own-ckpt")
    sv = supervisor(tmp_path, world, flags={"supervisor.progress_dir": "own-ckpt", "supervisor.max_restarts": 3})
    sv.job.expects_hello = False
    assert sv.run() is ExitStatus.GIVE_UP
    assert "restart budget spent" in of(tmp_path, Event.GIVE_UP)[0]["reason"]   # not "no progress"
    assert all(f.get("progress") is True for f in RunDir(path=tmp_path / "run").load_state().failures)


def test_exit_0_after_a_stop_reached_the_ranks_is_a_preemption_not_done(tmp_path, site):
    world = UnhookedWorld(clock=Clock(), steps=8, faults={0: Fault("exit0", 99)})
    sv = supervisor(tmp_path, world)
    sv.job.expects_hello = False
    original = sv._pump

    def pump():
        if sv.tracker is not None and sv.tracker.last_step == 8 and sv.stop_signal is None:
            sv.stop_signal = 15
        return original()

    sv._pump = pump  # type: ignore[method-assign]
    assert sv.run() is ExitStatus.PREEMPTED
    assert not of(tmp_path, Event.RUN_COMPLETE) and of(tmp_path, Event.PREEMPTION)


def tracker(**kw) -> AttemptTracker:
    from ckptsup.config import SupervisorConfig
    from ckptsup.supervisor.job.agent_step import Message

    t = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=SupervisorConfig(), started=0.0, **kw)
    t.msg = lambda m, at=1.0, **body: t.on_message(Message.received(recv=at, m=m, body={"node": "n1", **body}, step_id=1))
    return t


def test_exit_0_of_a_hooked_rank_that_said_it_stopped_is_a_preemption():
    t = tracker()
    for rank in (0, 1):
        t.msg(MessageKind.HELLO, rank=rank)
    t.msg(MessageKind.BYE, rank=0, status=int(ExitStatus.DONE))
    t.msg(MessageKind.BYE, rank=1, status=int(ExitStatus.RANK_STOPPED))
    failure = t.msg(MessageKind.TORCHRUN_EXIT, rc=0)
    assert failure is not None and failure.kind.value == "preempted" and not t.complete or t.preempted


def test_exit_0_of_a_hooked_rank_that_said_it_failed_is_a_crash():
    t = tracker()
    for rank in (0, 1):
        t.msg(MessageKind.HELLO, rank=rank)
        t.msg(MessageKind.BYE, rank=rank, status=int(ExitStatus.FAILURE) if rank else int(ExitStatus.DONE))
    failure = t.msg(MessageKind.TORCHRUN_EXIT, rc=0)
    assert failure is not None and failure.kind.value == "crash" and failure.rank == 1 and not t.complete


def test_progress_lines_of_hooked_ranks_are_ignored_and_heartbeat_only_ranks_set_the_level():
    t = tracker()
    t.msg(MessageKind.HELLO, rank=0, checkpoints=False)
    t.msg(MessageKind.HELLO, rank=1, checkpoints=False)
    t.msg(MessageKind.PROGRESS, rank=0, step=50)
    assert t.ranks[0].last_step is None and t.level is SupervisionLevel.HEARTBEAT
    t.msg(MessageKind.HELLO, rank=2)
    assert t.level is SupervisionLevel.HOOKS


def test_no_hello_past_the_init_allowance_is_the_process_level_not_a_hang():
    t = tracker(expect_hello=False)
    late = t.config.init_timeout_s + 1
    t.msg(MessageKind.HB, at=late)   # the agent talks: processes run
    assert t.check(now=late) is None and t.level is SupervisionLevel.PROCESS
    assert t.current_step() is None   # no "step 0" for a script that reported none
    assert t.progress_stale(now=t.config.progress_warn_s + 1, warn_s=t.config.progress_warn_s) is not None
    t.msg(MessageKind.PROGRESS, at=400.0, rank=0, step=7)
    assert t.level is SupervisionLevel.PROGRESS and t.current_step() == 8


def test_a_stopped_rank_that_prints_nothing_is_blamed_for_the_hang():
    from ckptsup.config import SupervisorConfig

    t = tracker(expect_hello=False)
    t.config = SupervisorConfig(hang_min_s=5.0, hang_timeout_s=5.0)
    t.msg(MessageKind.PROGRESS, at=1.0, rank=0, step=1)
    t.msg(MessageKind.HB, at=2.0, stopped_ranks=[1])
    hang = t.check(now=9.0)
    assert hang is not None and hang.kind.value == "hang" and hang.rank == 1 and "process stopped" in hang.detail


def test_the_unmodified_script_helpers_never_name_the_supervisor():
    """A script that mentions ckptsup anywhere in its source, a comment included, is expected to
    say hello (unhooked.uses_hooks): a helper standing for an unmodified script that did would be
    supervised as a hooked one and its hangs missed (seen: a docstring that named it)."""
    helpers = Path(__file__).resolve().parent / "helpers"
    assert not uses_hooks(str(helpers / "plain_ddp.py")) and not uses_hooks(str(helpers / "titan_train.py"))
    assert uses_hooks(str(helpers / "heartbeat_train.py"))


def test_a_script_uses_the_hooks_when_it_imports_ckptsup_not_when_it_names_it(tmp_path):
    cases = {
        "# launched by ckptsup launch; see the ckptsup docs\nimport torch\n": False,
        'print("ckptsup")\nx = "import ckptsup"\n': False,
        "import ckptsup\n": True,
        "import os, ckptsup as c\n": True,
        "from ckptsup.integrations.hf import CkptsupCallback\n": True,
        "def main():\n    from ckptsup import attach\n": True,
        'mod = importlib.import_module("ckptsup")\n': True,
        "import ckptsupport\n": False,
    }
    for i, (source, expected) in enumerate(cases.items()):
        script = tmp_path / f"s{i}.py"
        script.write_text(source)
        assert uses_hooks(str(script)) is expected, source
    assert uses_hooks(str(script), module=True) is False and uses_hooks(str(tmp_path / "none.py")) is False
