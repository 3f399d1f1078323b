"""Operator requests through the run directory (supervisor/job/control.py): what the supervisor takes
and refuses, and the loop in-process (the scripted agents of test_supervisor_loop): save-now is
sent to the ranks and acknowledged; stop checkpoints, stops, ends CANCELLED and is never requeued;
a script without ckptsup checkpoints is told why save-now cannot work."""
from __future__ import annotations

import json
import os

from ckptsup.env import ExitStatus, should_requeue
from ckptsup.events import Event, read_events
from ckptsup.rundir import RunDir, RunStatus
from ckptsup.slurm.render import no_requeue_statuses
from ckptsup.supervisor.job import control
from ckptsup.supervisor.job.control import BadRequest, ControlCommand, ControlRequest
from ckptsup.wire import MessageKind

from test_supervisor_loop import Clock, FakeSlurm, Fault, World, fast_ticks, of, site, supervisor  # noqa: F401


def test_a_request_is_taken_once_and_removed(tmp_path):
    request = control.submit(tmp_path, ControlCommand.STOP, save=False)
    assert oct(os.stat(tmp_path / "control").st_mode & 0o777) == "0o700"
    assert oct(os.stat(tmp_path / "control" / f"{request.id}.json").st_mode & 0o777) == "0o600"
    seen: set[str] = set()
    [got] = control.take(tmp_path, seen)
    assert got == ControlRequest(id=request.id, command=ControlCommand.STOP, save=False, requested=request.requested)
    assert control.take(tmp_path, seen) == [] and not list((tmp_path / "control").iterdir())


def test_bad_requests_are_refused_one_line_each_and_answered_once(tmp_path):
    directory = tmp_path / "control"
    directory.mkdir(mode=0o700)
    (directory / "a.json").write_text(json.dumps({"id": "a", "command": "reboot"}))
    (directory / "b.json").write_text(json.dumps({"id": "other", "command": "stop"}))
    (directory / "c.json").write_text("[" * 100_000)
    (directory / "d.json").write_text(json.dumps({"id": "d", "command": "stop", "save": "yes"}))
    (directory / "e.json").write_text(json.dumps({"id": "e", "command": "stop", "pad": "x" * 5000}))
    (directory / "f.json").mkdir()
    (directory / "g.json").write_text(json.dumps({"id": "g", "command": "save_now"}))
    os.chown(directory / "g.json", 4242, 4242)   # not the job's user
    seen: set[str] = set()
    got = {r.id: r for r in control.take(tmp_path, seen)}
    assert all(isinstance(r, BadRequest) for r in got.values()) and set(got) == set("abcdefg")
    assert "unknown command 'reboot'" in got["a"].why and "does not match" in got["b"].why
    assert "`save` must be true or false" in got["d"].why and "uid 4242" in got["g"].why
    assert all(len(r.why) <= 200 and "\n" not in r.why for r in got.values())
    assert control.take(tmp_path, seen) == []   # the directory f.json stays, answered once


def test_cancelled_is_a_finished_status_the_template_never_requeues():
    assert not should_requeue(int(ExitStatus.CANCELLED))
    assert "8" in no_requeue_statuses().split("|")
    from ckptsup.rundir import FINISHED

    assert RunStatus.CANCELLED in FINISHED


def test_save_now_reaches_the_ranks_and_is_acknowledged_with_the_step(tmp_path, site):
    world = World(clock=Clock(), steps=6)
    sv = supervisor(tmp_path, world)
    request = control.submit(sv.run_dir.path, ControlCommand.SAVE_NOW)
    assert sv.run() is ExitStatus.DONE
    [ack] = of(tmp_path, Event.CONTROL)
    assert (ack["request"], ack["command"], ack["outcome"]) == (request.id, "save_now", "accepted")
    saves = [(body, nodes) for _, m, body, nodes in world.sent if m is MessageKind.SAVE_NOW]
    assert saves == [({"reason": f"operator request {request.id}"}, None)]   # every agent of the step: n1
    assert isinstance(ack["step"], int)


def test_stop_saves_stops_and_ends_cancelled_without_a_requeue(tmp_path, site, monkeypatch):
    asked: list = []
    world = World(clock=Clock(), steps=50)
    sv = supervisor(tmp_path, world, in_slurm=True, requeue=asked.append)
    request = control.submit(sv.run_dir.path, ControlCommand.STOP)
    assert sv.run() is ExitStatus.CANCELLED
    [stop] = [body for _, m, body, _ in world.sent if m is MessageKind.STOP_AT]
    assert stop["save"] is True and stop["reason"] == "cancelled"
    [done] = of(tmp_path, Event.RUN_CANCELLED)
    assert done["request"] == request.id and done["saved"] is True
    assert RunDir(path=tmp_path / "run").load_state().status is RunStatus.CANCELLED
    assert asked == [] and not of(tmp_path, Event.REQUEUE) and not of(tmp_path, Event.RUN_COMPLETE)


def test_stop_no_save_asks_for_no_checkpoint_and_a_second_stop_is_refused(tmp_path, site):
    world = World(clock=Clock(), steps=50)
    sv = supervisor(tmp_path, world)
    control.submit(sv.run_dir.path, ControlCommand.STOP, save=False)
    control.submit(sv.run_dir.path, ControlCommand.STOP)
    assert sv.run() is ExitStatus.CANCELLED
    assert [b["save"] for _, m, b, _ in world.sent if m is MessageKind.STOP_AT] == [False]
    assert [a["outcome"] for a in of(tmp_path, Event.CONTROL)] == ["accepted", "refused"]


