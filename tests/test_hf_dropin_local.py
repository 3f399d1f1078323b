"""A run_clm-shaped HF Trainer script (tests/helpers/hf_clm.py: no ckptsup import, no callback)
under `ckptsup launch --nproc-per-node 2 hf_clm.py --output_dir out --save_steps 4 ...` at the
defaults, 2 ranks on CPU (gloo). It resumes by itself from `get_last_checkpoint(out)`; ckptsup
checks HF's checkpoint-N folders before every launch ([checkpoint] hf_output_dir = "auto": the
script's --output_dir) and moves a torn newest one out of the way. Each run ends with the model of
the same script uninterrupted under plain torchrun."""
import random
from pathlib import Path

import pytest

from ckptsup.events import read_events

from drop_in_helpers import rank_process
from run_helpers import launch, named, run_named, uninterrupted, wait_for

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent / "helpers" / "hf_clm.py"
STEPS = 20


def train_file(where: Path) -> Path:
    rng = random.Random(0)
    words = "the a cat dog sat on mat ran far near big small red blue green house tree river stone sky".split()
    path = where / "train.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(300)) + "\n")
    return path


def args(where: Path) -> list[str]:
    return ["--train_file", str(where / "train.txt"), "--output_dir", "out", "--do_train", "--max_steps", str(STEPS),
            "--save_steps", "4", "--per_device_train_batch_size", "2", "--block_size", "16", "--cache_dir",
            str(where / "cache"), "--report_to", "none", "--logging_steps", "2", "--use_cpu", "--seed", "7"]


def final_model(where: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(where / "out" / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("ref")
    train_file(where)
    uninterrupted(SCRIPT, *args(where), cwd=where)
    return final_model(where)


def of_attempt(run: Path, name: str, attempt: int) -> list[dict]:
    return [e for e in run_named(run, name) if e.get("attempt") == attempt]


def test_a_killed_rank_then_a_hang_resume_from_hfs_own_newest_whole_checkpoint(tmp_path, monkeypatch, reference):
    marker = train_file(tmp_path)
    hang = tmp_path / "hang"
    monkeypatch.setenv("HF_CLM_STEP_S", "0.4")
    monkeypatch.setenv("HF_CLM_HANG_FILE", str(hang))
    monkeypatch.setenv("HF_CLM_MARKS", str(tmp_path / "marks"))
    run = tmp_path / "run"
    proc = launch(tmp_path, run, SCRIPT, *args(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "out" / "checkpoint-8" / "trainer_state.json").exists(), 180, "checkpoint-8", proc)
        rank_process(SCRIPT, marker, 1).kill()
        wait_for(lambda: of_attempt(run, "hf_resume", 1), 120, "attempt 1's check of HF's folders", proc)
        # attempt 1 resumed by itself; once its bar gives steps, rank 1 sleeps forever in a step
        wait_for(lambda: of_attempt(run, "first_step", 1), 120, "attempt 1's progress lines", proc)
        hang.touch()
        console, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console[-3000:]
    crash, hung = named(events, "failure_detected")
    assert crash["kind"] == "crash" and hung["kind"] == "hang" and hung["rank"] == 1, (crash, hung)
    assert (tmp_path / "marks" / "hung").exists()
    resumed = named(events, "hf_resume")
    assert [e["attempt"] for e in resumed] == [1, 2], resumed
    assert resumed[0]["step"] >= 8 and resumed[0]["moved_aside"] in ([], [f"checkpoint-{resumed[0]['step'] + 4}"])
    assert all(e["level"] == "progress" for e in named(events, "supervision_level"))
    assert named(events, "run_complete") and not named(events, "give_up")
    assert same(final_model(tmp_path), reference)


def test_a_torn_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_one_before(tmp_path, monkeypatch,
                                                                                      reference):
    train_file(tmp_path)
    monkeypatch.setenv("HF_CLM_TEAR_AT", "8")   # rank 0 dies saving checkpoint-8: optimizer.pt half written
    monkeypatch.setenv("HF_CLM_MARKS", str(tmp_path / "marks"))
    run = tmp_path / "run"
    proc = launch(tmp_path, run, SCRIPT, *args(tmp_path))
    try:
        console, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console[-3000:]
    assert (tmp_path / "marks" / "torn").exists()
    assert len(named(events, "failure_detected")) == 1
    rejected = named(events, "checkpoint_rejected")
    assert [(e["external"], e["step"]) for e in rejected] == [("checkpoint-8", 8)], rejected
    assert "trainer_state.json" in rejected[0]["reason"] and "moved checkpoint-8 out of" in console
    resumed = named(events, "hf_resume")
    assert [(e["attempt"], e["folder"], e["moved_aside"]) for e in resumed] == [(1, "checkpoint-4", ["checkpoint-8"])]
    quarantined = Path(rejected[0]["quarantined"])
    assert quarantined.parent == tmp_path / "out.ckptsup-quarantine" and (quarantined / "optimizer.pt").exists()
    assert named(events, "run_complete") and not named(events, "give_up")
    assert same(final_model(tmp_path), reference)
