"""The supervisor on the real dev cluster, restarting within the allocation: the memory tier
(a node death resumed from memory and the buddy's replica, a rank's own flipped memory copy, the
adaptive memory interval, a node and its buddy lost together falling back to the object store), a
hung rank on the fast path, an operator's replace, and a GPU allocation's ranks per GPU. Each
faulted run ends with the parameters of an uninterrupted 2-rank reference run
(tests/supervisor_slurm_helpers.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.planning.accounting import account

from drop_in_helpers import env_processes, real_rank
from run_helpers import CKPTSUP, named
from s3_helpers import BUCKET, make_bucket, moto  # noqa: F401 - moto is a fixture
from supervisor_slurm_helpers import (  # noqa: F401 - reference is a fixture
    ROOT, TRAIN, committed, finished, job_config, reference, submit, ts
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def rank_pid(run: Path, rank: int) -> int:
    """Host PID of the process that runs a rank of `run` (its warm interpreter, not the proxy)."""
    found = env_processes(CKPTSUP_RUN_DIR=str(run), RANK=str(rank))
    if not found:
        raise AssertionError(f"rank {rank} of {run} not found")
    return real_rank(found[0]).pid


def test_a_hung_rank_on_a_cluster_node_restarts_on_the_fast_path(dev_cluster, tmp_path, reference):
    """Two hangs in one run: rank 1 SIGSTOPped (a hang at once, pinned on the stopped process),
    then rank 1 sleeping forever at step 40 (hang_min_s 10: a silence with no rank working, named
    from its Python stack with its node: the rank's own code, so no node is suspected). Both restart
    on the fast path, nothing excluded, and the run ends as an uninterrupted one. (The stacks of
    both nodes' agents arrive at once through one srun step: the frames go in pieces,
    step_lines.py; whole, they interleaved and were lost.)"""
    job, run, out = submit(tmp_path, nodes=2, spares=0, extra=("--hang-at-step", "40", "--hang-rank", "1"))
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    hit = time.time()
    os.kill(rank_pid(run, 1), signal.SIGSTOP)
    dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 240, what="the run to complete")
    events = read_events(run)
    stopped, asleep = named(events, "failure_detected")
    assert stopped["kind"] == "hang" and stopped["rank"] == 1 and "state T" in stopped["detail"]
    assert ts(stopped) - hit <= 10.0 + 2.0
    assert asleep["kind"] == "hang" and asleep["rank"] == 1 and asleep["detect_s"] <= 15.0
    line = next(i for i, text in enumerate(TRAIN.read_text().splitlines(), 1) if "time.sleep(3600)" in text)
    assert f"rank 1 on {asleep['node']}: at train.py:{line} in main" in asleep["detail"], asleep["detail"]
    assert [r["path"] for r in named(events, "restart_done")] == ["fast", "fast"] and not named(events, "node_excluded")
    assert not named(events, "restore_loss_jump")   # both restores were whole: no warning (training lowers the loss)
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


RANK = ROOT / "tests" / "helpers" / "wire_rank.py"  # a torch-free rank: only torchrun imports torch


def test_a_gpu_allocation_with_nproc_gpu_runs_a_rank_per_gpu_and_the_allocation_event_says_so(dev_cluster, tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "2", "--spares", "1",
                           "--gpus-per-node", "2", "--signal-lead-s", "77", "--nproc-per-node", "gpu",
                           "--config", str(job_config(tmp_path)), "--run-dir", str(run),
                           str(RANK), "--steps", "5", "--out", str(out)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 120, what=f"job {job} to finish")
    events = read_events(run)
    assert named(events, "run_complete"), (run / f"slurm-{job}.out").read_text()
    [allocation] = named(events, "allocation")
    assert (allocation["gpus_per_node"], allocation["ranks_per_node"], allocation["active"], allocation["spares"]) \
        == (2, 2, 2, 1)
    [launch] = named(events, "launch")
    assert launch["world_size"] == 4 and len(launch["nodes"]) == 2
    assert sorted(p.name for p in out.glob("rank*.step")) == [f"rank{r}.step" for r in range(4)]
    checks = named(events, "health_check")
    assert checks and all(c["ok"] and "2 GPU(s) allocated by Slurm here" in c["detail"] for c in checks), checks
    effective = json.loads((run / "config.json").read_text())
    sbatch = effective["config"]["sbatch"]
    assert (sbatch["spares"], sbatch["gpus_per_node"], sbatch["signal_lead_s"]) == (1, 2, 77)  # as submitted
    assert effective["config"]["supervisor"]["nproc_per_node"] == 2
    assert effective["provenance"]["supervisor.nproc_per_node"].startswith("allocation (gpu from flag")
    [row] = account(events).attempt_rows
    assert (row["active_devices"], row["spare_devices"]) == (4, 2)  # the report counts the allocation's GPUs


def test_an_operators_replace_moves_a_nodes_ranks_to_the_spare_at_a_checkpoint(dev_cluster, tmp_path, reference):
    job, run, out = submit(tmp_path, nodes=2, spares=1)
    dev_cluster.wait_for(lambda: committed(run, 10), 120, what="a checkpoint at step 10")
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    try:
        asked = subprocess.run([*CKPTSUP, "replace", str(run), victim], capture_output=True, text=True, timeout=60)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
        info = dev_cluster.client.node_info()[victim]   # ckptsup drained it ([slurm] drain_bad_nodes)
        assert info.state.value in ("drained", "draining") and info.reason.startswith("ckptsup: replaced")
    finally:
        dev_cluster.give_back(victim)  # give the node back to later tests
    events = read_events(run)
    [ack] = named(events, "control")
    [detected] = named(events, "failure_detected")
    assert detected["kind"] == "replaced" and detected["node"] == victim
    # the one asked for: the first past the slowest rank's position when the request was accepted
    # (a scheduled save of that step or an earlier one may commit after the ack: its write runs in
    # the background); a save committed while the ranks were being stopped may be newer still
    commits = [e["step"] for e in named(events, "checkpoint_committed")]
    saved = [step for step in commits if step > ack["step"]][0]
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] in commits   # nothing lost
    assert restart["resume_step"] >= saved, (ack["step"], commits, restart["resume_step"])
    assert named(events, "launch")[-1]["nodes"] == [first["nodes"][0], spare]
    [excluded] = named(events, "node_excluded")
    assert excluded["node"] == victim and excluded["reason"].startswith("replaced")
    assert not named(events, "requeue") and named(events, "run_complete")
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


MEMORY_EVERY = 5


MEMORY = f"[memory]\nenabled = true\nevery_steps = {MEMORY_EVERY}\n"


def replicated(run: Path, step: int) -> bool:
    return any(e["ok"] and e.get("step", -1) >= step for e in named(read_events(run), "memory_replicated"))


def test_node_death_with_a_spare_resumes_from_memory_and_the_buddys_replica(dev_cluster, tmp_path, reference):
    # disk saves only at the end: the spare's rank can only come back from the survivor's replica
    job, run, out = submit(tmp_path, nodes=2, spares=1, extra=("--save-every-steps", "1000"), extra_toml=MEMORY)
    dev_cluster.wait_for(lambda: replicated(run, 15), 120, what="every rank's replica of step >= 15")
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    dev_cluster.wait_for(lambda: spare in {e["node"] for e in named(read_events(run), "warm_ready")}, 60,
                         what="the spare's agent to be warm")
    last_replica = max(e["step"] for e in named(read_events(run), "memory_replicated") if e["ok"])
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] >= last_replica
    [loaded] = named(events, "checkpoint_loaded")
    assert loaded["step"] == restart["resume_step"] and loaded["source"] == "peer_memory", loaded
    # the survivor's rank from its own agent, the spare's from the survivor's replica of the dead node's
    assert loaded["files_by_source"]["memory"] == 1 and loaded["files_by_source"]["peer_memory"] == 1, loaded
    assert set(restart["load_by_source"]) == {"memory", "peer_memory"}
    assert not [e for e in named(events, "checkpoint_committed") if e["step"] < 70]
    # what the death cost: at most the memory interval plus the steps of the save whose replica
    # was still in flight (saved, not yet on the buddy) when the node died
    death = named(events, "failure_detected")[0]   # its step: the newest step the job had reached
    before = [e for e in events if ts(e) <= ts(death)]
    saved = max(e["step"] for e in named(before, "memory_saved") if e["ok"])
    whole = max(e["step"] for e in named(before, "memory_replicated") if e["ok"] and "ranks" in e)
    assert whole <= restart["resume_step"] <= saved, (whole, restart, saved)
    assert death["step"] - restart["resume_step"] <= MEMORY_EVERY + (saved - whole), (death, restart, saved, whole)
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def test_a_rank_whose_own_memory_copy_is_flipped_loads_the_buddys_replica(dev_cluster, tmp_path, reference,
                                                                         monkeypatch):
    # every agent flips a bit of the bundles its own ranks put (their replicas on the buddy stay
    # intact); no disk save before the end: the resume can only come from memory
    monkeypatch.setenv("CKPTSUP_TEST_FLIP_MEMORY", "own")
    job, run, out = submit(tmp_path, nodes=2, spares=0, extra=("--save-every-steps", "1000"), extra_toml=MEMORY)
    dev_cluster.wait_for(lambda: replicated(run, 15), 120, what="every rank's replica of step >= 15")
    hit = time.time()
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    dev_cluster.wait_for(lambda: finished(dev_cluster, job), 240, what=f"job {job} to finish")
    events = read_events(run)
    [failure] = named(events, "failure_detected")
    assert failure["kind"] == "crash" and failure["rank"] == 1 and ts(failure) - hit <= 1.0, failure
    restart = named(events, "restart_done")[-1]
    [loaded] = named(events, "checkpoint_loaded")
    assert restart["path"] == "fast" and loaded["step"] == restart["resume_step"] >= 15, loaded
    assert not named(events, "node_excluded")
    # each rank refused its own agent's copy and took its buddy's replica of the same bundle
    assert loaded["files_by_source"]["memory"] == 0 and loaded["files_by_source"]["peer_memory"] == 2, loaded
    assert "its memory copy of step" in (run / f"slurm-{job}.out").read_text()   # rank 0's console: why
    assert not named(events, "checkpoint_rejected") and not (run / "checkpoints" / "quarantine").exists()
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def memory_changes(run: Path) -> list[dict]:
    return [e for e in named(read_events(run), "interval_changed") if e.get("level") == "memory"]


def whole_replica_after(run: Path, after: dict) -> dict | None:
    """The first step every rank's replica reached its buddies after the event `after`."""
    later = [e for e in named(read_events(run), "memory_replicated")
             if e["ok"] and "ranks" in e and ts(e) > ts(after) and e["step"] > after.get("resume_step", -1)]
    return later[0] if later else None


def test_with_the_adaptive_interval_a_rank_kill_then_a_node_death_resume_from_the_buddys_memory(
        dev_cluster, tmp_path, reference):
    # issue 20: the script saves to disk every 20 steps (attach's keyword: the supervisor's config
    # says nothing), [memory] every_steps is left to the tuner; its cap must be those 20 steps, so
    # the relaunch after the rank kill still makes memory saves and the node death resumes from them
    job, run, out = submit(tmp_path, nodes=2, spares=1, adaptive=True, extra_toml="[memory]\nenabled = true\n",
                           extra=("--save-every-steps", "20", "--step-sleep-s", "0.3"))
    [change, *_] = dev_cluster.wait_for(lambda: memory_changes(run), 120, what="the tuner's memory schedule")
    assert change["every_steps"] == 20, change      # Young's is hours here: capped at the disk's 20 steps
    first = named(read_events(run), "launch")[0]
    victim, [spare] = first["nodes"][1], first["spares"]
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    fast = dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the fast-path restart")[0]
    relaunch = named(read_events(run), "launch")[1]
    spec = json.loads((run / f"attempt-{relaunch['attempt']}" / "launch.json").read_text())
    assert spec["env"]["CKPTSUP_MEMORY_EVERY_STEPS"] == "20", spec["env"]   # the clamped schedule, kept
    whole = dev_cluster.wait_for(lambda: whole_replica_after(run, fast), 120, what="a memory save replicated after the restart")
    dev_cluster.wait_for(lambda: spare in {e["node"] for e in named(read_events(run), "warm_ready")}, 60,
                         what="the spare's agent to be warm")
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: len(named(read_events(run), "restart_done")) >= 2, 120, what="the node restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    assert all(c["every_steps"] <= 20 for c in memory_changes(run)), memory_changes(run)
    [kill, death] = named(events, "failure_detected")
    assert kill["kind"] == "crash" and kill["rank"] == 1 and fast["path"] == "fast", (kill, fast)
    restart = named(events, "restart_done")[-1]
    assert restart["path"] == "node" and restart["resume_step"] >= whole["step"], (restart, whole)
    loaded = named(events, "checkpoint_loaded")[-1]
    assert loaded["step"] == restart["resume_step"] and loaded["source"] == "peer_memory", loaded
    # the survivor's rank from its own agent, the spare's from the survivor's replica: no disk file
    by_source = loaded["files_by_source"]
    assert by_source["memory"] == 1 and by_source["peer_memory"] == 1 and by_source["shared"] == 0, loaded
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference


def promoted(run: Path) -> list[int]:
    return sorted(e["step"] for e in named(read_events(run), "checkpoint_promoted") if e.get("ok"))


@pytest.mark.s3
def test_a_node_and_its_buddy_lost_together_fall_back_to_disk_and_the_object_store_bit_identical(
        dev_cluster, tmp_path, reference, moto):
    """2 active + 2 spares, the batch host kept as the last spare ([supervisor] batch_host_spare):
    the two active nodes are each other's buddy and die together, the supervisor lives on. No
    memory copy is left: the disk tiers decide, and the shared copy of the newest checkpoint the
    object store (a real moto_server) holds is deleted too, with everything newer: the resume
    fetches it back from the object store and validates it."""
    make_bucket(moto)
    storage = f'[storage]\nobject_store = "s3://{BUCKET}/buddies"\ns3_endpoint_url = "{moto.url}"\n'
    job, run, out = submit(tmp_path, nodes=2, spares=2, extra=("--save-every-steps", "10"),
                           extra_toml=MEMORY + storage, supervisor_toml="batch_host_spare = true\n")
    dev_cluster.wait_for(lambda: replicated(run, 15) and committed(run, 10) and promoted(run), 120,
                         what="replicas, a disk checkpoint and its object-store copy")
    events = read_events(run)
    first = named(events, "launch")[0]
    batch_host = named(events, "allocation")[0]["node_names"][0]   # Slurm runs the batch script there
    assert batch_host not in first["nodes"] and first["spares"][-1] == batch_host, first
    a, b = first["nodes"]
    with dev_cluster.revived(a, b):
        dev_cluster.kill_node(a)
        dev_cluster.kill_node(b)
        newest = promoted(run)[-1]   # the dead nodes promote nothing more
        gone = [d for d in (run / "checkpoints").glob("step_*") if int(d.name.split("_")[1]) >= newest]
        for folder in gone:
            shutil.rmtree(folder)
        dev_cluster.wait_for(lambda: named(read_events(run), "restart_done"), 120, what="the restart")
        dev_cluster.wait_for(lambda: finished(dev_cluster, job), 180, what=f"job {job} to finish")
    events = read_events(run)
    restart = named(events, "restart_done")[-1]
    [loaded] = named(events, "checkpoint_loaded")
    assert restart["path"] == "node" and loaded["source"] == "object" and loaded["step"] == newest, (loaded, gone)
    by_source = loaded["files_by_source"]
    assert by_source["object"] > 0 and by_source["memory"] == by_source["peer_memory"] == by_source["shared"] == 0
    assert not named(events, "checkpoint_rejected") and not (run / "checkpoints" / "quarantine").exists()
    assert sorted(named(events, "launch")[-1]["nodes"]) == sorted([first["spares"][0], batch_host])
    assert "a node and its buddy lost together" in (run / f"slurm-{job}.out").read_text()   # rank 0's console line
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference
