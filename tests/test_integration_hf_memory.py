"""The HF Trainer at ckptsup's defaults resumes from the memory tier (issue 24 part 4).

At the defaults a disk checkpoint is due every 1800 s and a memory save every 10 steps, so a
crash in the first half hour finds no disk checkpoint at all: `resume_path(trainer)` must pick
the newest memory copy every rank's agent holds, hand HF that copy's TrainerState (its data skip)
and let on_train_begin load exactly that copy. Real `ckptsup launch` (local mode, real torchrun),
transformers 5.24, 2 gloo ranks, no config file, the callback without options: rank 1 SIGKILLed
after the memory save of step 20 (of 70); the restart resumes
from memory, and the run ends on the samples and parameters of an uninterrupted run without ckptsup.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.events import read_events

from drop_in_helpers import rank_process
from hooks_helpers import private_dir
from run_helpers import assert_same_run, launch, named, newest_sample_step, uninterrupted, wait_for
from test_integration_hf import SCRIPT

pytestmark = pytest.mark.torch

# 80 samples / (2 ranks x 4) = 10 steps per epoch, 7 epochs; "--save-every-steps 0": the callback without options
STEPS = 70
ARGS = ["--dataset-size", "80", "--epochs", "7", "--step-sleep-s", "0.2"]


def memory_saves(run: Path, after: str = "") -> list[int]:
    return [e["step"] for e in named(read_events(run), "memory_saved") if e["ok"] and e["ts"] > after]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-memory-reference") / "out"
    # without the step sleep: it changes no sample and no parameter
    uninterrupted(SCRIPT, "--out", str(out), "--mode", "none", *ARGS, "--step-sleep-s", "0")
    return out


def test_hf_at_the_defaults_resumes_from_memory_not_step_0_and_ends_bit_exact(tmp_path, reference):
    tmp = private_dir(tmp_path)
    run, out = tmp / "run", tmp / "out"
    proc = launch(tmp, run, SCRIPT, "--out", str(out), "--save-every-steps", "0", *ARGS)   # no config file
    try:
        # one kill: after a restart the adaptive tuner may widen the memory interval past the run's end
        wait_for(lambda: any(s >= 20 for s in memory_saves(run)) and newest_sample_step(out) >= 21, 240,
                 "a memory save of step >= 20", proc)
        rank_process(SCRIPT, out, 1).kill()
        wait_for(lambda: named(read_events(run), "checkpoint_loaded"), 240, "the resume", proc)
        console, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, console[-3000:]
    events = read_events(run)
    assert not named(events, "checkpoint_committed")[:-1], "a disk checkpoint before the final one"
    loads = named(events, "checkpoint_loaded")
    launches = named(events, "launch")
    assert len(loads) == 1 and len(launches) == 2
    saved_before = [e["step"] for e in named(events, "memory_saved") if e["ok"] and e["ts"] < launches[1]["ts"]]
    [load] = loads
    assert load["source"] == "memory" and load["path"] == f"memory:step_{load['step']}"
    assert load["step"] == max(saved_before) >= 20, (load, saved_before)
    restarts = named(events, "restart_done")
    assert [r["resume_step"] for r in restarts] == [load["step"] for load in loads]
    # the Trainer's DDP-wrapped model reaches attach: its replicas are fingerprinted at every save
    # at the defaults (docs/sdc.md), and every check agreed
    assert "no replica fingerprints" not in console and any(e.get("sdc_s", 0) > 0 for e in events), console[-2000:]
    assert_same_run(out, reference, STEPS)
