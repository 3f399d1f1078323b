"""The requeue path on the real dev cluster: a requeued job runs again at once (StartTime=now
lifts the 121 s BeginTime), without the excluded nodes, in the spanning partition; from inside
the job the finish step is detached and survives the job's kill; `ckptsup requeue` from a batch
script appends exactly one fenced requeue event; a --no-requeue job is refused."""

from __future__ import annotations

import time
from pathlib import Path

import hostlist
import pytest

from ckptsup.config import Config, Resolved, write_config_json
from ckptsup.events import read_events
from ckptsup.rundir import RunDir
from ckptsup.slurm.devconf import SPANNING
from ckptsup.slurm.parsers import JobState
from ckptsup.supervisor.job.requeue import RequeueEffects, RequeueRefused, RequeueRequest, requeue_job

pytestmark = pytest.mark.slurm


def check_finisher_outcomes(updates: list[dict], final_partition: str, events: list[dict] | None = None) -> None:
    """Each requeue finisher either applied the pending-job updates, or found the job restarted at
    once — seen running again before it was ever PENDING (Slurm skips its BeginTime hold when a
    dead batch host's DOWN completes the requeue), or started between the PENDING it saw and its
    update, which Slurm then refused ("no longer pending"). A restarted job's record names where
    it landed; its new allocation avoids the excluded nodes, or — given the run's `events` — the
    next supervisor refused the excluded ones it holds (never launched there). The job is in the
    spanning partition exactly when one applied."""
    assert updates
    for update in updates:
        if update["ok"]:
            continue
        assert "restarted at once" in update["error"] and update["restarted"] is True, update
        assert update["nodes"], update  # where it landed
        on_excluded = set(update["nodes"]) & set(update["excluded"])
        assert set(update["on_excluded"]) == on_excluded, update
        if not on_excluded:
            assert "none of the excluded" in update["error"], update
            continue
        assert "which the next supervisor refuses" in update["error"], update
        assert events is not None, f"restarted on excluded node(s) {sorted(on_excluded)}, and no supervisor ran: {update}"
        (requeue,) = [e for e in events if e["event"] == "requeue" and e["excluded"] == update["excluded"]]
        later = [e for e in events if e["event"] in ("supervisor_start", "launch") and e["epoch"] > requeue["epoch"]]
        starts = [e for e in later if e["event"] == "supervisor_start"]
        assert starts and all(on_excluded <= set(e["excluded"]) for e in starts), (update, later)
        assert all(not on_excluded & set(e["nodes"]) for e in later if e["event"] == "launch"), (update, later)
    assert final_partition == (SPANNING if any(u["ok"] for u in updates) else "main"), updates


def make_run_dir(tmp_path: Path, *, spare_partition: str = SPANNING, **supervisor) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    config = Config()
    config.slurm.spare_partition = spare_partition
    for key, value in supervisor.items():
        setattr(config.supervisor, key, value)
    write_config_json(Resolved(config=config, provenance={}), rd.config_json_path)
    return rd


def running(dev_cluster, job: str, *, restarts: int = 0):
    info = dev_cluster.job(job)
    if info is not None and info.state == JobState.RUNNING and info.restart_count >= restarts:
        return info
    return None


def test_requeued_job_runs_again_at_once_without_the_excluded_node_in_the_spare_partition(dev_cluster, tmp_path):
    rd = make_run_dir(tmp_path)
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "2", "-p", "main", "--requeue")
    first = dev_cluster.wait_for(lambda: running(dev_cluster, job), 30, what="job running")
    bad = first.nodes[0]
    try:
        t0 = time.monotonic()
        result = requeue_job(dev_cluster.client, rd, RequeueRequest(job_id=job, reason="node_down", exclude=(bad,),
                                                                    partition=SPANNING),
                             RequeueEffects(detach=False))
        again = dev_cluster.wait_for(lambda: running(dev_cluster, job, restarts=1), 60, interval=0.05,
                                     what="job running again")
        end_to_end = time.monotonic() - t0
        assert result.requeued and result.finish.ok, result.finish
        assert bad not in again.nodes and len(again.nodes) == 2
        assert again.partition == SPANNING
        assert bad in again.excluded_nodes
        # far below Slurm's 121 s BeginTime hold: StartTime=now worked
        assert end_to_end < 30, end_to_end
        print(f"\nREQUEUE_E2E job={job} requeue->running {end_to_end:.2f}s "
              f"(check {result.phases['check_s']:.3f}s, requeue {result.phases['requeue_s']:.3f}s, "
              f"wait pending {result.finish.wait_pending_s:.2f}s, update {result.finish.update_s:.3f}s)")
        events = read_events(rd.path)
        assert [e["event"] for e in events] == ["requeue", "requeue_updated"]
        assert rd.load_state().status == "requeued" and rd.load_state().epoch == 1
    finally:
        dev_cluster.client.cancel(job)


