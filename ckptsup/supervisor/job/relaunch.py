"""A launch into a run directory that already holds a run (docs/supervisor.md §Launching again).

`decide_relaunch` is pure: what the run dir holds (`Previous`), who launches (the job id,
Slurm's restart count) and the flag (`--resume` / `--new` / neither) → `Resume`, `New` or
`Refuse`. `prepare` gathers those facts, decides, and carries the answer out before the
supervisor takes the run dir: one refusal line, the old run moved aside, or nothing (resume).

The rules, in order:

  no run there (no state.json)       → New; --resume is refused (a mistyped --run-dir must not
                                       quietly start from step 0)
  a requeue: the same Slurm job id and SLURM_RESTART_COUNT > 0, or status requeued
                                     → Resume, whatever the flag or the lease says: Slurm runs one
                                       instance of a job at a time, so the lease's writer is gone,
                                       and --new would throw the requeued run away
  running, lease fresh               → Refuse: a live supervisor holds it (whatever the flag)
  running, lease stale or absent     → Resume: its supervisor died (the watchdog's fenced requeue
                                       and a plain rerun both rely on this); --new moves it aside
  done, gave_up, stopped, or requeued by another job
                                     → Refuse without a flag; --resume continues it (history,
                                       checkpoints, attempt numbers), --new moves it aside

"Moved aside" is a rename, never a deletion: `<run_dir>` → `<run_dir>.<YYYYmmdd-HHMMSS>`, and a
checkpoint directory outside the run dir likewise (else the new run would resume from the old
run's checkpoints).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ...checkpoint.durable import rename_noreplace
from ...config import Config
from ...env import SLURM_JOB_ID, SLURM_RESTART_COUNT, ExitStatus
from ...errors import CkptsupError, ConfigError
from ...events import last_event
from ...rundir import STATE_FILE, RunDir, RunStatus
from ... import console
from .recovery import checkpoint_dir


class LaunchRefused(CkptsupError):
    """The run dir holds a run this launch may not take over as asked: a human decides."""

    exit_code = int(ExitStatus.USAGE)


@dataclass(frozen=True, kw_only=True)
class Previous:
    """What a run directory holds, as plain values."""

    path: str
    status: RunStatus | None = None   # None: no run there (no state.json)
    attempt: int = 0
    job_id: str | None = None         # the job id of its last event (None: no event)
    lease_age_s: float | None = None  # None: no lease
    holder: str = ""                  # the lease's writer, e.g. "pid 41 on node3"


@dataclass(frozen=True)
class Resume:
    why: str


@dataclass(frozen=True)
class New:
    move_aside: bool   # False: nothing there to move


@dataclass(frozen=True)
class Refuse:
    reason: str


Decision = Resume | New | Refuse

_HELD = {RunStatus.DONE: "a finished run", RunStatus.GAVE_UP: "a run that gave up",
         RunStatus.STOPPED: "a stopped run (preempted or signalled)"}


def decide_relaunch(prev: Previous, *, job_id: str, restart_count: int, lease_stale_s: float,
                    resume: bool | None) -> Decision:
    """`resume`: True for --resume, False for --new, None for neither. Pure."""
    path = prev.path
    if prev.status is None:
        if resume:
            return Refuse(f"--resume: {path} holds no run to resume; check --run-dir, or drop --resume "
                          "to start a new run there")
        return New(move_aside=False)
    same_job = prev.job_id == job_id
    if same_job and (restart_count > 0 or prev.status is RunStatus.REQUEUED):
        ignored = " (--new ignored: a requeue resumes its run)" if resume is False else ""
        return Resume(f"a requeue of job {job_id} (restart {restart_count}){ignored}")
    if prev.status is RunStatus.RUNNING:
        age = prev.lease_age_s
        if age is not None and age <= lease_stale_s:  # a negative age (clock skew) is fresh too
            who = f" ({prev.holder})" if prev.holder else ""
            return Refuse(f"{path} holds a live run: its supervisor{who} renewed its lease {max(age, 0.0):.1f}s ago; "
                          "wait for it to end or stop it, or pass another --run-dir (a killed supervisor's lease is "
                          f"stale after supervisor.lease_stale_s={lease_stale_s:g}s, and a launch then resumes its run)")
        if resume is False:
            return New(move_aside=True)
        lease = "no lease" if age is None else f"its lease is {age:.0f}s old"
        return Resume(f"its supervisor died ({lease})")
    if resume is None:
        held = _HELD.get(prev.status) or (f"job {prev.job_id}'s run, requeued (scancel {prev.job_id} first "
                                          "unless it should come back)" if prev.job_id else "a requeued run")
        return Refuse(f"{path} holds {held} ({_attempts(prev.attempt)}); pass --resume to continue it (its history, "
                      "checkpoints and attempt numbers) or --new to start afresh (the old run is moved aside "
                      "and kept)")
    if resume:
        return Resume(f"--resume: continuing the {prev.status.value} run")
    return New(move_aside=True)


def _attempts(attempt: int) -> str:
    n = attempt + 1  # attempt numbers start at 0
    return f"{n} attempt{'' if n == 1 else 's'}"


def inspect(path: Path, *, now: float) -> Previous:
    """The facts decide_relaunch needs. A damaged state.json is one ConfigError line (load_state)."""
    if not os.path.lexists(path / STATE_FILE):
        return Previous(path=str(path))
    rd = RunDir(path=path)
    state = rd.load_state()
    last = last_event(path)
    lease = rd.read_lease() or {}
    pid, host = lease.get("pid"), lease.get("host")
    holder = " on ".join(x for x in (f"pid {pid}" if isinstance(pid, int) else "",
                                     str(host)[:100] if isinstance(host, str) and host else "") if x)
    return Previous(path=str(path), status=state.status, attempt=state.attempt,
                    job_id=None if last is None else str(last.get("job_id")),
                    lease_age_s=rd.lease_age_s(now), holder=holder)


def restart_count(environ: Mapping[str, str]) -> int:
    """Slurm's requeue count of this job; 0 outside an allocation."""
    if not environ.get(SLURM_JOB_ID):
        return 0
    raw = environ.get(SLURM_RESTART_COUNT, "") or "0"
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {SLURM_RESTART_COUNT}={raw!r} is not an integer; "
                          "it is Slurm's to set: unset it") from None


