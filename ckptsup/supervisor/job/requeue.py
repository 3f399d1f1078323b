"""The requeue path (docs/architecture.md §Recovery paths; docs/timeouts.md §6): give the allocation
back and come back without bad nodes.

    check   squeue --json: the job must be requeueable (not submitted with --no-requeue)
    claim   one requeuer per epoch: O_EXCL file `requeue.claim-<epoch>` in the run dir, so the
            supervisor, the batch script and the watchdog never requeue twice
    fence   state.json: epoch + 1, excluded nodes recorded, status "requeued" — a zombie
            attempt of the old epoch can no longer commit a checkpoint
    requeue `scontrol requeue` — Slurm kills the job (SIGTERM, SIGKILL after KillWait) and sets
            BeginTime = now + 121 s
    event   one fenced `requeue` event (reason, excluded, by, phases)
    finish  once the job is PENDING: one `scontrol update` with ExcNodeList, Partition (the
            site's spanning partition) and StartTime=now; a `requeue_updated` event. A job that
            Slurm restarted before it was ever seen PENDING (no hold after a dead batch host),
            or started between the PENDING seen and the update (which Slurm then refuses: "Job
            is no longer pending execution"), is recorded as restarted at once, with where it
            landed, not waited for.

Slurm refuses ExcNodeList/Partition on a job that is still running or completing, and the job
only becomes pending after every process of it is gone — including whoever called requeue. So the
finish runs in a detached process (`setsid -f`, reparented away from slurmstepd) when called from
inside the job. Under proctrack/linuxproc (the dev cluster) it escapes the job's kill; under
proctrack/cgroup it is killed with the job, and then the job still comes back (after Slurm's
121 s BeginTime, possibly on the excluded nodes) and the next supervisor refuses to use any node
excluded in state.json. docs/timeouts.md records this limitation.
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ...errors import CkptsupError
from ...slurm.parsers import is_transient
from ...events import Event, EventWriter
from ...env import SLURM_JOB_ID, ExitStatus
from ...rundir import FINISHED, RunDir, RunState, RunStatus
from ... import console

CLAIM_PREFIX = "requeue.claim-"
FINISH_LOG = "requeue-finish.log"
FINISH_DEADLINE_S = 300.0   # KillWait (30 s default) + epilog, with room to spare
POLL_S = 0.2
# slurmd refuses a job credential issued in the same wall-clock second as (or before) the
# revocation of the job's previous run ("Killing non-startable batch job: Job credential
# revoked" — seen on the dev cluster when StartTime=now restarted the job within that second).
# Slurm's own 121 s BeginTime avoids it; we only wait for the second to turn over, twice.
CREDENTIAL_SETTLE_S = 2.0
ALREADY_PENDING = "pending execution"  # scontrol's refusal to requeue a job that is already pending
NOT_PENDING = "no longer pending"      # scontrol's refusal to update a job that has started
NOT_PENDING_RETRIES = 3                # a refused update whose job shows PENDING again is retried
BUSY_RETRY_S = 1.0                     # between updates that slurmctld answered "try again" (EAGAIN)


class RequeueRefused(CkptsupError):
    """Requeue is impossible (job submitted with --no-requeue, or no Slurm job): give up."""

    exit_code = int(ExitStatus.GIVE_UP)


class JobInfoLike(Protocol):
    """What requeueing reads of a job (slurm/parsers.JobInfo; read-only, as that frozen record is)."""

    @property
    def state(self) -> Any: ...
    @property
    def requeue(self) -> bool: ...
    @property
    def restart_count(self) -> int: ...
    @property
    def excluded_nodes(self) -> list[str]: ...
    @property
    def partition(self) -> str: ...
    @property
    def batch_host(self) -> str: ...
    @property
    def nodes(self) -> list[str]: ...
    @property
    def start_time(self) -> int | None: ...


class RequeueClient(Protocol):
    def job_info(self, job_id: str) -> JobInfoLike | None: ...
    def requeue(self, job_id: str) -> None: ...
    def update_job(self, job_id: str, *, exc_nodes: Sequence[str] | None = None,
                   partition: str | None = None, start_time_now: bool = False) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RequeueResult:
    job_id: str
    requeued: bool                 # False: skipped (another requeuer got there first, or run over)
    why_skipped: str = ""
    epoch: int = 0
    excluded: tuple[str, ...] = ()
    partition: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    finisher_pid: int | None = None
    finish: "FinishResult | None" = None


@dataclass(frozen=True, kw_only=True)
class FinishResult:
    ok: bool
    wait_pending_s: float
    hold_s: float                  # waited for the credential second to turn over
    update_s: float
    total_s: float                 # from the `scontrol requeue` call to the updates done
    error: str = ""
    restarted: bool = False        # Slurm ran the job again before the updates could be applied
    nodes: tuple[str, ...] = ()    # ... on these nodes
    on_excluded: tuple[str, ...] = ()  # ... of which these are excluded (the next supervisor refuses them)
    job_partition: str = ""        # ... in this partition


def _state_name(info: JobInfoLike | None) -> str:
    if info is None:
        return "GONE"
    state = info.state
    return str(getattr(state, "value", state)).upper()


def check_requeueable(info: JobInfoLike | None, job_id: str) -> JobInfoLike:
    """The job's record when it can be requeued, else RequeueRefused with the reason and the fix."""
    if info is None:
        raise RequeueRefused(f"job {job_id} is unknown to Slurm; it cannot be requeued (resubmit it)")
    if not info.requeue:
        raise RequeueRefused(f"job {job_id} was submitted with --no-requeue, so it cannot be requeued; "
                             "giving up (resubmit without --no-requeue to let ckptsup requeue it)")
    return info


