"""ckptsup.heartbeat() in a real 2-rank gloo DDP script under real torchrun
(tests/helpers/heartbeat_train.py), against a fake agent socket: what the agent side receives —
a hello with checkpoints=false from each rank, every step in order with its step time, bye DONE;
a NaN on one rank is its `nan` frame and exit RANK_NAN; a stop_at ends both ranks at that step
with RANK_STOPPED and nothing saved; without a socket the script runs silently to its end. Then
the same script under `ckptsup launch` (the real agent and supervisor): it completes with no
checkpoint events, and a NaN at the same real step again on the replay is the data's (a give-up). The NaN and
stop_at cases start the two ranks directly (env://), so each rank's own exit status is read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hooks_helpers import PY, ROOT, FakeAgent, base_env, free_port, private_dir

from ckptsup.env import ExitStatus

pytestmark = pytest.mark.torch

SCRIPT = ROOT / "tests" / "helpers" / "heartbeat_train.py"


@pytest.fixture
def agent(tmp_path: Path):
    fake = FakeAgent(private_dir(tmp_path / "agent"))
    yield fake
    fake.close()


def torchrun(out: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    argv = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), "--out", str(out), *args]
    return subprocess.Popen(argv, env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, output


def spawn_ranks(out: Path, *args: str, env: dict[str, str]) -> list[subprocess.Popen]:
    """The two ranks started directly, with the env:// variables torchrun would set, so the test
    is each rank's parent and reads its own exit status. Under torchrun the first rank to die
    decides the report: a rank still tearing down after its SystemExit is SIGTERMed (-15) when its
    peer aborts on the closed gloo pair first, which made an assertion on torchrun's summary racy."""
    port = str(free_port())
    return [subprocess.Popen([PY, str(SCRIPT), "--out", str(out), *args],
                             env=base_env({**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]


def finish_all(procs: list[subprocess.Popen], timeout: float = 120) -> tuple[list[int], str]:
    results = [finish(proc, timeout) for proc in procs]
    return [rc for rc, _ in results], "".join(f"--- rank {r}\n{out}" for r, (_, out) in enumerate(results))


def test_every_step_of_both_ranks_reaches_the_agent_and_a_normal_end_says_done(agent, tmp_path) -> None:
    out = private_dir(tmp_path / "out")
    rc, output = finish(torchrun(out, "--steps", "8", env=agent.env()))
    assert rc == 0, output[-3000:]
    agent.wait_ended(2)
    assert (out / "own.pt").exists()
    for rank in (0, 1):
        [hello] = agent.of_rank("hello", rank)
        assert hello["checkpoints"] is False and hello["world_size"] == 2 and hello["local_rank"] == rank
        steps = agent.of_rank("step", rank)
        assert [b["step"] for b in steps] == list(range(8))
        assert steps[0]["step_time_s"] is None
        assert all(b["step_time_s"] >= 0.02 and b["loss_finite"] for b in steps[1:])   # each step sleeps 20 ms
        assert agent.of_rank("bye", rank) == [{"rank": rank, "status": ExitStatus.DONE}]
    assert {m for m, _ in agent.frames} == {"hello", "step", "bye"}


def test_a_nan_on_one_rank_is_reported_and_that_rank_exits_rank_nan(agent, tmp_path) -> None:
    out = private_dir(tmp_path / "out")
    rcs, output = finish_all(spawn_ranks(out, "--steps", "50", "--nan-at-step", "3", "--nan-rank", "1", env=agent.env()))
    assert rcs[1] == int(ExitStatus.RANK_NAN), output[-3000:]
    assert rcs[0] != 0   # its peer left mid-all-reduce
    agent.wait_ended(2)
    assert agent.of("nan") == [{"rank": 1, "step": 3, "loss": "nan"}]
    assert [b["step"] for b in agent.of_rank("step", 1)] == [0, 1, 2]
    assert agent.of_rank("bye", 1) == [{"rank": 1, "status": ExitStatus.RANK_NAN}]
    assert not (out / "own.pt").exists()


def test_stop_at_ends_both_ranks_at_that_step_with_rank_stopped_and_saves_nothing(agent, tmp_path) -> None:
    out = private_dir(tmp_path / "out")
    ckpt = tmp_path / "ckpts"
    procs = spawn_ranks(out, "--steps", "1000", "--step-sleep-s", "0.05",
                        env={**agent.env(), "CKPTSUP_CHECKPOINT_DIR": str(ckpt)})
    try:
        agent.wait_for(lambda: min(agent.last_step_of(r) for r in (0, 1)) >= 2, procs[0])
        stop = agent.last_step() + 5
        agent.send("stop_at", {"step": stop, "reason": "test", "save": True, "budget_s": 60})
    finally:
        rcs, output = finish_all(procs)
    assert rcs == [int(ExitStatus.RANK_STOPPED)] * 2, output[-3000:]
    agent.wait_ended(2)
    for rank in (0, 1):
        assert [b["step"] for b in agent.of_rank("step", rank)] == list(range(stop + 1))
        assert agent.of_rank("bye", rank) == [{"rank": rank, "status": ExitStatus.RANK_STOPPED}]
    assert not ckpt.exists() and not (out / "own.pt").exists()   # heartbeat-only: ckptsup saved nothing


def test_without_an_agent_the_script_runs_to_its_end_silently(tmp_path) -> None:
    out = private_dir(tmp_path / "out")
    rc, output = finish(torchrun(out, "--steps", "5", "--nan-at-step", "2", env={}))
    assert rc == 0, output[-3000:]
    assert (out / "own.pt").exists()
    assert "ckptsup" not in output and "Traceback" not in output, output[-3000:]


# ---- through the real supervisor and agent (ckptsup launch, local mode) -----------------------

def launch(tmp: Path, *args: str) -> tuple[int, str, list[dict]]:
    from ckptsup.events import read_events

    out, run = private_dir(tmp / "out"), tmp / "run"
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\nhang_min_s = 4.0\nheartbeat_interval_s = 0.5\n")
    argv = [PY, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
            str(SCRIPT), "--out", str(out), *args]
    done = subprocess.run(argv, cwd=tmp, env=base_env(), capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr, read_events(run)


def test_under_ckptsup_launch_a_heartbeat_only_run_completes_without_checkpoints(tmp_path) -> None:
    rc, output, events = launch(tmp_path, "--steps", "30")
    assert rc == ExitStatus.DONE, output[-3000:]
    names = [e["event"] for e in events]
    assert "run_complete" in names and "first_step" in names, names
    assert not [n for n in names if n.startswith("checkpoint_")], names
    assert (tmp_path / "out" / "own.pt").exists()


def test_under_ckptsup_launch_a_nan_at_the_same_real_step_after_the_replay_gives_up_as_the_datas(tmp_path) -> None:
    rc, output, events = launch(tmp_path, "--steps", "30", "--nan-at-step", "5")
    assert rc == ExitStatus.GIVE_UP, output[-3000:]
    failures = [e for e in events if e["event"] == "failure_detected"]
    assert len(failures) == 2 and all(e["kind"] == "nan" and e["step"] == 5 and e["rank"] == 1 for e in failures), failures
    [give_up] = [e for e in events if e["event"] == "give_up"]
    assert "non-finite loss at step 5 on rank 1 again" in give_up["reason"]
    assert not [e for e in events if e["event"] == "node_excluded"]
