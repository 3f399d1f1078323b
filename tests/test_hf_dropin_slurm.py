"""The run_clm-shaped HF Trainer script (tests/helpers/hf_clm.py: no ckptsup import, no callback)
on the real dev cluster through the sbatch template, at the defaults: a node killed with `--nodes 2
--spares 1` is replaced by the spare, and the script resumes from HF's own newest whole
checkpoint-N (checked by the supervisor before the relaunch: [checkpoint] hf_output_dir = "auto"),
ending with the model of the same script uninterrupted under plain torchrun."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.slurm.devconf import SPANNING

from run_helpers import named, node_death_to_the_spare, sbatch_submit, uninterrupted
from test_hf_dropin_local import SCRIPT, args, final_model, same, train_file

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("hf-ref")
    train_file(where)
    uninterrupted(SCRIPT, *args(where), cwd=where)
    return final_model(where)


def test_a_dead_node_resumes_from_hfs_own_newest_whole_checkpoint(dev_cluster, tmp_path, monkeypatch, hf_reference):
    train_file(tmp_path)
    monkeypatch.setenv("HF_CLM_STEP_S", "0.4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # as the reference's (run_helpers.base_env): the same reduction order
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                   f"[slurm]\nspare_partition = \"{SPANNING}\"\n")
    job, run = sbatch_submit(tmp_path, cfg, SCRIPT, *args(tmp_path), nodes=2, spares=1)
    dev_cluster.wait_for(lambda: (tmp_path / "out" / "checkpoint-8" / "trainer_state.json").exists(), 180,
                         what="checkpoint-8")
    events, relaunch = node_death_to_the_spare(dev_cluster, run, job)
    resumed = [e for e in named(events, "hf_resume") if e["attempt"] == relaunch["attempt"]]
    assert resumed and resumed[0]["step"] >= 8, named(events, "hf_resume")
    assert resumed[0]["output_dir"] == str(tmp_path / "out")
    assert same(final_model(tmp_path), hf_reference)
