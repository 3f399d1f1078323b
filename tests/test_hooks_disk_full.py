"""Disk full in the middle of a save (a real, small tmpfs; needs root to mount): the save fails on
all ranks without a hang, the previous checkpoints stay intact, and training continues."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks_helpers import private_dir, run_train, small_tmpfs

from ckptsup.checkpoint.validate import validate
from ckptsup.events import read_events

pytestmark = pytest.mark.torch

# --hidden 1024: ~300 KB per checkpoint; 800 KB hold step_3 and step_6, step_9 runs out mid-write
ARGS = ["--steps", "12", "--save-every-steps", "3", "--hidden", "1024"]


@pytest.fixture
def disk_800k(tmp_path: Path):
    with small_tmpfs(tmp_path / "tmpfs", "800k") as mnt:
        yield mnt


def test_disk_full_mid_save_fails_on_all_ranks_keeps_the_previous_and_training_continues(disk_800k: Path, tmp_path: Path) -> None:
    run_dir = private_dir(tmp_path / "run")
    ck = disk_800k / "ck"
    proc = run_train(2, [*ARGS, "--checkpoint-dir", str(ck), "--out", str(tmp_path / "out")],
                     env={"CKPTSUP_RUN_DIR": str(run_dir)}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # training went on to the end
    assert "step 11 rank 0" in proc.stdout and "step 11 rank 1" in proc.stdout
    # the failure was seen on both ranks, and reported as an event
    for rank in (0, 1):
        assert f"rank {rank}: checkpoint of step 9 FAILED on every rank" in proc.stderr
    events = read_events(run_dir)
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert 9 in [e["step"] for e in failed] and all(e["reason"] for e in failed)
    assert committed[:2] == [3, 6]
    # the previous checkpoints are intact; nothing half-written is left
    for step in (3, 6):
        assert validate(ck / f"step_{step}", level=2, record=False).ok
    assert not (ck / "step_9").exists()
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
