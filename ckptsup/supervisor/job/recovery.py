"""The recovery steps that need no supervisor state: where checkpoints live, the ranks'
environment, which checkpoint to resume from, health checks, draining, the give-up quote. Each
takes plain values (config, paths, an `emit` callable); the loop owns state and order, and the
decisions live in policy.py / preemption.py / nccl.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from ...checkpoint.catalog import Status, list_checkpoints
from ...checkpoint.commit import parse_step
from ...checkpoint.trust import CheckpointDirUntrusted, OwnerModeError, check_checkpoint_dir, check_dir_trusted
from ...checkpoint.validate import quarantine, validate
from ... import env as envvars
from ...config import Config
from ...env import RankEnv
from ...errors import CkptsupError
from ...events import Event
from ... import console
from .error_quote import quote_logs
from ..health.health import NodeHealth
from .nccl import Timeouts, derive_timeouts, nccl_env

Emit = Callable[..., Any]
HealthChecker = Callable[[list[str]], dict[str, NodeHealth]]


def checkpoint_dir(config: Config, run_dir: Path, job_id: str) -> Path:
    configured = config.checkpoint.dir
    return Path(configured.replace("{job_id}", job_id)) if configured else run_dir / "checkpoints"


def rank_env(config: Config, *, run_dir: Path, config_json: Path, secret_path: Path, ckpt_dir: Path, job_id: str,
             attempt: int, epoch: int, resume_from: str, timeouts: Timeouts, save_every_s: float,
             preempt_budget_s: float, memory_every_steps: int | None = None) -> dict[str, str]:
    """Everything ranks learn from the supervisor (env.py); the agent adds RANK_SOCKET and NODE."""
    env = nccl_env(config, run_dir=run_dir, attempt=attempt, timeouts=timeouts)
    # resume_from None is written "" (a fresh start): an inherited value must not outlive it
    env.update(RankEnv.variables(
        run_dir=str(run_dir), job_id=job_id, attempt=attempt, epoch=epoch, config_json=str(config_json),
        checkpoint_dir=str(ckpt_dir), resume_from=resume_from or None, secret_file=str(secret_path),
        save_every_steps=config.checkpoint.save_every_steps, save_every_s=round(save_every_s, 3),
        preempt_budget_s=round(preempt_budget_s, 1)))
    if config.memory.enabled:   # the tuned memory schedule survives a relaunch (else [memory] every_steps)
        env.update(RankEnv.variables(memory_every_steps=memory_every_steps or config.memory.every_steps))
    if envvars.SITE_CONFIG in os.environ:
        env[envvars.SITE_CONFIG] = os.environ[envvars.SITE_CONFIG]
    return env


def attempt_timeouts(config: Config, *, step_times: Iterable[float], save_s: float | None) -> Timeouts:
    """The collective timeouts an attempt is launched with, from the step and save times
    measured so far (kept across requeues in state.json)."""
    return derive_timeouts(config, step_times=step_times, save_times=[] if save_s is None else [save_s])


def pick_resume(ckpt_dir: Path, emit: Emit, *, warn: Callable[[str], None] | None = None) -> str:
    """The newest checkpoint that passes validation levels 1-2 (a recorded validation at level ≥ 2
    is re-checked cheaply instead); "" when there is none (a fresh start).

    A content failure (hash, size, structure, links or special files) quarantines the checkpoint
    (`checkpoint_rejected` with where it went) and the previous one is tried. A trust failure of
    one checkpoint (owner, mode, permissions) says nothing about its bytes: it is skipped without
    quarantine, with one warning line naming the fix (`checkpoint_rejected`, quarantined ""), and
    the previous one is tried. Raises CheckpointDirUntrusted (exit status USAGE: a human fixes it,
    never requeued) when the checkpoint directory itself is untrusted, or when nothing usable is
    left but untrusted checkpoints: starting over would throw their progress away. Nothing here
    hangs on or crashes over what the directory holds (FIFOs, devices, hostile records)."""
    say = warn or _warn
    if not check_checkpoint_dir(ckpt_dir):
        return ""
    untrusted: list[str] = []
    for info in reversed(list_checkpoints(ckpt_dir)):
        if info.status not in (Status.COMMITTED, Status.VALIDATED):
            continue
        if info.validated_level >= 2:
            # validated earlier: re-check what can change cheaply (trust, files present, sizes,
            # structure); the reader verifies every item's hash as it loads it
            problems, not_trusted = _recheck(info.path)
            if not problems:
                return str(info.path)
            reason = f"changed since its validation: {problems[0]}"
        else:
            result = validate(info.path, level=2)
            if result.ok:
                emit(Event.CHECKPOINT_VALIDATED, step=info.step, level=2, duration_s=round(result.duration_s, 4))
                return str(info.path)
            problems, not_trusted, reason = result.problems, result.untrusted, result.summary()
        if not_trusted:
            line = problems[0] if problems else "untrusted"
            say(f"skipping {info.path.name} (not quarantined: its content is not in question): {line}")
            emit(Event.CHECKPOINT_REJECTED, step=info.step, level=1, reason=f"untrusted, skipped: {line}"[:400],
                 quarantined="")
            untrusted.append(f"{info.path.name}: {line}")
            continue
        try:
            where = str(quarantine(info.path, reason))
        except (CkptsupError, OSError) as err:   # e.g. no write access to the checkpoint dir
            where = ""
            reason = f"{reason} (not quarantined: {getattr(err, 'strerror', None) or err})"
            say(f"could not quarantine {info.path.name}; it stays where it is: {reason}")
        emit(Event.CHECKPOINT_REJECTED, step=info.step, level=2, reason=reason, quarantined=where)
    if untrusted:
        more = f" (and {len(untrusted) - 1} more)" if len(untrusted) > 1 else ""
        raise CheckpointDirUntrusted(f"no checkpoint in {ckpt_dir} is usable, and starting over would ignore untrusted "
                                     f"ones: {untrusted[0]}{more}; fix that, or move them away to start from step 0")
    return ""


def _warn(line: str) -> None:
    console.warning(f"ckptsup: warning: {line}", err=True)


def recheck(step_dir: Path) -> list[str]:
    """Trust (owner, mode, no links), manifest, every listed file present with its size, and the
    structure (JSON only)."""
    return _recheck(step_dir)[0]


def _recheck(step_dir: Path) -> tuple[list[str], bool]:
    """(problems, whether they are only a trust problem: owner, mode, permissions)."""
    from ...checkpoint.manifest import load_manifest
    from ...checkpoint.validate import RECORD_NAMES, check_level2, check_present

    try:
        check_dir_trusted(step_dir, recursive=True, skip=RECORD_NAMES)
        manifest = load_manifest(step_dir)
    except OwnerModeError as err:
        return [str(err)], True
    except CkptsupError as err:
        return [str(err)], False
    try:
        return check_present(step_dir, manifest) or check_level2(step_dir, manifest), False
    except OSError as err:
        return [f"cannot read {err.filename or step_dir}: {err.strerror or err}; check its permissions"], True


def log_tail(attempt_dir: Path, *, rank: int | None = None) -> str:
    """The error that ended the attempt, quoted from its rank logs (error_quote.py: the first
    failed rank's last traceback, bounded), so a user error is visible where the give-up is
    reported. `rank`: the rank the supervisor saw fail, when torchrun printed no summary."""
    return quote_logs(attempt_dir, rank=rank)


def resume_step(resume_from: str) -> int:
    if not resume_from:
        return 0
    step = parse_step(Path(resume_from).name)
    return 0 if step is None else step  # step_<N> holds the state after N steps: resume at N


def health_checker(config: Config, *, run_dir: Path, job_id: str, in_slurm: bool,
                   gpus_per_node: int = 0) -> HealthChecker:
    """The production checks: one srun step per node inside Slurm, in-process outside; each node
    must show the allocation's `gpus_per_node`."""
    from ..health import health as checks

    def check(nodes: list[str]) -> dict[str, NodeHealth]:
        if not nodes or not config.health.enabled:
            return {}
        if in_slurm:
            return checks.run_node_checks(nodes, run_dir, config, job_id=job_id, gpus_per_node=gpus_per_node)
        paths = checks.check_paths(config, run_dir, node=nodes[0], job_id=job_id)
        results = checks.run_local_checks(config, paths, node=nodes[0], gpus_per_node=gpus_per_node)
        return {nodes[0]: NodeHealth(node=nodes[0], results=tuple(results))}

    return check


def drain(slurm: Any, node: str, reason: str, *, job_id: str) -> bool:
    """Drain a blamed node (Slurm only, where permitted; `slurm` None otherwise)."""
    if slurm is None:
        return False
    try:
        return bool(slurm.drain(node, f"ckptsup: {reason} job {job_id}"))
    except CkptsupError:
        return False
