"""A script's own in-place checkpoint on the real dev cluster: rank 0's node killed while it writes
out/ckpt.pt (tests/script_ckpt_train.py --hang-in-save-at: half the file written, then the node
dies). The supervisor kept the earlier versions while the job ran; the node is the batch host, so
the supervisor dies with it and the watchdog requeues the job: the new supervisor's first launch
moves the torn file aside, puts the version verified at step 20 back, and the run ends with the
uninterrupted run's model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from run_helpers import named, node_deaths, sbatch_submit, uninterrupted
from supervisor_slurm_helpers import finished, job_config

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SCRIPT = Path(__file__).with_name("script_ckpt_train.py")
ARGS = ("--steps", "50", "--every", "10", "--step-s", "0.1", "--init_from=auto")


def test_rank_0s_node_killed_mid_save_resumes_from_the_previous_verified_version(dev_cluster, tmp_path):
    config = job_config(tmp_path, supervisor_toml='script_checkpoint = "out/ckpt.pt"\n')
    job, run = sbatch_submit(tmp_path, config, SCRIPT, *ARGS, "--hang-in-save-at", "30", nodes=2, spares=1)
    dev_cluster.wait_for(lambda: (tmp_path / "out" / "held-in-save").exists(), 180, what="rank 0 halfway through a save")
    victim = named(read_events(run), "launch")[0]["nodes"][0]   # node rank 0: global rank 0
    assert named(read_events(run), "script_checkpoint_verified"), "versions kept while the job ran"
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 240, what=f"job {job} to finish")
    events = read_events(run)
    # rank 0's node is the batch host here: the supervisor died with it, the watchdog requeued the job
    # without it, and the next supervisor's first launch found the torn file (a node death seen by a
    # live supervisor takes the same check before its relaunch)
    lost = [e for e in named(events, "requeue") if victim in e["excluded"]] or \
        [e for e in node_deaths(events) if e["node"] == victim]
    assert lost, [e["event"] for e in events]
    restored = named(events, "script_checkpoint_restored")
    assert len(restored) == 1 and restored[0]["path"] == "out/ckpt.pt", [e["event"] for e in events]
    assert named(events, "run_complete") and not named(events, "give_up")
    starts = (tmp_path / "out" / "starts.txt").read_text().split("\n")
    assert starts[:2] == ["start 0 auto", "start 20 auto"], starts   # the version verified at step 20
    ref = tmp_path / "ref"
    ref.mkdir()
    uninterrupted(SCRIPT, *ARGS, cwd=ref)
    for rank in (0, 1):
        got, want = torch.load(tmp_path / "out" / f"final_rank{rank}.pt"), torch.load(ref / "out" / f"final_rank{rank}.pt")
        assert all(torch.equal(got[k], want[k]) for k in want), f"rank {rank} differs"
