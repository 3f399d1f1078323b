"""The watchdog step on the real dev cluster: it runs on another node than the batch host and
requeues the job (excluding the batch host) when the supervisor's lease goes stale — whether the
supervisor merely stops renewing it or the batch host's node dies under --no-kill."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import hostlist
import pytest

from ckptsup.events import read_events

from test_requeue_cluster import check_finisher_outcomes, make_run_dir

pytestmark = pytest.mark.slurm

SCRIPT = """#!/bin/bash
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then
    echo "second run on $SLURM_JOB_NODELIST partition $SLURM_JOB_PARTITION"
    exit 0
fi
other=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vx "$SLURMD_NODENAME" | head -1)
echo "first run batch host $SLURMD_NODENAME watchdog on $other"
srun --overlap -N1 -n1 -w "$other" ckptsup watchdog --run-dir {run_dir} &
# the supervisor writes its effective config after the watchdog has started
sleep 1; [ -e {run_dir}/config.json.later ] && mv {run_dir}/config.json.later {run_dir}/config.json
# the "supervisor": renews its lease every 0.5 s, {renewals} times (forever when negative)
python - <<'PY'
import socket, time
from ckptsup.rundir import RunDir
from pathlib import Path
rd = RunDir(path=Path("{run_dir}"))
n = {renewals}
while n != 0:
    rd.renew_lease(epoch=0, host=socket.gethostname())
    time.sleep(0.5)
    n -= 1
PY
sleep 300
"""


def wait_output(out_file: Path, text: str, timeout: float, dev_cluster, job: str, rd) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out = out_file.read_text() if out_file.exists() else ""
        if text in out:
            return out
        assert time.monotonic() < deadline, (dev_cluster.job(job), out, read_events(rd.path))
        time.sleep(0.2)


def run_case(dev_cluster, tmp_path, *, renewals: int, kill_batch_host: bool, extra=()):
    rd = make_run_dir(tmp_path, lease_stale_s=3.0)
    rd.config_json_path.rename(rd.path / "config.json.later")
    out_file = tmp_path / "job.out"
    job = dev_cluster.submit(SCRIPT.format(run_dir=rd.path, renewals=renewals), "-N", "2", "-p", "main",
                             "--requeue", "--open-mode=append", f"--output={out_file}", *extra)
    try:
        out = wait_output(out_file, "first run", 30, dev_cluster, job, rd)
        batch_host = out.split("batch host ")[1].split()[0]
        dev_cluster.wait_for(lambda: rd.lease_path.exists(), 30, what="first lease")
        killed_at = None
        if kill_batch_host:
            time.sleep(2)  # the watchdog is up and the lease fresh
            killed_at = time.time()
            dev_cluster.kill_node(batch_host)
        out = wait_output(out_file, "second run", 150 if kill_batch_host else 60, dev_cluster, job, rd)
        second_run_at = time.time()
        second = out.split("second run on ")[1].split()[0]
        assert batch_host not in hostlist.expand_hostlist(second), out
        events = read_events(rd.path)
        requeues = [e for e in events if e["event"] == "requeue"]
        assert len(requeues) == 1, events
        assert requeues[0]["by"] == "watchdog" and requeues[0]["reason"] == "batch_host_lost"
        assert requeues[0]["excluded"] == [batch_host]
        dev_cluster.wait_for(lambda: any(e["event"] == "requeue_updated" for e in read_events(rd.path)), 10,
                             what="the finisher's record")
        (updated,) = [e for e in read_events(rd.path) if e["event"] == "requeue_updated"]
        check_finisher_outcomes([updated], out.split("second run on ")[1].split("partition ")[1].split()[0])
        lease_last = json.loads(rd.lease_path.read_text())["renewed"]
        requeued_at = dt.datetime.fromisoformat(requeues[0]["ts"]).timestamp()
        return {"job": job, "stale_to_requeue_s": requeued_at - lease_last,
                "killed_to_requeue_s": None if killed_at is None else requeued_at - killed_at,
                "requeue_to_second_run_s": round(second_run_at - requeued_at, 2),
                "pending_updates_s": updated["total_s"], "wait_pending_s": updated["wait_pending_s"],
                "updated": updated["ok"],
                "batch_host": batch_host}
    finally:
        dev_cluster.client.cancel(job)


def test_watchdog_requeues_once_when_the_lease_stops_being_renewed(dev_cluster, tmp_path):
    r = run_case(dev_cluster, tmp_path, renewals=4, kill_batch_host=False)
    # lease_stale_s = 3 s, polled every 0.75 s
    assert 3.0 < r["stale_to_requeue_s"] < 3.0 + 3.0, r
    print(f"\nWATCHDOG_STALE {r}")


def test_watchdog_requeues_when_the_batch_host_node_dies_under_no_kill(dev_cluster, tmp_path):
    r = run_case(dev_cluster, tmp_path, renewals=-1, kill_batch_host=True, extra=("--no-kill",))
    try:
        assert r["killed_to_requeue_s"] < 3.0 + 3.0, r
        print(f"\nWATCHDOG_NODE_DEATH {r}")
    finally:
        dev_cluster.revive_node(r["batch_host"])
