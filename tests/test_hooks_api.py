"""The training API in one process: refusals, settings precedence, what a checkpoint stores and
how (never pickled), RNG restore, events without a supervisor, NaN handling."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir, train_steps

import ckptsup
from ckptsup.errors import ConfigError
from ckptsup.events import read_events
from ckptsup.hooks import jsontensor
from ckptsup.hooks.reader import VerifyingReader
from ckptsup.hooks.session import NonFiniteLossError

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CKPTSUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


def test_a_plain_dataloader_is_refused_with_a_one_line_error_naming_the_fix(tmp_path: Path) -> None:
    model, opt, sched, _ = make_parts()
    plain = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(ConfigError) as err:
        ckptsup.attach(model=model, optimizer=opt, dataloader=plain, checkpoint_dir=str(tmp_path / "ck"))
    message = str(err.value)
    assert "\n" not in message
    assert "StatefulDataLoader" in message and "allow_stateless_dataloader" in message


def test_a_dataloader_whose_state_dict_fails_is_refused_at_attach_not_at_the_first_save(tmp_path: Path) -> None:
    """Accelerate's DataLoaderShard without use_stateful_dataloader has a state_dict attribute that
    fails (AttributeError: dl_state_dict): refused at attach with the fix, not a crash loop at step 10."""
    model, opt, sched, _ = make_parts()

    class Shard(torch.utils.data.DataLoader):
        def state_dict(self):
            raise AttributeError("dl_state_dict")

        def load_state_dict(self, state):
            raise AttributeError("dl_state_dict")

    with pytest.raises(ConfigError) as err:
        ckptsup.attach(model=model, optimizer=opt, dataloader=Shard(list(range(8)), batch_size=2),
                       checkpoint_dir=str(tmp_path / "ck"))
    message = str(err.value)
    assert "\n" not in message and "Shard.state_dict() fails (AttributeError: dl_state_dict)" in message
    assert "use_stateful_dataloader=True" in message and "allow_stateless_dataloader" in message


def test_the_stateless_opt_out_is_accepted(tmp_path: Path) -> None:
    model, opt, sched, _ = make_parts()
    plain = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    run = ckptsup.attach(model=model, optimizer=opt, dataloader=plain, checkpoint_dir=str(tmp_path / "ck"),
                         allow_stateless_dataloader=True)
    run.close(final_save=False)


def test_an_unknown_attach_keyword_is_refused_with_the_valid_keys(tmp_path: Path) -> None:
    model, opt, sched, loader = make_parts()
    with pytest.raises(ConfigError, match=r"unknown key checkpoint\.save_evry_steps.*did you mean save_every_steps"):
        ckptsup.attach(model=model, optimizer=opt, dataloader=loader, checkpoint_dir=str(tmp_path), save_evry_steps=3)


def test_attach_keywords_win_over_the_environment_which_wins_over_the_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKPTSUP_SAVE_EVERY_STEPS", "7")
    monkeypatch.setenv("CKPTSUP_CHECKPOINT_DIR", str(tmp_path / "from-env"))
    parts = make_parts()
    run = ckptsup.attach(model=parts[0], optimizer=parts[1], dataloader=parts[3], save_every_steps=5)
    try:
        assert run.settings.save_every_steps == 5
        assert run.settings.checkpoint_dir == tmp_path / "from-env"
        assert run.settings.provenance["checkpoint.save_every_steps"] == "attach()"
        assert run.settings.provenance["checkpoint.dir"] == "env"
    finally:
        run.close(final_save=False)


def test_json_state_round_trips_tensors_tuples_arrays_bytes_and_non_finite_numbers() -> None:
    state = {"a": (1, 2.5, None), 3: [b"\x00\xff", float("inf")], "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
             "n": np.arange(4, dtype=np.uint32), "nested": {"empty": torch.empty(0)},
             "scalar": torch.tensor(0.25)}   # 0-dim, as ModelCheckpoint's best_model_score
    back = jsontensor.from_tensor(jsontensor.to_tensor(state))
    assert back["scalar"].shape == () and back["scalar"].item() == 0.25
    assert back["a"] == (1, 2.5, None) and back[3][0] == b"\x00\xff" and math.isinf(back[3][1])
    assert torch.equal(back["t"], state["t"]) and back["t"].dtype == torch.int16
    assert back["n"].dtype == np.uint32 and (back["n"] == state["n"]).all()
    with pytest.raises(TypeError, match="without pickling"):
        jsontensor.to_tensor({"x": object()})


def test_side_state_is_stored_as_uint8_tensors_never_as_pickled_objects(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, extra={"counter": {"tokens": 12}}, async_save=False)
    train_steps(run, *parts, 0, 2)
    run.close()
    metadata = VerifyingReader(ck / "step_2").read_metadata()
    ours = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("ckptsup/")}
    assert {"ckptsup/meta", "ckptsup/lr_scheduler", "ckptsup/data", "ckptsup/extra/counter",
            "ckptsup/rank0/rng", "ckptsup/rank0/torch_rng", "ckptsup/rank0/dataloader"} <= set(ours)
    for key, md in ours.items():
        assert getattr(md, "properties", None) is not None and md.properties.dtype == torch.uint8, key


def test_resume_restores_every_rng_and_the_data_position_exactly(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, async_save=False)
    train_steps(run, *parts, 0, 3)
    run.save(reason="test", blocking=True)
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), train_steps(run, *parts, 3, 5))
    run.close(final_save=False)
    parts2 = make_parts()
    with torch.no_grad():
        for param in parts2[0].parameters():
            param.add_(1.0)  # a different model: the checkpoint must overwrite it
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    run2 = attach_parts(parts2, ck, async_save=False)
    assert run2.resume() == 3
    got = (random.random(), np.random.rand(), torch.rand(1).item(), train_steps(run2, *parts2, 3, 5))
    run2.close(final_save=False)
    assert got == expected
    for a, b in zip(parts[0].parameters(), parts2[0].parameters()):
        assert torch.equal(a, b)


def test_without_a_supervisor_events_go_to_the_run_dir_and_housekeeping_runs(tmp_path: Path, monkeypatch) -> None:
    run_dir = private_dir(tmp_path / "run")
    monkeypatch.setenv("CKPTSUP_RUN_DIR", str(run_dir))
    monkeypatch.delenv("CKPTSUP_SITE_CONFIG")  # shipped defaults: the first checkpoint is a daily keeper
    parts = make_parts()
    run = attach_parts(parts, private_dir(tmp_path / "c") / "ck", save_every_steps=2)
    train_steps(run, *parts, 0, 4)
    run.close()
    events = read_events(run_dir)
    names = [e["event"] for e in events if e["event"] != "phase"]
    assert names[0] == "first_step" and names[-1] == "run_complete"
    # rank 0's phase changes are in the log too (time per phase; first_step starts training, async
    # saves are no phase of their own): init at attach, stopping at close
    phases = [e["phase"] for e in events if e["event"] == "phase"]
    assert phases[0] == "init" and phases[-1] == "stopping"
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in committed] == [2, 4]
    for e in committed:
        assert e["bytes"] > 0 and e["stall_s"] >= 0 and e["write_s"] > 0
    # the daily keeper got its level-3 test load (a separate process) before the run completed
    validated = [e for e in events if e["event"] == "checkpoint_validated"]
    assert validated and validated[0]["level"] == 3


def test_a_nan_loss_without_a_supervisor_raises_a_clear_error_and_writes_no_checkpoint_of_it(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, save_every_steps=1, async_save=False)
    train_steps(run, *parts, 0, 2)
    with pytest.raises(NonFiniteLossError, match="rank 0 saw a non-finite loss \\(nan\\) at step 2"):
        run.step_done(2, loss=torch.tensor(float("nan")))
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_1", "step_2"]


def test_a_second_writer_on_the_same_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck)
    try:
        other = make_parts()
        with pytest.raises(Exception, match="two writers would mix checkpoints"):
            attach_parts(other, ck)
    finally:
        run.close(final_save=False)


def test_time_based_saves_happen_and_async_saves_reuse_the_staging_buffers(tmp_path: Path) -> None:
    import time

    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, save_every_s=0.2, jitter_s=0)
    buffers = []
    for start in range(0, 12, 3):
        train_steps(run, *parts, start, start + 3)
        time.sleep(0.25)
        if run.writer.stager._buffers is not None:
            buffers.append(run.writer.stager._buffers)
    run.close(final_save=False)
    steps = sorted(int(p.name.split("_")[1]) for p in ck.iterdir() if p.name.startswith("step_"))
    assert len(steps) >= 2
    assert len(buffers) >= 2 and all(b is buffers[0] for b in buffers), "host buffers must be allocated once and reused"


def test_init_process_group_uses_the_supervisors_timeouts(tmp_path: Path, monkeypatch) -> None:
    import torch.distributed as dist

    from ckptsup.hooks.process_group import set_steady_timeout

    monkeypatch.setenv("CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S", "123")
    monkeypatch.setenv("CKPTSUP_COLLECTIVE_TIMEOUT_S", "45")
    seen = {}
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: (seen.update(kw), real_init(**kw))[1])
    ckptsup.init_process_group(init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 123
        assert set_steady_timeout() is True
    finally:
        dist.destroy_process_group()
