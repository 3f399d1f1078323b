"""`ckptsup launch` in local mode (no Slurm): the real CLI, agent, torchrun and a wire-speaking
rank stand-in (tests/helpers/wire_rank.py). Each fault ends as the policy says, with events."""
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ckptsup.events import read_events

from run_helpers import named

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "tests" / "helpers" / "wire_rank.py"
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[supervisor]\nhang_min_s = 3.0\nheartbeat_interval_s = 0.5\n"
                    "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    return path


def launch(tmp_path, cfg, *rank_args, nproc=2, extra=(), timeout=120):
    run = tmp_path / "run"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", str(nproc), "--config", str(cfg), "--run-dir", str(run),
            *extra, str(RANK), *rank_args, "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, read_events(run) if run.exists() else []


def no_rank_left(tmp_path):
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(RANK) in cmd and str(tmp_path) in cmd:
            return False
    return True


def test_a_rank_sigkill_then_a_stopped_rank_then_a_nan_each_cost_one_fast_restart_and_the_run_finishes(tmp_path, cfg):
    """Three faults of rank 1 chained in one run, one an attempt: a SIGKILL at step 5 (attempt 0)
    is detected within a second and restarted on the fast path; a SIGSTOP at step 8 (attempt 1) is
    a hang after one heartbeat, not after the hang timeout; a NaN at step 11 (attempt 2) rolls back.
    Each costs exactly one restart; the run completes (attempt 3) and leaves no rank behind."""
    proc, events = launch(tmp_path, cfg, "--steps", "15", "--crash-at", "5", "--crash-attempt", "0",
                          "--hang-at", "8", "--hang-attempt", "1", "--nan-at", "11", "--nan-attempt", "2")
    assert proc.returncode == 0, proc.stderr
    crash, hang, nan = named(events, "failure_detected")
    assert crash["kind"] == "crash" and crash["rank"] == 1 and crash["attempt"] == 0 and crash["detect_s"] <= 1.0
    restart, after_hang, after_nan = named(events, "restart_done")
    assert restart["path"] == "fast" and restart["resume_step"] >= 5 and restart["attempt"] == 1
    assert set(restart["phases"]) == {"kill_s", "health_s", "launch_s", "rendezvous_s", "load_s", "first_step_s"}
    assert abs(sum(restart["phases"].values()) - restart["restart_s"]) < 0.05
    # the stopped rank: a process in state T answers nothing until continued: two heartbeats that
    # see it stopped (heartbeat_interval_s = 0.5) are the evidence, well inside hang_min_s = 3
    assert hang["kind"] == "hang" and hang["rank"] == 1 and hang["attempt"] == 1 and "stopped" in hang["detail"]
    assert 0.5 <= hang["detect_s"] <= 0.5 + 1.5 < 3.0
    assert after_hang["attempt"] == 2
    assert nan["kind"] == "nan" and nan["rank"] == 1 and nan["step"] == 11 and nan["attempt"] == 2
    assert after_nan["attempt"] == 3
    assert named(events, "run_complete")
    assert (tmp_path / "out" / "rank0.done").exists() and (tmp_path / "out" / "rank1.done").exists()
    assert [e["attempt"] for e in named(events, "launch")] == [0, 1, 2, 3]
    assert no_rank_left(tmp_path)


