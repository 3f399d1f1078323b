"""`ckptsup launch examples/train.py` locally with 2 gloo ranks (docs/training.md §Bit-exact resume:
with 2 data-parallel ranks an interrupted run can equal an uninterrupted one bit for bit). Faults
are injected from outside (SIGKILL / SIGSTOP of a real rank) or by train.py's flags; every run must
end with the reference parameters, or give up as the policy says."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckptsup.events import read_events

from drop_in_helpers import rank_process
from run_helpers import named

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
STEPS = ["--steps", "100", "--save-every-steps", "5", "--step-sleep-s", "0.08"]  # long enough to warm up first


def write_cfg(path: Path, extra_toml: str = "", supervisor_toml: str = "") -> Path:
    path.write_text("[supervisor]\nhang_min_s = 4.0\nheartbeat_interval_s = 0.5\n" + supervisor_toml +
                    "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n"
                    + extra_toml)
    return path


def start(tmp: Path, *extra: str, extra_toml: str = "", supervisor_toml: str = "") -> tuple[subprocess.Popen, Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    run, out = tmp / "run", tmp / "out"
    argv = [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config",
            str(write_cfg(tmp / "job.toml", extra_toml, supervisor_toml)), "--run-dir", str(run), str(TRAIN), *STEPS, "--out", str(out), *extra]
    proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run, out


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def params(out: Path) -> str:
    return json.loads((out / "final.json").read_text())["params_sha256"]


def held(tmp: Path) -> tuple[str, ...]:
    """The ranks wait at step 60 (in an eval phase) until `signal_rank1` releases them: however loaded the
    machine, the run is still there when the test has its precondition (a checkpoint, warm
    interpreters) and has found the rank to signal."""
    return ("--hold-at-step", "60", "--hold-file", str(tmp / "release"))


def signal_rank1(tmp: Path, out: Path, sig: signal.Signals) -> None:
    """Signal rank 1's real process, then release the held run (also when rank 1 is not found)."""
    try:
        rank_process(TRAIN, out, 1).send_signal(sig)
    finally:
        (tmp / "release").touch()


def wait_for_warm(run: Path, timeout: float = 120) -> None:
    """The agent's warm rank interpreters for the next launch are ready (docs/supervisor.md §Warm restarts)."""
    deadline = time.monotonic() + timeout
    while not named(read_events(run), "warm_ready"):
        assert time.monotonic() < deadline, "no warm_ready event"
        time.sleep(0.1)


def wait_for_commit(run: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.get("step", -1) >= step for e in named(read_events(run), "checkpoint_committed")):
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint at step >= {step} within {timeout}s")


