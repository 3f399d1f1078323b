"""The rank → agent channel against a real Unix socket standing in for the agent (same frames,
same HMAC): heartbeats and events go up; save_now, stop_at and dump_fr come down; a NaN is
reported and ends the rank with RANK_NAN. Forged and replayed commands are dropped."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest

from hooks_helpers import FakeAgent, base_env, private_dir, train_argv

from ckptsup import messages, wire
from ckptsup.env import ExitStatus
from ckptsup.hooks.agent_socket import RankChannel

pytestmark = pytest.mark.torch


@pytest.fixture
def agent(tmp_path: Path):
    fake = FakeAgent(private_dir(tmp_path / "agent"))
    yield fake
    fake.close()


def start(agent: FakeAgent, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = train_argv(1, ["--steps", "200", "--step-sleep-s", "0.05", "--save-every-steps", "1000",
                          "--checkpoint-dir", str(private_dir(tmp_path / "run") / "ck"), *args])
    return subprocess.Popen(argv, env=base_env({**agent.env(), **(env or {})}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_the_memory_schedule_starts_from_the_launch_and_follows_set_interval(agent: FakeAgent, tmp_path: Path) -> None:
    """What the supervisor's adaptive memory interval does (interval_tuner.py): the launch's
    CKPTSUP_MEMORY_EVERY_STEPS wins over [memory] every_steps, and a set_interval with
    memory_every_steps moves a real rank's memory saves."""
    from ckptsup.supervisor.node.memory_store import MemoryServer, MemoryStore, unix_listener

    site = tmp_path / "site.toml"
    site.write_text("[checkpoint]\nkeep_daily_days = 0\ntest_load_every = 0\n[memory]\nenabled = true\nevery_steps = 10\n")
    sock = private_dir(tmp_path / "mem") / "memory.sock"
    server = MemoryServer(unix_listener(sock), secret=agent.secret, store=MemoryStore(keep=2)).start()
    proc = start(agent, tmp_path, env={"CKPTSUP_SITE_CONFIG": str(site), "CKPTSUP_MEMORY_SOCKET": str(sock),
                                       "CKPTSUP_MEMORY_EVERY_STEPS": "4"})
    saved = lambda: [e["step"] for e in agent.events("memory_saved") if e["ok"]]  # noqa: E731
    try:
        agent.wait_for(lambda: len(saved()) >= 2, proc)
        before = saved()
        agent.send("set_interval", {"memory_every_steps": 3})
        agent.wait_for(lambda: [s for s in saved() if s % 3 == 0 and s % 4 and s > before[-1]][1:], proc)
    finally:
        proc.kill()
        proc.wait()
        server.close()
    steps = saved()
    assert all(s % 4 == 0 for s in before), before                   # the launch's schedule, not every_steps = 10
    changed = next(i for i, s in enumerate(steps) if s % 4)
    assert all(s % 4 == 0 for s in steps[:changed]) and all(s % 3 == 0 for s in steps[changed:]), steps


def test_heartbeats_events_save_now_and_stop_at_travel_over_the_channel(agent: FakeAgent, tmp_path: Path) -> None:
    proc = start(agent, tmp_path)
    try:
        agent.wait_for(lambda: agent.last_step() >= 3, proc)
        hello = agent.of("hello")[0]
        assert hello["rank"] == 0 and hello["pid"] == proc.pid and hello["world_size"] == 1
        assert [b["phase"] for b in agent.of("phase")][:3] == ["init", "load", "train"]
        assert agent.events("first_step")[0]["job_id"] == "4242"
        agent.send("save_now", {"reason": "test"})
        agent.wait_for(lambda: agent.events("checkpoint_committed"), proc)
        saved = agent.events("checkpoint_committed")[0]
        assert saved["attempt"] == 1 and saved["bytes"] > 0 and saved["step"] % 1000 != 0
        stop_step = agent.last_step() + 3
        agent.send("stop_at", {"step": stop_step, "reason": "test", "save": True, "budget_s": 60})
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == ExitStatus.RANK_STOPPED, proc.stderr.read()[-2000:]
    assert agent.last_step() == stop_step
    committed = [e["step"] for e in agent.events("checkpoint_committed")]
    assert committed[-1] == stop_step + 1  # the emergency save holds the state after the stop step
    assert agent.of("bye")[-1]["status"] == ExitStatus.RANK_STOPPED
    steps = [b["step"] for b in agent.of("step")]
    assert steps == sorted(steps) and all(b["loss_finite"] for b in agent.of("step"))


def test_a_nan_is_reported_up_and_ends_the_rank_with_rank_nan(agent: FakeAgent, tmp_path: Path) -> None:
    proc = start(agent, tmp_path, "--nan-at-step", "4")
    rc = proc.wait(timeout=60)
    assert rc == ExitStatus.RANK_NAN, proc.stderr.read()[-2000:]
    nan = agent.of("nan")
    assert nan and nan[0]["rank"] == 0 and nan[0]["step"] == 4 and nan[0]["loss"] == "nan"
    assert agent.of("bye")[-1]["status"] == ExitStatus.RANK_NAN


