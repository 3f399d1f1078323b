"""Scripts people run, unchanged, under `ckptsup launch --nproc-per-node 2` at the defaults (no
config): an HF Trainer script and a Lightning script, without ckptsup's callbacks and without
`import ckptsup`, on CPU (gloo). Their own progress output (HF's tqdm bar and log dicts,
Lightning's TQDMProgressBar) is what the `auto` progress presets read (ckptsup/progress.py,
docs/drop-in.md §Progress lines): each attempt is watched at the progress level, and a hang is
found from the progress lines — a rank sleeping forever mid-step (no stopped process: only the
lines' silence tells), then a SIGSTOPped rank after its lines were seen."""
import signal
from pathlib import Path

import pytest

from ckptsup.events import read_events

from drop_in_helpers import rank_process
from run_helpers import launch, named, run_named, wait_for

pytestmark = pytest.mark.integration

HELPERS = Path(__file__).resolve().parent / "helpers"
HF = HELPERS / "progress_hf.py"
LIGHTNING = HELPERS / "progress_lightning.py"
FROM_LINES = "(no progress line; supervisor.progress_pattern)"   # the detail of a hang found at the progress level


def of_attempt(run: Path, name: str, attempt: int) -> list[dict]:
    return [e for e in run_named(run, name) if e.get("attempt") == attempt]


def watched_from_lines(run: Path, attempt: int) -> bool:
    """The attempt is at the progress level and its lines have given steps."""
    levels = of_attempt(run, "supervision_level", attempt)
    return bool(levels) and levels[-1]["level"] == "progress" and bool(of_attempt(run, "first_step", attempt))


def hangs_are_found_from_progress_lines(tmp_path: Path, script: Path, *args: str) -> None:
    run, out, hang = tmp_path / "run", tmp_path / "out", tmp_path / "hang"
    proc = launch(tmp_path, run, script, "--out", str(out), "--hang-file", str(hang), *args)
    try:
        # attempt 0: once its lines give steps, rank 1 sleeps forever in a step (the script, on seeing
        # the file); rank 0 waits in DDP's all-reduce. Nothing is stopped: the lines' silence is the hang
        wait_for(lambda: watched_from_lines(run, 0), 180, "attempt 0's progress lines", proc)
        hang.touch()
        wait_for(lambda: run_named(run, "failure_detected"), 120, "the sleeping rank's hang", proc)
        assert (out / "hung").exists()
        # attempt 1 (the script's own start over): a SIGSTOP of rank 1's process once its lines give steps
        wait_for(lambda: watched_from_lines(run, 1), 180, "attempt 1's progress lines", proc)
        rank_process(script, out, 1).send_signal(signal.SIGSTOP)
        wait_for(lambda: len(run_named(run, "failure_detected")) >= 2, 120, "the stopped rank's hang", proc)
        console, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console[-3000:]
    slept, stopped = named(events, "failure_detected")
    assert slept["kind"] == "hang" and FROM_LINES in slept["detail"] and "process stopped" not in slept["detail"], slept
    assert stopped["kind"] == "hang" and FROM_LINES in stopped["detail"] and "process stopped" in stopped["detail"]
    assert slept["rank"] == 1 and stopped["rank"] == 1, (slept, stopped)   # the stacks name the sleeper
    assert slept["step"] > 0 and stopped["step"] > 0   # steps the lines gave
    assert {e["attempt"]: e["level"] for e in named(events, "supervision_level")} == {0: "progress", 1: "progress",
                                                                                    2: "progress"}
    assert named(events, "run_complete") and not named(events, "give_up")


def test_an_hf_trainer_script_is_watched_from_its_bar_and_its_hangs_are_found(tmp_path):
    """HF's default output: its tqdm bar (the global step) on stderr, its log dicts on stdout,
    eval bars every 4 steps between them."""
    hangs_are_found_from_progress_lines(tmp_path, HF, "--epochs", "4", "--samples", "64", "--step-s", "0.25",
                                        "--eval-steps", "4")


def test_a_lightning_script_is_watched_from_its_default_bar_and_its_hangs_are_found(tmp_path):
    """Lightning's default bar, as the script gets it with rich installed (ckptsup depends on it):
    RichProgressBar, which draws into the pipe because the agent sets TTY_COMPATIBLE=1 for the
    ranks — `Epoch E/L ━━━ N/M` (E*M+N), validation bars every 4 batches."""
    hangs_are_found_from_progress_lines(tmp_path, LIGHTNING, "--epochs", "4", "--samples", "64", "--step-s", "0.25",
                                        "--val-every", "4", "--bar", "default")
