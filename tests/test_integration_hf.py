"""The HF Trainer with ckptsup.integrations.hf.CkptsupCallback under the real `ckptsup launch`
(local mode, real torchrun, transformers 5.24 + accelerate 1.15, 2 gloo ranks on CPU).

One supervised run with chained faults — a rank SIGKILLed mid-epoch; the newest checkpoint
corrupted while rank 0 is stopped, then rank 0 SIGKILLed; a SIGTERM to the supervisor (a
preemption) and a relaunch in the same run dir — must train on exactly the samples of an
uninterrupted run without ckptsup (per step, per rank: none repeated, none skipped) and end with
its parameters bit for bit. A NaN loss on one rank is reported and ends that rank with RANK_NAN."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import Status, list_checkpoints
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.env import ExitStatus
from ckptsup.events import read_events

import run_helpers
from drop_in_helpers import rank_process
from hooks_helpers import FakeAgent, base_env, private_dir
from run_helpers import assert_same_run, flip_a_bit, named, newest_sample_step, uninterrupted, wait_for

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "hf_train.py"
STEPS = 24          # 48 samples / (2 ranks x 4) = 6 steps per epoch, 4 epochs
SAVE_EVERY = 4      # step_8 resumes mid-epoch (8 % 6 = 2), step_12 at an epoch boundary
ARGS = ["--save-every-steps", str(SAVE_EVERY), "--step-sleep-s", "0.25"]


def torchrun(out: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_helpers.torchrun(SCRIPT, "--out", str(out), *args, env=env, timeout=timeout)


def committed(ckpts: Path) -> list[int]:
    return [i.step for i in list_checkpoints(ckpts) if i.status in (Status.COMMITTED, Status.VALIDATED)]


def corrupt_newest(ckpts: Path) -> int:
    """Flip a bit in the middle of the newest checkpoint's largest shard (its size stays right)."""
    step = max(committed(ckpts))
    flip_a_bit(max((ckpts / f"step_{step}").glob("*.distcp"), key=lambda p: p.stat().st_size))
    return step


