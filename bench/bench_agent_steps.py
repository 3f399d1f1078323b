"""What running the agents costs the batch host, per design, on the dev cluster: one srun client
per node (`srun -N1 -w NODE` each) against ckptsup's one `--no-kill` step over every node
(supervisor/job/agent_set.py). Each task prints a one-line heartbeat a second, as an agent does.
Reports each design's srun processes on the batch host — CPU (% of a core, utime+stime over the
window) and memory (PSS, so shared libslurm pages count once) — per node and scaled to 2,048
nodes, then kills one node and checks that the --no-kill step's other tasks keep running (the
reason one step is enough).

    .venv/bin/python bench/bench_agent_steps.py [--nodes 4] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from ckptsup.slurm.devcluster import DevCluster
from ckptsup.slurm.devconf import ClusterSpec
from ckptsup.slurm.parsers import JobState

TASK = "while sleep 1; do echo \"$SLURMD_NODENAME hb\"; done"
SCALE = 2048


def srun(job: str, nodes: list[str], out: Path) -> subprocess.Popen:
    argv = ["srun", "-u", "--overlap", "--input=all", f"--jobid={job}", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}", f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=0", "--no-kill",
            "bash", "-c", TASK]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out.open("wb"), stderr=subprocess.STDOUT)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def pss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


def measure(clients: list[subprocess.Popen], seconds: float) -> tuple[float, float]:
    time.sleep(3)   # past srun's start-up
    procs = [p for c in clients for p in tree(c)]
    c0, t0 = cpu_s(procs), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(procs) - c0) / (time.monotonic() - t0) * 100, pss_mb(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--dir", default="/tmp/ckptsup-bench-steps")
    p.add_argument("--port-base", type=int, default=17400)
    a = p.parse_args()
    cluster = DevCluster(ClusterSpec(dir=Path(a.dir), port_base=a.port_base))
    cluster.down()
    cluster.up()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    client = cluster.client()
    work = Path(tempfile.mkdtemp(prefix="ckptsup-bench-steps-"))
    nodes = cluster.spec.node_names[:a.nodes]
    script = work / "hold.sbatch"
    script.write_text("#!/bin/bash\nsleep 3600\n")
    job = client.submit(script, ["--no-kill", f"--nodes={len(nodes)}", "--output=/dev/null"])
    while not (info := client.job_info(job)) or info.state is not JobState.RUNNING:
        time.sleep(0.2)
    try:
        per_node = [srun(job, [n], work / f"per-node-{n}.out") for n in nodes]
        cpu_a, mem_a = measure(per_node, a.seconds)
        for c in per_node:
            c.kill()
        one = srun(job, nodes, work / "one-step.out")
        cpu_b, mem_b = measure([one], a.seconds)
        victim = nodes[-1]
        size = (work / "one-step.out").stat().st_size
        cluster.kill_node(victim)
        time.sleep(10)
        tail = (work / "one-step.out").read_bytes()[size:].decode(errors="replace").splitlines()
        survivors = {line.split()[0] for line in tail[-2 * len(nodes):] if line.endswith(" hb")}
        one.kill()
    finally:
        client.cancel(job)
        cluster.down()
    n = len(nodes)
    print(f"per-node steps ({n} srun clients): {cpu_a / n:.3f} % of a core and {mem_a / n:.1f} MB PSS per node; "
          f"at {SCALE:,} nodes {cpu_a / n * SCALE:.0f} % of a core and {mem_a / n * SCALE / 1024:.1f} GB")
    print(f"one --no-kill step (1 srun client, {n} nodes): {cpu_b:.3f} % of a core and {mem_b:.1f} MB PSS in all")
    print(f"ratio per-node / one step at {n} nodes: CPU {cpu_a / max(cpu_b, 1e-9):.1f}x, memory {mem_a / mem_b:.1f}x")
    ok = survivors == set(nodes) - {victim}
    print(f"after killing {victim}: the one step's tasks still printing on {sorted(survivors)} "
          f"({'as expected' if ok else 'NOT the survivors'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