def test_no_requeue_job_is_refused_from_squeue_json(dev_cluster, tmp_path):
    rd = make_run_dir(tmp_path)
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "1", "--no-requeue")
    try:
        dev_cluster.wait_for(lambda: running(dev_cluster, job), 30, what="job running")
        with pytest.raises(RequeueRefused, match="--no-requeue"):
            requeue_job(dev_cluster.client, rd, RequeueRequest(job_id=job, reason="node_down"),
                        RequeueEffects(detach=False))
        assert dev_cluster.job_state(job) == JobState.RUNNING  # untouched
        assert read_events(rd.path) == [] and rd.load_state().epoch == 0
    finally:
        dev_cluster.client.cancel(job)


BATCH_REQUEUE = """#!/bin/bash
# First run: the "supervisor" dies abnormally; the script requeues through ckptsup.
# Second run: say where we are and finish.
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then
    echo "second run on $SLURM_JOB_NODELIST partition $SLURM_JOB_PARTITION"
    exit 0
fi
echo "first run batch host $SLURMD_NODENAME"
sh -c 'kill -9 $$'
rc=$?
echo "supervisor died rc=$rc"
ckptsup requeue --run-dir {run_dir} --reason supervisor_died --exclude $SLURMD_NODENAME
echo "requeue rc=$?"
sleep 60
"""


def test_batch_script_requeue_appends_one_event_and_the_detached_finish_survives_the_kill(dev_cluster, tmp_path):
    rd = make_run_dir(tmp_path)
    out_file = tmp_path / "job.out"
    job = dev_cluster.submit(BATCH_REQUEUE.format(run_dir=rd.path), "-N", "2", "-p", "main",
                             "--requeue", "--open-mode=append", f"--output={out_file}")
    output = lambda: out_file.read_text() if out_file.exists() else ""  # noqa: E731
    finish_log = rd.path / "requeue-finish.log"
    try:
        deadline = time.monotonic() + 90
        while not (dev_cluster.job_state(job) == JobState.COMPLETED and "second run" in output()):
            assert time.monotonic() < deadline, (dev_cluster.job(job), output(), read_events(rd.path),
                                                 finish_log.exists() and finish_log.read_text())
            time.sleep(0.2)
        out = output()
        batch_host = [line for line in out.splitlines() if line.startswith("first run")][0].split()[-1]
        second = [line for line in out.splitlines() if line.startswith("second run")][0]
        assert batch_host not in hostlist.expand_hostlist(second.split()[3]), out
        assert f"partition {SPANNING}" in second, out
        events = read_events(rd.path)
        requeues = [e for e in events if e["event"] == "requeue"]
        assert len(requeues) == 1, events
        assert requeues[0]["by"] == "batch_script" and requeues[0]["reason"] == "supervisor_died"
        assert requeues[0]["epoch"] == 1 and requeues[0]["excluded"] == [batch_host]
        updated = [e for e in events if e["event"] == "requeue_updated"]
        assert len(updated) == 1 and updated[0]["ok"], (events, finish_log.read_text())
        print(f"\nREQUEUE_DETACHED job={job} requeue->pending-updates {updated[0]['total_s']:.2f}s "
              f"(wait pending {updated[0]['wait_pending_s']:.2f}s)")
    finally:
        dev_cluster.client.cancel(job)


