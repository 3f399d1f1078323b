"""Every environment variable ckptsup sets or reads, and the exit statuses.

This module is the single source of truth; docs/contracts.md renders the same tables:

- VARS: ckptsup's own CKPTSUP_* variables (the supervisor ↔ agent ↔ rank contract), each with a
  module constant named without the prefix (RUN_DIR = "CKPTSUP_RUN_DIR"). Code outside this
  module names them through those constants, never as string literals (tests/test_env.py).
- EXTERNAL_VARS: the variables of Slurm, torch and others that ckptsup reads or sets, each with a
  constant of the same name (SLURM_JOB_ID = "SLURM_JOB_ID").

`RankEnv` is what a rank learns (`from_environ` / `to_environ`); `node_name` is the one way to
name this node. Nothing secret travels in the environment: the per-job HMAC secret lives in a
0600 file whose *path* is passed (CKPTSUP_SECRET_FILE).
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, fields
from typing import Mapping


class ExitStatus(enum.IntEnum):
    """Exit statuses shared by ranks, agents, the supervisor and the sbatch template.

    The template requeues the job (`scontrol requeue`) for PREEMPTED, REQUEUE and for any abnormal
    death of the supervisor (FAILURE, or killed by a signal: 128+N). It never requeues for DONE,
    USAGE, GIVE_UP or CANCELLED.
    """

    DONE = 0          # training finished (run_complete)
    FAILURE = 1       # unexpected failure of ckptsup itself (a bug, a crash): requeue
    USAGE = 2         # bad flags / config / script path: a human must fix it; never requeue
    GIVE_UP = 3       # policy gave up (crash loop, restart budget spent, user error); never requeue
    REQUEUE = 4       # the allocation cannot field the active nodes; requeue (already requested)
    PREEMPTED = 5     # stopped for preemption or time limit, checkpoint written if it fitted; requeue
    RANK_NAN = 6      # (rank → agent) a non-finite loss was seen on this rank
    RANK_STOPPED = 7  # (rank → agent) the rank stopped at the agreed stop step on command
    CANCELLED = 8     # stopped on the operator's request (`ckptsup stop`), checkpoint first unless --no-save; never requeue

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


PREFIX = "CKPTSUP_"

# ---- ckptsup's own variables --------------------------------------------------------------------
RUN_DIR = "CKPTSUP_RUN_DIR"
JOB_ID = "CKPTSUP_JOB_ID"
ATTEMPT = "CKPTSUP_ATTEMPT"
EPOCH = "CKPTSUP_EPOCH"
CONFIG_JSON = "CKPTSUP_CONFIG_JSON"
SITE_CONFIG = "CKPTSUP_SITE_CONFIG"
CHECKPOINT_DIR = "CKPTSUP_CHECKPOINT_DIR"
NODE_LOCAL_DIR = "CKPTSUP_NODE_LOCAL_DIR"
RESUME_FROM = "CKPTSUP_RESUME_FROM"
SAVE_EVERY_STEPS = "CKPTSUP_SAVE_EVERY_STEPS"
SAVE_EVERY_S = "CKPTSUP_SAVE_EVERY_S"
MEMORY_EVERY_STEPS = "CKPTSUP_MEMORY_EVERY_STEPS"
RANK_SOCKET = "CKPTSUP_RANK_SOCKET"
MEMORY_SOCKET = "CKPTSUP_MEMORY_SOCKET"
WARM_DIR = "CKPTSUP_WARM_DIR"
SECRET_FILE = "CKPTSUP_SECRET_FILE"
NODE = "CKPTSUP_NODE"
COLLECTIVE_TIMEOUT_INIT_S = "CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S"
COLLECTIVE_TIMEOUT_S = "CKPTSUP_COLLECTIVE_TIMEOUT_S"
FR_DUMP_DIR = "CKPTSUP_FR_DUMP_DIR"
PREEMPT_BUDGET_S = "CKPTSUP_PREEMPT_BUDGET_S"
LOG_FORMAT = "CKPTSUP_LOG_FORMAT"
TEST_SAVE_DELAY_S = "CKPTSUP_TEST_SAVE_DELAY_S"
TEST_LOAD_DELAY_S = "CKPTSUP_TEST_LOAD_DELAY_S"
TEST_FLIP_MEMORY = "CKPTSUP_TEST_FLIP_MEMORY"
CONTAINER = "CKPTSUP_CONTAINER"   # the agent's: the runtime it runs in (docs/containers.md)

# fmt: off
VARS: tuple[Var, ...] = (
    Var(name=RUN_DIR, set_by="supervisor, sbatch template", read_by="agent, hooks", meaning="run directory (shared FS, 0700)"),
    Var(name=JOB_ID, set_by="supervisor", read_by="agent, hooks", meaning="Slurm job id, or 'local'"),
    Var(name=ATTEMPT, set_by="supervisor", read_by="agent, hooks", meaning="attempt number (0-based, counts every restart and requeue)"),
    Var(name=EPOCH, set_by="supervisor", read_by="hooks", meaning="fencing epoch; a commit with an older epoch than state.json is refused"),
    Var(name=CONFIG_JSON, set_by="supervisor", read_by="agent, hooks", meaning="path of the effective config (JSON) the supervisor resolved"),
    Var(name=SITE_CONFIG, set_by="user/site", read_by="config", meaning="site TOML (else /etc/ckptsup/site.toml, else shipped default)"),
    Var(name=CHECKPOINT_DIR, set_by="supervisor", read_by="hooks", meaning="shared-tier checkpoint_dir holding step_<N>/"),
    Var(name=NODE_LOCAL_DIR, set_by="user/site", read_by="hooks", meaning="overrides [storage] node_local (already expanded); unset: the hooks expand node_local with CKPTSUP_NODE and the job id"),
    Var(name=RESUME_FROM, set_by="supervisor", read_by="hooks", meaning="step_<N> directory validated (levels 1-2) before relaunch; empty = fresh start"),
    Var(name=SAVE_EVERY_STEPS, set_by="supervisor", read_by="hooks", meaning="save every N steps (0 = off)"),
    Var(name=SAVE_EVERY_S, set_by="supervisor", read_by="hooks", meaning="initial time-based interval; later changes arrive over the channel"),
    Var(name=MEMORY_EVERY_STEPS, set_by="supervisor (with [memory] enabled)", read_by="hooks", meaning="memory saves every N steps at launch: the adaptive interval's current choice (never past the ranks' disk schedule), else [memory] every_steps; later changes arrive over the channel"),
    Var(name=MEMORY_SOCKET, set_by="agent", read_by="hooks", meaning="node-local Unix socket (in a 0700 dir) of the agent's memory store (the memory tier)"),
    Var(name=RANK_SOCKET, set_by="agent", read_by="hooks", meaning="node-local Unix socket (in a 0700 dir) for rank heartbeats and commands"),
    Var(name=WARM_DIR, set_by="agent", read_by="warm_proxy (torchrun's workers)", meaning="the 0700 dir of the warm rank interpreters' sockets (warm-<local_rank>.sock); set only when they are ready"),
    Var(name=SECRET_FILE, set_by="supervisor", read_by="agent, hooks", meaning="path of the 0600 per-job HMAC secret (never the secret itself)"),
    Var(name=NODE, set_by="agent; supervisor (local mode); health checks (for site commands)", read_by="hooks, agent, health checks", meaning="this node's name; unset: SLURMD_NODENAME, else the hostname (node_name())"),
    Var(name=COLLECTIVE_TIMEOUT_INIT_S, set_by="supervisor", read_by="hooks.init_process_group", meaning="collective timeout during init and the first steps"),
    Var(name=COLLECTIVE_TIMEOUT_S, set_by="supervisor", read_by="hooks.init_process_group", meaning="steady-state collective timeout (derived from step/save time, above the supervisor hang/save deadlines; docs/timeouts.md)"),
    Var(name=FR_DUMP_DIR, set_by="supervisor", read_by="hooks", meaning="flight-recorder dump directory in the run dir"),
    Var(name=PREEMPT_BUDGET_S, set_by="supervisor", read_by="agent, hooks", meaning="seconds the ranks have for an emergency save after a stop command"),
    Var(name=LOG_FORMAT, set_by="user", read_by="supervisor, agent, watchdog, ranks (console.py)", meaning="console (unset: today's lines) or json (one JSON object per line with timestamp, level, component, event; for log shippers); another value stops `ckptsup launch` with one line"),
    Var(name=TEST_SAVE_DELAY_S, set_by="tests", read_by="hooks (writer)", meaning="fault injection: sleep between writing the shards and the commit; never set in production"),
    Var(name=TEST_LOAD_DELAY_S, set_by="tests", read_by="hooks (loader)", meaning="fault injection: sleep before loading a checkpoint; never set in production"),
    Var(name=CONTAINER, set_by="supervisor (`[container]`, docs/containers.md)", read_by="agent", meaning="the runtime the agents run in (`pyxis`, `oci`, `apptainer`): the agent's hello says it, and a container's agent with a small /dev/shm warns; unset: none"),
    Var(name=TEST_FLIP_MEMORY, set_by="tests", read_by="agent (memory store)", meaning="fault injection: flip one bit of the bundles the agent's memory store keeps: 1 every one, own its node's ranks' only, replica the peers' copies only; never set in production"),
)
# fmt: on

NAMES = frozenset(v.name for v in VARS)

# ---- other programs' variables that ckptsup reads or sets -------------------------------------
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_NODELIST = "SLURM_NODELIST"
SLURMD_NODENAME = "SLURMD_NODENAME"
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
SLURM_JOB_NUM_NODES = "SLURM_JOB_NUM_NODES"
SLURM_NNODES = "SLURM_NNODES"
SLURM_CPUS_ON_NODE = "SLURM_CPUS_ON_NODE"
SLURM_JOB_PARTITION = "SLURM_JOB_PARTITION"
SLURM_JOB_NAME = "SLURM_JOB_NAME"
SLURM_SUBMIT_DIR = "SLURM_SUBMIT_DIR"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
SLURM_JOB_GPUS = "SLURM_JOB_GPUS"
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_PROCID = "SLURM_PROCID"
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
SLURM_STEP_GPUS = "SLURM_STEP_GPUS"
SLURM_JOB_END_TIME = "SLURM_JOB_END_TIME"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SLURM_CONF = "SLURM_CONF"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"   # torchrun's: the ranks on this node
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
TTY_COMPATIBLE = "TTY_COMPATIBLE"
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TORCH_NCCL_ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
TORCH_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
TORCH_NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
TORCH_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
TORCH_NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
TORCH_FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"

# fmt: off
EXTERNAL_VARS: tuple[Var, ...] = (
    Var(name=SLURM_JOB_ID, set_by="Slurm", read_by="supervisor, hooks, health checks, ckptsup requeue/ops, sbatch template", meaning="the job id; set means inside an allocation; the rank's job id when CKPTSUP_JOB_ID is unset"),
    Var(name=SLURM_JOB_NODELIST, set_by="Slurm", read_by="supervisor (allocation), sbatch template", meaning="the allocation's nodes (a hostlist)"),
    Var(name=SLURM_NODELIST, set_by="Slurm", read_by="supervisor (allocation)", meaning="older name of SLURM_JOB_NODELIST, read when that is unset"),
    Var(name=SLURMD_NODENAME, set_by="Slurm", read_by="node_name(), supervisor (allocation), sbatch template", meaning="this node's Slurm name; in the batch script, the batch host"),
    Var(name=SLURM_RESTART_COUNT, set_by="Slurm", read_by="supervisor (allocation), sbatch template", meaning="requeue count, informative only (state.json counts attempts)"),
    Var(name=SLURM_JOB_NUM_NODES, set_by="Slurm", read_by="supervisor (allocation)", meaning="node count of the allocation"),
    Var(name=SLURM_NNODES, set_by="Slurm", read_by="supervisor (allocation)", meaning="older name of SLURM_JOB_NUM_NODES, read when that is unset"),
    Var(name=SLURM_CPUS_ON_NODE, set_by="Slurm", read_by="supervisor (allocation)", meaning="CPUs of this node in the allocation"),
    Var(name=SLURM_JOB_PARTITION, set_by="Slurm", read_by="supervisor (allocation)", meaning="partition, for its preemption GraceTime"),
    Var(name=SLURM_JOB_NAME, set_by="Slurm", read_by="supervisor (allocation)", meaning="job name"),
    Var(name=SLURM_SUBMIT_DIR, set_by="Slurm", read_by="supervisor (allocation)", meaning="directory sbatch was run from"),
    Var(name=SLURM_GPUS_ON_NODE, set_by="Slurm", read_by="supervisor (allocation), health checks", meaning="GPUs of this node in the allocation; the supervisor's GPUs per node (else SLURM_JOB_GPUS, else scontrol show job -d)"),
    Var(name=SLURM_JOB_GPUS, set_by="Slurm", read_by="supervisor (allocation)", meaning="GPU indices of the batch host (a comma list), counted when SLURM_GPUS_ON_NODE is unset"),
    Var(name=SLURM_STEP_ID, set_by="Slurm (srun)", read_by="ckptsup launch", meaning="set inside a job step, not in the batch script: with more than one task, `srun ckptsup launch` would start a supervisor per task (refused)"),
    Var(name=SLURM_PROCID, set_by="Slurm (srun)", read_by="ckptsup launch", meaning="this task's index in its step: task 0 says why `srun ckptsup launch` is refused"),
    Var(name=SLURM_STEP_NUM_TASKS, set_by="Slurm (srun)", read_by="ckptsup launch", meaning="tasks of this step: more than one under `srun ckptsup launch` is refused"),
    Var(name=SLURM_JOB_END_TIME, set_by="Slurm", read_by="supervisor (allocation)", meaning="the job's end (Unix seconds): the time left prices continuing on fewer nodes against a requeue (supervisor.min_nodes)"),
    Var(name=SLURM_STEP_GPUS, set_by="Slurm", read_by="health checks", meaning="GPU indices a step got on its node, counted when SLURM_GPUS_ON_NODE is unset"),
    Var(name=CUDA_VISIBLE_DEVICES, set_by="user, Slurm", read_by="supervisor (local mode), health checks", meaning="outside Slurm, the GPUs of this machine (a count of the list; unset, empty or -1 = none)"),
    Var(name=SLURM_CONF, set_by="user, ckptsup dev-cluster", read_by="Slurm commands (slurm.client)", meaning="slurm.conf to use; the dev cluster is reached through it"),
    Var(name=LOCAL_RANK, set_by="torchrun", read_by="hooks", meaning="the rank's index on its node"),
    Var(name=LOCAL_WORLD_SIZE, set_by="torchrun", read_by="hooks", meaning="the ranks on the node: [memory] max_bytes = auto shares the node's memory among them"),
    Var(name=RANK, set_by="torchrun", read_by="hooks (heartbeat)", meaning="the rank's global index (attach() asks torch.distributed)"),
    Var(name=WORLD_SIZE, set_by="torchrun", read_by="hooks (heartbeat)", meaning="the number of ranks"),
    Var(name=PYTHONUNBUFFERED, set_by="agent", read_by="Python (torchrun, ranks)", meaning="unbuffered rank output, so the per-node rank log is live"),
    Var(name=TTY_COMPATIBLE, set_by="agent (unless set)", read_by="rich (ranks)", meaning="1: rich draws its live displays into the rank output, which is a pipe: Lightning's default RichProgressBar prints its bar, the progress lines of a Lightning script (docs/drop-in.md §Progress lines)"),
    Var(name=TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, set_by="agent", read_by="torchrun (--tee)", meaning="\"[rank${rank}]: \": every rank line carries its global rank, for progress lines and the console"),
    Var(name=TORCH_NCCL_ASYNC_ERROR_HANDLING, set_by="supervisor", read_by="torch", meaning="[nccl] async_error_handling: what a failed collective does (3 = skip cleanup, tear down)"),
    Var(name=TORCH_NCCL_ENABLE_MONITORING, set_by="supervisor", read_by="torch", meaning="1: the heartbeat monitor watches NCCL's watchdog thread"),
    Var(name=TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, set_by="supervisor", read_by="torch", meaning="watchdog-of-the-watchdog timeout (docs/timeouts.md)"),
    Var(name=TORCH_NCCL_DUMP_ON_TIMEOUT, set_by="supervisor", read_by="torch", meaning="1: dump the flight recorder on a collective timeout"),
    Var(name=TORCH_NCCL_TRACE_BUFFER_SIZE, set_by="supervisor", read_by="torch", meaning="flight-recorder entries (0 = off)"),
    Var(name=TORCH_FR_BUFFER_SIZE, set_by="supervisor", read_by="torch", meaning="newer name of TORCH_NCCL_TRACE_BUFFER_SIZE (both are set)"),
    Var(name=TORCH_NCCL_DEBUG_INFO_TEMP_FILE, set_by="supervisor", read_by="torch", meaning="flight-recorder dump prefix <run_dir>/attempt-<N>/flight_recorder/rank_"),
    Var(name=TORCH_FR_DUMP_TEMP_FILE, set_by="supervisor", read_by="torch", meaning="newer name of TORCH_NCCL_DEBUG_INFO_TEMP_FILE (both are set)"),
    Var(name=TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, set_by="supervisor", read_by="torch", meaning="how long a timed-out rank waits for the flight-recorder dump before it aborts"),
    Var(name=AWS_ACCESS_KEY_ID, set_by="user", read_by="boto3 (S3 tier)", meaning="S3 credentials; preferred over [storage] s3_access_key_id"),
    Var(name=AWS_SECRET_ACCESS_KEY, set_by="user", read_by="boto3 (S3 tier)", meaning="S3 credentials; preferred over [storage] s3_secret_access_key"),
)
# fmt: on


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name: CKPTSUP_NODE (the agent's, also a test's override), else Slurm's
    SLURMD_NODENAME, else the hostname. Every part of ckptsup names nodes this way so that the
    agent, the hooks and the health checks agree."""
    environ = os.environ if environ is None else environ
    return environ.get(NODE) or environ.get(SLURMD_NODENAME) or socket.gethostname()


