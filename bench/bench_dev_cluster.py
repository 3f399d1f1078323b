"""Benchmark of the local Slurm cluster: `up` (until every node is idle), `down`, and a node
death (kill-node → every process of the node gone; → Slurm says not responding; → Slurm says
DOWN), plus revive-node. Ratios are against figures measured in the same run: `up` against the
15 s target of issue 2, and Slurm's own detection against the node's actual death.

    .venv/bin/python bench/bench_dev_cluster.py [--rounds 3] [--dir /tmp/ckptsup-bench-cluster]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ckptsup.slurm.devcluster import DevCluster
from ckptsup.slurm.devconf import ClusterSpec
from ckptsup.slurm.parsers import JobState, NodeState

UP_TARGET_S = 15.0


def wait(predicate, timeout_s: float, poll_s: float = 0.05) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s}s")
        time.sleep(poll_s)
    return time.monotonic() - start


def requeue_elsewhere(client, directory: Path) -> tuple[float, float]:
    """Submit a sleeper, requeue it, exclude its node and lift the BeginTime hold once it is
    pending: seconds from `scontrol requeue` to running elsewhere, and to pending."""
    script = directory / "bench-sleeper.sbatch"
    script.write_text("#!/bin/bash\nsleep 300\n")
    job = client.submit(script, ["--requeue", "--output=/dev/null"])
    first = []
    wait(lambda: (i := client.job_info(job)) and i.state is JobState.RUNNING and first.append(i.nodes) is None, 30)
    t0 = time.monotonic()
    client.requeue(job)
    wait(lambda: client.job_info(job).state is JobState.PENDING, 60, poll_s=0.02)
    pending = time.monotonic() - t0
    client.update_job(job, exc_nodes=first[0], start_time_now=True)
    wait(lambda: (i := client.job_info(job)) and i.state is JobState.RUNNING and not set(i.nodes) & set(first[0]),
         60, poll_s=0.02)
    total = time.monotonic() - t0
    client.cancel(job)
    return total, pending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckptsup-bench-cluster")
    parser.add_argument("--port-base", type=int, default=17300)
    parser.add_argument("--node", default="n2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cluster = DevCluster(ClusterSpec(dir=Path(args.dir), port_base=args.port_base))
    cluster.down()
    ups, downs, gone, not_responding, down_state, revive = [], [], [], [], [], []
    try:
        for _ in range(args.rounds):
            ups.append(cluster.up())  # returns once every node is usable
            downs.append(cluster.down())
        cluster.up()
        client = cluster.client()
        for _ in range(args.rounds):
            t0 = time.monotonic()
            gone.append(cluster.kill_node(args.node))
            info = lambda: client.node_info([args.node])[args.node]  # noqa: E731
            wait(lambda: not info().responding, 60)
            not_responding.append(time.monotonic() - t0)
            wait(lambda: info().state is NodeState.DOWN, 120)
            down_state.append(time.monotonic() - t0)
            revive.append(cluster.revive_node(args.node))
        requeues = [requeue_elsewhere(client, Path(args.dir)) for _ in range(args.rounds)]
    finally:
        cluster.down()
    leftover = cluster.running_pids()

    med = statistics.median
    figures = {
        "rounds": args.rounds,
        "up_s": round(med(ups), 3), "up_max_s": round(max(ups), 3),
        "down_s": round(med(downs), 3),
        "kill_all_processes_gone_ms": round(med(gone) * 1000, 1),
        "kill_to_slurm_not_responding_s": round(med(not_responding), 2),
        "kill_to_slurm_down_s": round(med(down_state), 2),
        "revive_to_usable_s": round(med(revive), 3),
        "requeue_to_running_elsewhere_s": round(med(r[0] for r in requeues), 2),
        "requeue_to_pending_s": round(med(r[1] for r in requeues), 2),
        "up_vs_15s_target": round(med(ups) / UP_TARGET_S, 4),
        "slurm_down_vs_actual_death": round(med(down_state) / max(med(gone), 1e-6), 1),
        "processes_left_after_down": len(leftover),
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(f"dev cluster, {args.rounds} rounds (medians), 5 nodes, SlurmdTimeout={cluster.spec.slurmd_timeout_s}s")
    print(f"  up (until every node idle)      {figures['up_s']:8.3f} s   (max {figures['up_max_s']:.3f} s; "
          f"{figures['up_vs_15s_target']:.3f} x the 15 s target)")
    print(f"  down (no process left: {figures['processes_left_after_down'] == 0})   {figures['down_s']:8.3f} s")
    print(f"  kill-node: all processes gone   {figures['kill_all_processes_gone_ms']:8.1f} ms")
    print(f"  kill-node -> Slurm not resp.    {figures['kill_to_slurm_not_responding_s']:8.2f} s")
    print(f"  kill-node -> Slurm DOWN         {figures['kill_to_slurm_down_s']:8.2f} s   "
          f"({figures['slurm_down_vs_actual_death']:.0f} x the actual death)")
    print(f"  revive-node -> usable           {figures['revive_to_usable_s']:8.3f} s")
    print(f"  scontrol requeue -> pending     {figures['requeue_to_pending_s']:8.2f} s")
    print(f"  requeue -> running elsewhere    {figures['requeue_to_running_elsewhere_s']:8.2f} s   "
          "(ExcNodeList + StartTime=now once pending; without StartTime Slurm waits ~121 s)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