def no_rank_left(out: Path) -> bool:
    return not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])
                and str(TRAIN) in " ".join(p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The uninterrupted run's final parameters (computed once for the module; without the step
    sleep, which changes no parameter)."""
    proc, run, out = start(tmp_path_factory.mktemp("reference"), "--step-sleep-s", "0")
    rc, log = finish(proc)
    assert rc == 0, log
    return params(out)


def test_rank_sigkill_restarts_fast_and_ends_bit_identical(tmp_path, reference):
    # with the node-local cache on: the fast path restarts on the same node, so the resume reads
    # the local copies (the hooks expand {node} and {job_id} from the config the supervisor passes);
    # the memory tier (on by default) off, else its newer copy would be the one read
    local = tmp_path / "scratch"
    proc, run, out = start(tmp_path, *held(tmp_path),
                           extra_toml=f'[storage]\nnode_local = "{local}/{{node}}/{{job_id}}"\n'
                                      '[memory]\nenabled = false\n')
    wait_for_commit(run, 10)
    wait_for_warm(run)
    killed_at = time.monotonic()
    signal_rank1(tmp_path, out, signal.SIGKILL)
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    [failure] = named(events, "failure_detected")
    assert failure["kind"] == "crash" and failure["detect_s"] <= 1.0
    detected = failure["mono"] - killed_at  # the same host's monotonic clock
    assert detected <= 1.0, f"crash noticed {detected:.2f}s after the SIGKILL"
    [restart] = named(events, "restart_done")
    assert restart["path"] == "fast" and restart["resume_step"] >= 10
    assert restart["warm"] is True, "the ranks ran again in the warm interpreters"
    loaded = [e for e in named(events, "checkpoint_loaded") if e.get("step") == restart["resume_step"]]
    assert loaded and loaded[0]["read_local_files"] > 0 and loaded[0]["local_fallback_files"] == 0, loaded
    assert list(local.glob("*/*/local_rank_1/step_*")), "no local copy under <node>/<job_id>"
    assert not named(events, "restore_loss_jump")   # the whole state came back: the replayed losses match
    assert params(out) == reference
    assert no_rank_left(out)


def held_at(run: Path, step: int, attempt: int, timeout: float = 120) -> None:
    """The ranks of `attempt` wait at `step` (train.py's hold: an eval phase entered there), with
    the agent's warm interpreters for the next launch ready."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(run)
        holding = [e for e in named(events, "phase") if e.get("phase") == "eval" and e.get("step") == step
                   and e["attempt"] == attempt]
        warm = [e for e in named(events, "warm_ready") if e["attempt"] == attempt]
        if holding and warm:
            return
        assert time.monotonic() < deadline, f"attempt {attempt} not held at step {step} with warm interpreters"
        time.sleep(0.1)


def test_nan_once_rolls_back_then_a_sigstopped_rank_is_a_hang_detected_within_timeout_plus_2s_both_bit_identical(
        tmp_path, reference):
    """Two faults in one run: rank 1's NaN at step 17 rolls back to step_15 (attempt 1); then, with
    attempt 1 held at step 60, rank 1 SIGSTOPped is a hang within the hang timeout + 2 s, restarted
    warm (attempt 2). The run ends with the uninterrupted run's parameters."""
    proc, run, out = start(tmp_path, "--nan-at-step", "17", "--nan-rank", "1", *held(tmp_path))
    held_at(run, 60, attempt=1)
    stopped_at = time.monotonic()
    signal_rank1(tmp_path, out, signal.SIGSTOP)
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    nan, hang = named(events, "failure_detected")
    assert nan["kind"] == "nan" and nan["rank"] == 1 and nan["step"] == 17
    rollback, restart = named(events, "restart_done")
    assert rollback["resume_step"] == 15 and rollback["attempt"] == 1
    assert hang["kind"] == "hang" and hang["rank"] == 1 and hang["attempt"] == 1 and "stopped" in hang["detail"]
    hang_timeout = 4.0  # the floor: steps of ~0.1 s give 10 x p99 < 4 s
    assert hang["mono"] - stopped_at <= hang_timeout + 2.0
    assert restart["warm"] is True and restart["attempt"] == 2
    assert params(out) == reference
    assert no_rank_left(out)


def test_a_restore_whose_loss_jumps_is_a_warning_and_training_goes_on(tmp_path):
    """docs/sdc.md §After a restore: the script damages its model after resuming (a wrong restore);
    rank 0's loss at the first replayed step is far from the one before the crash: one warning,
    no failure, the run completes."""
    # 30 steps: the jump is at the first replayed step (15); no reference to end with, so the
    # run's last 70 steps of STEPS proved nothing more
    proc, run, out = start(tmp_path, "--crash-at-step", "17", "--crash-rank", "1", "--damage-after-resume",
                           "--steps", "30")
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    assert [f["kind"] for f in named(events, "failure_detected")] == ["crash"]
    [jump] = named(events, "restore_loss_jump")
    resumed = named(events, "restart_done")[0]["resume_step"]
    assert jump["step"] == resumed and jump["basis"] == "same step" and abs(jump["loss"] - jump["before"]) > 0.1 * jump["before"]
    assert "warning: after the restore rank 0's loss at step" in log
    assert named(events, "run_complete")


def test_nan_at_the_same_step_every_time_gives_up_and_drains_nothing(tmp_path):
    proc, run, out = start(tmp_path, "--nan-at-step", "7", "--nan-rank", "1", "--fault-mode", "always")
    rc, log = finish(proc)
    assert rc == 3, log
    events = read_events(run)
    # replay before blame (docs/sdc.md §NaN): the replay on the same nodes shows the NaN again at
    # step 7 on rank 1, so it is the data's: give up at the second, nothing drained
    assert [f["kind"] for f in named(events, "failure_detected")] == ["nan"] * 2
    reason = named(events, "give_up")[0]["reason"]
    assert "user error" in reason and "step 7 on rank 1 again" in reason
    assert not named(events, "node_excluded")
    assert no_rank_left(out)


def test_sigterm_to_a_local_supervisor_stops_the_ranks_and_exits_preempted(tmp_path):
    proc, run, out = start(tmp_path)
    wait_for_commit(run, 5)
    proc.send_signal(signal.SIGTERM)
    rc, log = finish(proc, timeout=120)
    assert rc == 5, log  # ExitStatus.PREEMPTED
    events = read_events(run)
    assert [f["kind"] for f in named(events, "failure_detected")] == ["preempted"]
    assert named(events, "preemption") and not named(events, "run_complete")
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert no_rank_left(out)


def test_a_sigkilled_supervisor_leaves_no_rank_behind_and_a_corrupted_newest_checkpoint_is_quarantined_on_resume(
        tmp_path, reference):
    """A SIGKILLed supervisor: its agent kills the ranks when the supervisor's pipe closes (none
    left within 10 s). Then the newest checkpoint is truncated and a new supervisor in the same
    run dir quarantines it and resumes from the previous one, ending bit-identical."""
    lease = "lease_interval_s = 0.2\nlease_stale_s = 1.0\n"  # the killed supervisor's lease is soon stale
    proc, run, out = start(tmp_path, supervisor_toml=lease)
    wait_for_commit(run, 20)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while not no_rank_left(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert no_rank_left(out), "the agent must kill its ranks when the supervisor's pipe closes"
    ckpts = run / "checkpoints"
    newest = max((p for p in ckpts.iterdir() if p.name.startswith("step_")), key=lambda p: int(p.name[5:]))
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    while time.time() - json.loads((run / "lease").read_text())["renewed"] <= 1.0:
        time.sleep(0.1)  # a fresh lease would be a live run: the launch would be refused
    proc, run, out = start(tmp_path, supervisor_toml=lease)  # same run dir, supervisor dead: the run resumes
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    [rejected] = named(events, "checkpoint_rejected")
    assert rejected["step"] == int(newest.name[5:]) and "size" in rejected["reason"]
    assert not newest.exists() and (ckpts / "quarantine").is_dir()
    resumed = named(events, "launch")[-1]
    assert resumed["resume_from"] and int(Path(resumed["resume_from"]).name[5:]) < int(newest.name[5:])
    assert params(out) == reference


def wait_for_memory_save(proc: subprocess.Popen, run: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not [e for e in named(read_events(run), "memory_saved") if e["ok"] and e["step"] >= step]:
        assert time.monotonic() < deadline and proc.poll() is None, f"no memory save of step >= {step}"
        time.sleep(0.1)


def test_a_rank_sigkill_resumes_from_the_agents_memory_and_ends_bit_identical(tmp_path, reference):
    # disk saves only at the end: the restart point can only come from the memory tier
    # the memory tier as every job has it (on by default), only its schedule set
    proc, run, out = start(tmp_path, "--save-every-steps", "1000", *held(tmp_path),
                           extra_toml="[memory]\nevery_steps = 5\n")
    wait_for_memory_save(proc, run, 20)
    wait_for_warm(run)
    signal_rank1(tmp_path, out, signal.SIGKILL)
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    [restart] = named(events, "restart_done")
    assert restart["path"] == "fast" and restart["resume_step"] >= 20
    [loaded] = named(events, "checkpoint_loaded")
    assert loaded["source"] == "memory" and loaded["step"] == restart["resume_step"], loaded
    assert loaded["files_by_source"]["memory"] == 2 and loaded["files_by_source"]["shared"] == 0, loaded  # a shard file a rank
    assert set(restart["load_by_source"]) == {"memory"} and restart["load_by_source"]["memory"] == restart["phases"]["load_s"]
    assert not [e for e in named(events, "checkpoint_committed") if e["step"] < 100]   # nothing on disk to resume from
    assert params(out) == reference
    assert no_rank_left(out)


def test_a_rank_lost_after_the_last_steps_checkpoint_resumes_from_memory_at_that_step_and_saves_it_no_more(tmp_path):
    """The last step's checkpoint is committed on disk and held in memory, then a rank dies before
    the run ends (a node lost at the end): the restart resumes from memory at that step, which the
    disk already holds. Before the fix the final save of that step was tried again and refused
    ("already holds checkpoint ... refusing to mix"): a spurious checkpoint_failed."""
    proc, run, out = start(tmp_path, "--steps", "20", "--save-every-steps", "10", "--hold-at-step", "20",
                           "--hold-file", str(tmp_path / "release"), extra_toml="[memory]\nevery_steps = 5\n")
    wait_for_memory_save(proc, run, 20)
    wait_for_commit(run, 20)
    signal_rank1(tmp_path, out, signal.SIGKILL)
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    [loaded] = named(events, "checkpoint_loaded")
    assert loaded["source"] == "memory" and loaded["step"] == 20, loaded
    assert [e["step"] for e in named(events, "checkpoint_committed")] == [10, 20]   # step 20 once
    assert not named(events, "checkpoint_failed"), named(events, "checkpoint_failed")
    assert json.loads((out / "final.json").read_text())["step"] == 20
    assert no_rank_left(out)


def test_a_corrupt_memory_bundle_is_refused_and_the_disk_checkpoint_used_with_nothing_quarantined(
        tmp_path, reference, monkeypatch):
    monkeypatch.setenv("CKPTSUP_TEST_FLIP_MEMORY", "1")   # the agent's store flips a bit of every bundle it keeps
    proc, run, out = start(tmp_path, "--save-every-steps", "10", *held(tmp_path),
                           extra_toml="[memory]\nenabled = true\nevery_steps = 5\n")
    wait_for_memory_save(proc, run, 25)
    wait_for_warm(run)
    signal_rank1(tmp_path, out, signal.SIGKILL)
    rc, log = finish(proc)
    assert rc == 0, log
    events = read_events(run)
    [loaded] = named(events, "checkpoint_loaded")
    assert loaded["source"] == "shared" and loaded["step"] % 10 == 0 and loaded["files_by_source"]["memory"] == 0
    assert "memory checkpoint of step" in log and "not used" in log   # the refused bundle, said on the console
    assert not named(events, "checkpoint_rejected") and not (run / "checkpoints" / "quarantine").exists()
    assert params(out) == reference
