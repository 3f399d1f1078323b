"""ckptsup.integrations.hf without a training run: the TrainerState extra, HF's mid-epoch rule,
the callback's signature and bad use, and rank 0's choice of checkpoint (a real single-process
ckptsup checkpoint, read back verified; a corrupt one quarantined, a foreign one refused)."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.errors import CheckpointError, ConfigError
from ckptsup.hooks import rank_link
from ckptsup.integrations import hf
from ckptsup.integrations.hf_state import (STATE_EXTRA, TrainerStateExtra, choose_checkpoint, read_trainer_state,
                                           write_state_folder)

from hooks_helpers import private_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch


def test_the_trainer_state_round_trips_but_each_process_keeps_its_own_rank_fields():
    saved = transformers.TrainerState(global_step=8, epoch=1.25, log_history=[{"loss": float("nan"), "step": 5}],
                                      is_world_process_zero=True, is_local_process_zero=True, max_steps=24)
    live = transformers.TrainerState(is_world_process_zero=False, is_local_process_zero=False, max_steps=30)
    TrainerStateExtra(live).load_state_dict(TrainerStateExtra(saved).state_dict())
    assert (live.global_step, live.epoch, live.log_history[0]["step"]) == (8, 1.25, 5)
    assert live.is_world_process_zero is False and live.is_local_process_zero is False and live.max_steps == 30


@pytest.mark.parametrize("step,batches,gas,mid", [(8, 6, 1, True), (12, 6, 1, False), (0, 6, 1, False),
                                                  (3, 6, 2, False), (4, 7, 2, False), (5, 7, 2, True), (5, None, 1, True)])
def test_mid_epoch_follows_hfs_own_rule(step, batches, gas, mid):
    args = types.SimpleNamespace(gradient_accumulation_steps=gas, ignore_data_skip=False)
    state = types.SimpleNamespace(global_step=step, max_steps=24)
    loader = object() if batches is None else list(range(batches))
    assert hf._resumes_mid_epoch(args, state, loader) is mid


def test_the_callback_takes_no_required_argument_and_only_keyword_options():
    hf.CkptsupCallback()
    hf.CkptsupCallback(save_every_steps=5, checkpoint_dir="/tmp/x")
    with pytest.raises(TypeError):
        hf.CkptsupCallback(5)  # type: ignore[misc]


def test_resume_path_without_the_callback_says_what_to_add():
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=[]))
    with pytest.raises(ConfigError, match=r"callbacks=\[ckptsup.integrations.hf.CkptsupCallback\(\)\]"):
        hf.resume_path(trainer)


def _save(ck: Path, steps: list[int], monkeypatch, *, extra: bool = True) -> None:
    """Real ckptsup checkpoints of a tiny model, one process, with the TrainerState extra."""
    import ckptsup

    monkeypatch.setattr(rank_link, "_CLAIM", rank_link.HooksClaim())   # a fresh process's claim
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = transformers.TrainerState()
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ck), save_every_s=3600,
                         extra={STATE_EXTRA: TrainerStateExtra(state)} if extra else {})
    for step in range(max(steps)):
        state.global_step = step + 1
        run.step_done(step)
        if step + 1 in steps:
            run.save(blocking=True)
    run.close(final_save=False)


def test_rank_zero_chooses_the_newest_whose_state_reads_back_verified(tmp_path, monkeypatch):
    ck = private_dir(tmp_path) / "ck"
    _save(ck, [2, 4], monkeypatch)
    assert read_trainer_state(ck / "step_4")["global_step"] == 4
    manifest = load_manifest(ck / "step_4")
    [item] = [i for i in manifest.items if i.key.startswith("ckptsup/extra/" + STATE_EXTRA)]
    path = ck / "step_4" / item.file
    data = bytearray(path.read_bytes())
    data[item.offset + item.length // 2] ^= 1
    path.write_bytes(bytes(data))
    choice = choose_checkpoint(ck, None)
    assert choice.error is None and choice.step == 2 and choice.path == str(ck / "step_2")
    assert [Path(p).name for p, _ in choice.rejected] == ["step_4"] and "hash" in choice.rejected[0][1]
    assert not (ck / "step_4").exists() and any((ck / "quarantine").iterdir())
    folder = write_state_folder(ck, 1, choice.state)
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["trainer_state.json"]      # no weights in it
    assert (folder.stat().st_mode & 0o777, (folder / "trainer_state.json").stat().st_mode & 0o777) == (0o700, 0o600)
    assert transformers.TrainerState.load_from_json(str(folder / "trainer_state.json")).global_step == 2


def test_a_checkpoint_without_the_trainer_state_stops_with_one_line(tmp_path, monkeypatch):
    ck = private_dir(tmp_path) / "ck"
    _save(ck, [3], monkeypatch, extra=False)
    with pytest.raises(CheckpointError, match="holds no HF TrainerState"):
        read_trainer_state(ck / "step_3")
    choice = choose_checkpoint(ck, None)
    assert choice.path is None and "holds no HF TrainerState" in choice.error
    assert (ck / "step_3").is_dir()   # not corrupt: not quarantined


def test_a_fresh_start_chooses_nothing(tmp_path):
    choice = choose_checkpoint(private_dir(tmp_path) / "none-yet", None)
    assert (choice.path, choice.step, choice.error, choice.rejected) == (None, 0, None, [])