def test_nothing_sent_to_the_rank_socket_by_a_non_rank_costs_a_restart(tmp_path, cfg):
    """Connections that close without a frame (more than the restart budget), a 1 MB line, deep
    brackets, a forged hello, a rank's own frames replayed on a new connection, well-signed
    frames of no identity: the run goes on as if nothing happened."""
    proc, events = launch(tmp_path, cfg, "--steps", "12", "--intrude-at", "3", extra=("--max-restarts", "2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not named(events, "failure_detected"), [(e["kind"], e["detail"]) for e in named(events, "failure_detected")]
    assert [e["attempt"] for e in named(events, "launch")] == [0] and named(events, "run_complete")
    agent_log = "".join(p.read_text() for p in (tmp_path / "run").rglob("agents.log"))
    assert "without an authenticated hello" in agent_log, agent_log[-2000:]


def test_a_rank_aborting_after_it_finished_is_a_teardown_error_and_the_run_completes(tmp_path, cfg):
    proc, events = launch(tmp_path, cfg, "--steps", "6", "--abort-at-exit")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert named(events, "teardown_error") and named(events, "run_complete")
    assert not named(events, "failure_detected") and [e["attempt"] for e in named(events, "launch")] == [0]
    assert "a crash in process teardown" in proc.stdout


def test_nan_at_the_same_step_every_time_gives_up_without_draining(tmp_path, cfg):
    proc, events = launch(tmp_path, cfg, "--steps", "12", "--nan-at", "5")
    assert proc.returncode == 3, proc.stderr  # ExitStatus.GIVE_UP
    # replay before blame (docs/sdc.md): the replay on the same nodes shows it again: the data's
    assert [e["kind"] for e in named(events, "failure_detected")] == ["nan"] * 2
    [give_up] = named(events, "give_up")
    assert "user error" in give_up["reason"] and "step 5 on rank 1 again" in give_up["reason"]
    assert not named(events, "node_excluded")
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["status"] == "gave_up" and state["excluded_nodes"] == {}
    assert "giving up" in proc.stdout + proc.stderr


def test_crash_at_step_zero_gives_up_after_k_attempts(tmp_path, cfg):
    proc, events = launch(tmp_path, cfg, "--steps", "12", "--crash-at", "0")
    assert proc.returncode == 3
    assert len(named(events, "failure_detected")) == 3 and named(events, "give_up")
    assert no_rank_left(tmp_path)


def test_restart_budget_is_honoured(tmp_path, cfg):
    proc, events = launch(tmp_path, cfg, "--steps", "12", "--crash-at", "3", "--once", extra=("--max-restarts", "0"))
    assert proc.returncode == 3
    assert "restart budget spent" in named(events, "give_up")[0]["reason"]


ARGV_SCRIPT = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n"


def test_arguments_after_the_script_reach_it_untouched(tmp_path, cfg):
    script = tmp_path / "argv.py"
    script.write_text(ARGV_SCRIPT)
    out = tmp_path / "argv.json"
    args = ["--nodes", "7", "--config", "x.toml", "--max-restarts=3", "-h", "plain"]
    proc = subprocess.run([*CKPTSUP, "launch", "--nproc-per-node", "1", "--config", str(cfg), "--run-dir",
                           str(tmp_path / "run"), str(script), str(out), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == args


@pytest.mark.parametrize("argv, needle", [
    (["launch", "missing.py"], "missing.py does not exist"),
    (["launch", "--config", "nope.toml", "x.py"], "nope.toml does not exist"),
    (["launch", "--nodes", "3", "{script}"], "--nodes 3 active nodes requested"),
    (["launch", "--nproc-per-node", "0", "{script}"], "supervisor.nproc_per_node = 0 must be >= 1"),
])
def test_bad_launches_get_one_clear_line_and_usage_status(tmp_path, argv, needle):
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    argv = [a.replace("{script}", str(script)) for a in argv]
    proc = subprocess.run([*CKPTSUP, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "ckptsup-runs").exists()


def test_the_supervisor_imports_no_torch():
    code = ("import sys; import ckptsup.supervisor.cli, ckptsup.supervisor.job.loop, ckptsup.supervisor.node.agent; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_measured_checkpoint_costs_retune_the_interval_through_the_channel(tmp_path):
    cfg = tmp_path / "adaptive.toml"
    cfg.write_text("[supervisor]\nhang_min_s = 5.0\n[checkpoint]\nadaptive_interval = true\nsave_every_s = 1800.0\n"
                   "keep_daily_days = 0\ntest_load_every = 0\n[cost]\ngpu_mtbf_hours = 1.0\n")
    proc, events = launch(tmp_path, cfg, "--steps", "30", "--commit-every", "5")
    assert proc.returncode == 0, proc.stderr
    [change, *_] = named(events, "interval_changed")
    assert change["interval_s"] < 1800 and "Daly" in change["why"]
    received = [json.loads(x) for x in (tmp_path / "out" / "rank0.commands").read_text().splitlines()]
    assert {"m": "set_interval", "body": {"interval_s": change["interval_s"]}} in received


def test_a_script_that_fails_at_import_gives_up_showing_its_error(tmp_path, cfg):
    script = tmp_path / "bad.py"
    script.write_text("import no_such_module_for_ckptsup_test\n")
    proc = subprocess.run([*CKPTSUP, "launch", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), str(script)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3
    assert "ModuleNotFoundError: No module named 'no_such_module_for_ckptsup_test'" in proc.stdout


def test_a_killed_agent_is_replaced_and_its_ranks_do_not_live_on(tmp_path, cfg):
    import signal
    import time

    run = tmp_path / "run"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
            str(RANK), "--steps", "60", "--step-s", "0.1", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "out" / "rank1.step").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    agent = next(c for c in psutil.Process(proc.pid).children() if "agent" in " ".join(c.cmdline()))
    old_ranks = {p.pid for p in psutil.process_iter(["cmdline"]) if str(RANK) in " ".join(p.info["cmdline"] or [])
                 and str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.pid != proc.pid}
    agent.send_signal(signal.SIGKILL)
    while not [e for e in named(read_events(run), "launch") if e["attempt"] >= 1] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    alive = [p for p in old_ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, "the dead agent's ranks must be killed before the new attempt starts"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    events = read_events(run)
    assert named(events, "failure_detected")[0]["kind"] == "crash"
    assert named(events, "launch")[-1]["path"] == "node" and named(events, "run_complete")
    assert not [p for p in old_ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(("target", "signame"), [("supervisor", "SIGHUP"), ("agent", "SIGHUP"), ("agent", "SIGUSR1")])
def test_a_hangup_stops_the_run_like_a_preemption(tmp_path, cfg, target, signame):
    """SIGHUP (the terminal of an interactive `ckptsup launch` closed, an ssh session ended) to the
    supervisor or to its agent: the ranks are told to stop, a `preemption` event, state `stopped`,
    exit PREEMPTED — not a dead process, a run left `running`, or a restart. SIGUSR1 to the agent
    (Slurm's time-limit warning sent to the steps; a container's PID 1 gets only what it handles)
    stops it the same way instead of killing it."""
    import signal
    import time

    run = tmp_path / "run"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
            str(RANK), "--steps", "400", "--step-s", "0.05", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "out" / "rank1.step").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = psutil.Process(proc.pid)
    if target == "agent":
        victim = next(c for c in victim.children() if "agent" in " ".join(c.cmdline()))
    victim.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, out + err   # ExitStatus.PREEMPTED
    events = read_events(run)
    assert named(events, "preemption") and not named(events, "restart_done")
    assert [e["attempt"] for e in named(events, "launch")] == [0]
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert no_rank_left(tmp_path)


@pytest.mark.parametrize("how", ["module", "no-python"])
def test_a_module_or_an_executable_runs_under_torchrun_as_torchrun_would_run_it(tmp_path, cfg, how):
    import os

    env = dict(os.environ)
    if how == "module":   # torchrun -m wire_rank: python -m in every rank, the module found on PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join([str(RANK.parent), env.get("PYTHONPATH", "")])
        target = ["-m", "wire_rank"]
    else:                 # torchrun --no-python ./rank.sh: the executable itself, no python in front
        wrapper = tmp_path / "rank.sh"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {RANK} "$@"\n')
        wrapper.chmod(0o755)
        target = ["--no-python", "./rank.sh"]
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(tmp_path / "run"),
            *target, "--steps", "3", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    events = read_events(tmp_path / "run")
    assert named(events, "run_complete") and named(events, "supervisor_start")[0]["script"] == \
        ("wire_rank" if how == "module" else str(tmp_path / "rank.sh"))
    spec = json.loads((tmp_path / "run" / "attempt-0" / "launch.json").read_text())
    assert (spec["module"], spec["no_python"]) == (how == "module", how == "no-python")
    assert [(tmp_path / "out" / f"rank{r}.step").read_text() for r in (0, 1)] == ["3", "3"]
