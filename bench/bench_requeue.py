"""The requeue path end to end on the dev cluster, against Slurm's own requeue measured in the
same run.

    ckptsup path   requeue_job: squeue check → fence → scontrol requeue → event → (PENDING) →
                   one update ExcNodeList + Partition=mainspare + StartTime=now
    baseline       plain `scontrol requeue` (what an exit status or a bare script gets): the job
                   waits out Slurm's BeginTime hold (~121 s) and may land on the same nodes

Figures (seconds, median of --rounds):
    inline         requeue_job called from outside the job (the finisher runs inline)
    batch script   `ckptsup requeue` inside the job after its "supervisor" died: detached finisher
    watchdog       lease stops being renewed → watchdog on another node → job running again
    node death     batch host killed under --no-kill → watchdog → job running again (1 round)

    .venv/bin/python bench/bench_requeue.py [--rounds 3] [--no-baseline] [--json]
    .ci/slurm-matrix.sh run trixie .venv/bin/python bench/bench_requeue.py   # on Slurm 24.11 (sid: 26.05)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from ckptsup.config import Config, Resolved, write_config_json
from ckptsup.events import Event, read_events
from ckptsup.rundir import RunDir
from ckptsup.slurm.devcluster import DevCluster, slurm_version
from ckptsup.slurm.devconf import SPANNING, ClusterSpec
from ckptsup.slurm.parsers import JobState
from ckptsup.supervisor.job.requeue import RequeueEffects, RequeueRequest, requeue_job

SLEEPER = "#!/bin/bash\nsleep 600\n"
BATCH = """#!/bin/bash
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then sleep 600; exit 0; fi
sh -c 'kill -9 $$'
ckptsup requeue --run-dir {run_dir} --reason supervisor_died --exclude $SLURMD_NODENAME
sleep 600
"""
WATCHED = """#!/bin/bash
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then sleep 600; exit 0; fi
other=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vx "$SLURMD_NODENAME" | head -1)
srun --overlap -N1 -n1 -w "$other" ckptsup watchdog --run-dir {run_dir} &
python - <<'PY'
import socket, time
from pathlib import Path
from ckptsup.rundir import RunDir
rd, n = RunDir(path=Path("{run_dir}")), {renewals}
while n != 0:
    rd.renew_lease(epoch=0, host=socket.gethostname())
    time.sleep(0.5)
    n -= 1