def _claim(run_dir: RunDir, epoch: int, who: str) -> bool:
    path = run_dir.path / f"{CLAIM_PREFIX}{epoch}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps({"by": who, "pid": os.getpid(), "host": socket.gethostname(),
                                 "ts": time.time()}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True, kw_only=True)
class RequeueRequest:
    """What to requeue and why: the job, the reason its `requeue` event records, the nodes to
    exclude (beside those state.json excludes already), the partition to move it to (the site's
    spanning partition of spares; None keeps its own) and who asks (supervisor, batch_script,
    watchdog)."""

    job_id: str
    reason: str
    exclude: tuple[str, ...] = ()
    partition: str | None = None
    by: str = "supervisor"


@dataclass(frozen=True, kw_only=True)
class RequeueEffects:
    """How a requeue meets the world: its clocks, its sleep, where the finish runs. The defaults
    are the real ones; a test injects its own. `detach` None: detach the finish when running
    inside the job itself (its kill would take an in-line finish with it); `spawn` None: a
    `setsid -f` process (spawn_detached)."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    detach: bool | None = None
    spawn: Callable[[list[str], Path], int] | None = None
    finish_deadline_s: float = FINISH_DEADLINE_S


def requeue_job(client: RequeueClient, run_dir: str | os.PathLike[str] | RunDir, request: RequeueRequest,
                effects: RequeueEffects = RequeueEffects()) -> RequeueResult:
    """Requeue `request.job_id` excluding `request.exclude` (plus every node already excluded in
    state.json): check, claim, fence, requeue, event, then finish in line or detached.

    Raises RequeueRefused when the job cannot be requeued (the caller gives up with
    ExitStatus.GIVE_UP). Returns requeued=False when the run is already requeued in this epoch
    or finished."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(path=Path(run_dir))
    job_id, clock = str(request.job_id), effects.clock
    t0 = clock()
    info = check_requeueable(client.job_info(job_id), job_id)
    t_check = clock()
    fenced = _fence(rd, request, job_id)
    if isinstance(fenced, RequeueResult):
        return fenced
    state, previous_status = fenced
    excluded = tuple(sorted(set(state.excluded_nodes) | set(info.excluded_nodes or ())))
    t_fence = clock()
    already_pending = _scontrol_requeue(client, rd, job_id, info, state, previous_status, effects.sleep)
    t_requeue = clock()
    requeued_wall = effects.wall()
    phases = {"check_s": t_check - t0, "fence_s": t_fence - t_check, "requeue_s": t_requeue - t_fence}
    log_error = _log_requeue(rd, request, job_id, info, state, excluded, already_pending, phases, t_requeue)

    detach = effects.detach if effects.detach is not None else os.environ.get(SLURM_JOB_ID) == job_id
    done = functools.partial(RequeueResult, job_id=job_id, requeued=True, epoch=state.epoch, excluded=excluded,
                             partition=request.partition, phases=phases)
    if detach:
        if log_error:
            console.error(log_error, err=True)
        argv = finisher_argv(run_dir=rd.path, job_id=job_id, exclude=excluded, partition=request.partition,
                             restart_count=info.restart_count, requeued_mono=t_requeue,
                             requeued_wall=requeued_wall, deadline_s=effects.finish_deadline_s)
        return done(finisher_pid=(effects.spawn or spawn_detached)(argv, rd.path))
    result = finish_requeue(client, rd, job_id, exclude=excluded, partition=request.partition,
                            restart_count=info.restart_count, requeued_mono=t_requeue,
                            requeued_wall=requeued_wall, clock=clock, wall=effects.wall, sleep=effects.sleep,
                            deadline_s=effects.finish_deadline_s)
    return done(finish=result)


