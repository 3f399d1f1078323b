"""What a container costs an agent's start (the container phase: docs/containers.md): one srun step of
`ckptsup agent`'s interpreter importing ckptsup's agent module on N dev-cluster nodes, bare and in
Slurm's OCI container (runc, the dev cluster's test bundle), alternated, same clock. Reported: the
median wall time of the step (srun → every task's import done → srun back) and the ratio container /
bare; the difference is what `restart_done.phases.container_s` adds to a restart that starts agents.

usage: python bench/bench_container_start.py [--cluster-dir /tmp/ckptsup-bench-containers] [--repeats 10] [--nodes 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
IMPORT = "import ckptsup.supervisor.node.agent"   # what `ckptsup agent` imports before its hello


def step(nodes: int, bundle: str | None, env: dict[str, str]) -> float:
    argv = ["srun", f"-N{nodes}", f"-n{nodes}", *([f"--container={bundle}"] if bundle else []),
            sys.executable, "-c", IMPORT]
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, cwd="/tmp", stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster-dir", default="/tmp/ckptsup-bench-containers")
    ap.add_argument("--port-base", type=int, default=19700)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args()
    subprocess.run([*CKPTSUP, "dev-cluster", "up", "--dir", args.cluster_dir, "--port-base", str(args.port_base),
                    "--first-job-id", "7000000", "--containers"], check=True, stdout=subprocess.DEVNULL)
    env = {**os.environ, "SLURM_CONF": str(Path(args.cluster_dir) / "slurm.conf")}
    bundle = str(Path(args.cluster_dir) / "bundle")
    try:
        step(args.nodes, None, env)   # warm: page cache, slurmd's first step
        step(args.nodes, bundle, env)
        bare, boxed = [], []
        for _ in range(args.repeats):   # alternated: a load change hits both alike
            bare.append(step(args.nodes, None, env))
            boxed.append(step(args.nodes, bundle, env))
    finally:
        subprocess.run([*CKPTSUP, "dev-cluster", "down", "--dir", args.cluster_dir], stdout=subprocess.DEVNULL)
    b, c = statistics.median(bare), statistics.median(boxed)
    print(f"agent start, {args.nodes} nodes, {args.repeats} steps each (median): bare {b:.3f}s, "
          f"OCI container (runc) {c:.3f}s: +{c - b:.3f}s, ratio container/bare {c / b:.2f}")


if __name__ == "__main__":
    main()
