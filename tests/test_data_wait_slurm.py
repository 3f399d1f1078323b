"""Waiting for data is not a hang on the real dev cluster (docs/timeouts.md §Evidence): the
unmodified DataLoader script (tests/helpers/data_ddp.py: num_workers=2, no ckptsup) through the
sbatch template on 2 nodes, at the defaults (an empty job config), stalls 40 s computing in its
workers at the start of epoch 1: a busy spell "waiting for data", never a failure, and torchrun's
model at the end."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from drop_in_helpers import same_model
from run_helpers import ended, named, sbatch_submit, uninterrupted

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SCRIPT = Path(__file__).parent / "helpers" / "data_ddp.py"
EPOCHS = 3


def test_a_40s_data_stall_in_the_workers_on_two_nodes_is_busy_not_hung(dev_cluster, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted(SCRIPT, "--epochs", str(EPOCHS), "--ckpt-dir", str(reference / "ckpt"), "--out",
                  str(reference / "final.pt"), cwd=reference)
    config = tmp_path / "job.toml"
    config.write_text("[supervisor]\n")   # the defaults
    job, run = sbatch_submit(tmp_path, config, SCRIPT, "--epochs", str(EPOCHS), "--ckpt-dir", str(tmp_path / "ckpt"),
                             "--out", str(tmp_path / "final.pt"), "--cpu-stall", "1", "--stall-s", "40",
                             nodes=2, spares=0)
    dev_cluster.wait_for(lambda: ended(run), 300, what=f"job {job} to end")
    events = read_events(run)
    assert not named(events, "failure_detected"), [(f["kind"], f["detail"]) for f in named(events, "failure_detected")]
    [busy] = named(events, "busy")
    assert busy["ranks"] == [0, 1] and busy["detail"].count("waiting for data (2 workers, ") == 2, busy
    assert named(events, "supervision_level")[-1]["level"] == "progress"
    assert [e["attempt"] for e in named(events, "launch")] == [0] and named(events, "run_complete")
    assert same_model(torch.load(tmp_path / "final.pt"), torch.load(reference / "final.pt"))
