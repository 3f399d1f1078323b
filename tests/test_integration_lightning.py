"""Lightning with ckptsup's callback under the real `ckptsup launch` (local mode, torchrun, 2 gloo ranks,
CPU): tests/helpers/lightning_train.py, 2 epochs of a shuffled plain DataLoader that Lightning gives
a DistributedSampler. One uninterrupted reference run (plain torchrun, same callback) is shared by the
tests; the faults are chained in one supervised run: rank 1 SIGKILLed mid-epoch 0, then the newest
checkpoint corrupted and rank 1 SIGKILLed again in epoch 1. Every step must see the reference's
sample ids on both ranks and the final parameters must be bit-equal."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from drop_in_helpers import rank_processes
from hooks_helpers import base_env, free_port, private_dir

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


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def reference(base: Path) -> Path:
    """The script uninterrupted under plain torchrun (2 ranks): its out dir."""
    out = base / "out"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), *ARGS, "--step-s", "0", "--out", str(out),
            "--ckpt-dir", str(base / "ck")]
    proc = subprocess.run(argv, env=base_env(), capture_output=True, text=True, timeout=300, cwd=base)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def samples(out: Path, rank: int) -> dict[int, list[int]]:
    """global step -> that step's sample ids on `rank`; the last line of a step wins (a resumed run
    repeats the steps after its checkpoint)."""
    steps: dict[int, list[int]] = {}
    for line in (out / f"samples_rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["ids"]
    return steps


def assert_same_run(out: Path, ref: Path) -> None:
    for rank in (0, 1):
        got, want = samples(out, rank), samples(ref, rank)
        assert sorted(got) == list(range(STEPS)), f"rank {rank} ran steps {sorted(got)}"
        assert got == want, f"rank {rank}: steps {[s for s in want if got.get(s) != want[s]]} saw other samples"
        final, expected = torch.load(out / f"final_rank{rank}.pt"), torch.load(ref / f"final_rank{rank}.pt")
        assert final.keys() == expected.keys()
        for key in final:
            assert torch.equal(final[key], expected[key]), f"rank {rank}: parameter {key} differs"
    all_ids = sorted(i for rank in (0, 1) for ids in samples(out, rank).values() for i in ids)
    assert all_ids == sorted(list(range(SAMPLES)) * EPOCHS)   # every sample once per epoch


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def committed(run: Path) -> list[int]:
    return sorted(e["step"] for e in named(read_events(run), "checkpoint_committed"))


def newest_checkpoint(ckpt: Path) -> int:
    return max(int(p.name[5:]) for p in ckpt.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())


def flip_a_bit(step_dir: Path) -> None:
    """One bit in the middle of the largest shard: the size stays, only the hashes can tell."""
    shard = max((p for p in step_dir.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory) -> Path:
    return reference(private_dir(tmp_path_factory.mktemp("lightning-reference")))


def launch(tmp: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    (tmp / "job.toml").write_text(CONFIG)
    run, out = tmp / "run", tmp / "out"
    argv = [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(tmp / "job.toml"),
            "--run-dir", str(run), str(SCRIPT), *ARGS, "--step-s", "0.1", "--out", str(out), *extra]
    proc = subprocess.Popen(argv, cwd=tmp, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        flip_a_bit(run / "checkpoints" / f"step_{newest}")
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
    assert proc.returncode == 0, console.decode()[-4000:]
    assert [f["kind"] for f in named(events, "failure_detected")] == ["crash", "crash"]
    loaded = sorted({e["step"] for e in named(events, "checkpoint_loaded")})
    rejected = {e["step"] for e in named(events, "checkpoint_rejected")}
    assert rejected == {second}, rejected
    assert loaded == [first, second - 5], loaded   # the corrupt one refused, the one before it used
    assert named(events, "run_complete") and not named(events, "give_up")
    # Lightning's DDP strategy hands attach the DDP wrapper: its replicas are fingerprinted at
    # every save at the defaults (docs/sdc.md), and every check agreed (no sdc failure above)
    assert b"no replica fingerprints" not in console and any(e.get("sdc_s", 0) > 0 for e in events), console[-2000:]
    assert_same_run(out, lightning_reference)


def test_sigterm_to_the_ranks_stops_them_at_one_step_with_an_emergency_checkpoint_and_exit_preempted(
        tmp_path: Path, lightning_reference: Path) -> None:
    """SIGTERM straight to both ranks, as Slurm's preemption sends it (plain torchrun: no supervisor
    to ask them): ckptsup's handler, not Lightning's, takes it; the ranks agree on a stop step, save
    (the budget fits the measured save) and exit 5, never 0; the resumed run equals the reference."""
    tmp = private_dir(tmp_path)
    out, ckpt = tmp / "out", tmp / "ck"
    def argv() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), str(SCRIPT), *ARGS, "--step-s", "0.1", "--out", str(out),
                "--ckpt-dir", str(ckpt)]

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
