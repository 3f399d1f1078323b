"""The HF Trainer with `save_strategy="steps"` beside ckptsup's callback (issue 24 part 4): real
transformers 5.24, 2 gloo ranks on CPU under plain torchrun (tests/helpers/hf_train.py
--hf-save-steps). HF's checkpoint-N folders are hashed when HF saves them (on_save), and
`resume_path()` picks the newest valid checkpoint of either kind:

- ckptsup's own checkpoints too rare to exist: the newest checkpoint-N corrupted after rank 1's
  SIGKILL is refused and moved aside, HF resumes from the older one;
- ckptsup's own checkpoint (step 12) newer than HF's newest folder (checkpoint-10): ckptsup's is used.

Both end on the samples and parameters of an uninterrupted run without ckptsup."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.checkpoint.external import quarantine_dir

from hooks_helpers import private_dir
from run_helpers import assert_same_run, resumed_at, uninterrupted
from test_integration_hf import SCRIPT, torchrun

pytestmark = pytest.mark.torch

STEPS = 24          # 48 samples / (2 ranks x 4) = 6 steps per epoch, 4 epochs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-save-strategy-reference") / "out"
    uninterrupted(SCRIPT, "--out", str(out), "--mode", "none")
    return out


def test_a_corrupt_newest_checkpoint_folder_is_refused_and_the_older_one_resumed(tmp_path, reference):
    tmp = private_dir(tmp_path)
    out, ck = tmp / "out", tmp / "ck"
    args = ("--save-every-steps", "1000", "--hf-save-steps", "5", "--die-at", "17", "--checkpoint-dir", str(ck))
    first = torchrun(out, *args)
    assert first.returncode != 0 and (out / "died").exists(), first.stderr[-3000:]
    hf = out / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["checkpoint-10", "checkpoint-15", "checkpoint-5"]
    assert sorted(p.name for p in (ck / "framework" / "external").iterdir()) == [
        "checkpoint-10.json", "checkpoint-15.json", "checkpoint-5.json"]   # hashed when HF saved them
    weights = hf / "checkpoint-15" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1   # a bit of a weight: the size stays, the hash tells
    weights.write_bytes(bytes(data))
    second = torchrun(out, *args)
    console = second.stdout + second.stderr
    assert second.returncode == 0, console[-4000:]
    assert "moved checkpoint-15 out of" in console and "model.safetensors: hash" in console
    moved = [p.name for p in quarantine_dir(hf).iterdir() if not p.name.endswith(".json")]
    assert len(moved) == 1 and moved[0].startswith("checkpoint-15-"), moved
    assert resumed_at(out, 1) == 10
    assert_same_run(out, reference, STEPS)


def test_ckptsups_own_newer_checkpoint_wins_over_an_older_checkpoint_folder(tmp_path, reference):
    tmp = private_dir(tmp_path)
    out, ck = tmp / "out", tmp / "ck"
    # rank 1 dies at step 15: 3 steps of 0.3 s after ckptsup's async save of step 12 began
    args = ("--save-every-steps", "4", "--hf-save-steps", "10", "--die-at", "15", "--step-sleep-s", "0.3",
            "--checkpoint-dir", str(ck))
    first = torchrun(out, *args)
    assert first.returncode != 0 and (out / "died").exists(), first.stderr[-3000:]
    assert (ck / "step_12").is_dir() and (out / "hf" / "checkpoint-10").is_dir()
    second = torchrun(out, *args)
    console = second.stdout + second.stderr
    assert second.returncode == 0, console[-4000:]
    assert resumed_at(out, 1) == 12   # ckptsup's step_12: HF's newest folder is checkpoint-10
    assert_same_run(out, reference, STEPS)
