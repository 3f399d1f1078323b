"""Fewer nodes or a requeue, measured on the dev cluster (issue 24 part 3): the same 3-node job
(examples/train.py with `attach`, no spare) loses a node at the same step twice — once with
`min_nodes = 2` and a horizon that makes the policy continue on the 2 survivors, once at the
defaults (min_nodes = the active nodes: the requeue of today). For each run:

    lost       job-seconds lost from the kill to the end: (end - kill) - (work done after the kill)
               / the 3-node rate measured before the kill, work counted in samples (the sampler's
               global position: steps x global batch), so both runs are in the unit of
               planning/shrink.py
    goodput    useful / paid device-seconds (planning/accounting.py) of the whole run

and beside them `ckptsup plan --min-nodes 2` fed with the runs' measured inputs (R: the in-allocation
restart, Q: the requeue to the next supervisor's start, S: the requeued allocation's start-up, H:
the time the job ran on 2 nodes) — what the policy's arithmetic predicts for each way.

    .venv/bin/python bench/bench_shrink.py [--steps 300] [--json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckptsup.events import read_events
from ckptsup.planning.accounting import account
from ckptsup.slurm.devcluster import DevCluster
from ckptsup.slurm.devconf import SPANNING, ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
BATCH = 4      # examples/train.py's per-rank batch
NODES = 3


def ts(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["ts"]).timestamp()


def named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def wait(predicate, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def one_run(cluster: DevCluster, tmp: Path, *, steps: int, shrink: bool) -> dict[str, Any]:
    run, out = tmp / "run", tmp / "out"
    toml = ("[supervisor]\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
            + ("min_nodes = 2\nshrink_horizon_s = 600.0\nrequeue_wait_s = 900.0\n" if shrink else "")
            + "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n"
            + f"[slurm]\nspare_partition = \"{SPANNING}\"\n")
    (tmp / "job.toml").write_text(toml)
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(NODES), "--spares", "0",
                           "--nproc-per-node", "1", "--config", str(tmp / "job.toml"), "--run-dir", str(run),
                           str(ROOT / "examples" / "train.py"), "--steps", str(steps), "--save-every-steps", "5",
                           "--step-sleep-s", "0.1", "--dataset-size", str(NODES * BATCH * steps), "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    wait(lambda: any(e.get("step", -1) >= 15 for e in named(read_events(run), "checkpoint_committed")), 180,
         "a checkpoint at step 15")
    victim = named(read_events(run), "launch")[0]["nodes"][1]
    killed = time.time()
    cluster.kill_node(victim)
    try:
        wait(lambda: named(read_events(run), "run_complete"), 600, "the run to complete")
    finally:
        cluster.revive_node(victim)
        cluster.client().resume(victim)
    events = read_events(run)
    at_kill = named(events, "failure_detected")[0]["step"] + 1            # steps done when the node died
    done_at_kill = at_kill * NODES * BATCH
    # samples/s on 3 nodes: first step to the kill (checkpoint stalls included, as after the kill)
    full_rate = (at_kill - named(events, "first_step")[0]["step"]) * NODES * BATCH / \
        (killed - ts(named(events, "first_step")[0]))
    launches = named(events, "launch")
    last = launches[-1]
    resume = named(events, "restart_done")[-1]["resume_step"] if named(events, "restart_done") else \
        named(events, "first_step")[-1]["step"]
    world = last["world_size"]
    total = resume * NODES * BATCH + (steps - resume) * world * BATCH     # the sampler's position at the end
    end = ts(named(events, "run_complete")[-1])
    lost = (end - killed) - (total - done_at_kill) / full_rate
    acc = account(events)
    result: dict[str, Any] = {
        "way": "continue" if world < NODES else "requeue", "kill_to_end_s": round(end - killed, 2),
        "lost_job_s": round(lost, 2), "goodput": round(acc.useful_device_s / acc.paid_device_s, 4),
        "useful_device_s": round(acc.useful_device_s, 1), "paid_device_s": round(acc.paid_device_s, 1),
        "queue_s": round(acc.queue_s, 2), "full_rate_samples_per_s": round(full_rate, 1),
        "resume_step": resume, "world_size_after": world}
    if named(events, "restart_done"):
        result["restart_s"] = named(events, "restart_done")[-1]["restart_s"]
        result["fewer_nodes_s"] = round(end - ts(named(events, "first_step")[-1]), 2)   # H: the time on 2 nodes
    starts = named(events, "supervisor_start")
    if len(starts) > 1:   # the requeued allocation: queue wait and start-up
        first = [e for e in named(events, "first_step") if ts(e) > ts(starts[-1])][0]
        result["startup_s"] = round(ts(first) - ts(starts[-1]), 2)
        result["requeue_to_start_s"] = round(ts(starts[-1]) - ts(named(events, "requeue")[-1]), 2)
    choice = named(events, "shrink_decided")
    if choice:
        result["shrink_decided"] = {k: choice[0][k] for k in ("choice", "continue_cost_s", "requeue_cost_s")}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dir", default="/tmp/ckptsup-bench-shrink")
    p.add_argument("--port-base", type=int, default=17500)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    cluster = DevCluster(ClusterSpec(dir=Path(a.dir), port_base=a.port_base))
    cluster.down()
    cluster.up()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        runs = {}
        for shrink in (True, False):
            with tempfile.TemporaryDirectory(prefix="bench-shrink-") as tmp:
                os.chmod(tmp, 0o700)
                runs["continue" if shrink else "requeue"] = one_run(cluster, Path(tmp), steps=a.steps, shrink=shrink)
    finally:
        cluster.down()
    cont, req = runs["continue"], runs["requeue"]
    restart = cont.get("restart_s", 0.0)
    plan = subprocess.run([*CKPTSUP, "plan", "--gpus", str(NODES), "--gpus-per-node", "1", "--mtbf", "6h",
                           "--stall", "1s", "--restart", f"{restart}s", "--price", "1", "--min-nodes", "2",
                           "--queue-wait", f"{req.get('requeue_to_start_s', 0.0)}s",
                           "--requeue-restart", f"{req.get('startup_s', restart)}s",
                           "--shrink-horizon", f"{cont.get('fewer_nodes_s', 1.0)}s", "--json"],
                          capture_output=True, text=True, timeout=60)
    predicted = json.loads(plan.stdout)["shrink"] if plan.returncode == 0 else {"error": plan.stderr.strip()}
    report = {"continue": cont, "requeue": req, "plan": predicted}
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for way in ("continue", "requeue"):
            r = report[way]
            print(f"{way:9} lost {r['lost_job_s']:7.2f} job-s  kill->end {r['kill_to_end_s']:7.2f} s  "
                  f"goodput {r['goodput']:.3f}  world after {r['world_size_after']}")
        if "error" not in predicted:
            print(f"plan      continue {predicted['continue_cost_s']:.2f} job-s, requeue {predicted['requeue_cost_s']:.2f} "
                  f"job-s -> {predicted['choice']}")
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
