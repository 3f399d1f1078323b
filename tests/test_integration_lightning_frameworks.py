"""Lightning's own state and checkpoints beside ckptsup's callback (issue 24 part 4), real Lightning
2.6, 2 gloo ranks on CPU under plain torchrun (tests/helpers/lightning_train.py --stateful):

- a stateful DataModule (`state_dict`), a stateful callback (`Callback.state_dict` / `state_key`)
  and a key the LightningModule adds in `on_save_checkpoint` come back from ckptsup's checkpoint
  after rank 1 is SIGKILLed, with Lightning's ModelCheckpoint on beside the callback and
  `fit(ckpt_path="last")`: ckptsup's own checkpoint is newer, so Lightning loads nothing;
- ModelCheckpoint's `.ckpt` files are hashed at write; with ckptsup's own checkpoints too rare to
  exist, the newest `.ckpt` files (last.ckpt and its step file) corrupted after the kill are
  refused and moved aside, and the older one is what Lightning resumes from, at the same samples
  as an uninterrupted run (the data position rides in the .ckpt)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ckptsup.checkpoint.external import quarantine_dir

import run_helpers
from hooks_helpers import private_dir
from run_helpers import flip_a_bit, resumed_at, samples, uninterrupted
from test_integration_lightning import BATCH, EPOCHS, SAMPLES, SCRIPT, STEPS

pytestmark = pytest.mark.integration

ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH), "--stateful"]


def torchrun(out: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_helpers.torchrun(SCRIPT, *ARGS, "--out", str(out), "--ckpt-dir", str(ckpt), *extra, timeout=400,
                                cwd=out.parent)


def assert_state_and_samples(out: Path, ref: Path) -> None:
    for rank in (0, 1):
        state = json.loads((out / f"state_rank{rank}.json").read_text())
        # every batch counted once: restored, not restarted from 0 or counted twice
        assert state == {"datamodule_seen": STEPS * BATCH, "callback_batches": STEPS, "module_steps_seen": STEPS,
                         "global_step": STEPS}, (rank, state)
        assert samples(out, rank) == samples(ref, rank), f"rank {rank} trained on other samples than the reference"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    base = private_dir(tmp_path_factory.mktemp("lightning-frameworks-reference"))
    uninterrupted(SCRIPT, *ARGS, "--out", str(base / "out"), "--ckpt-dir", str(base / "ck"), "--step-s", "0",
                  "--every", "5", timeout=400, cwd=base)
    return base / "out"


def test_datamodule_callback_and_on_save_checkpoint_state_come_back_from_ckptsups_checkpoint(
        tmp_path: Path, reference: Path) -> None:
    tmp = private_dir(tmp_path)
    out, ckpt = tmp / "out", tmp / "ck"
    # ckptsup every 4 steps, ModelCheckpoint every 10, fit(ckpt_path="last"); rank 1 dies at step 15
    # (3 steps of 0.3 s after ckptsup's async save of step 12 began: time for it to commit)
    args = ("--every", "4", "--pl-every", "10", "--model-checkpoint", "--ckpt-path", "last", "--die-at", "15",
            "--step-s", "0.3")
    first = torchrun(out, ckpt, *args)
    assert first.returncode != 0 and (out / "died").exists(), first.stderr[-3000:]
    assert (ckpt / "step_12").is_dir() and (ckpt / "pl" / "last.ckpt").is_file()
    second = torchrun(out, ckpt, *args, "--step-s", "0")   # the resumed run needs no save to outrun a death
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-4000:]
    assert "Restoring states from the checkpoint path" not in text   # ckptsup's step_12 is newer than last.ckpt (10)
    assert resumed_at(out, 1) == 12
    assert_state_and_samples(out, reference)
    # ModelCheckpoint beside the callback: no conflict, at most one line about it
    assert "enable_checkpointing=False" not in text
    assert sum("ModelCheckpoint" in line and "ckptsup" in line for line in text.splitlines()) <= 1


def test_a_corrupt_newest_ckpt_is_moved_aside_and_lightning_resumes_from_the_older_one(
        tmp_path: Path, reference: Path) -> None:
    tmp = private_dir(tmp_path)
    out, ckpt = tmp / "out", tmp / "ck"
    # ckptsup's own interval (1000 steps) leaves nothing of its own to resume from: the .ckpt decides
    args = ("--every", "1000", "--pl-every", "5", "--model-checkpoint", "--ckpt-path", "last", "--die-at", "17",
            "--step-s", "0")
    first = torchrun(out, ckpt, *args)
    assert first.returncode != 0 and (out / "died").exists(), first.stderr[-3000:]
    pl_dir = ckpt / "pl"
    assert sorted(p.name for p in pl_dir.iterdir()) == ["epoch=0-step=10.ckpt", "epoch=0-step=15.ckpt",
                                                       "epoch=0-step=5.ckpt", "last.ckpt"]
    assert len(list((ckpt / "framework" / "external").iterdir())) == 4   # each .ckpt's hashes, taken at write
    for name in ("last.ckpt", "epoch=0-step=15.ckpt"):   # the newest: what "last" finds, and its step file
        flip_a_bit(pl_dir / name)
    second = torchrun(out, ckpt, *args)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-4000:]
    moved = sorted(p.name for p in quarantine_dir(pl_dir).iterdir() if not p.name.endswith(".json"))
    assert [m.split(".ckpt-")[0] for m in moved] == ["epoch=0-step=15", "last"], moved
    assert "moved last.ckpt out of" in text and "(corrupted)" in text
    assert f"Restoring states from the checkpoint path at {pl_dir / 'epoch=0-step=10.ckpt'}" in text
    assert resumed_at(out, 1) == 10
    assert_state_and_samples(out, reference)
