"""`ckptsup launch` twice into one run dir, locally (no Slurm), with the real CLI, agent and torchrun
on a script without the hooks: an ended run needs --resume or --new, a live one is refused, a run
whose supervisor was killed resumes (supervisor/job/relaunch.py; docs/supervisor.md §Launching again)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckptsup.events import read_events

from run_helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
SCRIPT = "import sys, time\nif '--sleep' in sys.argv:\n    time.sleep(60)\nprint('trained')\n"


@pytest.fixture
def world(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    # a short lease, so that a killed supervisor's goes stale in a second
    (tmp_path / "job.toml").write_text("[supervisor]\nlease_interval_s = 0.2\nlease_stale_s = 1.0\n"
                                       "heartbeat_interval_s = 0.5\n")
    return tmp_path


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTSUP_", "SLURM_"))}
    out["PYTHONPATH"] = str(ROOT)
    return out


def argv(world: Path, *flags: str, sleep: bool = False) -> list[str]:
    return [*CKPTSUP, "launch", "--config", str(world / "job.toml"), "--run-dir", str(world / "run"), *flags,
            str(world / "train.py"), *(["--sleep"] if sleep else [])]


def launch(world: Path, *flags: str, **more_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(world, *flags), capture_output=True, text=True, timeout=120, env={**env(), **more_env},
                          cwd=world)


def state(run: Path) -> dict:
    return json.loads((run / "state.json").read_text())


def starts(run: Path) -> list[bool]:
    return [e["resumed"] for e in read_events(run) if e["event"] == "supervisor_start"]


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("ckptsup: error: "), line
    return line


def running(run: Path) -> bool:
    try:
        return state(run)["status"] == "running" and (run / "lease").exists() and (run / "attempt-0").is_dir()
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def test_a_second_launch_into_an_ended_run_needs_resume_or_new(world):
    run = world / "run"
    first = launch(world)
    assert first.returncode == 0, first.stdout + first.stderr
    assert state(run)["status"] == "done" and starts(run) == [False]

    line = refusal(launch(world))
    assert f"{run} holds a finished run (1 attempt)" in line and "--resume" in line and "--new" in line
    assert starts(run) == [False] and state(run)["status"] == "done"   # the refused launch touched nothing

    # for a log shipper (ckptsup/console.py): the supervisor's lines are JSON, on the same stream;
    # the rank's relayed lines stay its bytes, and the agent's frames are untouched
    resumed = launch(world, "--resume", CKPTSUP_LOG_FORMAT="json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = [json.loads(line) for line in resumed.stderr.splitlines()]   # every one a JSON object
    [resuming] = [s for s in said if s["event"].startswith(f"ckptsup: resuming the run in {run}: ")]
    assert resuming["level"] == "info" and resuming["component"] == "supervisor"
    assert resuming["timestamp"].endswith("Z")
    assert "[rank0]: trained" in resumed.stdout.splitlines()
    assert all(line.startswith("[rank") or json.loads(line) for line in resumed.stdout.splitlines())
    assert starts(run) == [False, True] and state(run)["attempt"] == 1 and state(run)["status"] == "done"

    new = launch(world, "--new")
    assert new.returncode == 0, new.stdout + new.stderr
    [old] = [p for p in world.iterdir() if p.name.startswith("run.")]
    assert str(old) in new.stderr
    assert starts(old) == [False, True] and state(old)["attempt"] == 1      # kept whole, history and all
    assert starts(run) == [False] and state(run)["attempt"] == 0 and state(run)["status"] == "done"


def test_a_live_run_is_refused_naming_its_supervisor_and_then_a_stopped_run_needs_a_flag(world):
    run = world / "run"
    live = subprocess.Popen(argv(world, sleep=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=world)
    try:
        wait_for(lambda: running(run), 60, "the first supervisor to start")
        for flags in ((), ("--resume",), ("--new",)):
            line = refusal(launch(world, *flags))
            assert "holds a live run" in line and f"pid {live.pid} on " in line, line
        assert not [p for p in world.iterdir() if p.name.startswith("run.")]   # --new moved nothing
        live.send_signal(signal.SIGTERM)   # local mode: stopped like a preemption, exit 5
        assert live.wait(60) == 5, live.communicate()
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    assert state(run)["status"] == "stopped"
    assert "holds a stopped run" in refusal(launch(world))


def test_a_run_whose_supervisor_was_killed_resumes_without_a_flag_once_its_lease_is_stale(world):
    run = world / "run"
    dead = subprocess.Popen(argv(world, sleep=True), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env(), cwd=world)
    tree: list[psutil.Process] = []
    try:
        wait_for(lambda: running(run), 60, "the supervisor to start")
        tree = psutil.Process(dead.pid).children(recursive=True)
        dead.kill()
        dead.wait()
        _, alive = psutil.wait_procs(tree, timeout=30)   # its agent kills the ranks when stdin closes
        assert not alive, alive
        wait_for(lambda: (time.time() - json.loads((run / "lease").read_text())["renewed"]) > 1.0, 10,
                 "the lease to go stale")
        assert state(run)["status"] == "running"
        again = launch(world)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "its supervisor died" in again.stderr
        assert starts(run) == [False, True] and state(run)["attempt"] == 1 and state(run)["status"] == "done"
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait()
        for proc in tree:   # only what this test started
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
