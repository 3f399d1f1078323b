"""A corrupt real DCP checkpoint is never loaded: resume quarantines it and uses the previous one;
nothing of a checkpoint is unpickled before its manifest checks pass."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir, train_steps

from ckptsup.checkpoint.catalog import Status, list_checkpoints
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.hooks.reader import VerifyingReader, load_metadata_bytes
from ckptsup.errors import CheckpointError
from ckptsup.hooks.testload import test_load as run_test_load

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def fast_housekeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


def two_checkpoints(base: Path) -> Path:
    """step_2 and step_4 of a real run (sync saves), returns the checkpoint dir."""
    ck = private_dir(base) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    assert run.resume() == 0
    train_steps(run, *parts, 0, 4)
    run.close()
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
    return ck


def resume_step(ck: Path) -> tuple[int, torch.nn.Module]:
    parts = make_parts(seed=99)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    try:
        return run.resume(), parts[0]
    finally:
        run.close(final_save=False)


def shard(step_dir: Path) -> Path:
    return next(p for p in sorted(step_dir.iterdir()) if p.suffix == ".distcp")


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def corrupt_bitflip(step: Path) -> None:
    f = shard(step)
    flip_bit(f, f.stat().st_size // 2)


def corrupt_truncate(step: Path) -> None:
    f = shard(step)
    os.truncate(f, f.stat().st_size - 100)


def corrupt_missing_file(step: Path) -> None:
    shard(step).unlink()


def corrupt_missing_manifest(step: Path) -> None:
    (step / "manifest.json").unlink()


def corrupt_escaping_manifest(step: Path) -> None:
    data = json.loads((step / "manifest.json").read_text())
    data["files"][0]["path"] = "../x"
    (step / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize("corrupt", [corrupt_bitflip, corrupt_truncate, corrupt_missing_file,
                                     corrupt_missing_manifest, corrupt_escaping_manifest],
                         ids=lambda f: f.__name__.removeprefix("corrupt_"))
def test_a_corrupt_newest_checkpoint_is_rejected_and_resume_uses_the_previous(tmp_path: Path, corrupt) -> None:
    ck = two_checkpoints(tmp_path)
    saved_at_2 = VerifyingReader(ck / "step_2").manifest.checkpoint_id
    corrupt(ck / "step_4")
    step, _ = resume_step(ck)
    assert step == 2
    assert load_manifest(ck / "step_2").checkpoint_id == saved_at_2
    if corrupt in (corrupt_missing_manifest, corrupt_escaping_manifest):
        # without a valid manifest it never was a checkpoint: the catalog skips it, resume never reads it
        info = next(i for i in list_checkpoints(ck) if i.step == 4)
        assert info.status is Status.INCOMPLETE and info.problem
    else:
        quarantined = list((ck / "quarantine").iterdir())
        assert [q.name.split("-")[0] for q in quarantined] == ["step_4"]
        assert not (ck / "step_4").exists()


def test_resume_from_a_good_checkpoint_restores_exactly_what_was_saved(tmp_path: Path) -> None:
    ck = two_checkpoints(tmp_path)
    shutil.rmtree(ck / "step_2")
    parts = make_parts()
    run = attach_parts(parts, tmp_path / "ck2", async_save=False)
    run.resume()
    train_steps(run, *parts, 0, 4)
    run.close(final_save=False)
    step, model = resume_step(ck)
    assert step == 4
    for a, b in zip(parts[0].parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_one_hundred_random_bit_flips_are_all_detected(tmp_path: Path) -> None:
    ck = two_checkpoints(tmp_path)
    good = ck / "step_4"
    run_test_load(good)  # the unflipped checkpoint loads
    files = [p for p in good.iterdir() if p.suffix == ".distcp" or p.name == ".metadata"]
    rng = random.Random(1234)
    detected = 0
    for i in range(100):
        copy = tmp_path / f"flip{i}" / "step_4"
        shutil.copytree(good, copy)
        target = copy / rng.choice(files).name
        flip_bit(target, rng.randrange(target.stat().st_size), rng.randrange(8))
        try:
            run_test_load(copy)
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            detected += 1
        shutil.rmtree(copy.parent)
    assert detected == 100


def test_a_malicious_metadata_pickle_is_never_unpickled_when_the_manifest_check_fails(tmp_path: Path) -> None:
    ck = two_checkpoints(tmp_path)
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    (ck / "step_4" / ".metadata").write_bytes(pickle.dumps(Evil()))
    step, _ = resume_step(ck)
    assert step == 2
    assert not canary.exists()
    # and even when pointed at it explicitly, as the supervisor would with CKPTSUP_RESUME_FROM
    shutil.copytree(ck / "quarantine" / next(iter(os.listdir(ck / "quarantine"))), tmp_path / "evil" / "step_4")
    os.chmod(tmp_path / "evil", 0o700)
    (tmp_path / "evil" / "step_4" / "quarantine_reason.json").unlink()
    with pytest.raises(Exception, match="metadata"):
        VerifyingReader(tmp_path / "evil" / "step_4").read_metadata()
    assert not canary.exists()


def test_the_metadata_unpickler_refuses_anything_but_dcp_classes(tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    with pytest.raises(Exception, match="not allowed"):
        load_metadata_bytes(pickle.dumps(Evil()))
    assert not canary.exists()


def test_a_checkpoint_that_does_not_fit_the_model_stops_resume_instead_of_starting_over(tmp_path: Path) -> None:
    ck = two_checkpoints(tmp_path)
    model, opt, sched, loader = make_parts()
    wider = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    run = attach_parts((wider, torch.optim.AdamW(wider.parameters()), None, loader), ck)
    try:
        with pytest.raises(CheckpointError, match="cannot be loaded into this model") as err:
            run.resume()
        assert "\n" not in str(err.value)
    finally:
        run.close(final_save=False)
    assert (ck / "step_4").is_dir() and not (ck / "quarantine").exists()  # a good checkpoint is not quarantined


def test_the_writers_read_back_hashes_each_item_and_refuses_a_shard_shorter_than_its_items(tmp_path: Path) -> None:
    from ckptsup.checkpoint.hashing import hash_bytes
    from ckptsup.hooks.writer import hash_file_and_items

    data = os.urandom(3000)
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(data)
    items = [("b@0", 1000, 2000), ("a@0", 0, 1000), ("empty@0", 3000, 0)]
    size, whole, hashes = hash_file_and_items(shard, items, "xxh3-128", copy_to=tmp_path / "copy")
    assert size == 3000 and whole == hash_bytes(data, "xxh3-128")
    assert hashes == {"a@0": hash_bytes(data[:1000], "xxh3-128"), "b@0": hash_bytes(data[1000:], "xxh3-128"),
                      "empty@0": hash_bytes(b"", "xxh3-128")}
    assert (tmp_path / "copy").read_bytes() == data
    shard.write_bytes(data[:2500])  # DCP's metadata says more than the file holds
    with pytest.raises(CheckpointError, match="is 2500 bytes but DCP says item b@0 ends at 3000"):
        hash_file_and_items(shard, items, "xxh3-128")


def test_an_untrusted_newest_checkpoint_is_skipped_without_quarantine_and_resume_uses_the_previous(tmp_path: Path) -> None:
    """Without a supervisor the hooks judge trust as pick_resume does: skip, keep, fall back."""
    ck = two_checkpoints(tmp_path)
    os.chmod(ck / "step_4", 0o777)   # writable by others: it may not be read, but it is not corrupt
    try:
        step, _ = resume_step(ck)
        assert step == 2
        assert (ck / "step_4").exists() and not (ck / "quarantine").exists()
        os.chmod(ck / "step_2", 0o777)
        from ckptsup.checkpoint.trust import CheckpointDirUntrusted

        with pytest.raises(CheckpointDirUntrusted, match="2 untrusted one"):
            resume_step(ck)   # nothing usable left: stop rather than start over
    finally:
        os.chmod(ck / "step_4", 0o700)
        os.chmod(ck / "step_2", 0o700)
