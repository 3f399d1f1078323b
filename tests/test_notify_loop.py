"""`[notify]` through the supervisor's loop, in-process (the scripted agent step of
tests/test_supervisor_loop.py): a preemption inside Slurm tells the preemption and the requeue
(whose event requeue_job appends, not the loop), a node drained at start and a crash loop's
give-up reach a real command — and a command that hangs costs the run nothing but its bound."""

from __future__ import annotations

import json
import time

from ckptsup.env import ExitStatus
from ckptsup.events import Event, EventWriter

from test_notify import recorder
from test_supervisor_loop import Clock, FakeSlurm, Fault, World, healthy, of, supervisor


def notify_site(tmp_path, monkeypatch, command: list[str], timeout_s: float = 10.0) -> None:
    path = tmp_path / "site.toml"
    path.write_text("[supervisor]\nhang_min_s = 3.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                    "[checkpoint]\nadaptive_interval = false\n[health]\nenabled = true\n"
                    f"[notify]\ncommand = {json.dumps(command)}\ntimeout_s = {timeout_s}\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(path))


def told(out) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_a_preemption_and_the_requeue_after_it_are_told(tmp_path, monkeypatch):
    prog, out = recorder(tmp_path)
    notify_site(tmp_path, monkeypatch, [str(prog)])

    def requeue(r):   # as requeue_job does: the fenced requeue event is its own, not the loop's
        writer = EventWriter(run_dir=tmp_path / "run", job_id="77", attempt=0, epoch=2)
        writer.emit(Event.REQUEUE, reason=r.reason, by="supervisor", excluded=list(r.exclude))
        writer.close()
    world = World(clock=Clock(), faults={0: Fault("preempt", 3)})
    sv = supervisor(tmp_path, world, nodes=("n1",), in_slurm=True, slurm=FakeSlurm(), requeue=requeue)
    assert sv.run() is ExitStatus.PREEMPTED
    notices = told(out)
    assert [n["notice"] for n in notices] == ["preemption", "requeue"], notices
    assert notices[1]["event"] == of(tmp_path, Event.REQUEUE)[0] and notices[1]["job_id"] == "77"


def test_a_node_drained_at_start_and_a_crash_loops_give_up_are_told(tmp_path, monkeypatch):
    prog, out = recorder(tmp_path)
    notify_site(tmp_path, monkeypatch, [str(prog)])
    world = World(clock=Clock(), faults={i: Fault("crash", 3) for i in range(5)})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2"), in_slurm=True, slurm=FakeSlurm(),
                    health=healthy({"n2": "disk full"}))
    assert sv.run() is ExitStatus.GIVE_UP
    notices = told(out)
    assert [n["notice"] for n in notices] == ["node_drained", "give_up"], notices
    assert notices[0]["event"]["node"] == "n2" and "user error" in notices[1]["event"]["reason"]


def test_a_hanging_command_costs_the_run_only_its_bound(tmp_path, monkeypatch):
    (tmp_path / "slow").mkdir()
    prog, out = recorder(tmp_path / "slow", sleep_s=60)
    notify_site(tmp_path, monkeypatch, [str(prog)], timeout_s=1.0)
    world = World(clock=Clock())
    t0 = time.monotonic()
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    assert time.monotonic() - t0 < 5.0   # the run_complete notice waited 1 s + 1 s at most
    assert of(tmp_path, Event.RUN_COMPLETE) and not out.exists()
