"""Time to restart: detection → first step after resume, with ckptsup's phase breakdown.

  fast path  a crashed rank (SIGKILL) on this machine: ckptsup restarts torchrun inside the
             running agent (a pre-imported standby launcher); baselines: torchrun's own restart
             (--max-restarts) and ft_launcher's, same workload, same clock
  node path  a node killed on the local Slurm dev cluster (3 nodes: 2 active + 1 hot spare):
             the survivor's and the spare's agents (one --no-kill step over every node, the
             spare's warmed up in standby) take the new launch; no new srun step
             (`--cluster-dir` to run it; it starts the cluster if needed)

usage: python bench/bench_restart.py [--cluster-dir /tmp/ckptsup-bench-cluster] [--skip-node-path]
                                     [--repeats N] [--tools ckptsup,torchrun,ft_launcher]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultbench import TRAIN, have_ft_launcher, run_one  # noqa: E402

from ckptsup.events import Event, FailureKind  # noqa: E402

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


def fast_path(base: Path, cap_s: float, *, repeats: int = 1, tools: list[str] | None = None) -> None:
    """Each tool `repeats` times, the tools taking turns (a busy machine's drift is shared); the
    medians of what did happen, and each other tool's median against ckptsup's."""
    tools = tools or ["ckptsup", "torchrun"] + (["ft_launcher"] if have_ft_launcher() else [])
    fmt = lambda v: "  n/a" if v is None else f"{v:5.2f}"  # noqa: E731
    runs: dict[str, list[tuple[float | None, float | None, float | None]]] = {tool: [] for tool in tools}
    for _ in range(repeats):
        for tool in tools:
            r = run_one(tool, "crash", base, cap_s=cap_s, hang_timeout_s=5.0)
            restart = None if r.stepping_s is None or r.detect_s is None else r.stepping_s - r.detect_s
            running = None if r.running_s is None or r.detect_s is None else r.running_s - r.detect_s
            runs[tool].append((r.stepping_s, restart, running))
            print(f"fast path  {tool:11s} fault→detect {fmt(r.detect_s)}  detect→ranks running {fmt(running)}"
                  f"  detect→first step {fmt(restart)}  fault→first step {fmt(r.stepping_s)}  {r.note}", flush=True)
            if r.phases:
                print("           phases: " + ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items()))
    medians = {tool: [_median([run[i] for run in rs]) for i in range(3)] for tool, rs in runs.items()}
    if repeats > 1:
        for tool, rs in runs.items():
            done = sorted(run[0] for run in rs if run[0] is not None)
            spread = f" (min {done[0]:.2f}, max {done[-1]:.2f})" if done else ""
            print(f"fast path  {tool:11s} median of {len(done)}/{repeats}: fault→first step {fmt(medians[tool][0])}{spread}"
                  f"  detect→first step {fmt(medians[tool][1])}  detect→ranks running {fmt(medians[tool][2])}")
    mine = medians.get("ckptsup")
    for tool, (_, restart, running) in medians.items():
        if tool == "ckptsup" or mine is None:
            continue
        for label, theirs, ours in (("first step", restart, mine[1]), ("ranks running", running, mine[2])):
            if theirs is not None and ours:
                print(f"fast path: {tool} detect→{label} / ckptsup = {theirs / ours:.1f}x")
            elif ours:
                print(f"fast path: {tool} detect→{label}: none within --cap-s {cap_s:g} (ckptsup {ours:.2f} s)")


def _median(values: list[float | None]) -> float | None:
    """The median of the runs where it happened; None when it never did."""
    done = sorted(v for v in values if v is not None)
    return statistics.median(done) if done else None


def node_path(cluster: Path, port_base: str) -> None:
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([*CKPTSUP, "dev-cluster", "up", "--dir", str(cluster), "--port-base", port_base],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    try:
        node_path_on(cluster, env)
    finally:  # its ports would collide with the test suite's second cluster (port base + 500)
        subprocess.run([*CKPTSUP, "dev-cluster", "down", "--dir", str(cluster), "--port-base", port_base],
                       env=env, check=False, stdout=subprocess.DEVNULL)


def node_path_on(cluster: Path, env: dict[str, str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="ckptsup-bench-node-", dir=cluster))
    (work / "job.toml").write_text("[supervisor]\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                                   "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    run = work / "run"
    sub = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", "2", "--spares", "1",
                          "--nproc-per-node", "1", "--config", str(work / "job.toml"), "--run-dir", str(run),
                          str(TRAIN), "--steps", "400", "--save-every-steps", "10", "--step-sleep-s", "0.1",
                          "--out", str(work / "out")], check=True, env=env, capture_output=True, text=True)
    job = json.loads(sub.stdout)["job_id"]

    def evts() -> list[dict]:
        path = run / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    deadline = time.monotonic() + 240
    while not any(e["event"] == Event.CHECKPOINT_COMMITTED and e.get("step", 0) >= 20 for e in evts()):
        if time.monotonic() > deadline:
            print("node path: the job did not checkpoint in time; skipped")
            return
        time.sleep(0.3)
    victim = [e for e in evts() if e["event"] == Event.LAUNCH][0]["nodes"][1]
    killed = time.time()
    subprocess.run([*CKPTSUP, "dev-cluster", "kill-node", victim, "--dir", str(cluster)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    before = len([e for e in evts() if e["event"] == Event.FAILURE_DETECTED])
    while not any(e["event"] == Event.RESTART_DONE and e["path"] == "node" for e in evts()) and time.monotonic() < deadline:
        time.sleep(0.3)
    done = [e for e in evts() if e["event"] == Event.RESTART_DONE and e["path"] == "node"]
    down = [e for e in evts() if e["event"] in (Event.FAILURE_DETECTED, Event.FAILURE_ATTRIBUTED)
            and e["kind"] == FailureKind.NODE_DOWN]
    subprocess.run(["scancel", job], env=env, check=False)
    subprocess.run([*CKPTSUP, "dev-cluster", "revive-node", victim, "--dir", str(cluster)], env=env, check=False,
                   stdout=subprocess.DEVNULL)
    if not done:
        print("node path: no restart_done within 180 s")
        return
    import datetime as dt

    first = [e for e in evts() if e["event"] == Event.FAILURE_DETECTED][before]
    seen = dt.datetime.fromisoformat(first["ts"]).timestamp() - killed
    r = done[0]
    print(f"node path  ckptsup     node kill→first detection {seen:5.2f}  "
          f"(node_down pinned: {down[0]['detect_s'] if down else 'n/a'} s after its last heartbeat)  "
          f"detect→first step {r['restart_s']:5.2f}  path={r['path']}  nodes={','.join(r['nodes'])}  "
          f"warm={r.get('warm')}")
    print("           phases: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-s", type=float, default=60.0)
    p.add_argument("--cluster-dir", default="/tmp/ckptsup-bench-cluster")
    p.add_argument("--port-base", default="17600")
    p.add_argument("--skip-node-path", action="store_true")
    p.add_argument("--skip-fast-path", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="fast path: runs of each tool, taking turns (medians)")
    p.add_argument("--tools", default="", help="fast path: comma-separated subset of ckptsup,torchrun,ft_launcher")
    a = p.parse_args()
    if not a.skip_fast_path:
        fast_path(Path(tempfile.mkdtemp(prefix="ckptsup-bench-restart-")), a.cap_s, repeats=max(1, a.repeats),
                  tools=[t for t in a.tools.split(",") if t] or None)
    if not a.skip_node_path:
        node_path(Path(a.cluster_dir), a.port_base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