# A rank's command (rankside/): `--ckptsup-module` before SCRIPT says it is a module name (`-m`)
RANK_MODULE_FLAG = "--ckptsup-module"


def cold_rank_argv(python: str, argv: list[str], *, module: bool) -> list[str]:
    """The command of a rank started cold: python running rankside/cold_rank.py, which installs
    the stack dump and then runs SCRIPT (or MODULE) as __main__."""
    return [python, "-u", "-m", "ckptsup.rankside.cold_rank", *([RANK_MODULE_FLAG] if module else []), *argv]


def split_module_flag(args: list[str]) -> tuple[list[str], bool]:
    """(argv, module) from a rank command's `[--ckptsup-module] SCRIPT ARGS` (cold_rank, warm_proxy)."""
    if args and args[0] == RANK_MODULE_FLAG:
        return args[1:], True
    return args, False


RANK_TITLE = "ckptsup rank {rank}: {command}"   # a rank's process title (ps, top, py-spy; docs/supervisor.md §Finding a rank)
WARM_TITLE = "ckptsup warm interpreter {local_rank}: {path}"   # a warm interpreter waiting for its rank
TORCHRUN_TITLE = "ckptsup torchrun: {command}"   # torchrun forked by the zygote (its command line would be the zygote's)


class ForkKind(enum.StrEnum):
    """What the agent asks its zygote (rankside/zygote.py) to fork: the request's `kind`."""

    WARM = "warm"            # a warm rank interpreter, listening for its proxy
    TORCHRUN = "torchrun"    # torchrun itself, its output the fd sent along