def launch(tmp: Path, run: Path, out: Path, *resume: str) -> subprocess.Popen:
    config = ("[supervisor]\nhang_min_s = 8.0\nheartbeat_interval_s = 0.5\n"
              "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n"
              "[memory]\nenabled = false\n")   # the disk tier's resumes (memory: test_integration_hf_memory.py)
    return run_helpers.launch(tmp, run, SCRIPT, "--out", str(out), *ARGS, config=config, launch_args=resume)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same Trainer, uninterrupted, without ckptsup, under plain torchrun."""
    out = tmp_path_factory.mktemp("hf-reference") / "out"
    # without the step sleep: it changes no sample and no parameter
    uninterrupted(SCRIPT, "--out", str(out), "--mode", "none", *ARGS, "--step-sleep-s", "0")
    return out


def test_hf_trainer_survives_a_kill_a_corrupt_checkpoint_and_a_preemption_bit_exact(tmp_path, reference):
    tmp = private_dir(tmp_path)
    run, out = tmp / "run", tmp / "out"
    ckpts = run / "checkpoints"
    proc = launch(tmp, run, out)
    try:
        # 1. SIGKILL rank 1 mid-epoch, once step_8 is committed (the resume skips 2 batches into epoch 2)
        wait_for(lambda: 8 in committed(ckpts) and newest_sample_step(out) >= 9, 180, "step_8", proc)
        rank_process(SCRIPT, out, 1).kill()
        wait_for(lambda: len(named(read_events(run), "checkpoint_loaded")) >= 1, 180, "the first resume", proc)
        # 2. freeze rank 0 (nothing can commit), corrupt the newest checkpoint, SIGKILL rank 0
        wait_for(lambda: max(committed(ckpts), default=0) >= 16 and newest_sample_step(out) >= 17, 180, "step_16", proc)
        victim = rank_process(SCRIPT, out, 0)
        victim.suspend()
        corrupted = corrupt_newest(ckpts)
        victim.kill()
        wait_for(lambda: len(named(read_events(run), "checkpoint_loaded")) >= 2, 180, "the second resume", proc)
        # 3. a preemption: SIGTERM to the supervisor stops the ranks; a relaunch in the same run dir resumes
        # after a commit of this attempt: its save time is measured, so an emergency save can fit
        loaded = named(read_events(run), "checkpoint_loaded")[-1]["step"]
        measured = loaded + SAVE_EVERY
        wait_for(lambda: measured in committed(ckpts) and newest_sample_step(out) >= measured + 1, 180,
                 f"step_{measured}", proc)
        proc.send_signal(signal.SIGTERM)
        console, _ = proc.communicate(timeout=120)
        assert proc.returncode == int(ExitStatus.PREEMPTED), console[-3000:]
        preempted_events = read_events(run)
        proc = launch(tmp, run, out, "--resume")   # as the requeued job's launch does
        console, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, console[-3000:]
    events = read_events(run)
    assert [f["kind"] for f in named(events, "failure_detected")] == ["crash", "crash", "preempted"]
    assert not named(preempted_events, "run_complete") and len(named(events, "run_complete")) == 1
    launches = named(events, "launch")
    loads = named(events, "checkpoint_loaded")
    # each resume loaded the newest checkpoint committed before its launch, but the corrupt one
    first_commits = [e["step"] for e in named(events, "checkpoint_committed") if e["ts"] < launches[1]["ts"]]
    assert loads[0]["step"] == max(first_commits) >= 8
    [rejected] = named(events, "checkpoint_rejected")
    assert rejected["step"] == corrupted
    assert loads[1]["step"] == corrupted - SAVE_EVERY
    # locally the supervisor knows no grace time (budget 0): the ranks stop at the agreed step
    # (stop_at) without an emergency save, and exit RANK_STOPPED through HF's train() (never 0)
    assert len(loads) == 3 and loads[2]["step"] >= measured
    [preemption] = named(events, "preemption")
    assert preemption["emergency_save"] is False
    log = "".join(p.read_text(errors="replace") for p in run.glob("attempt-*/ranks-*.log"))
    assert log.count("exits with RANK_STOPPED") == 2
    assert_same_run(out, reference, STEPS)


def test_a_nan_loss_on_one_rank_is_reported_and_ends_it_with_rank_nan(tmp_path):
    """One process under a stand-in agent: the loss HF's training_step returned for step 5 is NaN."""
    tmp = private_dir(tmp_path)
    agent = FakeAgent(tmp)
    try:
        env = base_env({**agent.env(), "CKPTSUP_CHECKPOINT_DIR": str(tmp / "ck")})
        proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp / "out"), "--nan-at-step", "5",
                               "--nan-rank", "0", "--epochs", "1"], env=env, capture_output=True, text=True, timeout=180)
        agent.wait_ended(1)
    finally:
        agent.close()
    assert proc.returncode == int(ExitStatus.RANK_NAN), proc.stderr[-3000:]
    [nan] = agent.of("nan")
    assert nan["step"] == 5 and nan["loss"] == "nan"
    assert agent.last_step() == 4


def test_a_checkpoint_that_fails_only_while_loading_is_quarantined_and_the_next_start_uses_the_previous(tmp_path):
    """resume_path vets the checkpoint's structure and its TrainerState; a model item whose hash
    fails is found by the full load in on_train_begin, after HF positioned its data for that
    checkpoint: it is quarantined and the rank fails, so the restart resumes from the one before."""
    tmp = private_dir(tmp_path)
    ck, out = tmp / "ck", tmp / "out"
    one = [sys.executable, str(SCRIPT), "--out", str(out), "--checkpoint-dir", str(ck), "--save-every-steps", "4"]
    first = subprocess.run([*one, "--epochs", "1"], env=base_env(), capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert committed(ck) == [4, 8, 12]
    manifest = load_manifest(ck / "step_12")
    item = max((i for i in manifest.items if i.key.startswith("model.")), key=lambda i: i.length)
    shard = ck / "step_12" / item.file
    data = bytearray(shard.read_bytes())
    data[item.offset + item.length // 2] ^= 1
    shard.write_bytes(bytes(data))
    failed = subprocess.run([*one, "--epochs", "2"], env=base_env(), capture_output=True, text=True, timeout=180)
    assert failed.returncode != 0 and "step_12 was rejected while loading" in failed.stderr, failed.stderr[-3000:]
    assert committed(ck) == [4, 8] and any((ck / "quarantine").iterdir())
    again = subprocess.run([*one, "--epochs", "2"], env=base_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [json.loads(line)["step"] for line in (out / "samples_rank0.jsonl").read_text().splitlines()]
    assert lines == [*range(12), *range(8, 24)], "the restart resumed from step_8"