def test_ckptsup_requeue_on_a_no_requeue_job_is_one_line_and_give_up_status(dev_cluster, tmp_path):
    import subprocess

    rd = make_run_dir(tmp_path)
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "1", "--no-requeue")
    try:
        dev_cluster.wait_for(lambda: running(dev_cluster, job), 30, what="job running")
        proc = subprocess.run(["ckptsup", "requeue", "--run-dir", str(rd.path), "--reason", "supervisor_died",
                               "--job-id", job], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.count("\n") == 1 and "--no-requeue" in proc.stderr and "Traceback" not in proc.stderr
        assert dev_cluster.job_state(job) == JobState.RUNNING
    finally:
        dev_cluster.client.cancel(job)


def test_job_already_requeued_by_slurm_gets_the_updates_and_runs_at_once(dev_cluster, tmp_path):
    rd = make_run_dir(tmp_path)
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "1", "-p", "main", "--requeue")
    try:
        first = dev_cluster.wait_for(lambda: running(dev_cluster, job), 30, what="job running")
        dev_cluster.client.requeue(job)  # as Slurm's preemption would: BeginTime now + 121 s
        dev_cluster.wait_for(lambda: dev_cluster.job_state(job) == JobState.PENDING, 30, what="pending")
        result = requeue_job(dev_cluster.client, rd, RequeueRequest(job_id=job, reason="preempted",
                                                                    exclude=(first.nodes[0],), partition=SPANNING),
                             RequeueEffects(detach=False))
        again = dev_cluster.wait_for(lambda: running(dev_cluster, job, restarts=1), 30, what="running again")
        assert result.requeued and result.finish.ok
        assert first.nodes[0] not in again.nodes and again.partition == SPANNING
        assert [e["already_pending"] for e in read_events(rd.path) if e["event"] == "requeue"] == [True]
    finally:
        dev_cluster.client.cancel(job)


class StartsBeforeTheUpdate:
    """The real client, except that just before the finisher's first update the job is started
    (StartTime=now alone, as Slurm itself does after a dead batch host's DOWN): the finisher's
    update then meets Slurm's own refusal of a job that is no longer pending."""

    def __init__(self, dev_cluster, job: str):
        self.fx, self.job, self.started = dev_cluster, job, None

    def job_info(self, job_id):
        return self.fx.client.job_info(job_id)

    def requeue(self, job_id):
        self.fx.client.requeue(job_id)

    def update_job(self, job_id, **kw):
        if self.started is None:
            self.fx.client.update_job(job_id, start_time_now=True)
            self.started = self.fx.wait_for(lambda: running(self.fx, self.job, restarts=1), 30, interval=0.05,
                                            what="the job started before the update")
        self.fx.client.update_job(job_id, **kw)


def test_a_job_slurm_starts_between_the_pending_seen_and_the_update_is_recorded_where_it_landed(dev_cluster, tmp_path):
    rd = make_run_dir(tmp_path)
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "2", "-p", "main", "--requeue")
    try:
        first = dev_cluster.wait_for(lambda: running(dev_cluster, job), 30, what="job running")
        bad = first.nodes[0]
        client = StartsBeforeTheUpdate(dev_cluster, job)
        result = requeue_job(client, rd, RequeueRequest(job_id=job, reason="node_down", exclude=(bad,),
                                                        partition=SPANNING),
                             RequeueEffects(detach=False))
        finish, again = result.finish, client.started
        assert result.requeued and again is not None and not finish.ok, finish
        assert finish.restarted and "restarted at once" in finish.error and "no longer pending" in finish.error
        assert finish.nodes == tuple(again.nodes) and finish.job_partition == "main" == again.partition
        assert set(finish.on_excluded) == {bad} & set(again.nodes)  # no ExcNodeList: it may be back on `bad`
        (updated,) = [e for e in read_events(rd.path) if e["event"] == "requeue_updated"]
        assert updated["ok"] is False and updated["nodes"] == list(again.nodes)
        if bad in again.nodes:
            assert "which the next supervisor refuses" in finish.error
            with pytest.raises(AssertionError, match="no supervisor ran"):
                check_finisher_outcomes([updated], again.partition)
        else:
            check_finisher_outcomes([updated], again.partition)
        assert rd.load_state().status == "requeued"
    finally:
        dev_cluster.client.cancel(job)