def prepare_rank_title(*, keep_environ: bool = True) -> bool:
    """Ready setproctitle while this process's environment is still its own: it finds the command
    line's memory through `environ` on first use, so a warm interpreter (which replaces its
    environment with the rank's) calls this at start. SPT_NOENV: the title is then cut to the
    original command line's length rather than overwriting /proc/PID/environ (the agent reads RANK
    there). `keep_environ=False` (a child forked by the zygote, whose /proc environ is the zygote's
    and read by nobody): the title may use that room too. False when setproctitle is missing: a
    title is a convenience, never a reason to fail."""
    try:
        import setproctitle
    except ImportError:
        return False
    ours = keep_environ and "SPT_NOENV" not in os.environ
    if ours:
        os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.getproctitle()   # the one-time set-up
    finally:
        if ours:
            os.environ.pop("SPT_NOENV", None)   # not the rank's children's business
    return True


def set_rank_title(rank: int | str, argv: list[str]) -> bool:
    """Show `ckptsup rank R: SCRIPT ARGS` as this process's command line, so that ps, py-spy and
    kill find a rank, warm interpreter or not."""
    return _set_title(RANK_TITLE.format(rank=rank, command=" ".join(argv)), keep_environ=True)


def set_warm_title(local_rank: int, path: str) -> bool:
    """A warm interpreter forked by the zygote waits titled `ckptsup warm interpreter L: PATH`:
    ps (and a test) tells it by its local rank and socket, as its own environment is not in
    /proc (a fork's is its parent's). That environment's room is the title's, so the rank's title
    later is not cut to the zygote's short command line."""
    return _set_title(WARM_TITLE.format(local_rank=local_rank, path=path), keep_environ=False)


