"""Heartbeat-only hooks (ckptsup/hooks/heartbeat.py, docs/heartbeat.md): the hello says
checkpoints=false, every call is a step frame with the time since the previous call, a non-finite
loss is a `nan` frame and exit RANK_NAN, a stop_at ends the rank with RANK_STOPPED at that step
(nothing saved), set_timeout moves the collective timeout, dump_fr is served; the bye at
interpreter exit says DONE or FAILURE, or nothing after a SystemExit whose code atexit cannot see.
Without a rank socket every call is a no-op. attach() and heartbeat() in one process are refused.

In-process against a fake agent, and small real interpreters (no torch: they start in a blink)
for what only an interpreter's exit can show. The 2-rank torchrun runs are in
tests/test_heartbeat_torchrun.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hooks_helpers import PY, ROOT, FakeAgent, base_env, private_dir

import ckptsup
from ckptsup.env import ExitStatus, RankEnv
from ckptsup.errors import CkptsupError, ConfigError
from ckptsup.hooks import heartbeat as heartbeat_mod
from ckptsup.hooks import rank_link
from ckptsup.hooks.heartbeat import Heartbeat, exit_status, returned, torchrun_rank
from ckptsup.hooks.rank_link import Hooks, HooksClaim, HooksMixedError


@pytest.fixture
def agent(tmp_path: Path):
    fake = FakeAgent(private_dir(tmp_path / "agent"))
    yield fake
    fake.close()


@pytest.fixture
def fresh(monkeypatch):
    """The process-wide state of a script that has not called heartbeat() or attach() yet."""
    monkeypatch.setattr(heartbeat_mod, "_beat", heartbeat_mod._UNSTARTED)
    monkeypatch.setattr(rank_link, "_CLAIM", HooksClaim())


@pytest.fixture
def timeouts(monkeypatch):
    """Every collective timeout the link applies (None: the steady value from the environment)."""
    applied: list[float | None] = []
    monkeypatch.setattr(rank_link, "set_steady_timeout", lambda seconds=None: applied.append(seconds))
    return applied


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def beating(agent: FakeAgent, *, rank: int = 1, world_size: int = 2) -> tuple[Heartbeat, Clock]:
    clock = Clock()
    beat = Heartbeat(env=RankEnv.from_environ(agent.env()), rank=rank, world_size=world_size, clock=clock)
    wait_until(lambda: agent.of("hello"))
    return beat, clock


# ---- in-process, against a fake agent -----------------------------------------------------------

def test_the_hello_says_heartbeat_only_and_each_call_is_a_step_frame_with_its_time(agent, timeouts) -> None:
    beat, clock = beating(agent)
    for step, dt in ((0, 0.0), (1, 0.5), (2, 0.25)):
        clock.now += dt
        beat.beat(step, 1.5)
    wait_until(lambda: len(agent.of("step")) == 3)
    [hello] = agent.of("hello")
    assert hello["checkpoints"] is False and hello["rank"] == 1 and hello["world_size"] == 2
    assert hello["pid"] == os.getpid()
    assert agent.of("step") == [{"rank": 1, "step": 0, "step_time_s": None, "loss_finite": True},
                                {"rank": 1, "step": 1, "step_time_s": 0.5, "loss_finite": True},
                                {"rank": 1, "step": 2, "step_time_s": 0.25, "loss_finite": True}]
    assert timeouts == [None]  # the steady collective timeout once, after the first step
    beat.close(ExitStatus.DONE)
    agent.wait_ended(1)
    assert agent.of("bye") == [{"rank": 1, "status": ExitStatus.DONE}]
    assert {m for m, _ in agent.frames} == {"hello", "step", "bye"}  # no phase, no event: nothing saved or loaded


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), "tensor"])
def test_a_non_finite_loss_is_reported_and_the_rank_exits_rank_nan(agent, timeouts, loss) -> None:
    if loss == "tensor":
        torch = pytest.importorskip("torch")
        loss = torch.tensor([float("nan")]).sum()
    beat, _ = beating(agent)
    beat.beat(0, 2.0)
    with pytest.raises(SystemExit) as exit_:
        beat.beat(1, loss)
    assert exit_.value.code == ExitStatus.RANK_NAN
    agent.wait_ended(1)
    [nan] = agent.of("nan")
    assert nan["rank"] == 1 and nan["step"] == 1 and nan["loss"] in ("nan", "inf")
    assert [b["step"] for b in agent.of("step")] == [0]   # the NaN step is no progress
    assert agent.of("bye") == [{"rank": 1, "status": ExitStatus.RANK_NAN}]


def test_stop_at_ends_the_rank_at_that_step_with_rank_stopped(agent, timeouts) -> None:
    beat, _ = beating(agent)
    beat.beat(0)
    agent.send("stop_at", {"step": 2, "reason": "test", "save": True, "budget_s": 60})
    wait_until(lambda: beat.link.channel.commands.stop_at is not None)
    beat.beat(1)
    with pytest.raises(SystemExit) as exit_:
        beat.beat(2)
    assert exit_.value.code == ExitStatus.RANK_STOPPED
    agent.wait_ended(1)
    assert [b["step"] for b in agent.of("step")] == [0, 1, 2]
    assert agent.of("bye") == [{"rank": 1, "status": ExitStatus.RANK_STOPPED}]


def test_the_supervisors_stop_at_without_a_step_stops_at_the_next_call(agent, timeouts) -> None:
    beat, _ = beating(agent)
    beat.beat(0)
    agent.send("stop_at", {"reason": "preemption", "save": True, "budget_s": 20})  # as loop.py sends it
    wait_until(lambda: beat.link.channel.commands.stop_at is not None)
    with pytest.raises(SystemExit) as exit_:
        beat.beat(1)
    assert exit_.value.code == ExitStatus.RANK_STOPPED
    agent.wait_ended(1)
    assert [b["step"] for b in agent.of("step")] == [0, 1]


def test_set_timeout_applies_and_commands_that_need_a_checkpointer_are_ignored(agent, timeouts) -> None:
    beat, _ = beating(agent)
    beat.beat(0)
    agent.send("set_timeout", {"collective_s": 77.0})
    agent.send("save_now", {"reason": "test"})
    agent.send("set_interval", {"interval_s": 5, "save_every_steps": 2})
    wait_until(lambda: beat.link.channel.commands.interval is not None)
    for step in range(1, 5):
        beat.beat(step)
    assert timeouts == [None, 77.0]
    wait_until(lambda: len(agent.of("step")) == 5)
    assert {m for m, _ in agent.frames} == {"hello", "step"}


@pytest.mark.torch
def test_dump_fr_is_served_by_the_channel_thread(agent, tmp_path) -> None:
    pytest.importorskip("torch")
    beat, _ = beating(agent, rank=0, world_size=1)
    beat.beat(0)
    agent.send("dump_fr", {"path": str(tmp_path / "fr")})
    wait_until(lambda: agent.events("fr_dumped"), timeout=30)
    assert (tmp_path / "fr" / "rank_0.json").exists()
    beat.close(None)


# ---- the pure parts --------------------------------------------------------------------------

def test_a_finished_frame_returned_or_was_unwound() -> None:
    def finishes():
        return sys._getframe()

    def raises():
        raise ValueError("x")

    assert returned(finishes())
    try:
        raises()
    except ValueError as err:
        assert not returned(err.__traceback__.tb_next.tb_frame)
    assert not returned(sys._getframe())  # still running


def test_the_bye_at_exit_is_done_failure_or_none() -> None:
    def finishes():
        return sys._getframe()

    done = finishes()
    assert exit_status(done, crashed=False) is ExitStatus.DONE
    assert exit_status(done, crashed=True) is ExitStatus.FAILURE
    assert exit_status(sys._getframe(), crashed=False) is None   # unwound (or not finished): the agent reads the rc
    assert exit_status(None, crashed=False) is None


def test_rank_and_world_size_come_from_torchrun() -> None:
    assert torchrun_rank({}) == (0, 1)
    assert torchrun_rank({"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    for bad in ({"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}):
        with pytest.raises(ConfigError) as err:
            torchrun_rank(bad)
        assert "\n" not in str(err.value) and "torchrun" in str(err.value)


def test_one_kind_of_hooks_per_process() -> None:
    claim = HooksClaim()
    claim.claim(Hooks.HEARTBEAT)
    claim.claim(Hooks.HEARTBEAT)          # every call may claim again
    with pytest.raises(HooksMixedError) as err:
        claim.claim(Hooks.FULL)
    message = str(err.value)
    assert isinstance(err.value, CkptsupError) and "\n" not in message
    assert "ckptsup.attach() after ckptsup.heartbeat()" in message and "docs/heartbeat.md" in message
    other = HooksClaim()
    other.claim(Hooks.FULL)
    with pytest.raises(HooksMixedError, match=r"heartbeat\(\) after ckptsup.attach\(\)"):
        other.claim(Hooks.HEARTBEAT)


# ---- the module-level function -----------------------------------------------------------------

def test_without_a_socket_heartbeat_is_a_no_op_that_reads_the_environment_once(fresh, monkeypatch) -> None:
    monkeypatch.delenv("CKPTSUP_RANK_SOCKET", raising=False)
    ckptsup.heartbeat(0, float("nan"))       # no agent: no NaN check either, never an error
    assert heartbeat_mod._beat is None
    monkeypatch.setattr(RankEnv, "from_environ", lambda *a: pytest.fail("read the environment again"))
    for step in range(1, 100):
        ckptsup.heartbeat(step, 1.0)
    assert ckptsup.heartbeat is heartbeat_mod.heartbeat  # no wrapper around the one check


def test_heartbeat_then_attach_is_refused_with_one_line(fresh, monkeypatch) -> None:
    monkeypatch.delenv("CKPTSUP_RANK_SOCKET", raising=False)
    ckptsup.heartbeat(0, 1.0)
    with pytest.raises(HooksMixedError, match="use one of them"):
        ckptsup.attach(model=None)


def test_attach_then_heartbeat_is_refused_every_call(fresh, monkeypatch) -> None:
    rank_link.claim_hooks(Hooks.FULL)     # what attach() does first
    for step in range(2):
        with pytest.raises(HooksMixedError):
            ckptsup.heartbeat(step, 1.0)


def test_import_ckptsup_reaches_the_hooks_only_on_first_use() -> None:
    code = ("import sys, ckptsup; before = [m for m in sys.modules if m.startswith('ckptsup.hooks')]; "
            "from ckptsup import heartbeat; import ckptsup.hooks.heartbeat as h; "
            "print(before, heartbeat is h.heartbeat, 'torch' in sys.modules)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == ["[]", "True", "False"]


# ---- real interpreters: what the bye at exit says ---------------------------------------------

SCRIPT = """
import os, sys
import ckptsup
for step in range(3):
    ckptsup.heartbeat(step, 0.5)