def _fence(rd: RunDir, request: RequeueRequest, job_id: str) -> tuple[RunState, RunStatus] | RequeueResult:
    """Claim the epoch and fence it: (the new state, the status before) — or the result of a
    requeue that is not ours to make (the run is over, or another requeuer claimed the epoch)."""
    state = rd.load_state()
    if state.status in (*FINISHED, RunStatus.REQUEUED):
        return RequeueResult(job_id=job_id, requeued=False, epoch=state.epoch,
                             why_skipped=f"run status is {state.status!r} in epoch {state.epoch}")
    if not _claim(rd, state.epoch, request.by):
        return RequeueResult(job_id=job_id, requeued=False, epoch=state.epoch,
                             why_skipped=f"another requeuer claimed epoch {state.epoch}")
    previous_status = state.status
    for node in request.exclude:
        state.excluded_nodes.setdefault(node, request.reason)
    state.epoch += 1
    state.status = RunStatus.REQUEUED
    rd.save_state(state)
    return state, previous_status


def _scontrol_requeue(client: RequeueClient, rd: RunDir, job_id: str, info: JobInfoLike, state: RunState,
                      previous_status: RunStatus, sleep: Callable[[float], None]) -> bool:
    """`scontrol requeue`; True when Slurm had requeued the job already. A requeue that did not
    happen puts the status back and raises."""
    try:
        client.requeue(job_id)
    except CkptsupError as err:
        if ALREADY_PENDING in str(err).lower():
            # Slurm requeued it already (a preemption with PreemptMode=REQUEUE does): the
            # pending-job updates still apply, and lift its BeginTime hold.
            return True
        if killed_by_its_own_requeue(client, job_id, err, restart_count=info.restart_count, sleep=sleep):
            return False  # the requeue happened: its kill of the batch step took scontrol with it
        # Not requeued after all: the new epoch stays (fencing never hurts), but the status
        # goes back so that the next requeuer (the batch script) is not told "already requeued".
        state.status = previous_status
        rd.save_state(state)
        raise
    return False


def _log_requeue(rd: RunDir, request: RequeueRequest, job_id: str, info: JobInfoLike, state: RunState,
                 excluded: tuple[str, ...], already_pending: bool, phases: dict[str, float],
                 requeued_mono: float) -> str | None:
    """The one fenced `requeue` event; the line to say instead when the run dir cannot take it."""
    try:
        writer = EventWriter(run_dir=rd.path, job_id=job_id, attempt=state.attempt, epoch=state.epoch, fsync=True)
        try:
            writer.emit(Event.REQUEUE, reason=request.reason, by=request.by, excluded=list(excluded),
                        new_excluded=sorted(set(request.exclude)), partition=request.partition or "",
                        restart_count=info.restart_count, already_pending=already_pending,
                        phases={k: round(v, 4) for k, v in phases.items()},
                        requeued_mono=requeued_mono)
        finally:
            writer.close()
    except OSError as err:
        # the job is requeued already: a full or flaky run dir costs the log line, never the
        # pending-job updates (exclusions, partition, the hold lifted); in-line, the finish step
        # meets the same run dir and reports it as its one line
        return f"ckptsup: requeued job {job_id} but could not log it in {rd.path}: {err.strerror or err}"
    return None


REQUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def killed_by_its_own_requeue(client: RequeueClient, job_id: str, err: CkptsupError, *, restart_count: int,
                              sleep: Callable[[float], None] = time.sleep, polls: int = 10) -> bool:
    """Whether `scontrol requeue` died of a signal because it worked: Slurm kills the requeued
    job's batch step, which holds the requeuer (the supervisor's own scontrol), at once. Then the
    job shows a higher restart count or a requeued state within a moment; anything else is a
    real failure."""
    if getattr(err, "rc", 0) >= 0:
        return False
    for _ in range(polls):
        try:
            info = client.job_info(job_id)
        except CkptsupError:
            info = None
        if info is not None and (info.restart_count > restart_count or _state_name(info) in REQUEUED_STATES):
            return True
        sleep(0.2)
    return False


def finish_requeue(client: RequeueClient, run_dir: RunDir, job_id: str, *, exclude: Sequence[str],
                   partition: str | None, restart_count: int, requeued_mono: float,
                   requeued_wall: float | None = None, clock: Callable[[], float] = time.monotonic,
                   wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                   deadline_s: float = FINISH_DEADLINE_S, poll_s: float = POLL_S,
                   on_state: Callable[[str, float], None] = lambda state, waited_s: None) -> FinishResult:
    """Wait until the requeued job is PENDING, then one `scontrol update` with ExcNodeList,
    Partition and StartTime=now (StartTime lifts the 121 s BeginTime hold). Records a
    `requeue_updated` event. Never raises for Slurm refusals: they are recorded.

    Three outcomes: the updates applied (ok); the job restarted at once, seen running again
    before it was ever seen PENDING; or Slurm started it between the PENDING seen and the update
    ("Job is no longer pending execution"). The last two are recorded alike — ok false,
    `restarted`, the new run's nodes and partition and which excluded nodes it holds (the next
    supervisor refuses those: it never uses a node excluded in state.json)."""
    t0 = clock()
    error = ""
    landed: JobInfoLike | None = None  # the new run, when Slurm started it before the updates
    seen = None
    while True:
        info = client.job_info(job_id)
        state = _state_name(info)
        if state != seen:  # every state change goes to the finish log, for post-mortems
            seen = state
            on_state(state, clock() - t0)
        if state == "PENDING":
            break
        if info is None:
            error = f"job {job_id} is gone before the updates could be applied"
            break
        if _restarted(info, state, restart_count, requeued_wall):
            landed = info
            error = _restarted_error(info, job_id, state, exclude)
            break
        if clock() - t0 > deadline_s:
            error = f"job {job_id} still {state.lower()} after {deadline_s:g}s; updates not applied"
            break
        sleep(poll_s)
    t_pending = clock()
    hold = 0.0
    if not error and requeued_wall is not None:
        hold = math.floor(requeued_wall) + CREDENTIAL_SETTLE_S - wall()
        if hold > 0:
            sleep(hold)
    t_hold = clock()
    if not error:
        error, landed = _update_pending(client, job_id, exclude, partition, sleep=sleep, poll_s=poll_s,
                                        on_state=lambda st: on_state(st, clock() - t0),
                                        busy_until=lambda: clock() - t0 < deadline_s)
    t_done = clock()
    nodes = tuple(getattr(landed, "nodes", None) or ()) if landed is not None else ()
    result = FinishResult(ok=not error, wait_pending_s=t_pending - t0, hold_s=t_hold - t_pending,
                          update_s=t_done - t_hold, total_s=t_done - requeued_mono, error=error,
                          restarted=landed is not None, nodes=nodes,
                          on_excluded=tuple(sorted(set(nodes) & set(exclude))),
                          job_partition=str(getattr(landed, "partition", "") or "") if landed is not None else "")
    rs = run_dir.load_state()
    writer = EventWriter(run_dir=run_dir.path, job_id=job_id, attempt=rs.attempt, epoch=rs.epoch, fsync=True)
    try:
        writer.emit(Event.REQUEUE_UPDATED, ok=result.ok, excluded=list(exclude), partition=partition or "",
                    wait_pending_s=round(result.wait_pending_s, 4), hold_s=round(result.hold_s, 4),
                    update_s=round(result.update_s, 4),
                    total_s=round(result.total_s, 4), error=error, restarted=result.restarted,
                    nodes=list(result.nodes), on_excluded=list(result.on_excluded),
                    job_partition=result.job_partition)
    finally:
        writer.close()
    return result


