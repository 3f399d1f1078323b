"""Silent data corruption with HSDP (docs/sdc.md): FSDP2, and FSDP1's HYBRID_SHARD, on a (replicate,
shard) mesh of real gloo ranks under `ckptsup launch` (tests/helpers/sdc_hsdp.py). The ranks that hold the same shard are
compared across the replica groups, and ranks that hold other shards are not: 3 replicas of 2
shards (6 ranks), fingerprints at every step, a bit flipped in rank 3's shard after step 7 — the
majority of its shard's three copies names rank 3 alone, and no check before the flip was a false
alarm. The run stops there (max_restarts = 0): what follows a named rank is the supervisor's, the
same for DDP and HSDP (tests/test_sdc_real.py, the dev-cluster tests in test_supervisor_slurm_sdc_elastic.py),
and 6 ranks starting twice on 2 cores took 70 s instead of 30 s (a shared, loaded box)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest


from run_helpers import run_named

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "sdc_hsdp.py"
REPLICAS, SHARDS = 3, 2
WORLD = REPLICAS * SHARDS


@pytest.mark.parametrize("fsdp", ["fsdp2", "fsdp1-hybrid-shard"])
def test_a_flip_in_one_replica_of_a_shard_is_caught_across_the_replica_groups_and_that_rank_named(tmp_path, fsdp):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\nmax_restarts = 0\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\n[checkpoint]\n"
                   "adaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n[sdc]\nevery_steps = 1\n")
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", str(WORLD), "--config",
                           str(cfg), "--run-dir", str(run), str(SCRIPT), "--mesh", f"{REPLICAS},{SHARDS}",
                           "--steps", "12", "--save-every-steps", "5", "--flip", "7:3", "--out", str(out),
                           *(["--fsdp1"] if fsdp == "fsdp1-hybrid-shard" else [])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and run_named(run, "give_up"), log[-4000:]
    assert f"replica fingerprints: HSDP, each shard compared across its {REPLICAS} replicas" in log
    # rank 3 holds shard 1 in replica group 1: ranks 1 and 5 hold the same bytes, and outvote it
    [failure] = run_named(run, "failure_detected")
    assert (failure["kind"], failure["rank"], failure["step"], failure["ranks"]) == ("sdc", 3, 7, [3]), failure
    assert "rank(s) 3 on" in failure["detail"] and "majority of 3 copies" in failure["detail"], failure
    # no false alarm: every check up to the flip agreed (one per step; shard 0's ranks hold other
    # bytes than shard 1's, so comparing them would have failed the first), and so did the save
    assert failure["agreed_step"] == 6, failure
    saved = json.loads((run / "checkpoints" / "step_5" / "manifest.json").read_text())
    assert saved["extra"]["replicas"]["agree"] is True and saved["extra"]["replicas"]["copies"] == REPLICAS


def test_a_mixed_layout_compares_the_replicas_it_has_and_the_rank_without_one_takes_part(tmp_path):
    """tests/helpers/sdc_stages.py: ranks 0 and 2 are DDP replicas over their own subgroup, rank 1
    a plain module of other bytes. Checks at every step: rank 1 takes part with nothing to
    compare (else ranks 0 and 2 would wait for it in the all-gather forever), no false alarm up
    to the flip, and a flip on rank 2 after step 7 puts exactly the two replicas in dispute (two
    copies, no majority: the supervisor's rerun rule follows, tests/test_sdc_real.py)."""
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\nmax_restarts = 0\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\n[checkpoint]\n"
                   "adaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n[sdc]\nevery_steps = 1\n")
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "3", "--config",
                           str(cfg), "--run-dir", str(run), str(ROOT / "tests" / "helpers" / "sdc_stages.py"),
                           "--steps", "12", "--save-every-steps", "5", "--flip", "7:2", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and run_named(run, "give_up"), log[-4000:]
    assert "replica fingerprints on ranks 0,2 only; the other 1 ranks hold no replica" in log, log[-4000:]
    [failure] = run_named(run, "failure_detected")
    assert (failure["kind"], failure["step"], failure["ranks"]) == ("sdc", 7, [0, 2]), failure
    assert failure["agreed_step"] == 6, failure   # every check before the flip agreed
    saved = json.loads((run / "checkpoints" / "step_5" / "manifest.json").read_text())
    assert saved["extra"]["replicas"]["agree"] is True and saved["extra"]["replicas"]["copies"] == 2


def test_tensor_parallel_inside_hsdp_compares_each_tp_shard_across_the_replicas(tmp_path):
    """torchtitan's 3-D mesh (replicate 2, shard 1, tp 2; tests/helpers/sdc_tp.py, real gloo ranks
    under torchrun): every parameter is a DTensor on that one mesh, replicated along its first
    dimension, so ranks 0 and 2 (tp shard 0) and ranks 1 and 3 (tp shard 1) are each other's
    replicas — equal fingerprints within a pair, other ones across."""
    from hooks_helpers import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), str(ROOT / "tests" / "helpers" / "sdc_tp.py"), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [s["replication"] for s in seen] == ["hybrid"] * 4
    assert [s["group"] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert seen[0]["fingerprint"] == seen[2]["fingerprint"] and seen[1]["fingerprint"] == seen[3]["fingerprint"]
    assert seen[0]["fingerprint"] != seen[1]["fingerprint"]