print("torch imported:", "torch" in sys.modules)
"""

FORK = """
pid = os.fork()
if pid:
    os.waitpid(pid, 0)
    ckptsup.heartbeat(3, 0.5)
# the child runs on to the end of the script: its interpreter exit runs the atexit hook too
"""


def run_script(agent: FakeAgent, tmp_path: Path, end: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT + textwrap.dedent(end))
    env = base_env({**agent.env(), "PYTHONPATH": str(ROOT)})
    done = subprocess.run([PY, str(script)], env=env, capture_output=True, text=True, timeout=60)
    agent.wait_ended(1)
    return done


@pytest.mark.parametrize("end, rc, bye", [
    ("", 0, [ExitStatus.DONE]),                               # the script ran to its end
    ("raise RuntimeError('boom')", 1, [ExitStatus.FAILURE]),  # an uncaught exception
    ("sys.exit(3)", 3, []),                                   # a SystemExit: its code is not visible at exit,
    ("sys.exit(0)", 0, []),                                   # so no bye: the agent reads the real status
    (FORK, 0, [ExitStatus.DONE]),                             # a forked child's exit is not the rank's
])
def test_the_bye_at_interpreter_exit(agent, tmp_path, end, rc, bye) -> None:
    done = run_script(agent, tmp_path, end)
    assert done.returncode == rc, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout
    assert [b["status"] for b in agent.of("bye")] == bye
    [hello] = agent.of("hello")
    assert hello["checkpoints"] is False and hello["rank"] == 0 and hello["world_size"] == 1
    steps = [b["step"] for b in agent.of("step")]
    assert steps == ([0, 1, 2, 3] if end is FORK else [0, 1, 2])


def test_without_an_agent_the_script_runs_silently(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT + "ckptsup.heartbeat(3, float('nan'))\n")
    done = subprocess.run([PY, str(script)], env=base_env({"PYTHONPATH": str(ROOT)}), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "torch imported: False\n"