def test_dump_fr_is_served_while_the_main_thread_is_stuck(agent: FakeAgent, tmp_path: Path) -> None:
    proc = start(agent, tmp_path, "--hang-at-step", "2")
    try:
        agent.wait_for(lambda: agent.last_step() >= 0, proc)
        time.sleep(1.0)  # the main thread is now asleep inside step 2 (steps take ~60 ms)
        dump_dir = tmp_path / "fr"
        agent.send("dump_fr", {"path": str(dump_dir)})
        agent.wait_for(lambda: any(b["record"]["event"] == "fr_dumped" for b in agent.of("event")), proc, timeout=20)
        assert (dump_dir / "rank_0.json").exists()
        assert agent.last_step() <= 1
    finally:
        proc.kill()
        proc.wait()


def test_forged_and_replayed_commands_are_dropped(tmp_path) -> None:
    secret = secrets.token_hex(32).encode()  # a ckptsup secret: 64 hex characters (rundir.read_secret)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    channel = RankChannel(socket_path=None, secret_file=str(secret_file), rank=0)
    good = wire.encode("save_now", {"reason": "a"}, seq=5, secret=secret)
    channel.handle_frame(wire.encode("save_now", {"reason": "forged"}, seq=9, secret=b"wrong"))
    assert channel.commands.take_save_now() is None and channel.dropped == 1
    channel.handle_frame(good)
    assert channel.commands.take_save_now() == "a"
    channel.handle_frame(good)  # replayed
    assert channel.commands.take_save_now() is None and channel.dropped == 2


def test_a_command_with_a_mistyped_body_is_dropped_and_counted_and_intervals_merge(tmp_path) -> None:
    """The rank's command reader types each body (messages.py): a bad one is dropped like a forged one."""
    secret = secrets.token_hex(32).encode()
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    channel = RankChannel(socket_path=None, secret_file=str(secret_file), rank=0)
    channel.handle_frame(wire.encode("set_interval", {"interval_s": "soon"}, seq=1, secret=secret))
    channel.handle_frame(wire.encode("stop_at", {"reason": "x", "save": "yes"}, seq=2, secret=secret))
    assert channel.dropped == 2 and channel.commands.interval is None and channel.commands.stop_at is None
    channel.handle_frame(wire.encode("set_interval", {"interval_s": 60}, seq=3, secret=secret))
    channel.handle_frame(wire.encode("set_interval", {"memory_every_steps": 4}, seq=4, secret=secret))
    channel.handle_frame(wire.encode("stop_at", {"reason": "x", "save": False, "budget_s": 5}, seq=5, secret=secret))
    assert channel.commands.take_interval() == messages.SetInterval(interval_s=60, memory_every_steps=4)
    assert channel.commands.stop_at == messages.StopAt(reason="x", save=False, budget_s=5) and channel.dropped == 2


def test_without_a_socket_the_channel_is_a_no_op() -> None:
    channel = RankChannel(socket_path=None, secret_file=None, rank=3)
    channel.send(messages.Step(step=1))
    assert not channel.connected


def test_set_interval_changes_the_save_cadence(agent: FakeAgent, tmp_path: Path) -> None:
    proc = start(agent, tmp_path)
    try:
        agent.wait_for(lambda: agent.last_step() >= 2, proc)
        agent.send("set_interval", {"save_every_steps": 4, "interval_s": 3600})
        agent.wait_for(lambda: len(agent.events("checkpoint_committed")) >= 2, proc)
    finally:
        proc.kill()
        proc.wait()
    steps = [e["step"] for e in agent.events("checkpoint_committed")]
    assert steps[:2] == sorted(steps[:2]) and all(step % 4 == 0 for step in steps)


def test_the_flight_recorder_dump_is_the_recorder_with_entries_not_an_empty_one(monkeypatch, tmp_path: Path) -> None:
    """On an NCCL job (torch 2.11, H200) the generic recorder's dump was empty (91 bytes, no
    entries): NCCL keeps its own. Whichever recorder holds entries is the one written."""
    import json as jsonlib

    import torch._C._distributed_c10d as c10d

    from ckptsup.hooks.agent_socket import dump_flight_recorder

    empty = jsonlib.dumps({"version": "2.10", "pg_config": {}}).encode()
    full = jsonlib.dumps({"version": "2.10", "entries": [{"profiling_name": "nccl:all_reduce"}]}).encode()
    for first, second in ((empty, full), (full, empty)):
        monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda **kw: first, raising=False)
        monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda **kw: second, raising=False)
        path = dump_flight_recorder(tmp_path / "fr", 3)
        assert path == tmp_path / "fr" / "rank_3.json" and path.read_bytes() == full
