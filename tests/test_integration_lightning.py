"""Lightning with ckptsup's callback under the real `ckptsup launch` (local mode, torchrun, 2 gloo ranks,
CPU): tests/helpers/lightning_train.py, 2 epochs of a shuffled plain DataLoader that Lightning gives
a DistributedSampler. One uninterrupted reference run (plain torchrun, same callback) is shared by the
tests; the faults are chained in one supervised run: rank 1 SIGKILLed mid-epoch 0, then the newest
checkpoint corrupted and rank 1 SIGKILLed again in epoch 1. Every step must see the reference's
sample ids on both ranks and the final parameters must be bit-equal."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptsup.events import read_events

import run_helpers
from drop_in_helpers import rank_processes
from hooks_helpers import base_env, private_dir
from run_helpers import flip_a_bit, named, samples, torchrun_argv, uninterrupted, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "lightning_train.py"
EPOCHS, SAMPLES, BATCH = 2, 192, 4      # 2 ranks: 24 optimizer steps per epoch, 48 in all
STEPS = EPOCHS * SAMPLES // (2 * BATCH)
ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH), "--every", "5"]
# heartbeat_interval_s 3: the kill tests hold rank 1 stopped for 1.5 s before its SIGKILL (a quiet
# checkpoint to corrupt), and a stop seen for one heartbeat interval is a hang (docs/architecture.md)
CONFIG = ("[supervisor]\nhang_min_s = 20.0\nheartbeat_interval_s = 3.0\nnode_silence_s = 6.0\n"
          "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\nkeep_last = 4\n")


def reference(base: Path) -> Path:
    """The script uninterrupted under plain torchrun (2 ranks): its out dir."""
    out = base / "out"
    uninterrupted(SCRIPT, *ARGS, "--step-s", "0", "--out", str(out), "--ckpt-dir", str(base / "ck"), cwd=base)
    return out


def assert_same_run(out: Path, ref: Path) -> None:
    run_helpers.assert_same_run(out, ref, STEPS)
    all_ids = sorted(i for rank in (0, 1) for ids in samples(out, rank).values() for i in ids)
    assert all_ids == sorted(list(range(SAMPLES)) * EPOCHS)   # every sample once per epoch


def committed(run: Path) -> list[int]:
    return sorted(e["step"] for e in named(read_events(run), "checkpoint_committed"))


def newest_checkpoint(ckpt: Path) -> int:
    return max(int(p.name[5:]) for p in ckpt.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory) -> Path:
    return reference(private_dir(tmp_path_factory.mktemp("lightning-reference")))


def launch(tmp: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    run, out = tmp / "run", tmp / "out"
    proc = run_helpers.launch(tmp, run, SCRIPT, *ARGS, "--step-s", "0.1", "--out", str(out), *extra, config=CONFIG)
    return proc, run, out


def kill_rank1_at_a_quiet_checkpoint(run: Path, out: Path, *, after_step: int, corrupt: bool) -> int:
    """Once a checkpoint of step >= after_step is committed: SIGSTOP rank 1 (no save can commit
    without it), let the in-flight one settle, optionally flip a bit of the newest, SIGKILL rank 1.
    Returns the newest checkpoint's step."""
    launches = len(named(read_events(run), "launch"))
    wait_for(lambda: any(s >= after_step for s in committed(run)), 180, f"a checkpoint of step >= {after_step}")
    victim = rank_processes(SCRIPT, out)[1]
    victim.send_signal(signal.SIGSTOP)
    time.sleep(1.5)
    newest = newest_checkpoint(run / "checkpoints")
    if corrupt:
        # one bit in the largest shard: the size stays, only the hashes can tell
        flip_a_bit(max((run / "checkpoints" / f"step_{newest}").rglob("*.distcp"), key=lambda p: p.stat().st_size))
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: len(named(read_events(run), "launch")) > launches, 120, "the restart")
    return newest


def test_rank_sigkills_and_a_corrupt_newest_checkpoint_resume_with_the_reference_samples_and_parameters(
        tmp_path: Path, lightning_reference: Path) -> None:
    tmp = private_dir(tmp_path)
    proc, run, out = launch(tmp)
    try:
        first = kill_rank1_at_a_quiet_checkpoint(run, out, after_step=10, corrupt=False)   # mid epoch 0
        assert first < STEPS // EPOCHS
        second = kill_rank1_at_a_quiet_checkpoint(run, out, after_step=first + 15, corrupt=True)   # epoch 1
        assert second > STEPS // EPOCHS
        console, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console[-4000:]
    assert [f["kind"] for f in named(events, "failure_detected")] == ["crash", "crash"]
    loaded = sorted({e["step"] for e in named(events, "checkpoint_loaded")})
    rejected = {e["step"] for e in named(events, "checkpoint_rejected")}
    assert rejected == {second}, rejected
    assert loaded == [first, second - 5], loaded   # the corrupt one refused, the one before it used
    assert named(events, "run_complete") and not named(events, "give_up")
    # Lightning's DDP strategy hands attach the DDP wrapper: its replicas are fingerprinted at
    # every save at the defaults (docs/sdc.md), and every check agreed (no sdc failure above)
    assert "no replica fingerprints" not in console and any(e.get("sdc_s", 0) > 0 for e in events), console[-2000:]
    assert_same_run(out, lightning_reference)


def test_sigterm_to_the_ranks_stops_them_at_one_step_with_an_emergency_checkpoint_and_exit_preempted(
        tmp_path: Path, lightning_reference: Path) -> None:
    """SIGTERM straight to both ranks, as Slurm's preemption sends it (plain torchrun: no supervisor
    to ask them): ckptsup's handler, not Lightning's, takes it; the ranks agree on a stop step, save
    (the budget fits the measured save) and exit 5, never 0; the resumed run equals the reference."""
    tmp = private_dir(tmp_path)
    out, ckpt = tmp / "out", tmp / "ck"
    def argv() -> list[str]:
        return torchrun_argv(SCRIPT, *ARGS, "--step-s", "0.1", "--out", str(out), "--ckpt-dir", str(ckpt))

    env = base_env({"CKPTSUP_PREEMPT_BUDGET_S": "120"})
    proc = subprocess.Popen(argv(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        wait_for(lambda: (ckpt / "step_10").is_dir() and len(samples(out, 1)) > 12, 180, "step 12 after step_10")
        for rank in rank_processes(SCRIPT, out).values():
            rank.send_signal(signal.SIGTERM)
        console, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    text = console.decode()
    assert proc.returncode != 0, text[-3000:]
    assert text.count("exits with PREEMPTED") == 2 and "exitcode  : 5" in text and "done at step" not in text
    stopped = [int(line.split("stopping after step ")[1].split()[0]) for line in text.splitlines()
               if "stopping after step" in line and "emergency save written" in line]
    assert len(set(stopped)) == 1 and len(stopped) == 2, text[-3000:]   # both ranks, the same step
    assert newest_checkpoint(ckpt) == stopped[0] + 1
    resumed = subprocess.run(argv(), env=base_env(), capture_output=True, text=True,
                             timeout=300, cwd=tmp)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert_same_run(out, lightning_reference)
