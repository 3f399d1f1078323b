"""The recovery steps that need no supervisor state: where checkpoints live, the ranks'
environment, which checkpoint to resume from, health checks, draining, the give-up quote. Each
takes plain values (config, paths, an `emit` callable); the loop owns state and order, and the
decisions live in policy.py / preemption.py / nccl.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from ..checkpoint.catalog import Status, list_checkpoints
from ..checkpoint.commit import parse_step
from ..checkpoint.validate import quarantine, validate
from .. import env as envvars
from ..config import Config
from ..errors import CkptsupError
from ..events import Event
from .health import NodeHealth
from .nccl import Timeouts, derive_timeouts, nccl_env

Emit = Callable[..., Any]
HealthChecker = Callable[[list[str]], dict[str, NodeHealth]]


def checkpoint_dir(config: Config, run_dir: Path, job_id: str) -> Path:
    configured = config.checkpoint.dir
    return Path(configured.replace("{job_id}", job_id)) if configured else run_dir / "checkpoints"


def rank_env(config: Config, *, run_dir: Path, config_json: Path, secret_path: Path, ckpt_dir: Path, job_id: str,
             attempt: int, epoch: int, resume_from: str, timeouts: Timeouts, save_every_s: float,
             preempt_budget_s: float) -> dict[str, str]:
    """Everything ranks learn from the supervisor (env.py); the agent adds RANK_SOCKET and NODE."""
    env = nccl_env(config, run_dir=run_dir, attempt=attempt, timeouts=timeouts)
    # the constants, not RankEnv.to_environ: RESUME_FROM="" (fresh start) must be set, not omitted
    env.update({
        envvars.RUN_DIR: str(run_dir),
        envvars.JOB_ID: job_id,
        envvars.ATTEMPT: str(attempt),
        envvars.EPOCH: str(epoch),
        envvars.CONFIG_JSON: str(config_json),
        envvars.CHECKPOINT_DIR: str(ckpt_dir),
        envvars.RESUME_FROM: resume_from,
        envvars.SECRET_FILE: str(secret_path),
        envvars.SAVE_EVERY_STEPS: str(config.checkpoint.save_every_steps),
        envvars.SAVE_EVERY_S: f"{save_every_s:g}",
        envvars.PREEMPT_BUDGET_S: f"{preempt_budget_s:.1f}",
    })
    if envvars.SITE_CONFIG in os.environ:
        env[envvars.SITE_CONFIG] = os.environ[envvars.SITE_CONFIG]
    return env


def attempt_timeouts(config: Config, *, step_times: Iterable[float], save_s: float | None) -> Timeouts:
    """The collective timeouts an attempt is launched with, from the step and save times
    measured so far (kept across requeues in state.json)."""
    return derive_timeouts(config, step_times=step_times, save_times=[] if save_s is None else [save_s])


def pick_resume(ckpt_dir: Path, emit: Emit) -> str:
    """The newest checkpoint that passes validation levels 1-2 (recorded validations at level ≥ 2
    are trusted); a failing one is quarantined and reported, and the previous one is tried."""
    for info in reversed(list_checkpoints(ckpt_dir)):
        if info.status not in (Status.COMMITTED, Status.VALIDATED):
            continue
        if info.validated_level >= 2:
            # validated earlier: re-check what can change cheaply (files present, sizes,
            # structure); the reader verifies every item's hash as it loads
            problems = recheck(info.path)
            if not problems:
                return str(info.path)
            reason = f"changed since its validation: {problems[0]}"
        else:
            result = validate(info.path, level=2)
            if result.ok:
                emit(Event.CHECKPOINT_VALIDATED, step=info.step, level=2, duration_s=round(result.duration_s, 4))
                return str(info.path)
            reason = result.summary()
        where = quarantine(info.path, reason)
        emit(Event.CHECKPOINT_REJECTED, step=info.step, level=2, reason=reason, quarantined=str(where))
    return ""


def recheck(step_dir: Path) -> list[str]:
    """Manifest, every listed file present with its size, and the structure (JSON only)."""
    from ..checkpoint.manifest import load_manifest
    from ..checkpoint.validate import check_level2, check_present

    try:
        manifest = load_manifest(step_dir)
    except CkptsupError as err:
        return [str(err)]
    return check_present(step_dir, manifest) or check_level2(step_dir, manifest)


def log_tail(attempt_dir: Path, lines: int = 3) -> str:
    """The errors at the end of the last attempt's rank logs (a traceback's last line), so a user
    error is visible where the give-up is reported."""
    out = []
    for log in sorted(attempt_dir.glob("ranks-*.log")):
        text = log.read_text(errors="replace").splitlines()
        errors = [x.strip() for x in text if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b", x)]
        if errors:
            out.append(f"--- {log}:")
            out.extend(dict.fromkeys(errors[-lines:]))
    return "\n".join(out) or f"(no error in the rank logs of {attempt_dir})"


def resume_step(resume_from: str) -> int:
    if not resume_from:
        return 0
    step = parse_step(Path(resume_from).name)
    return 0 if step is None else step  # step_<N> holds the state after N steps: resume at N


def health_checker(config: Config, *, run_dir: Path, job_id: str, in_slurm: bool) -> HealthChecker:
    """The production checks: one srun step per node inside Slurm, in-process outside."""
    from . import health as checks

    def check(nodes: list[str]) -> dict[str, NodeHealth]:
        if not nodes or not config.health.enabled:
            return {}
        if in_slurm:
            return checks.run_node_checks(nodes, run_dir, config, job_id=job_id)
        paths = checks.check_paths(config, run_dir, node=nodes[0], job_id=job_id)
        return {nodes[0]: NodeHealth(node=nodes[0], results=tuple(checks.run_local_checks(config, paths,
                                                                                         node=nodes[0])))}

    return check


def drain(slurm: Any, node: str, reason: str, *, job_id: str) -> bool:
    """Drain a blamed node (Slurm only, where permitted; `slurm` None otherwise)."""
    if slurm is None:
        return False
    try:
        return bool(slurm.drain(node, f"ckptsup: {reason} job {job_id}"))
    except CkptsupError:
        return False