def test_save_now_to_a_script_without_ckptsup_checkpoints_is_refused_with_why(tmp_path, site):
    from test_supervisor_unhooked import UnhookedWorld

    world = UnhookedWorld(clock=Clock(), steps=8)
    sv = supervisor(tmp_path, world, flags={"supervisor.init_timeout_s": 0.5})
    sv.job.expects_hello = False
    control.submit(sv.run_dir.path, ControlCommand.SAVE_NOW)
    assert sv.run() is ExitStatus.DONE
    [ack] = of(tmp_path, Event.CONTROL)
    assert ack["outcome"] == "refused" and "do not keep ckptsup checkpoints" in ack["detail"]
    assert not [m for _, m, _, _ in world.sent if m is MessageKind.SAVE_NOW]


def test_a_run_without_a_live_supervisor_gets_one_line_and_no_request(tmp_path):
    import subprocess
    import sys

    run = RunDir.create(tmp_path / "run")
    state = run.load_state()
    state.status = RunStatus.RUNNING
    run.save_state(state)   # "running", but nobody renews the lease: the supervisor died
    done = subprocess.run([sys.executable, "-m", "ckptsup.cli", "stop", str(run.path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "has no live supervisor (no lease" in line and "is the job running?" in line
    assert not (run.path / "control").exists()


class SavingStep:
    """A FakeStep whose ranks commit checkpoints when asked to save now (the hooks' answer): by
    default a save of step 4 that began before they heard (the slowest rank's position when the
    request was taken: its write ran in the background), then the one asked for, of step 5."""

    @staticmethod
    def wrap(world: World, steps: tuple[int, ...] = (4, 5)):
        original = world.factory

        def factory(**kw):
            step = original(**kw)
            send = step.send

            def send_and_save(msg, *, nodes=None):
                for saved in steps if msg.KIND is MessageKind.SAVE_NOW else ():
                    step.put(MessageKind.EVENT, step.active[0], record={"event": "checkpoint_committed",
                                                                       "step": saved, "stall_s": 0.1})
                return send(msg, nodes=nodes)

            step.send = send_and_save  # type: ignore[method-assign]
            return step

        return factory


def test_replace_checkpoints_then_moves_the_nodes_ranks_to_the_spare_and_drains_it(tmp_path, site):
    slurm = FakeSlurm()
    world = World(clock=Clock(), faults={0: Fault("hang", 4)})   # still running when the request is read
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=slurm)
    sv.step_factory = SavingStep.wrap(world)
    request = control.submit(sv.run_dir.path, ControlCommand.REPLACE, node="n2")
    assert sv.run() is ExitStatus.DONE
    [ack] = of(tmp_path, Event.CONTROL)
    assert ack["outcome"] == "accepted" and ack["request"] == request.id and "n3" in ack["detail"]
    [detected] = of(tmp_path, Event.FAILURE_DETECTED)
    assert detected["kind"] == "replaced" and detected["node"] == "n2"
    order = [(e["event"], e.get("step")) for e in read_events(tmp_path / "run")
             if e["event"] in ("checkpoint_committed", "failure_detected")]
    assert order == [("checkpoint_committed", 4), ("checkpoint_committed", 5), ("failure_detected", 4)]
    [relaunch] = [e for e in of(tmp_path, Event.LAUNCH) if e["path"] == "node"]
    assert relaunch["nodes"] == ["n1", "n3"]
    assert [e["node"] for e in of(tmp_path, Event.NODE_EXCLUDED)] == ["n2"] and slurm.drained == ["n2"]
    state = RunDir(path=tmp_path / "run").load_state()
    assert state.restarts == 0 and "replaced" in state.excluded_nodes["n2"]   # no restart budget spent


def test_a_replace_waits_for_a_checkpoint_newer_than_where_the_ranks_were_when_it_was_asked(tmp_path, site):
    world = World(clock=Clock(), faults={0: Fault("hang", 4)})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm())
    sv.step_factory = SavingStep.wrap(world, steps=(4,))   # only the save that was already under way
    control.submit(sv.run_dir.path, ControlCommand.REPLACE, node="n2")
    sv.run()
    [ack] = of(tmp_path, Event.CONTROL)
    assert ack["outcome"] == "accepted" and ack["step"] == 4
    assert [e["kind"] for e in of(tmp_path, Event.FAILURE_DETECTED)] == ["hang"]   # never "replaced"


def test_replace_of_a_node_not_active_or_without_a_spare_is_refused(tmp_path, site):
    world = World(clock=Clock(), faults={0: Fault("hang", 4)})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2"), needed=2, in_slurm=True, slurm=FakeSlurm())
    control.submit(sv.run_dir.path, ControlCommand.REPLACE, node="n9")
    control.submit(sv.run_dir.path, ControlCommand.REPLACE, node="n2")
    sv.run()
    details = [a["detail"] for a in of(tmp_path, Event.CONTROL)]
    assert [a["outcome"] for a in of(tmp_path, Event.CONTROL)] == ["refused", "refused"]
    assert any("n9 is not an active node" in d for d in details)
    assert any("no spare node to move n2's ranks to" in d for d in details)
