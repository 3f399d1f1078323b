"""A script that keeps its own checkpoint in place, as nanoGPT does (tests/script_ckpt_train.py),
under `ckptsup launch` with 2 local ranks (real torchrun, gloo): a save torn by a SIGKILL halfway
through, a script that resumes only on `--init_from=resume`, a file that never verifies."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from run_helpers import launch, named, uninterrupted

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("script_ckpt_train.py")
STEPS = 60


def finish(proc, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return out


def same_final(out: Path, ref: Path) -> None:
    for rank in (0, 1):
        got, want = torch.load(out / f"final_rank{rank}.pt"), torch.load(ref / f"final_rank{rank}.pt")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), f"rank {rank} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The script uninterrupted under plain torchrun, once for the module: its model is a function
    of the steps alone (the data is the step's; --step-s only sleeps; --init_from=auto with no
    checkpoint yet starts from scratch, as the default does), so both resumed runs compare to it."""
    ref = tmp_path_factory.mktemp("script-ckpt-reference")
    uninterrupted(SCRIPT, "--steps", str(STEPS), "--step-s", "0", cwd=ref)
    return ref / "out"


def test_a_save_torn_by_a_kill_resumes_from_the_previous_verified_version(tmp_path, reference):
    """Rank 0 writes half of out/ckpt.pt in place at step 40 and is SIGKILLed. (Without
    --script-checkpoint every restart dies in torch.load and the run gives up with "no progress":
    this test's first version ran that too, 2026-12-06.) With it, the torn file is moved aside, the
    version verified at step 30 put back, and the run ends with the uninterrupted run's model."""
    args = ("--steps", str(STEPS), "--init_from=auto", "--tear-at", "40")
    kept = tmp_path / "kept"
    kept.mkdir()
    proc = launch(kept, kept / "run", SCRIPT, *args, launch_args=("--script-checkpoint", "out/ckpt.pt"))
    console = finish(proc)
    events = read_events(kept / "run")
    assert proc.returncode == 0, console[-3000:]
    assert named(events, "run_complete") and not named(events, "give_up")
    verified = named(events, "script_checkpoint_verified")
    assert len(verified) >= 3 and all(v["kind"] == "torch.save zip" for v in verified)
    restored = named(events, "script_checkpoint_restored")
    assert len(restored) == 1 and "end-of-central-directory" in restored[0]["reason"], restored
    assert (kept / "out" / restored[0]["moved_to"]).exists()   # the torn file, kept aside
    assert "put back the version verified" in console
    starts = (kept / "out" / "starts.txt").read_text().split("\n")
    assert starts[:2] == ["start 0 auto", "start 30 auto"], starts
    same_final(kept / "out", reference)


def test_resume_args_go_only_to_an_attempt_that_starts_with_a_verified_checkpoint(tmp_path, reference):
    """A nanoGPT-style script (resumes only on --init_from=resume): attempt 0 runs without the
    flag; rank 1 crashes after step 25; attempt 1 gets it and resumes from step 20."""
    proc = launch(tmp_path, tmp_path / "run", SCRIPT, "--steps", str(STEPS), "--crash-at", "25",
                  launch_args=("--script-checkpoint", "out/ckpt.pt", "--resume-args", "--init_from=resume"))
    console = finish(proc)
    assert proc.returncode == 0, console[-3000:]
    specs = [json.loads((tmp_path / "run" / f"attempt-{a}" / "launch.json").read_text())
             for a in (0, 1)]
    assert "--init_from=resume" not in specs[0]["script_args"]
    assert specs[1]["script_args"][-1] == "--init_from=resume"
    assert (tmp_path / "out" / "starts.txt").read_text().split("\n")[:2] == ["start 0 scratch", "start 20 resume"]
    same_final(tmp_path / "out", reference)


def test_a_file_that_never_verifies_gives_up_in_one_line_or_starts_over(tmp_path):
    """The script writes garbage as its checkpoint and crashes once: the relaunch gives up at once
    (one launch, one line naming the file and the fix); with start-over the garbage is moved aside
    and the script starts fresh."""
    args = ("--steps", "30", "--init_from=auto", "--garbage", "--crash-at", "25")
    first = tmp_path / "give-up"
    first.mkdir()
    proc = launch(first, first / "run", SCRIPT, *args, launch_args=("--script-checkpoint", "out/ckpt.pt"))
    console = finish(proc)
    events = read_events(first / "run")
    assert proc.returncode == 3, console[-3000:]
    assert len(named(events, "launch")) == 1 and not named(events, "script_checkpoint_verified")
    lines = [line for line in console.splitlines() if "giving up" in line]
    assert len(lines) == 1 and "out/ckpt.pt is corrupt" in lines[0] and "start-over" in lines[0], console[-2000:]
    assert named(events, "script_checkpoint_rejected")[0]["outcome"] == "give_up"

    again = tmp_path / "start-over"
    again.mkdir()
    proc = launch(again, again / "run", SCRIPT, *args, config='[supervisor]\nscript_checkpoint = "out/ckpt.pt"\n'
                  'script_checkpoint_on_corrupt = "start-over"\n')
    console = finish(proc)
    assert proc.returncode == 0, console[-3000:]
    assert (again / "out" / "starts.txt").read_text().split("\n")[:2] == ["start 0 auto", "start 0 auto"]
    assert [p for p in (again / "out").iterdir() if ".corrupt-" in p.name]
    assert named(read_events(again / "run"), "script_checkpoint_rejected")[0]["outcome"] == "start_over"
