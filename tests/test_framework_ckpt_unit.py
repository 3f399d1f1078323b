"""framework_ckpt.FrameworkCheckpoints (hashes of a framework's own checkpoints) and
lightning_ckpt.pick (which .ckpt Lightning loads) on real files, with a test load that is a
function of the test: the choice logic alone. The real Lightning / HF runs are in
tests/test_integration_lightning_frameworks.py and tests/test_integration_hf_save_strategy.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.checkpoint.external import quarantine_dir
from ckptsup.integrations.framework_ckpt import FrameworkCheckpoints
from ckptsup.integrations.framework_ckpt import pick

from hooks_helpers import private_dir


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[FrameworkCheckpoints, Path]:
    base = private_dir(tmp_path)
    folder = base / "pl"
    folder.mkdir(mode=0o700)
    recorder = FrameworkCheckpoints(base / "ck", "xxh3-128")
    for step in (5, 10, 15):
        (folder / f"step={step}.ckpt").write_bytes(bytes([step]) * 1000)
        recorder.record(folder / f"step={step}.ckpt", step)
    return recorder, folder


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[500] ^= 1
    path.write_bytes(bytes(data))


def steps_by_byte(path: Path) -> int:
    return path.read_bytes()[0]


def test_a_file_and_a_folder_pass_after_the_save_and_fail_once_a_bit_flips(setup, tmp_path):
    recorder, folder = setup
    assert recorder.verify(folder / "step=10.ckpt").problems == []
    flip(folder / "step=10.ckpt")
    [problem] = recorder.verify(folder / "step=10.ckpt").problems
    assert "pl/step=10.ckpt: hash" in problem and "(corrupted)" in problem
    hf = private_dir(tmp_path / "hf")
    (hf / "checkpoint-4").mkdir(mode=0o700)
    (hf / "checkpoint-4" / "model.safetensors").write_bytes(b"w" * 64)
    recorder.record(hf / "checkpoint-4", 4)
    assert recorder.verify(hf / "checkpoint-4").problems == []
    (hf / "checkpoint-4" / "model.safetensors").write_bytes(b"w" * 63)
    assert "63 bytes, 64 when it was saved" in recorder.verify(hf / "checkpoint-4").problems[0]


def test_no_manifest_is_hashed_and_adopted_and_a_removed_file_forgets_its_manifest(setup):
    recorder, folder = setup
    (folder / "last.ckpt").write_bytes(b"x" * 10)
    verdict = recorder.verify(folder / "last.ckpt")
    assert verdict.problems == [] and verdict.how == "hashes (adopted at resume)"
    assert recorder.manifest(folder / "last.ckpt") is not None
    (folder / "step=5.ckpt").unlink()
    recorder.forget(folder / "step=5.ckpt")
    assert recorder.manifest(folder / "step=5.ckpt") is None


def test_pick_refuses_the_corrupt_newest_moves_it_aside_and_takes_the_older(setup):
    recorder, folder = setup
    flip(folder / "step=15.ckpt")
    choice = pick(str(folder / "step=15.ckpt"), recorder, 0, steps_by_byte)
    assert choice.path == str(folder / "step=10.ckpt") and choice.step == 10 and choice.checked == "hashes"
    [(name, step, reason, where)] = choice.rejected
    assert name == "step=15.ckpt" and step == 15 and "(corrupted)" in reason
    assert Path(where).parent == quarantine_dir(folder) and not (folder / "step=15.ckpt").exists()


def test_pick_leaves_the_resume_to_ckptsup_when_its_own_is_as_new_without_reading_the_file(setup):
    recorder, folder = setup

    def never(path: Path) -> int:
        raise AssertionError("read although ckptsup's own checkpoint is as new")

    assert pick(str(folder / "step=15.ckpt"), recorder, 15, never).path is None
    flip(folder / "step=15.ckpt")
    choice = pick(str(folder / "step=15.ckpt"), recorder, 10, steps_by_byte)
    assert choice.path is None and len(choice.rejected) == 1 and choice.error is None   # 10 is ckptsup's: as new


def test_pick_with_nothing_valid_and_no_ckptsup_checkpoint_stops_with_one_line(setup):
    recorder, folder = setup

    def broken(path: Path) -> int:
        raise ValueError("unpickling error\ninvalid load key")

    choice = pick(str(folder / "step=15.ckpt"), recorder, 0, broken)
    assert choice.path is None and len(choice.rejected) == 3
    assert "test load failed: ValueError: invalid load key" in choice.rejected[0][2]
    assert choice.error is not None and "\n" not in choice.error and "rerun to start fresh" in choice.error
