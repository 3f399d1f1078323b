"""Hugging Face's own checkpoint-N folders checked torch-free (ckptsup/checkpoint/hf_folder.py) and
moved out of the way of `get_last_checkpoint` before a launch (ckptsup/supervisor/job/hf_resume.py),
on real folders: a tiny GPT-2 trained two steps by a real Trainer, which saves checkpoint-2 itself
(model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, ...); the
two-rank layout has the RNG state torch.save'd per rank, as HF does (rng_state_<rank>.pth)."""
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from ckptsup.checkpoint import hf_folder
from ckptsup.config import Config, apply_layer
from ckptsup.errors import ConfigError
from ckptsup.events import Event
from ckptsup.supervisor.job.hf_resume import HfCheckpoints, resolve_dir



@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """checkpoint-2 as a real Trainer wrote it (world size 1)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("hf") / "out"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32} for _ in range(8)]
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=2, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=data).train()
    return out / "checkpoint-2"


def copy_of(saved: Path, tmp_path: Path, *, ranks: int = 1, step: int = 2) -> Path:
    dest = tmp_path / "out" / f"checkpoint-{step}"
    shutil.copytree(saved, dest)
    if step != 2:
        state = json.loads((dest / "trainer_state.json").read_text())
        state["global_step"] = step
        (dest / "trainer_state.json").write_text(json.dumps(state))
    if ranks > 1:   # HF's layout for a world of `ranks`: rng_state_<rank>.pth, each a torch.save
        import torch

        rng = torch.load(dest / "rng_state.pth", weights_only=False)
        (dest / "rng_state.pth").unlink()
        for rank in range(ranks):
            torch.save(rng, dest / f"rng_state_{rank}.pth")
    return dest


def problems(folder: Path, **kw) -> list[str]:
    return hf_folder.check_folder(folder, hf_folder.step_of(folder.name), **kw)


def test_a_whole_folder_written_by_the_trainer_passes(saved, tmp_path):
    names = {p.name for p in saved.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "config.json", "training_args.bin"} <= names, names
    assert problems(saved) == []
    assert problems(copy_of(saved, tmp_path, ranks=2)) == []


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors", "rng_state.pth", "scheduler.pt"])
def test_a_truncated_file_is_refused(saved, tmp_path, name):
    folder = copy_of(saved, tmp_path)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    found = problems(folder)
    assert len(found) == 1 and found[0].startswith(f"checkpoint-2/{name}: "), found


def test_a_missing_trainer_state_is_an_unfinished_save(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    (folder / "trainer_state.json").unlink()
    assert problems(folder) == ["checkpoint-2 has no trainer_state.json (HF writes it last): a save that did not finish"]


def test_a_trainer_state_that_does_not_parse_or_names_another_step_is_refused(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    text = (folder / "trainer_state.json").read_text()
    (folder / "trainer_state.json").write_text(text[: len(text) // 2])
    assert "not valid JSON" in problems(folder)[0]
    wrong = copy_of(saved, tmp_path / "b", step=7)
    state = json.loads((wrong / "trainer_state.json").read_text())
    state["global_step"] = 6
    (wrong / "trainer_state.json").write_text(json.dumps(state))
    assert problems(wrong) == ["checkpoint-7/trainer_state.json says global_step 6, not 7"]


def test_the_rng_state_of_every_rank_must_be_there(saved, tmp_path):
    folder = copy_of(saved, tmp_path, ranks=2)
    (folder / "rng_state_1.pth").unlink()   # rng_state_0.pth: a world of two or more
    assert problems(folder) == ["checkpoint-2/rng_state_1.pth: missing"]
    four = copy_of(saved, tmp_path / "b", ranks=3)   # the world that wrote it, when the supervisor knows it
    assert problems(four) == []
    assert problems(four, world_size=4) == ["checkpoint-2/rng_state_3.pth: missing"]
    assert problems(saved, world_size=4) == []   # rng_state.pth: written by a world of one, whatever runs now


def test_a_flipped_byte_in_optimizer_pt_is_refused_by_its_crc(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    path = folder / "optimizer.pt"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:   # a byte of the largest tensor's bytes (torch.save stores them, uncompressed)
        entry = max(z.infolist(), key=lambda i: i.file_size)
    start = entry.header_offset + 30 + len(entry.filename.encode()) \
        + int.from_bytes(data[entry.header_offset + 28: entry.header_offset + 30], "little")
    data[start + entry.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    found = problems(folder)
    assert len(found) == 1 and found[0].startswith("checkpoint-2/optimizer.pt: ") and "CRC" in found[0], found


def test_missing_weights_and_a_missing_optimizer_are_refused(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "optimizer.pt").unlink()
    assert problems(folder) == ["checkpoint-2 has no model weights (model.safetensors, pytorch_model.bin)",
                                "checkpoint-2/optimizer.pt: missing"]


@pytest.mark.parametrize("args, found", [
    (["--output_dir", "out", "--save_steps", "4"], "out"),
    (["--output-dir", "a/b"], "a/b"),
    (["--output_dir=x", "--output_dir", "y"], "y"),   # argparse: the last one wins
    (["--do_train"], None),
    (["--", "--output_dir", "z"], None),
])
def test_the_output_dir_comes_from_the_scripts_arguments(args, found):
    assert hf_folder.output_dir_of(args) == found


def config_with(value: str | None) -> Config:
    config = Config()
    if value is not None:
        apply_layer(config, {}, {"checkpoint": {"hf_output_dir": value}}, "job.toml")
    return config


def test_the_knob_is_auto_by_default_can_be_off_or_a_folder_and_is_checked_at_the_edge(tmp_path):
    args = ["--output_dir", "out"]
    assert resolve_dir(config_with(None), cwd=str(tmp_path), script_args=args) == (tmp_path / "out", False)
    assert resolve_dir(config_with(None), cwd=str(tmp_path), script_args=["--x"]) == (None, False)
    assert resolve_dir(config_with(""), cwd=str(tmp_path), script_args=args) == (None, False)
    assert resolve_dir(config_with("elsewhere"), cwd=str(tmp_path), script_args=args) == (tmp_path / "elsewhere", True)
    with pytest.raises(ConfigError, match="hf_output_dir"):
        config_with("a\x00b")


def test_before_a_launch_bad_newest_folders_are_moved_out_of_get_last_checkpoints_way(saved, tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    copy_of(saved, tmp_path, ranks=2, step=4)
    torn = copy_of(saved, tmp_path, ranks=2, step=8)
    (torn / "trainer_state.json").unlink()
    half = copy_of(saved, tmp_path, ranks=2, step=12)
    (half / "rng_state_1.pth").unlink()
    other = out / "checkpoint-16"   # another tool's folder of that name: left alone
    other.mkdir()
    (other / "weights.npz").write_bytes(b"x")
    events: list[tuple[Event, dict]] = []
    hf = HfCheckpoints(directory=out, explicit=False, emit=lambda name, **f: events.append((name, f)))
    hf.before_launch(world_size=2)
    assert get_last_checkpoint(str(out)) == str(other)   # HF would pick it; ckptsup does not judge it
    other.rename(tmp_path / "elsewhere")
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    quarantine = tmp_path / "out.ckptsup-quarantine"
    moved = sorted(p.name for p in quarantine.iterdir() if p.is_dir())
    assert [m.rsplit("-", 1)[0] for m in moved] == ["checkpoint-12", "checkpoint-8"]
    assert (quarantine / moved[1] / "model.safetensors").exists()   # moved whole, nothing deleted
    rejected = [f for name, f in events if name is Event.CHECKPOINT_REJECTED]
    assert [(r["external"], r["step"]) for r in rejected] == [("checkpoint-12", 12), ("checkpoint-8", 8)]
    assert "rng_state_1.pth: missing" in rejected[0]["reason"] and "trainer_state.json" in rejected[1]["reason"]
    resumed = [f for name, f in events if name is Event.HF_RESUME]
    assert len(resumed) == 1 and resumed[0]["folder"] == "checkpoint-4" and resumed[0]["step"] == 4
    assert resumed[0]["moved_aside"] == ["checkpoint-12", "checkpoint-8"]


def test_a_folder_named_explicitly_is_judged_whole_or_not_and_a_fresh_start_says_nothing(saved, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    events: list[tuple[Event, dict]] = []
    hf = HfCheckpoints(directory=out, explicit=True, emit=lambda name, **f: events.append((name, f)))
    hf.before_launch(world_size=2)
    assert events == []
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "weights.npz").write_bytes(b"x")
    hf.before_launch(world_size=2)
    assert not (out / "checkpoint-3").exists()
    assert events[-1] == (Event.HF_RESUME, {"output_dir": str(out), "folder": None, "step": None,
                                            "moved_aside": ["checkpoint-3"], "check_s": events[-1][1]["check_s"]})


def test_a_folder_saved_since_the_last_launch_is_held_to_that_launchs_world(saved, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hf = HfCheckpoints(directory=out, explicit=False, emit=lambda name, **f: None)
    hf.before_launch(world_size=4)   # this supervisor launched 4 ranks; then a save of 3 rng states only
    folder = copy_of(saved, tmp_path, ranks=3, step=6)
    assert hf.progressed(since_wall=0.0)
    hf.before_launch(world_size=4)
    assert not folder.exists()
