"""Bit-exact resume with 2 data-parallel ranks (docs/training.md §Bit-exact resume: with 2 ranks
gloo's all-reduce sum is order-free, so an interrupted run can equal an uninterrupted one bit for
bit on CPU).

Each test compares a run that is SIGKILLed (every process: torchrun and both ranks) and resumed
with one uninterrupted run of the same N steps: parameters, optimizer state and the sample ids of
every step on every rank must be identical."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hooks_helpers import Running, assert_states_equal, load_final, private_dir, read_samples, run_train

pytestmark = pytest.mark.torch

STEPS = 14
ARGS = ["--steps", str(STEPS), "--save-every-steps", "3", "--step-sleep-s", "0.05"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    base = private_dir(tmp_path_factory.mktemp("reference"))
    proc = run_train(2, [*ARGS, "--checkpoint-dir", str(base / "ck"), "--out", str(base / "out")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return base / "out"


def assert_same_as_reference(out: Path, reference: Path) -> None:
    for rank in (0, 1):
        assert_states_equal(load_final(out, rank), load_final(reference, rank))
        got, want = read_samples(out, rank), read_samples(reference, rank)
        assert sorted(got) == list(range(STEPS))
        assert got == want, f"rank {rank} saw other samples than the uninterrupted run"


def test_sigkill_at_a_random_step_then_resume_is_bit_exact(tmp_path: Path, reference: Path) -> None:
    kill_step = random.Random().randint(4, STEPS - 3)
    print(f"killing at step {kill_step}")
    args = [*ARGS, "--checkpoint-dir", str(private_dir(tmp_path) / "ck"), "--out", str(tmp_path / "out")]
    run = Running(2, args)
    run.wait_for(lambda: run.saw(f"step {kill_step} rank 0") and run.saw(f"step {kill_step} rank 1"))
    run.sigkill_all()
    resumed = run_train(2, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_as_reference(tmp_path / "out", reference)


def test_sigkill_during_an_async_save_and_during_a_load_then_resume_is_bit_exact(tmp_path: Path, reference: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    args = [*ARGS, "--checkpoint-dir", str(ck), "--out", str(tmp_path / "out")]
    # 1. kill while the second save (step 6) is written but not committed
    run = Running(2, args, env={"CKPTSUP_TEST_SAVE_DELAY_S": "30"})
    run.wait_for(lambda: run.saw("delaying the commit of step 6"))
    assert any(p.name.startswith(".tmp-step_6-") for p in ck.iterdir())
    run.sigkill_all()
    assert not (ck / "step_6").exists(), "an uncommitted save became a checkpoint"
    assert (ck / "step_3").is_dir()
    # 2. kill while the resume is loading
    run = Running(2, args, env={"CKPTSUP_TEST_LOAD_DELAY_S": "30"})
    run.wait_for(lambda: run.saw("delaying the load of step_3"))
    run.sigkill_all()
    # 3. resume for real
    resumed = run_train(2, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_as_reference(tmp_path / "out", reference)
