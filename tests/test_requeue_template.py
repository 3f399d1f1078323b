"""The real thing end to end: the supervisor (`ckptsup launch` under the rendered template) is
SIGKILLed mid-run. The batch script sees it die and runs `ckptsup requeue`: exactly one fenced
requeue event (by the batch script), the job comes back at once (StartTime=now), resumes from
the newest checkpoint and completes; no rank of the killed attempt is left running."""

from __future__ import annotations

import shutil
import time

import psutil
import pytest

from ckptsup.events import read_events

from drop_in_helpers import env_processes, with_real_ranks
from test_watchdog_template import submit_train_job, wait_events

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def job_processes(job: str, **env_match: str) -> list[psutil.Process]:
    """Host processes of `job` whose environment has every KEY=VALUE of env_match."""
    return env_processes(SLURM_JOB_ID=job, **env_match)


def test_sigkilled_supervisor_is_requeued_by_the_batch_script_and_resumes(dev_cluster, tmp_path):
    job, run_dir = submit_train_job(dev_cluster, tmp_path, steps=300)
    try:
        wait_events(run_dir, "first_step", 1, 120)
        wait_events(run_dir, "checkpoint_committed", 1, 60)
        supervisors = [p for p in job_processes(job) if p.cmdline()[1:3] == [shutil.which("ckptsup") or "", "launch"]
                       or p.cmdline()[:2] == ["ckptsup", "launch"]]
        assert len(supervisors) == 1, [p.cmdline() for p in supervisors]
        ranks_before = with_real_ranks(job_processes(job, CKPTSUP_ATTEMPT="0", LOCAL_RANK="0"))
        assert ranks_before, "no rank of attempt 0 found"
        killed_at = time.time()
        supervisors[0].kill()
        wait_events(run_dir, "supervisor_start", 2, 60)
        back_after = time.time() - killed_at
        time.sleep(max(0.0, 30 - (time.time() - killed_at)))
        orphans = [p for p in ranks_before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not orphans, [p.cmdline() for p in orphans]
        wait_events(run_dir, "run_complete", 1, 240)
        events = read_events(run_dir)
        requeues = [e for e in events if e["event"] == "requeue"]
        assert len(requeues) == 1 and requeues[0]["by"] == "batch_script", requeues
        assert requeues[0]["reason"] == "supervisor_died" and requeues[0]["epoch"] == 2
        resumed = [e["resume_from"] for e in events if e["event"] == "launch"]
        assert resumed[0] is None and resumed[1]
        # StartTime=now: no 121 s BeginTime hold. ~10 s on a quiet box; the bound is the hold's half,
        # not a speed figure: 34 s was seen on Slurm 26.05 with the 2 cores under other test runs
        assert back_after < 60, back_after
        print(f"\nSUPERVISOR_KILLED job={job}: killed -> new supervisor {back_after:.2f}s")
    finally:
        dev_cluster.client.cancel(job)