def _restarted(info: JobInfoLike, state: str, restart_count: int, requeued_wall: float | None) -> bool:
    """The requeued job already ran again: Slurm skips its 121 s BeginTime hold when the requeue
    completes through a node going DOWN (the dead batch host's case) and may start the job in the
    same scheduling pass, before it was ever seen PENDING here."""
    if state == "RUNNING" and info.restart_count > restart_count:
        return True
    started = getattr(info, "start_time", None)
    return (state not in ("PENDING", "COMPLETING") and requeued_wall is not None
            and started is not None and started > requeued_wall)


def _restarted_error(info: JobInfoLike, job_id: str, state: str, exclude: Sequence[str], *,
                     refused: str = "") -> str:
    nodes = list(getattr(info, "nodes", None) or ())
    on_excluded = sorted(set(nodes) & set(exclude))
    where = f"partition {info.partition} on {','.join(nodes) or '?'}"
    when = (f"after it was seen pending, so the updates were refused ({refused})" if refused
            else "before the updates could be applied")
    tail = (f"; it holds excluded node(s) {','.join(on_excluded)}, which the next supervisor refuses"
            if on_excluded else "; none of the excluded nodes is in its allocation")
    return f"job {job_id} restarted at once ({state.lower()}, {where}) {when}{tail}"


def _update_pending(client: RequeueClient, job_id: str, exclude: Sequence[str], partition: str | None, *,
                    on_state: Callable[[str], None] = lambda state: None, sleep: Callable[[float], None] = time.sleep,
                    poll_s: float = POLL_S, retries: int = NOT_PENDING_RETRIES,
                    busy_until: Callable[[], bool] = lambda: False) -> tuple[str, JobInfoLike | None]:
    """Apply the updates to the job seen PENDING. Slurm may start it in between (no BeginTime
    hold after a dead batch host) and then refuses them: "Job is no longer pending execution".
    Then look where it landed: (error, the new run's JobInfo) — recorded like a job restarted at
    once. slurmctld may also answer "Resource temporarily unavailable" for a while after the
    requeue (Slurm 26.05, past the client's own retries): while `busy_until()` holds and the job
    still shows PENDING, the updates are tried again. Returns ('', None) when the updates applied;
    never raises for Slurm's answers."""
    refusals = 0
    while True:
        error, answer = _apply_updates(client, job_id, exclude, partition)
        if answer is _Answer.APPLIED or answer is _Answer.REFUSED:
            return error, None
        if answer is _Answer.BUSY and not busy_until():
            return f"{error}; slurmctld still busy at the finish deadline", None
        try:
            info = client.job_info(job_id)
        except CkptsupError as err:
            return f"{error}; then squeue failed, so where it runs is unknown: {err}", None
        state = _state_name(info)
        on_state(state)
        if info is None:
            return f"job {job_id} is gone after it was seen pending; updates not applied ({error})", None
        if state != "PENDING":
            return _restarted_error(info, job_id, state, exclude, refused=error), info
        if answer is _Answer.NOT_PENDING:
            refusals += 1
            if refusals > retries:
                return f"{error}; the job still shows pending after {refusals} refused updates", None
            sleep(poll_s)  # pending again (refused in a moment it was not): try once more
        else:
            sleep(BUSY_RETRY_S)


class _Answer(enum.Enum):
    """What slurmctld made of the updates (`_apply_updates`)."""

    APPLIED = "applied"          # all, or what it accepts of them (the error says what it refused)
    NOT_PENDING = "not_pending"  # "Job is no longer pending execution": nothing more was tried
    BUSY = "busy"                # a transient error ("try again"): nothing applied
    REFUSED = "refused"          # every update refused for good