def set_torchrun_title(argv: list[str]) -> bool:
    """torchrun forked by the zygote is titled `ckptsup torchrun: ARGS`, not the zygote's command
    line; its environment's room is the title's, as for a warm interpreter."""
    return _set_title(TORCHRUN_TITLE.format(command=" ".join(argv)), keep_environ=False)


def _set_title(title: str, *, keep_environ: bool) -> bool:
    """This process's title (prepare_rank_title says whose room it may take); False without setproctitle."""
    if not prepare_rank_title(keep_environ=keep_environ):
        return False
    import setproctitle

    setproctitle.setproctitle(title)
    return True


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """What a rank learns from the supervisor. Every field has a standalone default so that
    `attach` also works under plain torchrun or python. Field `x` is variable CKPTSUP_X."""

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
    memory_socket: str | None = None
    memory_every_steps: int | None = None

    @property
    def supervised(self) -> bool:
        return self.rank_socket is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        """Read `environ` (default os.environ); unset or empty variables take the defaults.
        Raises ConfigError for a number that does not parse."""
        env = os.environ if environ is None else environ
        return cls(
            run_dir=_opt(env, RUN_DIR),
            job_id=env.get(JOB_ID) or env.get(SLURM_JOB_ID) or "local",
            attempt=_num(env, ATTEMPT, int) or 0,
            epoch=_num(env, EPOCH, int) or 0,
            config_json=_opt(env, CONFIG_JSON),
            checkpoint_dir=_opt(env, CHECKPOINT_DIR),
            node_local_dir=_opt(env, NODE_LOCAL_DIR),
            resume_from=_opt(env, RESUME_FROM),
            save_every_steps=_num(env, SAVE_EVERY_STEPS, int),
            save_every_s=_num(env, SAVE_EVERY_S, float),
            rank_socket=_opt(env, RANK_SOCKET),
            secret_file=_opt(env, SECRET_FILE),
            node=node_name(env),
            collective_timeout_init_s=_num(env, COLLECTIVE_TIMEOUT_INIT_S, float),
            collective_timeout_s=_num(env, COLLECTIVE_TIMEOUT_S, float),
            fr_dump_dir=_opt(env, FR_DUMP_DIR),
            preempt_budget_s=_num(env, PREEMPT_BUDGET_S, float),
            memory_socket=_opt(env, MEMORY_SOCKET),
            memory_every_steps=_num(env, MEMORY_EVERY_STEPS, int, at_least=1),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that from_environ reads back as this RankEnv. None fields are left out
        (unset reads as the default); an empty string would read back as None."""
        return self.variables(**{f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None})

    @classmethod
    def variables(cls, **values: object) -> dict[str, str]:
        """The variables of the named fields only: the one writer of rank variables, for a writer
        that knows part of them (the supervisor; the agent adds the socket and the node). None is
        written as "", which reads back as unset and hides a value the rank would otherwise
        inherit from the agent's environment."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"not a RankEnv field: {unknown[0]}")
        # field `x` is CKPTSUP_X; str() of an int or float reads back exactly through int() / float()
        return {PREFIX + name.upper(): "" if value is None else str(value) for name, value in values.items()}


def _opt(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "")
    return value if value != "" else None


def _num(env: Mapping[str, str], name: str, kind: type, *, at_least: int | None = None):
    raw = _opt(env, name)
    if raw is None:
        return None
    from .errors import ConfigError

    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not a {kind.__name__}; unset it or fix the value") from None
    if at_least is not None and value < at_least:
        raise ConfigError(f"environment {name}={raw!r} must be >= {at_least}; unset it or fix the value")
    return value