def prepare(path: str | os.PathLike[str], config: Config, *, job_id: str, resume: bool | None,
            environ: Mapping[str, str] = os.environ, now: Callable[[], float] = time.time,
            say: Callable[[str], None] | None = None) -> Decision:
    """Decide what this launch does with `path` and do it: raise LaunchRefused, move the old run
    aside (New), or leave it for the supervisor to resume. Called before RunDir.create."""
    say = say or _stderr
    run_dir = Path(path)
    prev = inspect(run_dir, now=now())
    decision = decide_relaunch(prev, job_id=job_id, restart_count=restart_count(environ),
                               lease_stale_s=config.supervisor.lease_stale_s, resume=resume)
    match decision:
        case Refuse(reason=reason):
            raise LaunchRefused(reason)
        case Resume(why=why):
            say(f"resuming the run in {run_dir}: {why}")
        case New(move_aside=True):
            _refuse_over_object_copies(config, job_id, say)
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now()))
            moved = move_aside(run_dir, checkpoint_dir(config, run_dir, job_id), stamp)
            what = " and ".join(f"{src} to {dst}" for src, dst in moved)
            status = prev.status.value if prev.status else "?"
            say(f"moved the previous run ({status}, {_attempts(prev.attempt)}): {what}; starting a new run in {run_dir}")
    return decision


def _refuse_over_object_copies(config: Config, job_id: str, say: Callable[[str], None]) -> None:
    """--new cannot move an object-store prefix aside (S3 has no rename), and a resume fetches a
    checkpoint back from the store when the shared tier has none: the new run would continue the
    old one. Refuse while the prefix holds checkpoints; an unreachable store only warns (the
    hooks' resume cannot list it either)."""
    if not config.storage.object_store:
        return
    from ...checkpoint.s3tier import S3Tier

    try:
        steps = S3Tier.from_config(config.storage, node="", job_id=job_id).list_steps()
    except (CkptsupError, OSError) as err:
        say(f"warning: cannot list the object store {config.storage.object_store} ({err}); if it holds the old run's "
            "checkpoints the new run will resume from them")
        return
    if steps:
        raise LaunchRefused(
            f"--new: the object store {config.storage.object_store} holds {len(steps)} checkpoint(s) of the previous "
            f"run (newest step_{max(steps)}) and a resume would fetch them back; set [storage] object_store to another "
            "prefix (e.g. one with {job_id}) or delete them there first")


def move_aside(run_dir: Path, ckpt_dir: Path, stamp: str) -> list[tuple[Path, Path]]:
    """Rename the run dir, and a checkpoint dir outside it that holds anything, to `<name>.<stamp>`
    (then `-1`, `-2`… while taken). Never replaces or deletes: a failure undoes what was moved
    and is one LaunchRefused line."""
    run_abs, ck_abs = run_dir.resolve(), ckpt_dir.resolve()
    todo = [run_dir]
    if not ck_abs.is_relative_to(run_abs) and _has_entries(ckpt_dir):
        if run_abs.is_relative_to(ck_abs):
            raise LaunchRefused(f"--new: the checkpoint directory {ckpt_dir} contains the run directory {run_dir}, "
                                "so it cannot be moved aside alone; move the old run away yourself, or set "
                                "[checkpoint] dir elsewhere")
        todo.insert(0, ckpt_dir)  # first: a run dir moved without its checkpoints would be resumed from them
    done: list[tuple[Path, Path]] = []
    for src in todo:
        try:
            done.append((src, _rename_aside(src, stamp)))
        except OSError as err:
            undone = _undo(done)
            raise LaunchRefused(f"--new: cannot move {src} aside: {err.strerror or err}{undone}; move it yourself, "
                                "or pass another --run-dir") from None
    return done


def _rename_aside(src: Path, stamp: str) -> Path:
    for n in range(100):
        dst = src.with_name(f"{src.name}.{stamp}" + (f"-{n}" if n else ""))
        try:
            rename_noreplace(src, dst)
            return dst
        except FileExistsError:
            continue
    raise FileExistsError(f"{src.name}.{stamp} and its 99 variants are all taken")


def _undo(done: list[tuple[Path, Path]]) -> str:
    """Move back what was moved; the part of the message that says where things are."""
    for src, dst in reversed(done):
        try:
            rename_noreplace(dst, src)
        except OSError as err:
            return f" (and {dst} could not go back to {src}: {err.strerror or err})"
    return ""


def _has_entries(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as err:
        raise LaunchRefused(f"--new: cannot read the checkpoint directory {path}: {err.strerror or err}; "
                            "fix its permissions, or move it aside yourself") from None


def _stderr(line: str) -> None:
    console.info(f"ckptsup: {line}", err=True)
