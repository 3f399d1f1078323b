"""Elastic resume: a checkpoint saved at world size 2 resumes at 1 and at 4. The loaded model and
optimizer equal what was saved (DCP reshards them), and over the whole run no sample is repeated or
skipped: the global sample index is the data position, not the per-rank loader state."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hooks_helpers import assert_states_equal, load_final, private_dir, read_samples, run_train

pytestmark = pytest.mark.torch

DATASET = 64
BATCH = 4
COMMON = ["--dataset-size", str(DATASET), "--batch-size", str(BATCH), "--save-every-steps", "3"]


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory) -> Path:
    base = private_dir(tmp_path_factory.mktemp("elastic"))
    proc = run_train(2, [*COMMON, "--steps", "6", "--checkpoint-dir", str(base / "ck"), "--out", str(base / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (base / "ck" / "step_6").is_dir()
    return base


def resumed_copy(saved: Path, dest: Path) -> Path:
    private_dir(dest)
    shutil.copytree(saved / "ck", dest / "ck")
    return dest


@pytest.mark.parametrize("world", [1, 4])
def test_a_checkpoint_saved_at_world_2_loads_the_same_model_and_optimizer_at_another_world_size(
        saved_at_two: Path, tmp_path: Path, world: int) -> None:
    run = resumed_copy(saved_at_two, tmp_path / f"w{world}")
    proc = run_train(world, [*COMMON, "--steps", "6", "--checkpoint-dir", str(run / "ck"), "--out", str(run / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = load_final(saved_at_two / "out", 0)
    for rank in range(world):
        assert_states_equal(load_final(run / "out", rank), saved)


def epoch_permutation(epoch: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(DATASET, generator=gen).tolist()


def test_resuming_at_world_4_neither_repeats_nor_skips_a_sample(saved_at_two: Path, tmp_path: Path) -> None:
    run = resumed_copy(saved_at_two, tmp_path / "w4")
    proc = run_train(4, [*COMMON, "--steps", "10", "--checkpoint-dir", str(run / "ck"), "--out", str(run / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    consumed: list[int] = []
    for out, world, steps in ((saved_at_two / "out", 2, range(0, 6)), (run / "out", 4, range(6, 10))):
        per_rank = [read_samples(out, r) for r in range(world)]
        for step in steps:
            # rank r of W takes perm[g + i*W + r]: interleave the ranks to get the global order
            for i in range(BATCH):
                consumed.extend(per_rank[r][step][i] for r in range(world))
    # 6 steps x 8 samples at world 2 = 48 of epoch 0; step 6 at world 4 takes its last 16;
    # steps 7-9 take the first 48 of epoch 1
    assert consumed == epoch_permutation(0) + epoch_permutation(1)[:48]