def _apply_updates(client: RequeueClient, job_id: str, exclude: Sequence[str],
                   partition: str | None) -> tuple[str, _Answer]:
    """All three in one update; if Slurm refuses (e.g. the partition), keep what it accepts:
    the exclusion and StartTime matter most; a transient error ends the round (the caller tries
    the whole update again). Returns (the error text, '' when all applied; what Slurm answered)."""
    attempts: list[dict[str, Any]] = [
        {"exc_nodes": list(exclude), "partition": partition, "start_time_now": True},
        {"exc_nodes": list(exclude), "start_time_now": True},
        {"start_time_now": True},
    ]
    if not partition:
        attempts.pop(0)
    errors = []
    for kwargs in attempts:
        try:
            client.update_job(job_id, **kwargs)
        except CkptsupError as err:
            errors.append(f"update {sorted(k for k, v in kwargs.items() if v)} refused: {err}")
            if NOT_PENDING in str(err).lower():
                return "; ".join(errors), _Answer.NOT_PENDING
            if is_transient(str(err)):
                return "; ".join(errors), _Answer.BUSY   # "try again": the same update, not a lesser one
            continue
        return "; ".join(errors), _Answer.APPLIED
    return "; ".join(errors), _Answer.REFUSED


def finisher_argv(*, run_dir: Path, job_id: str, exclude: Sequence[str], partition: str | None,
                  restart_count: int, requeued_mono: float, requeued_wall: float, deadline_s: float) -> list[str]:
    argv = [sys.executable, "-m", "ckptsup.supervisor.job.requeue", "--finish", "--run-dir", str(run_dir),
            "--job-id", job_id, "--restart-count", str(restart_count), "--requeued-mono", repr(requeued_mono),
            "--requeued-wall", repr(requeued_wall), "--deadline-s", repr(deadline_s)]
    for node in exclude:
        argv += ["--exclude", node]
    if partition:
        argv += ["--partition", partition]
    return argv


def spawn_detached(argv: list[str], run_dir: Path) -> int:
    """Start `argv` in a new session, reparented away from us (`setsid -f`: the process that
    Slurm's linuxproc tracking follows exits at once). Output goes to the run dir's log.

    The job's kill (SIGTERM to every process of the job) races with this spawn: seen on the dev
    cluster, about one spawn in three died before its first instruction. So SIGTERM and SIGHUP
    are blocked in the child from the fork on (a blocked mask survives fork and exec) and then
    ignored by the shell that execs the finisher; SIGKILL after KillWait no longer reaches it
    once it is reparented."""
    log = os.open(run_dir / FINISH_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    shielded = ["/bin/sh", "-c", 'trap "" TERM HUP; exec "$0" "$@"', *argv]
    setsid = shutil.which("setsid")
    cmd = [setsid, "-f", *shielded] if setsid else shielded
    blocked = {signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                close_fds=True, start_new_session=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        os.close(log)
    if setsid:
        proc.wait(timeout=10)
    return proc.pid


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptsup.supervisor.job.requeue",
                                     description="internal: finish a requeue once the job is pending")
    parser.add_argument("--finish", action="store_true", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--exclude", action="append", default=[])
    parser.add_argument("--partition", default=None)
    parser.add_argument("--restart-count", type=int, default=0)
    parser.add_argument("--requeued-mono", type=float, required=True)
    parser.add_argument("--requeued-wall", type=float, default=None)
    parser.add_argument("--deadline-s", type=float, default=FINISH_DEADLINE_S)
    args = parser.parse_args(argv)
    print(json.dumps({"finisher": os.getpid(), "job_id": args.job_id, "host": socket.gethostname(),
                      "ts": time.time()}), flush=True)
    from ...slurm.client import SlurmClient
    from ..health.health import effective_config

    rd = RunDir(path=Path(args.run_dir))
    client = SlurmClient.from_config(effective_config(rd.path).slurm)
    result = finish_requeue(client, rd, args.job_id, exclude=args.exclude, partition=args.partition,
                            restart_count=args.restart_count, requeued_mono=args.requeued_mono,
                            requeued_wall=args.requeued_wall,
                            deadline_s=args.deadline_s,
                            on_state=lambda state, waited_s: print(json.dumps(
                                {"job_state": state, "waited_s": round(waited_s, 3)}), flush=True))
    print(json.dumps({"ok": result.ok, "wait_pending_s": result.wait_pending_s, "hold_s": result.hold_s,
                      "update_s": result.update_s, "total_s": result.total_s, "error": result.error,
                      "restarted": result.restarted, "nodes": list(result.nodes),
                      "on_excluded": list(result.on_excluded)}),
          flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(_main())
