"""Every environment variable of the supervisor ↔ agent ↔ rank contract, and the exit statuses.

This module is the single source of truth; docs/contracts.md renders the same tables. Nothing
secret travels in the environment: the per-job HMAC secret lives in a 0600 file whose *path* is
passed (CKPTSUP_SECRET_FILE).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Mapping


class ExitStatus(enum.IntEnum):
    """Exit statuses shared by ranks, agents, the supervisor and the sbatch template.

    The template requeues the job (`scontrol requeue`) for PREEMPTED, REQUEUE and for any abnormal
    death of the supervisor (FAILURE, or killed by a signal: 128+N). It never requeues for DONE,
    USAGE or GIVE_UP.
    """

    DONE = 0          # training finished (run_complete)
    FAILURE = 1       # unexpected failure of ckptsup itself (a bug, a crash): requeue
    USAGE = 2         # bad flags / config / script path: a human must fix it; never requeue
    GIVE_UP = 3       # policy gave up (crash loop, restart budget spent, user error); never requeue
    REQUEUE = 4       # the allocation cannot field the active nodes; requeue (already requested)
    PREEMPTED = 5     # stopped for preemption or time limit, checkpoint written if it fitted; requeue
    RANK_NAN = 6      # (rank → agent) a non-finite loss was seen on this rank
    RANK_STOPPED = 7  # (rank → agent) the rank stopped at the agreed stop step on command

    @property
    def requeues(self) -> bool:
        return self in (ExitStatus.FAILURE, ExitStatus.REQUEUE, ExitStatus.PREEMPTED)


def should_requeue(returncode: int) -> bool:
    """What the sbatch template decides after `wait` on the supervisor (kept in sync with it)."""
    if returncode > 128 or returncode < 0:  # killed by a signal
        return True
    try:
        return ExitStatus(returncode).requeues
    except ValueError:
        return True  # an unknown status is abnormal


@dataclass(frozen=True, kw_only=True)
class Var:
    name: str
    set_by: str
    read_by: str
    meaning: str


# fmt: off
VARS: tuple[Var, ...] = (
    Var(name="CKPTSUP_RUN_DIR", set_by="supervisor", read_by="agent, hooks", meaning="run directory (shared FS, 0700)"),
    Var(name="CKPTSUP_JOB_ID", set_by="supervisor", read_by="agent, hooks", meaning="Slurm job id, or 'local'"),
    Var(name="CKPTSUP_ATTEMPT", set_by="supervisor", read_by="agent, hooks", meaning="attempt number (0-based, counts every restart and requeue)"),
    Var(name="CKPTSUP_EPOCH", set_by="supervisor", read_by="hooks", meaning="fencing epoch; a commit with an older epoch than state.json is refused"),
    Var(name="CKPTSUP_CONFIG_JSON", set_by="supervisor", read_by="agent, hooks", meaning="path of the effective config (JSON) the supervisor resolved"),
    Var(name="CKPTSUP_SITE_CONFIG", set_by="user/site", read_by="config", meaning="site TOML (else /etc/ckptsup/site.toml, else shipped default)"),
    Var(name="CKPTSUP_CHECKPOINT_DIR", set_by="supervisor", read_by="hooks", meaning="shared-tier checkpoint_dir holding step_<N>/"),
    Var(name="CKPTSUP_NODE_LOCAL_DIR", set_by="user/site", read_by="hooks", meaning="overrides [storage] node_local (already expanded); unset: the hooks expand node_local with CKPTSUP_NODE and the job id"),
    Var(name="CKPTSUP_RESUME_FROM", set_by="supervisor", read_by="hooks", meaning="step_<N> directory validated (levels 1-2) before relaunch; empty = fresh start"),
    Var(name="CKPTSUP_SAVE_EVERY_STEPS", set_by="supervisor", read_by="hooks", meaning="save every N steps (0 = off)"),
    Var(name="CKPTSUP_SAVE_EVERY_S", set_by="supervisor", read_by="hooks", meaning="initial time-based interval; later changes arrive over the channel"),
    Var(name="CKPTSUP_RANK_SOCKET", set_by="agent", read_by="hooks", meaning="node-local Unix socket (in a 0700 dir) for rank heartbeats and commands"),
    Var(name="CKPTSUP_SECRET_FILE", set_by="supervisor", read_by="agent, hooks", meaning="path of the 0600 per-job HMAC secret (never the secret itself)"),
    Var(name="CKPTSUP_NODE", set_by="agent", read_by="hooks", meaning="this node's Slurm name (hostname outside Slurm)"),
    Var(name="CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S", set_by="supervisor", read_by="hooks.init_process_group", meaning="collective timeout during init and the first steps"),
    Var(name="CKPTSUP_COLLECTIVE_TIMEOUT_S", set_by="supervisor", read_by="hooks.init_process_group", meaning="steady-state collective timeout (derived from step/save time, above the supervisor hang/save deadlines; docs/timeouts.md)"),
    Var(name="CKPTSUP_FR_DUMP_DIR", set_by="supervisor", read_by="hooks", meaning="flight-recorder dump directory in the run dir"),
    Var(name="CKPTSUP_PREEMPT_BUDGET_S", set_by="supervisor", read_by="hooks", meaning="seconds the ranks have for an emergency save after a stop command"),
)
# fmt: on

NAMES = frozenset(v.name for v in VARS)


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """What a rank learns from the supervisor. Every field has a standalone default so that
    `attach` also works under plain torchrun or python."""

    run_dir: str | None
    job_id: str
    attempt: int
    epoch: int
    config_json: str | None
    checkpoint_dir: str | None
    node_local_dir: str | None
    resume_from: str | None
    save_every_steps: int | None
    save_every_s: float | None
    rank_socket: str | None
    secret_file: str | None
    node: str
    collective_timeout_init_s: float | None
    collective_timeout_s: float | None
    fr_dump_dir: str | None
    preempt_budget_s: float | None

    @property
    def supervised(self) -> bool:
        return self.rank_socket is not None


def _opt(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "")
    return value if value != "" else None


def _num(env: Mapping[str, str], name: str, kind: type):
    raw = _opt(env, name)
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        from .errors import ConfigError

        raise ConfigError(f"environment {name}={raw!r} is not a {kind.__name__}; unset it or fix the value") from None


def read_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    env = os.environ if env is None else env
    import socket

    return RankEnv(
        run_dir=_opt(env, "CKPTSUP_RUN_DIR"),
        job_id=env.get("CKPTSUP_JOB_ID") or env.get("SLURM_JOB_ID") or "local",
        attempt=_num(env, "CKPTSUP_ATTEMPT", int) or 0,
        epoch=_num(env, "CKPTSUP_EPOCH", int) or 0,
        config_json=_opt(env, "CKPTSUP_CONFIG_JSON"),
        checkpoint_dir=_opt(env, "CKPTSUP_CHECKPOINT_DIR"),
        node_local_dir=_opt(env, "CKPTSUP_NODE_LOCAL_DIR"),
        resume_from=_opt(env, "CKPTSUP_RESUME_FROM"),
        save_every_steps=_num(env, "CKPTSUP_SAVE_EVERY_STEPS", int),
        save_every_s=_num(env, "CKPTSUP_SAVE_EVERY_S", float),
        rank_socket=_opt(env, "CKPTSUP_RANK_SOCKET"),
        secret_file=_opt(env, "CKPTSUP_SECRET_FILE"),
        node=env.get("CKPTSUP_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname(),
        collective_timeout_init_s=_num(env, "CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S", float),
        collective_timeout_s=_num(env, "CKPTSUP_COLLECTIVE_TIMEOUT_S", float),
        fr_dump_dir=_opt(env, "CKPTSUP_FR_DUMP_DIR"),
        preempt_budget_s=_num(env, "CKPTSUP_PREEMPT_BUDGET_S", float),
    )
