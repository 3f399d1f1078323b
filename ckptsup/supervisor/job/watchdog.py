"""The watchdog step: covers the batch host's death (docs/timeouts.md §6).

Under `--no-kill` Slurm removes a dead batch host from the job and kills the batch step, but
leaves the job RUNNING on the other nodes with nobody to drive it. The batch script starts this
loop with `srun --overlap -N1 -n1 -w <another node> ckptsup watchdog --run-dir DIR &`; it is
not part of the agents' step (which includes the batch host and dies with it).

Each poll it reads the run's state and the supervisor's lease:
  state done / gave_up / requeued        → exit quietly (nothing to watch any more); a
                                           "requeued" left by the previous batch run only
                                           counts once the new supervisor has taken over
  lease renewed within lease_stale_s     → fine
  no lease renewed since we started      → wait up to `startup_grace_s` for the supervisor
  lease older than lease_stale_s, state running
                                         → requeue (requeue_job, reason batch_host_lost,
                                           excluding the lease's host) and exit
The lease age uses wall clocks (it is written on another host); a lease from a previous batch run
(older than our start) never counts as alive.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ... import console
from ...config import Config
from ...errors import CkptsupError, SlurmCommandError
from ...events import Event, EventWriter
from ...rundir import FINISHED, RunDir, RunStatus
from .requeue import RequeueClient, RequeueEffects, RequeueRefused, RequeueRequest, RequeueResult, requeue_job

# the requeue the watchdog carries out (requeue_job; a test injects its own)
Requeue = Callable[[RequeueClient, RunDir, RequeueRequest, RequeueEffects], RequeueResult]

REASON = "batch_host_lost"


class WatchOutcome(str, enum.Enum):
    FINISHED = "finished"          # the run ended normally (done / gave_up)
    ALREADY_REQUEUED = "already_requeued"
    REQUEUED = "requeued"          # we requeued it
    REFUSED = "refused"            # stale, but the job cannot be requeued (--no-requeue)
    STOPPED = "stopped"            # asked to stop (SIGTERM: the job is ending)


@dataclass(frozen=True, kw_only=True)
class WatchResult:
    outcome: WatchOutcome
    detail: str = ""
    lease_age_s: float | None = None
    requeue: RequeueResult | None = None


def _lease(rd: RunDir) -> dict:
    try:
        data = json.loads(rd.lease_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def watch(*, run_dir: str | os.PathLike[str] | RunDir, job_id: str, config: Config, client: RequeueClient,
          wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep, stop: Callable[[], bool] = lambda: False,
          poll_s: float | None = None, startup_grace_s: float | None = None,
          requeue: Requeue = requeue_job) -> WatchResult:
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(path=Path(run_dir))
    sup = config.supervisor
    stale_s = sup.lease_stale_s
    poll = poll_s if poll_s is not None else min(1.0, stale_s / 4)
    grace = startup_grace_s if startup_grace_s is not None else max(60.0, 3 * stale_s)
    started = wall()
    first = rd.load_state()
    # After a requeue the new batch run starts us while state.json still says "requeued" (the
    # previous run's): that is not a reason to leave, until the new supervisor takes over.
    leftover_epoch = first.epoch if first.status is RunStatus.REQUEUED else None
    while True:
        if stop():
            return WatchResult(outcome=WatchOutcome.STOPPED, detail="stop requested")
        state = rd.load_state()
        if state.status in FINISHED:
            return WatchResult(outcome=WatchOutcome.FINISHED, detail=f"run {state.status.value}")
        if leftover_epoch is not None and (state.epoch != leftover_epoch or state.status is not RunStatus.REQUEUED):
            leftover_epoch = None  # the new supervisor took over
        if state.status is RunStatus.REQUEUED and leftover_epoch is None:
            return WatchResult(outcome=WatchOutcome.ALREADY_REQUEUED, detail=f"requeued in epoch {state.epoch}")
        now = wall()
        lease = _lease(rd)
        renewed = lease.get("renewed")
        age = None if not isinstance(renewed, (int, float)) else now - float(renewed)
        # A lease older than our own start belongs to a previous batch run (or none exists yet):
        # give the new supervisor `grace` to write its first one.
        fresh_since_start = age is not None and isinstance(renewed, (int, float)) and renewed >= started - stale_s
        if age is not None and fresh_since_start:
            stale = age > stale_s
        else:
            stale = now - started > grace
        if stale:
            host = str(lease.get("host") or "") if fresh_since_start else ""
            try:
                return _requeue(rd, job_id, host, age, client, requeue, clock, wall, sleep,
                                partition=config.slurm.spare_partition or None)
            except SlurmCommandError as err:
                # Slurm did not answer within its seam's retries: the job's fate is unknown, so
                # keep watching and ask again; never a cancel on a guess
                console.warning(f"ckptsup watchdog: Slurm did not answer ({err}); trying again", err=True)
        sleep(poll)


def _requeue(rd: RunDir, job_id: str, host: str, age: float | None, client: RequeueClient,
             requeue: Requeue, clock: Callable[[], float], wall: Callable[[], float],
             sleep: Callable[[float], None], *, partition: str | None) -> WatchResult:
    # The lease names the supervisor's host as it saw it (a hostname); Slurm's own batch host
    # name wins when the two differ (FQDN vs node name), since ExcNodeList needs Slurm's.
    info = client.job_info(job_id)
    slurm_host = getattr(info, "batch_host", "") if info is not None else ""
    known = set(getattr(info, "nodes", None) or ()) | {slurm_host}
    batch_host = host if host and (host in known or not slurm_host) else slurm_host
    exclude = [batch_host] if batch_host else []
    detail = (f"supervisor lease stale for {age:.1f}s" if age is not None else "supervisor never renewed its lease")
    try:
        result = requeue(client, rd, RequeueRequest(job_id=job_id, reason=REASON, exclude=tuple(exclude),
                                                    partition=partition, by="watchdog"),
                         RequeueEffects(clock=clock, wall=wall, sleep=sleep))
    except RequeueRefused as err:
        # Nobody drives the job and it cannot come back: record why, then free the allocation
        # (scancel kills this step too, so the record comes first).
        state = rd.load_state()
        state.status = RunStatus.GAVE_UP
        rd.save_state(state)
        writer = EventWriter(run_dir=rd.path, job_id=job_id, attempt=state.attempt, epoch=state.epoch, fsync=True)
        try:
            writer.emit(Event.GIVE_UP, reason=f"{detail}; {err}; cancelling the idle allocation", by="watchdog")
        finally:
            writer.close()
        freed = cancel_idle(client, job_id) if hasattr(client, "cancel") else "not cancelled"
        return WatchResult(outcome=WatchOutcome.REFUSED, detail=f"{err} (job {freed})", lease_age_s=age)
    if not result.requeued:
        return WatchResult(outcome=WatchOutcome.ALREADY_REQUEUED, detail=result.why_skipped, lease_age_s=age,
                           requeue=result)
    return WatchResult(outcome=WatchOutcome.REQUEUED, detail=f"{detail}; excluded {exclude or 'none'}",
                       lease_age_s=age, requeue=result)


def cancel_idle(client, job_id: str) -> str:
    """When the job cannot be requeued, free the allocation rather than leave it idle."""
    try:
        client.cancel(job_id)
    except CkptsupError as err:
        return f"scancel failed: {err}"
    return "cancelled"


__all__: Sequence[str] = ("watch", "WatchOutcome", "WatchResult", "cancel_idle")