PY
sleep 600
"""


def wait(predicate, timeout_s: float, poll_s: float = 0.02):
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s}s")
        time.sleep(poll_s)


class Bench:
    def __init__(self, cluster: DevCluster, work: Path):
        self.cluster, self.client, self.work = cluster, cluster.client(), work
        self.n = 0

    def run_dir(self, **supervisor) -> RunDir:
        self.n += 1
        path = self.work / f"run-{self.n}"
        shutil.rmtree(path, ignore_errors=True)
        rd = RunDir.create(path)
        config = Config()
        config.slurm.spare_partition = SPANNING
        for key, value in supervisor.items():
            setattr(config.supervisor, key, value)
        write_config_json(Resolved(config=config, provenance={}), rd.config_json_path)
        return rd

    def submit(self, text: str, *args: str) -> str:
        script = self.work / f"job-{self.n}.sbatch"
        script.write_text(text)
        return self.client.submit(script, ["-N", "2", "-p", "main", "--requeue", "--output=/dev/null", *args])

    def running(self, job: str, restarts: int = 0):
        info = self.client.job_info(job)
        return info if info and info.state is JobState.RUNNING and info.restart_count >= restarts else None

    def requeue_ts(self, rd: RunDir) -> float:
        event = wait(lambda: next((e for e in read_events(rd.path) if e["event"] == Event.REQUEUE), None), 120)
        return dt.datetime.fromisoformat(event["ts"]).timestamp()

    def inline(self) -> dict:
        rd = self.run_dir()
        job = self.submit(SLEEPER)
        first = wait(lambda: self.running(job), 30)
        t0 = time.monotonic()
        result = requeue_job(self.client, rd, RequeueRequest(job_id=job, reason="bench", exclude=(first.nodes[0],),
                                                             partition=SPANNING), RequeueEffects(detach=False))
        again = wait(lambda: self.running(job, 1), 60)
        total = time.monotonic() - t0
        assert first.nodes[0] not in again.nodes and again.partition == SPANNING
        self.client.cancel(job)
        f = result.finish
        return {"total_s": total, "wait_pending_s": f.wait_pending_s, "hold_s": f.hold_s,
                "update_s": f.update_s, "scheduler_s": total - f.total_s}

    def batch_script(self) -> dict:
        rd = self.run_dir()
        job = self.submit(BATCH.format(run_dir=rd.path))
        t_req = self.requeue_ts(rd)
        wait(lambda: self.running(job, 1), 60)
        total = time.time() - t_req
        self.client.cancel(job)
        return {"total_s": total}

    def watchdog(self, *, kill: bool) -> dict:
        rd = self.run_dir(lease_stale_s=3.0)
        job = self.submit(WATCHED.format(run_dir=rd.path, renewals=-1 if kill else 4), "--no-kill")
        first = wait(lambda: self.running(job), 30)
        wait(lambda: rd.lease_path.exists(), 30)
        t_fault = time.time()
        if kill:
            time.sleep(2.0)
            t_fault = time.time()
            self.cluster.kill_node(first.nodes[0])
        else:
            # the fault is the last renewal: wait until renewals (every 0.5 s) have stopped
            wait(lambda: (rd.lease_age_s() or 0.0) > 0.6, 30)
            t_fault = json.loads(rd.lease_path.read_text())["renewed"]
        t_req = self.requeue_ts(rd)
        again = wait(lambda: self.running(job, 1), 150, poll_s=0.05)
        total = time.time() - t_fault
        assert first.nodes[0] not in again.nodes
        self.client.cancel(job)
        if kill:
            self.cluster.revive_node(first.nodes[0])
        return {"fault_to_requeue_s": t_req - t_fault, "total_s": total}

    def baseline(self) -> dict:
        job = self.submit(SLEEPER)
        wait(lambda: self.running(job), 30)
        t0 = time.monotonic()
        self.client.requeue(job)
        wait(lambda: self.running(job, 1), 300, poll_s=0.2)
        total = time.monotonic() - t0
        self.client.cancel(job)
        return {"total_s": total}


def med(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckptsup-bench-requeue")
    parser.add_argument("--port-base", type=int, default=17800)
    parser.add_argument("--no-baseline", action="store_true", help="skip Slurm's own ~121 s requeue")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    venv_bin = str(Path(sys.executable).parent)
    os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    cluster = DevCluster(ClusterSpec(dir=Path(args.dir), port_base=args.port_base))
    cluster.down()
    cluster.up()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    work = Path(args.dir) / "bench"
    work.mkdir(mode=0o700, exist_ok=True)
    bench = Bench(cluster, work)
    try:
        inline = [bench.inline() for _ in range(args.rounds)]
        batch = [bench.batch_script() for _ in range(args.rounds)]
        stale = [bench.watchdog(kill=False) for _ in range(args.rounds)]
        death = bench.watchdog(kill=True)
        base = None if args.no_baseline else bench.baseline()
    finally:
        cluster.down()
    figures = {
        "slurm": "%d.%02d" % slurm_version(),
        "inline_requeue_to_running_s": med(inline, "total_s"),
        "inline_wait_pending_s": med(inline, "wait_pending_s"),
        "inline_credential_hold_s": med(inline, "hold_s"),
        "inline_update_s": med(inline, "update_s"),
        "inline_scheduler_s": med(inline, "scheduler_s"),
        "batch_script_requeue_to_running_s": med(batch, "total_s"),
        "watchdog_stale_to_requeue_s": med(stale, "fault_to_requeue_s"),
        "watchdog_stale_to_running_s": med(stale, "total_s"),
        "node_death_to_requeue_s": round(death["fault_to_requeue_s"], 3),
        "node_death_to_running_s": round(death["total_s"], 3),
        "baseline_plain_requeue_to_running_s": None if base is None else round(base["total_s"], 2),
    }
    if base is not None:
        figures["speedup_vs_plain_requeue"] = round(base["total_s"] / figures["inline_requeue_to_running_s"], 1)
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    print(f"requeue path on the dev cluster, Slurm {figures['slurm']} ({args.rounds} rounds, medians; lease_stale_s = 3 s)")
    print(f"  inline: requeue -> running elsewhere  {figures['inline_requeue_to_running_s']:7.2f} s "
          f"(pending {figures['inline_wait_pending_s']:.2f}, credential hold {figures['inline_credential_hold_s']:.2f}, "
          f"update {figures['inline_update_s']:.3f}, scheduler {figures['inline_scheduler_s']:.2f})")
    print(f"  batch script (detached finisher)      {figures['batch_script_requeue_to_running_s']:7.2f} s")
    print(f"  watchdog: lease stale -> requeue      {figures['watchdog_stale_to_requeue_s']:7.2f} s, "
          f"-> running {figures['watchdog_stale_to_running_s']:.2f} s")
    print(f"  batch host killed -> requeue          {figures['node_death_to_requeue_s']:7.2f} s, "
          f"-> running {figures['node_death_to_running_s']:.2f} s")
    if base is not None:
        print(f"  baseline: plain scontrol requeue      {figures['baseline_plain_requeue_to_running_s']:7.2f} s   "
              f"ratio {figures['speedup_vs_plain_requeue']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
