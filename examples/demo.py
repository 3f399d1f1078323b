"""`make demo`: a node dies in the middle of a training run and ckptsup recovers on a hot spare.

1. start the local Slurm dev cluster (real slurmctld + slurmd per node, one machine);
2. submit examples/train.py through the sbatch template: 3 active nodes + 1 hot spare;
3. once the run has checkpointed, kill one active node (its whole PID namespace at once);
4. wait for the run to complete and print the restart log as a story (`ckptsup log`: one line per
   incident and recovery — the dead node, its detection, blame and drain, the spare taken, the
   restart's phases and where it resumed from — and one folded line per attempt) and the goodput
   report (`ckptsup report`), both led by the run's one line.

Everything here is what a user types: `ckptsup dev-cluster`, `ckptsup sbatch --submit`,
`ckptsup log`, `ckptsup report`. Usage: python examples/demo.py [--cluster-dir DIR] [--keep-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
JOB_TOML = """\
[supervisor]
heartbeat_interval_s = 0.5
node_silence_s = 4.0
hang_min_s = 15.0
[checkpoint]
adaptive_interval = false
# level-3 test loads run beside training; on a 2-core demo machine they would only compete for CPU
keep_daily_days = 0
test_load_every = 0
[slurm]
spare_partition = "mainspare"
"""


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def ckptsup(*args: str, capture: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CKPTSUP, *args], check=True, text=True, env=env,
                          stdout=subprocess.PIPE if capture else None)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return out


def wait(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"demo: timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-dir", default="/tmp/ckptsup-dev-cluster")
    parser.add_argument("--port-base", default="17000")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--keep-cluster", action="store_true", help="leave the dev cluster running")
    args = parser.parse_args()
    cluster = Path(args.cluster_dir)

    say(f"starting the local Slurm dev cluster in {cluster}")
    ckptsup("dev-cluster", "up", "--dir", str(cluster), "--port-base", args.port_base)
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    os.environ.update(env)
    work = cluster / "demo" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.toml").write_text(JOB_TOML)
    run_dir = work / "run"
    try:
        say("submitting examples/train.py: 3 active nodes + 1 hot spare, 1 rank per node")
        sub = ckptsup("sbatch", "--submit", "--json", "--nodes", "3", "--spares", "1", "--nproc-per-node", "1",
                      "--config", str(work / "job.toml"), "--run-dir", str(run_dir), str(TRAIN),
                      "--steps", str(args.steps), "--save-every-steps", "10", "--step-sleep-s", "0.1",
                      "--out", str(work / "out"), capture=True)
        job = json.loads(sub.stdout)["job_id"]
        print(f"job {job}; run directory {run_dir}")

        wait("the first checkpoint", lambda: any(e["event"] == "checkpoint_committed" and e.get("step", 0) >= 20
                                                 for e in events(run_dir)), 240)
        launch = [e for e in events(run_dir) if e["event"] == "launch"][0]
        victim = launch["nodes"][1]
        say(f"training on {', '.join(launch['nodes'])} (spare: {', '.join(launch['spares'])}); "
            f"killing node {victim} now")
        ckptsup("dev-cluster", "kill-node", victim, "--dir", str(cluster))

        wait("the run to finish", lambda: any(e["event"] in ("run_complete", "give_up") for e in events(run_dir)), 600)
        say("what happened (ckptsup log: the story; --all lists every event)")
        subprocess.run([*CKPTSUP, "log", str(run_dir)], check=False)
        say("where the run's time went (ckptsup report)")
        subprocess.run([*CKPTSUP, "report", str(run_dir)], check=False)
        ckptsup("dev-cluster", "revive-node", victim, "--dir", str(cluster))
    finally:
        if not args.keep_cluster:
            say("stopping the dev cluster")
            subprocess.run([*CKPTSUP, "dev-cluster", "down", "--dir", str(cluster)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
