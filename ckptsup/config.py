"""Configuration: keyword-only dataclasses, loaded from TOML in layers, with provenance.

Precedence (lowest first): built-in defaults < site config ($CKPTSUP_SITE_CONFIG, else
/etc/ckptsup/site.toml, else the shipped site_config/default.toml) < job config (--config FILE)
< command-line flags. Every value remembers where it came from (`ckptsup config show`).

Validation happens at the edge, per value, while the layer that set it is known, so the one-line
error names the file, the key and the valid choices. Every number is finite and has an upper
bound no site would exceed (a larger figure is a typo, and would overflow a derivation later:
`int(inf)` in the NCCL timeouts, a port past 65535, a kill grace no clock can wait for). The rules
between knobs (`RULES`) are checked once every layer is in, naming both keys and their sources.
Config files are read through safe_io: regular files (symlinks followed) of at most 1 MiB.
Units live in key names (`_s`, `_gb`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .env import SITE_CONFIG
from .errors import ConfigError
from .safe_io import read_json, read_regular

SYSTEM_SITE_CONFIG = Path("/etc/ckptsup/site.toml")
AUTO = "auto"
SECRET_NAME = re.compile(r"(secret|password|passwd|token|credential|access_key|private_key)", re.I)
REDACTED = "***redacted***"
MAX_CONFIG_BYTES = 1 << 20        # a site or job TOML; the effective config.json may be larger
MAX_CONFIG_JSON_BYTES = 4 << 20

# Upper bounds (docs/contracts.md §TOML schema): above any real site, so a larger figure is a typo.
HOUR_S = 3600
WEEK_S = 7 * 86400                # no timeout or interval of ckptsup is longer
MAX_NODES = 100_000               # nodes of one job (as slurm/render.py)
MAX_PER_NODE = 4096               # GPUs, CPUs or ranks on one node (as slurm/render.py)
PORT_SPREAD = 1999                # placement.rdzv_endpoint adds up to this to the rendezvous port
MAX_REPLICAS = 3                  # [memory] replicas: buddy nodes per node (each holds a copy of its ranks' bundles)

Check = Callable[[Any], "str | None"]  # returns a problem description, or None when fine


# ---- value checks (each returns what is wrong, or None) -------------------------------------

def positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def at_least_one(value: Any) -> str | None:
    return None if value >= 1 else "must be >= 1"


def count_or_auto(value: Any) -> str | None:
    if value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer >= 0 or \"{AUTO}\""
    return non_negative(value)


def positive_or_auto(value: Any) -> str | None:
    if value == AUTO:
        return None
    if isinstance(value, str):
        return f"must be a number of seconds > 0 or \"{AUTO}\""
    return positive(value)


GPU = "gpu"
RANK_WORDS = (GPU, AUTO)


def ranks_choice(value: Any) -> str | None:
    """Ranks per node: a number, or a word `ckptsup launch` resolves from the allocation."""
    if isinstance(value, str):
        return None if value in RANK_WORDS else f"must be an integer >= 1, \"{GPU}\" or \"{AUTO}\""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer >= 1, \"{GPU}\" or \"{AUTO}\""   # 1.0 too: a count of ranks
    return at_least_one(value)


def between(low: int, high: int, note: str = "") -> Check:
    """An integer range with both ends in the message (ports, signal leads)."""
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"must be between {low} and {high}{note}"
    return check


def one_of(*choices: Any) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of: {', '.join(map(str, choices))}"
    return check


def progress_check(value: Any) -> str | None:
    from .progress import pattern_problem

    return pattern_problem(value)


def external_pattern_problem(text: object) -> str | None:
    """What is wrong with `external_pattern` as a regex whose one group is the step, else None."""
    if not isinstance(text, str) or not text:
        return "must be a regular expression with one group that captures the step number"
    try:
        compiled = re.compile(text)
    except re.error as err:
        return f"is not a regular expression ({err})"
    if compiled.groups != 1:
        return f"must have exactly one group (the step number), not {compiled.groups}"
    return None


def external_pattern_check(value: Any) -> str | None:
    return external_pattern_problem(value)


def hf_output_dir_check(value: Any) -> str | None:
    """`[checkpoint] hf_output_dir`: "auto", "" (off) or the folder of HF's checkpoint-N folders."""
    if value in (AUTO, "") or (value and "\x00" not in value and len(value) <= 4096):
        return None
    return f"must be \"{AUTO}\" (the script's --output_dir), \"\" (off) or a folder's path, e.g. out"


CLOUDS = ("aws", "gcp", "azure")   # [preemption] cloud_notice: the clouds whose metadata service is polled


def metadata_endpoint(value: Any) -> str | None:
    """`[preemption] *_endpoint`: an http:// URL with a host (a cloud's link-local metadata
    service, or a site's proxy in front of it); no https, credentials, query or fragment."""
    from urllib.parse import urlsplit

    fix = "must be an http:// URL of the metadata service, e.g. http://169.254.169.254"
    if not value or len(value) > 2048 or any(ord(c) < 0x21 or c == "\x7f" for c in value):
        return fix
    try:
        parts = urlsplit(value)
        parts.port   # a bad port raises here
    except ValueError:
        return fix
    if parts.scheme != "http" or not parts.hostname or parts.username is not None or parts.query or parts.fragment:
        return fix
    return None


def script_checkpoint_check(value: Any) -> str | None:
    """`[supervisor] script_checkpoint`: paths or globs of a script's own checkpoint files."""
    for entry in value:
        if not entry or "\x00" in entry or len(entry) > 4096 or entry.endswith("/"):
            return (f"holds {entry[:60]!r}: each entry is a file's path or a glob (relative to the launch "
                    "directory), e.g. out/ckpt.pt")
    return None


def resume_args_check(value: Any) -> str | None:
    """`[supervisor] resume_args`: words for the script, split as a shell would (shlex)."""
    import shlex

    try:
        shlex.split(value)
    except ValueError as err:
        return f"cannot be split into words ({err}); quote it as a shell would, e.g. \"--init_from=resume\""
    return None


def domain_pattern_check(value: Any) -> str | None:
    """`[memory] domain_pattern`: empty, or a regex with at most one group (the domain's name)."""
    if value == "":
        return None
    try:
        compiled = re.compile(value)
    except re.error as err:
        return f"is not a regular expression ({err}); fix it, e.g. ^(rack\\d+)-, or leave it empty"
    if compiled.groups > 1:
        return (f"must have at most one group (the domain's name), not {compiled.groups}; "
                "make the others non-capturing: (?:...)")
    return None


def tier_path(*schemes: str) -> Check:
    """A storage location: empty (tier off), a plain path, or one of the given URL schemes."""
    def check(value: Any) -> str | None:
        if value == "":
            return None
        match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", value)
        if match is None:
            return None if "" in schemes else f"must be a URL with scheme {', '.join(s + '://' for s in schemes if s)}"
        if match.group(1) not in schemes:
            valid = ", ".join(f"{s}://" if s else "a plain path" for s in schemes)
            return f"unknown scheme {match.group(1)}://; valid: {valid}"
        return None
    return check


def knob(default: Any, help: str, check: Check | None = None, *, max: float | None = None,
         why: str = "no site needs more", one_or_list: bool = False) -> Any:
    """A config field: its default, a one-line why/unit (shown by `config show --help` and in
    default.toml), its check, and for numbers the upper bound (`why`: what a larger one means).
    `one_or_list`: a list of strings that may also be given as one string (a list of one)."""
    factory = (lambda d=default: list(d)) if isinstance(default, list) else None
    meta = {"help": help, "check": check, "max": max, "why": why, "one_or_list": one_or_list}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---- the schema -----------------------------------------------------------------------------

@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = knob("ckptsup-runs/{job_id}", "run directory on the shared FS; {job_id} expands; survives requeues")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = knob("", "shared-tier checkpoint_dir holding step_<N>/; empty = <run_dir>/checkpoints")
    save_every_steps: int = knob(0, "save every N steps; 0 = use the time interval only", non_negative, max=10**9)
    save_every_s: float = knob(1800.0, "initial time between saves (s); the adaptive interval replaces it", positive, max=WEEK_S)
    adaptive_interval: bool = knob(True, "let the supervisor set the interval from Daly's formula with measured costs")
    async_save: bool = knob(True, "write, hash and commit in the background; the stall is the copy to host only")
    keep_last: int = knob(3, "retention: keep the newest K checkpoints per tier", at_least_one, max=10_000)
    keep_daily_days: int = knob(14, "retention: also keep one checkpoint a day for D days (0 = none)", non_negative, max=3650)
    hash_algorithm: str = knob("xxh3-128", "per-file and per-item checksum", one_of("xxh3-128", "crc32", "sha256"))
    test_load_every: int = knob(5, "run a level-3 test load on every Nth commit (0 = only before a daily keeper)", non_negative, max=10**6)
    jitter_s: float = knob(30.0, "random delay (s) added to time-based saves so jobs do not write in the same minute", non_negative, max=WEEK_S)
    emergency_margin: float = knob(1.5, "an emergency save runs only if measured save time x margin fits the budget", positive, max=100)
    allow_stateless_dataloader: bool = knob(False, "accept a dataloader without state_dict (data WILL repeat after restart)")
    external_dir: str = knob("", "a framework's own folder of DCP step folders (torchtitan's checkpoint.folder), relative to "
                             "the job's cwd or absolute: validated in place, bad ones moved out of it; empty = off")
    external_pattern: str = knob(r"step-(\d+)", "regex (searched, as torchtitan does) on external_dir's folder names; its one "
                                 "group is the step", external_pattern_check)
    hf_output_dir: str = knob(AUTO, "Hugging Face's own checkpoint-N folders, checked before every launch and a bad newest "
                              "one moved out of the way of get_last_checkpoint: \"auto\" = the script's --output_dir "
                              "(when its arguments name one), \"\" = off, or a folder (relative to the job's cwd)",
                              hf_output_dir_check)


@dataclass(kw_only=True)
class StorageConfig:
    node_local: str = knob("", "node-local cache tier ({node}, {job_id} expand); empty = off", tier_path("", "file"))
    object_store: str = knob("", "object tier, s3://bucket/prefix; empty = off", tier_path("s3"))
    s3_endpoint_url: str = knob("", "S3-compatible endpoint URL; empty = AWS default")
    s3_region: str = knob("us-east-1", "S3 region")
    s3_access_key_id: str = knob("", "prefer AWS_ACCESS_KEY_ID in the environment; redacted in output")
    s3_secret_access_key: str = knob("", "prefer AWS_SECRET_ACCESS_KEY in the environment; redacted in output")
    promote_retries: int = knob(5, "attempts per file when promoting to a slower tier", at_least_one, max=1000)
    promote_queue_size: int = knob(4, "checkpoints waiting for promotion before the oldest waiting one is skipped", at_least_one, max=1000)
    min_free_gb: float = knob(5.0, "health: minimum free space on every checkpoint tier (GB)", non_negative, max=10**6)


@dataclass(kw_only=True)
class MemoryConfig:
    enabled: bool = knob(True, "memory tier: each rank's shard also kept in its node agent's memory, so a rank crash "
                         "resumes from there, and replicated to buddy nodes' agents (docs/training.md); only under "
                         "`ckptsup launch`, and only while the bundles fit (max_bytes)")
    every_steps: int = knob(10, "memory saves every N steps (with enabled); left at this default, with [checkpoint] "
                            "adaptive_interval the supervisor retunes it from measured costs, never past the job's own "
                            "disk save schedule; set in a site or job TOML (or `ckptsup launch --memory-every-steps`) "
                            "it is the schedule and the tuner never changes it", at_least_one, max=10**9)
    keep: int = knob(2, "memory checkpoints the agent keeps per rank", at_least_one, max=100)
    max_bytes: Any = knob(AUTO, "a rank's memory bundle larger than this turns the tier off for it with one warning; "
                          "auto = what fits in half the node's available memory at the first save, shared by "
                          "(keep + 1) copies x ranks on the node x (1 + replicas); 0 = no limit", count_or_auto,
                          max=1 << 50)
    replicas: int = knob(1, "buddy nodes, each in another failure domain, that hold a copy of a node's bundles; "
                         "0 = the node's own memory only", non_negative, max=MAX_REPLICAS,
                         why="each replica costs a node's bundles in another node's memory")
    domain_pattern: str = knob("", "regex searched in a node's name: its first group (else the whole match) names the "
                               "node's failure domain, e.g. ^(rack\\d+)-; empty, or a name it does not match = a domain "
                               "of its own", domain_pattern_check)


@dataclass(kw_only=True)
class SupervisorConfig:
    nproc_per_node: Any = knob(AUTO, "ranks per node (torchrun --nproc-per-node): a number, gpu (the allocation's GPUs "
                               "per node) or auto (its GPUs per node, else 1); `ckptsup launch` resolves the word",
                               ranks_choice, max=MAX_PER_NODE)
    nodes: int = knob(0, "active nodes; 0 = every allocated node minus [sbatch] spares", non_negative, max=MAX_NODES, why="more than any cluster has")
    min_nodes: int = knob(0, "fewest nodes to train on (torchrun's --nnodes MIN:MAX): a node lost with no spare left "
                               "continues on the survivors (>= this) when that costs less than a requeue "
                               "(docs/planning.md §Fewer nodes or a requeue); 0 = the active nodes (never fewer)",
                          non_negative, max=MAX_NODES, why="more than any cluster has")
    requeue_wait_s: float = knob(900.0, "expected queue wait of a requeue (s), used to price continuing on fewer nodes "
                                        "until this run has measured one", non_negative, max=WEEK_S)
    shrink_horizon_s: float = knob(3600.0, "how long a job continued on fewer nodes is expected to run that way (s): the "
                                           "rest of its work; the time left in the allocation when that is shorter",
                                   positive, max=WEEK_S)
    batch_host_spare: bool = knob(False, "with spares in the allocation, the batch host (where the supervisor runs) is "
                                  "the last hot spare: an active node's death never takes the supervisor with it; it "
                                  "trains only once no other spare is left")
    max_restarts: int = knob(10, "restart budget per run (all attempts together)", non_negative, max=10**6)
    heartbeat_interval_s: float = knob(1.0, "agent -> supervisor heartbeat period (s)", positive, max=HOUR_S)
    node_silence_s: float = knob(5.0, "an agent silent this long while others talk = node down (s)", positive, max=WEEK_S)
    relay_above_nodes: int = knob(1024, "past this many nodes, ~sqrt(nodes) agents relay their neighbours' heartbeats "
                                        "and send the supervisor one summary a beat (docs/architecture.md §A heartbeat's "
                                        "path); 0 = never: every agent writes its own", non_negative, max=MAX_NODES,
                                  why="more than any cluster has")
    hang_timeout_s: Any = knob(AUTO, "no step progress this long = hang (s); auto = max(hang_min_s, hang_step_factor x p99 step)", positive_or_auto, max=WEEK_S)
    hang_min_s: float = knob(10.0, "floor of the automatic hang timeout (s); a silence this long is only suspect: "
                                   "a hang when no rank shows work (CPU, I/O) through the evidence window", positive, max=WEEK_S)
    # 10 min, eval_timeout_s's: an unmodified script's quiet evaluation (or compile, or data phase)
    # gets what a declared one gets, and NCCL's own default is 10 min; a rank spinning forever looks
    # the same from /proc and costs this much (docs/timeouts.md §Evidence)
    busy_limit_s: float = knob(600.0, "ranks that work (CPU, I/O) without progress are busy, not hung: killed only after "
                                      "this long without progress (s)", positive, max=WEEK_S)
    straggler_ratio: float = knob(1.15, "a rank whose compute time per step is this many times the other ranks' "
                                        "median is a straggler (supervisor/job/stragglers.py)", positive, max=100)
    straggler_window_steps: int = knob(10, "steps per straggler comparison window", at_least_one, max=10**6)
    straggler_windows: int = knob(3, "windows in a row a rank must be slower to be flagged", at_least_one, max=10**6)
    straggler_replace: bool = knob(False, "a flagged straggler's node is replaced by a spare at the next checkpoint")
    hang_step_factor: float = knob(3.0, "automatic hang timeout = this x p99 step time", positive, max=10_000)
    init_timeout_s: float = knob(300.0, "allowance from launch to the first step (s)", positive, max=WEEK_S)
    save_timeout_s: float = knob(600.0, "allowance for a blocking save (s)", positive, max=WEEK_S)
    load_timeout_s: float = knob(600.0, "allowance for a checkpoint load (s)", positive, max=WEEK_S)
    eval_timeout_s: float = knob(600.0, "allowance for an eval phase (ckptsup.phase, the framework callbacks' "
                                        "validation/test/predict loops) without a heartbeat in it (s); while one rank "
                                        "evaluates, the ranks waiting for it get the same allowance", positive, max=WEEK_S,
                                 why="a quiet evaluation pass is not a hang")
    kill_grace_s: float = knob(10.0, "SIGTERM -> SIGKILL deadline when stopping ranks (s)", positive, max=HOUR_S)
    exit_grace_s: float = knob(30.0, "once every rank said bye (without hooks: once a rank exited 0), the rank processes "
                                     "left must exit within this; then they are killed (teardown_hang) and the run "
                                     "counts complete (s)", positive, max=HOUR_S)
    crash_loop_threshold: int = knob(3, "same failure at the same step this many times = user error, give up", at_least_one, max=1000)
    backoff_initial_s: float = knob(0.0, "delay before the 2nd restart in a row; doubles after (s)", non_negative, max=WEEK_S)
    backoff_max_s: float = knob(60.0, "cap of the restart backoff (s)", non_negative, max=WEEK_S)
    lease_interval_s: float = knob(1.0, "how often the supervisor renews its lease in the run dir (s)", positive, max=HOUR_S)
    lease_stale_s: float = knob(10.0, "the watchdog requeues when the lease is older than this (s)", positive, max=WEEK_S)
    rdzv_port: int = knob(29500, "c10d rendezvous port on the first active node; up to 1999 is added per job and attempt",
                          between(1, 65535 - PORT_SPREAD, f" (up to {PORT_SPREAD} is added to spread jobs over ports)"),
                          max=65535 - PORT_SPREAD)
    progress_pattern: str = knob("auto", "regex on the ranks' output whose one group is the step (progress lines); "
                                 "auto = every preset, off, or a preset: torchtitan, megatron, nanogpt, plain, hf_log, tqdm, rich "
                                 "(docs/drop-in.md §Progress lines)", progress_check)
    progress_dir: str = knob("", "a script's own checkpoint directory: a newer entry there counts as progress "
                                 "(for scripts that report no steps); empty = none")
    script_checkpoint: list = knob([], "a script's own checkpoint files (paths or globs, relative to the launch "
                                   "directory; one string or a list; `ckptsup launch --script-checkpoint`): each new "
                                   "version is checked once written and the newest verified ones kept in the run dir; "
                                   "before each launch a torn or corrupt one is moved aside and the newest verified "
                                   "copy put back (docs/drop-in.md)", script_checkpoint_check, one_or_list=True)
    script_checkpoint_keep: int = knob(2, "verified versions of each script checkpoint file kept in the run dir "
                                          "(each costs the file's size there)", at_least_one, max=100)
    script_checkpoint_on_corrupt: str = knob("give-up", "a script checkpoint that is corrupt before a launch, with no "
                                             "verified copy to put back: give-up (one line naming the file), or "
                                             "start-over (the file moved aside, the script starts fresh)",
                                             one_of("give-up", "start-over"))
    resume_args: str = knob("", "words (split as a shell would) appended to the script's arguments on every attempt "
                                "that starts with a verified script checkpoint in place, e.g. --init_from=resume; "
                                "needs script_checkpoint", resume_args_check)
    progress_warn_s: float = knob(900.0, "warn (an event, never a kill) when a script that never reported a step has "
                                         "printed no progress line for this long (s)", positive, max=WEEK_S)
    warm_ranks: bool = knob(True, "launches run the ranks in interpreters forked from one that imported torch "
                                  "ahead of need (one import a node; false: every rank starts cold)")
    tee: bool = knob(False, "every rank's output on the console, prefixed [rankN]: (default: rank 0's only)")
    rdzv_backend: str = knob("static", "torchrun rendezvous: static (node ranks from the supervisor, workers start ~0.3 s sooner on a restart) or c10d", one_of("static", "c10d"))


@dataclass(kw_only=True)
class NcclConfig:
    collective_timeout_init_s: float = knob(900.0, "collective timeout during init and the first steps (s); above init and load allowances", positive, max=WEEK_S)
    collective_timeout_s: Any = knob(AUTO, "steady-state collective timeout (s); auto = derived from step/save times, above the hang timeout", positive_or_auto, max=WEEK_S)
    heartbeat_timeout_s: float = knob(120.0, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: watchdog-of-the-watchdog (s)", positive, max=WEEK_S)
    flight_recorder_entries: int = knob(2000, "TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_FR_BUFFER_SIZE entries", non_negative, max=10**6)
    dump_on_timeout: bool = knob(True, "TORCH_NCCL_DUMP_ON_TIMEOUT: dump the flight recorder into the run dir")
    async_error_handling: int = knob(3, "TORCH_NCCL_ASYNC_ERROR_HANDLING (3 = skip cleanup and tear down)", one_of(0, 1, 2, 3), max=3)


@dataclass(kw_only=True)
class HealthConfig:
    enabled: bool = knob(True, "run health checks before launch and on suspects after a failure")
    timeout_s: float = knob(30.0, "timeout of each health check command (s)", positive, max=WEEK_S)
    check_gpus: str = knob(AUTO, "GPUs visible: auto (when nvidia-smi exists), require, off", one_of(AUTO, "require", "off"))
    commands: list = knob([], "site commands (argv strings, no shell); non-zero exit = node unhealthy")
    gpu_fatal_xids: list = knob([48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120],
                                "XIDs (kernel log NVRM lines, DCGM field 230) that make a node unhealthy; others are reported only")
    gpu_max_uncorrected_ecc: int = knob(0, "volatile uncorrected ECC errors a GPU may show and stay healthy",
                                        non_negative, max=10**9)
    gpu_fatal_throttle: list = knob(["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"],
                                    "nvidia-smi clock throttle reasons that make a node unhealthy while active")
    dcgm_diag: str = knob(AUTO, "dcgmi diag -r 1 in the checks: auto (when dcgmi exists), off", one_of(AUTO, "off"))


@dataclass(kw_only=True)
class SlurmConfig:
    spare_partition: str = knob("", "partition spanning regular + reserved spare nodes, used on requeue; empty = keep")
    drain_bad_nodes: bool = knob(True, "drain a blamed node (where permitted); always recorded in the run's state")
    command_timeout_s: float = knob(30.0, "timeout of one Slurm command (s)", positive, max=WEEK_S)
    retry_budget_s: float = knob(60.0, "total time to retry transient Slurm failures (s)", positive, max=WEEK_S)


@dataclass(kw_only=True)
class SbatchConfig:
    partition: str = knob("", "partition for the job; empty = cluster default")
    account: str = knob("", "account to charge; empty = user default")
    time: str = knob("24:00:00", "time limit (Slurm format)")
    nodes: int = knob(2, "active nodes", at_least_one, max=MAX_NODES, why="more than any cluster has")
    spares: int = knob(0, "hot spare nodes inside the allocation", non_negative, max=MAX_NODES, why="more than any cluster has")
    gpus_per_node: int = knob(0, "GPUs per node (--gpus-per-node); 0 = none", non_negative, max=MAX_PER_NODE)
    cpus_per_task: int = knob(0, "CPUs per agent task; 0 = Slurm default", non_negative, max=MAX_PER_NODE)
    job_name: str = knob("ckptsup", "job name")
    signal_lead_s: int = knob(120, "--signal=B:USR1@N: seconds of warning before the time limit", between(1, 65535, " seconds"), max=65535)
    template: str = knob("train.sbatch", "template name in sbatch_templates/ or a path")
    extra_directives: list = knob([], "extra #SBATCH lines, e.g. \"--qos=high\"")


@dataclass(kw_only=True)
class CostConfig:
    price_per_gpu_hour: float = knob(2.0, "USD per GPU-hour, for pricing badput", non_negative, max=10_000)
    gpu_mtbf_hours: float = knob(45000.0, "prior per-GPU MTBF (h); Llama 3: 466 interruptions / 54 d / 16k GPUs", positive, max=10**8)


@dataclass(kw_only=True)
class ReportConfig:
    prom_textfile: str = knob("", "Prometheus textfile the supervisor rewrites every few seconds while the job runs "
                                  "(node_exporter's textfile collector; {job_id} expands); empty = off")


@dataclass(kw_only=True)
class SdcConfig:
    every_steps: int = knob(1000, "replica fingerprints (docs/sdc.md) every N steps, and at every save (disk and memory); "
                                  "0 = only at saves. Default from the measured cost: at 1 GiB of state per rank and a "
                                  "50 ms step, under 1 % of the step time (BENCHMARKS.md §SDC)", non_negative, max=10**9)
    enabled: bool = knob(True, "compare replica fingerprints where ranks hold replicas (DDP); a disagreement is an "
                               "sdc failure and a checkpoint taken then is never validated")


@dataclass(kw_only=True)
class PreemptionConfig:
    cloud_notice: str = knob(AUTO, "each agent polls its cloud's metadata service for a spot/preemption notice every 5 s "
                             "(docs/cloud.md): auto = the cloud the node's DMI names (AWS, GCP, Azure; none: no polling), "
                             "or aws, gcp, azure, off", one_of(AUTO, *CLOUDS, "off"))
    aws_endpoint: str = knob("http://169.254.169.254", "AWS instance metadata service (IMDSv2) base URL", metadata_endpoint)
    gcp_endpoint: str = knob("http://metadata.google.internal", "GCP metadata server base URL (169.254.169.254)",
                             metadata_endpoint)
    azure_endpoint: str = knob("http://169.254.169.254", "Azure Instance Metadata Service base URL (Scheduled Events)",
                               metadata_endpoint)


CONTAINER_RUNTIMES = ("none", "pyxis", "oci", "apptainer")   # [container] runtime (docs/containers.md)


def container_mounts_check(value: Any) -> str | None:
    """`[container] mounts`: SRC[:DST[:FLAGS]] entries with absolute paths (pyxis's and apptainer's syntax)."""
    for entry in value:
        parts = entry.split(":") if isinstance(entry, str) else []
        if not (1 <= len(parts) <= 3) or not all(p.startswith("/") for p in parts[:2]) or "," in entry \
                or any(c in entry for c in "\x00\n"):
            return (f"holds {str(entry)[:60]!r}: each entry is SRC[:DST[:FLAGS]] with absolute paths and no comma, "
                    "e.g. /data:/data:ro")
    return None


def env_names_check(value: Any) -> str | None:
    """`[container] env`: names of variables (pyxis's --container-env)."""
    for name in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            return f"holds {str(name)[:40]!r}: each entry is a variable's name, e.g. NCCL_DEBUG"
    return None


def container_word_check(value: Any) -> str | None:
    """An image, bundle, working directory or interpreter: one word, no control characters."""
    if value == "" or (len(value) <= 4096 and not any(c.isspace() or ord(c) < 0x20 for c in value)):
        return None
    return "must be one word without spaces, e.g. nvcr.io#nvidia/pytorch:24.05-py3 or /images/train.sif"


@dataclass(kw_only=True)
class ContainerConfig:
    runtime: str = knob("none", "where the agents and ranks run (docs/containers.md): none = on the nodes' own Python; "
                        "pyxis = srun --container-image (pyxis/enroot); oci = srun --container BUNDLE (Slurm's OCI "
                        "support); apptainer = apptainer exec IMAGE. The supervisor stays on the batch host",
                        one_of(*CONTAINER_RUNTIMES))
    image: str = knob("", "pyxis: the image (nvcr.io#nvidia/pytorch:24.05-py3, docker://..., or a .sqsh path); "
                      "apptainer: a .sif path or a docker:// / oras:// URI", container_word_check)
    bundle: str = knob("", "oci: the OCI bundle directory (config.json + rootfs) on every node", container_word_check)
    mounts: list[str] = knob([], "extra SRC[:DST[:FLAGS]] mounts; the run dir, the checkpoint tiers, the launch "
                             "directory and the script are mounted at their own paths unless listed here",
                             container_mounts_check, one_or_list=True)
    env: list[str] = knob([], "pyxis: variables whose host value overrides the image's (--container-env)",
                          env_names_check, one_or_list=True)
    workdir: str = knob("", "the working directory inside (pyxis --container-workdir, apptainer --pwd); "
                        "empty: the launch directory", container_word_check)
    python: str = knob("python3", "the interpreter inside the container that imports ckptsup and torch",
                       container_word_check)
    name: str = knob("ckptsup-{job_id}", "pyxis: the container's name, so that a later step (a spare, a node-path "
                     "restart) reuses the imported file system instead of importing the image again",
                     container_word_check)


NOTIFY_EVENTS = ("give_up", "node_drained", "sdc", "requeue", "preemption", "run_complete")   # [notify] events


def notify_events_check(value: Any) -> str | None:
    """`[notify] events`: names of the notices a person must get (supervisor/job/notify.py)."""
    for name in value:
        if name not in NOTIFY_EVENTS:
            return f"holds {str(name)[:40]!r}: valid: {', '.join(NOTIFY_EVENTS)}"
    return None


def notify_command_check(value: Any) -> str | None:
    """`[notify] command`: an argv run without a shell: no empty first word, no NUL or line break."""
    if value and (not value[0] or any("\x00" in word or "\n" in word for word in value)):
        return "must be an argv list such as [\"/usr/local/bin/page-oncall\", \"--team\", \"ml\"] (no shell)"
    return None


def webhook_check(value: Any) -> str | None:
    """`[notify] webhook`: empty (off) or an http(s) URL with a host."""
    if value == "" or re.fullmatch(r"https?://[^/\s?#@]+(/[^\s]*)?", value):
        return None
    return "must be an https:// URL (http:// for a test server), e.g. https://hooks.example.com/ckptsup"


def env_name_check(value: Any) -> str | None:
    """The name of an environment variable (a secret is read from it, never written into a config)."""
    if value == "" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return "must be the name of an environment variable, e.g. WEBHOOK_TOKEN"


@dataclass(kw_only=True)
class NotifyConfig:
    command: list[str] = knob([], "argv run (no shell) with each notice as JSON on stdin, off the supervisor's "
                              "loop, e.g. [\"/usr/local/bin/page-oncall\", \"--team\", \"ml\"]; empty = off",
                              notify_command_check)
    webhook: str = knob("", "URL each notice is POSTed to as JSON (retried, bounded); empty = off", webhook_check)
    webhook_secret_env: str = knob("", "environment variable of the supervisor whose value is sent as "
                                   "`Authorization: Bearer ...` with each POST (never logged, never on argv); "
                                   "empty = no header", env_name_check)
    events: list[str] = knob(list(NOTIFY_EVENTS), f"the notices sent: any of {', '.join(NOTIFY_EVENTS)}",
                             notify_events_check)
    timeout_s: float = knob(10.0, "bound on one notice's delivery by each channel (the command's run, the "
                            "webhook's tries together)", positive, max=600)
    retries: int = knob(3, "webhook tries per notice (exponential backoff inside timeout_s)", at_least_one, max=10)


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    sbatch: SbatchConfig = field(default_factory=SbatchConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


@dataclass(kw_only=True)
class Resolved:
    config: Config
    provenance: dict[str, str]  # "section.key" -> "default" | "site:/path" | "job:/path" | "flag --x" | "env"

    def rows(self, *, redact: bool = True) -> list[dict[str, Any]]:
        out = []
        for section, values in self.config.to_dict().items():
            for key, value in values.items():
                if redact and is_secret(key) and value:
                    value = REDACTED
                out.append({"key": f"{section}.{key}", "value": value,
                            "source": self.provenance.get(f"{section}.{key}", "default")})
        return out


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with secret-looking values replaced, recursively; for logs and events."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            out[key] = redact(value)
        elif is_secret(str(key)) and value:
            out[key] = REDACTED
        else:
            out[key] = value
    return out


# ---- loading ----------------------------------------------------------------------------------

def _type_problem(fld: dataclasses.Field, value: Any) -> str | None:
    default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()  # type: ignore[operator]
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
        return None if abs(value) < 2**63 else "is too large (TOML integers are 64-bit)"
    if isinstance(default, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return "must be a number"
        if isinstance(value, int):   # TOML and JSON integers have any size; math.isfinite overflows past 1e308
            return None if abs(value) < 2**63 else "is too large (TOML integers are 64-bit)"
        return None if math.isfinite(value) else "must be a finite number (not nan or inf)"
    if isinstance(default, list):
        if isinstance(value, str) and fld.metadata.get("one_or_list"):
            return None
        if default and isinstance(default[0], int):   # a list of numbers (XIDs)
            ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31
                                                 for v in value)
            return None if ok else "must be a list of integers (0 to 2**31-1)"
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return None if ok else "must be a list of strings"
    if isinstance(default, str) and default == AUTO and fld.metadata.get("check") is positive_or_auto:
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            return f"must be a number or \"{AUTO}\""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number (not nan or inf) or \"{AUTO}\""
        return None if not isinstance(value, int) or abs(value) < 2**63 else "is too large (TOML integers are 64-bit)"
    if isinstance(default, str) and fld.metadata.get("check") is count_or_auto:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return None if not isinstance(value, int) or abs(value) < 2**63 else "is too large (TOML integers are 64-bit)"
        return f"must be an integer >= 0 or \"{AUTO}\""
    if isinstance(default, str) and fld.metadata.get("check") is ranks_choice:
        if isinstance(value, str):
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, \"{GPU}\" or \"{AUTO}\""
        return None if abs(value) < 2**63 else "is too large (TOML integers are 64-bit)"
    if isinstance(default, str):
        return None if isinstance(value, str) else "must be a string"
    return None


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _human_s(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f" ({seconds // size:g} {unit})"
    return ""


def _bound_problem(fld: dataclasses.Field, value: Any) -> str | None:
    """The upper bound of a number (`knob(max=...)`); None for strings such as "auto"."""
    high = fld.metadata.get("max")
    if high is None or not isinstance(value, (int, float)) or isinstance(value, bool) or value <= high:
        return None
    human = _human_s(high) if fld.name.endswith("_s") else ""
    return f"must be at most {_fmt(high)}{human}: {fld.metadata.get('why') or 'no site needs more'}; check the figure"


def _shown(key: str, value: Any) -> str:
    if is_secret(key):
        return REDACTED
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + "..."


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _name(name: Any) -> str:
    """A section or key name for a message: as written when it is a bare TOML key, else its
    repr, shortened (a quoted key may hold line breaks or be of any length; the error stays one line)."""
    if isinstance(name, str) and _BARE_KEY.fullmatch(name):
        return name
    text = repr(name)
    return text if len(text) <= 60 else text[:40] + "..."


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{hint}; valid: {', '.join(valid)}"


def apply_layer(config: Config, provenance: dict[str, str], data: Mapping[str, Any], source: str) -> None:
    """Merge one layer (a parsed TOML document or flag overrides) into `config`, checking each
    value while its source is known. Raises ConfigError with one line."""
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{_name(section)}]{_suggest(section, list(SECTIONS))}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{_name(section)}] must be a table of keys")
        target = getattr(config, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key {section}.{_name(key)}{_suggest(key, list(fields))}")
            fld = fields[key]
            problem = _type_problem(fld, value)
            if problem is None and isinstance(value, str) and fld.metadata.get("one_or_list"):
                value = [value]
            if problem is None and fld.metadata.get("check") is not None:
                problem = fld.metadata["check"](value)
            if problem is None:
                problem = _bound_problem(fld, value)
            if problem is not None:
                raise ConfigError(f"{source}: {section}.{key} = {_shown(key, value)} {problem}")
            if isinstance(fld.default, float) and isinstance(value, int):
                value = float(value)
            setattr(target, key, value)
            provenance[f"{section}.{key}"] = source


def read_toml(path: Path, role: str, *, named_by: str | None = None) -> dict[str, Any]:
    """A site or job TOML file: a regular file (a symlink is followed) of at most
    MAX_CONFIG_BYTES, read without blocking (safe_io), parsed; every problem is one line.
    `named_by` is where the path came from (the site config's environment variable)."""
    what = f"{role} config" + (f" (${named_by})" if named_by else "")
    try:
        data = read_regular(path, max_bytes=MAX_CONFIG_BYTES, what=what, error=ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; check the path") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply; a config is a few flat tables") from None
    except ValueError as err:  # TOMLDecodeError, and an integer of more than 4300 digits
        raise ConfigError(f"{path}: invalid TOML: {str(err)[:200]}") from None


def shipped_default_config() -> Path:
    from .resources import site_config_dir

    return site_config_dir() / "default.toml"


# ---- rules between knobs ------------------------------------------------------------------------

# (section, key, factor, other key, why): config.<section>.<key> must be >= factor x <other key>.
# Checked once every layer is in, so a site's interval and a job's timeout meet (docs/timeouts.md).
RULES: tuple[tuple[str, str, float, str, str], ...] = (
    ("supervisor", "lease_stale_s", 2.0, "lease_interval_s",
     "else the watchdog requeues a live supervisor whose lease renewal is merely late"),
    ("supervisor", "node_silence_s", 2.0, "heartbeat_interval_s",
     "else one late heartbeat counts as a dead node"),
    ("supervisor", "backoff_max_s", 1.0, "backoff_initial_s",
     "else the cap is below the first delay and the backoff never grows"),
)


def check_rules(config: Config, provenance: Mapping[str, str]) -> None:
    """Raise ConfigError (one line: both keys, their values and sources, the fix) for the first
    rule of RULES that the resolved config breaks."""
    sup = config.supervisor
    if sup.nodes and sup.min_nodes > sup.nodes:
        raise ConfigError(
            f"supervisor.min_nodes = {sup.min_nodes} ({provenance.get('supervisor.min_nodes', 'default')}) is more than "
            f"supervisor.nodes = {sup.nodes} ({provenance.get('supervisor.nodes', 'default')}): MIN must be at most MAX; "
            "lower min_nodes or raise nodes")
    for section, key, factor, other, why in RULES:
        target = getattr(config, section)
        value, bound = getattr(target, key), getattr(target, other)
        if value < factor * bound:
            raise ConfigError(
                f"{section}.{key} = {value!r} ({provenance.get(f'{section}.{key}', 'default')}) must be at least "
                f"{factor:g} x {section}.{other} = {bound!r} ({provenance.get(f'{section}.{other}', 'default')}), "
                f"{why}; raise {key} or lower {other}")


def set_explicitly(provenance: Mapping[str, str], key: str) -> bool:
    """True when `key` ("section.key") was set by a site file, a job file, a flag or the
    environment; False for the built-in default, and for the shipped default.toml (the site
    layer when no site file exists), which repeats every default and so says nothing chosen."""
    source = provenance.get(key, "default")
    if source == "default":
        return False
    if source.startswith("site:"):
        try:
            return Path(source[len("site:"):]).resolve() != shipped_default_config().resolve()
        except (OSError, RuntimeError):   # an unresolvable path is not the shipped file
            return True
    return True


def site_config_path(env: Mapping[str, str]) -> Path:
    if env.get(SITE_CONFIG):
        return Path(env[SITE_CONFIG])
    if SYSTEM_SITE_CONFIG.exists():
        return SYSTEM_SITE_CONFIG
    return shipped_default_config()


def flag_overrides(flags: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"checkpoint.keep_last": 5} → {"checkpoint": {"keep_last": 5}}; None values are skipped
    (an unset flag does not override)."""
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        nested.setdefault(section, {})[key] = value
    return nested


def load_config(*, job_config: str | os.PathLike[str] | None = None,
                flags: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> Resolved:
    env = os.environ if env is None else env
    config = Config()
    provenance: dict[str, str] = {}
    site = site_config_path(env)
    named_by = SITE_CONFIG if env.get(SITE_CONFIG) else None
    apply_layer(config, provenance, read_toml(site, "site", named_by=named_by), f"site:{site}")
    if job_config is not None:
        path = Path(job_config)
        apply_layer(config, provenance, read_toml(path, "job"), f"job:{path}")
    if flags:
        for dotted, value in flags.items():
            if value is not None:
                apply_layer(config, provenance, flag_overrides({dotted: value}), f"flag {dotted}")
    check_rules(config, provenance)
    return Resolved(config=config, provenance=provenance)


def write_config_json(resolved: Resolved, path: Path) -> None:
    """The supervisor writes the effective config for agents and ranks (0600, secrets included,
    since ranks may need S3 credentials; never logged)."""
    payload = {"config": resolved.config.to_dict(), "provenance": resolved.provenance}
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(tmp, path)


def read_config_json(path: str | os.PathLike[str]) -> Resolved:
    try:
        payload = read_json(path, max_bytes=MAX_CONFIG_JSON_BYTES, what="effective config", error=ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"effective config {path} unreadable (it does not exist); relaunch through ckptsup launch") from None
    except ConfigError as err:
        raise ConfigError(f"{err} (the effective config is unreadable; relaunch through ckptsup launch)") from None
    provenance_in = payload.get("provenance", {}) if isinstance(payload, dict) else None
    if not isinstance(payload, dict) or not isinstance(payload.get("config", {}), dict) \
            or not isinstance(provenance_in, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in provenance_in.items()):
        raise ConfigError(f"effective config {path} is not a ckptsup config (a JSON object with \"config\"); "
                          "relaunch through ckptsup launch")
    config = Config()
    provenance: dict[str, str] = {}
    apply_layer(config, provenance, payload.get("config", {}), f"supervisor:{path}")
    check_rules(config, provenance)
    return Resolved(config=config, provenance=payload.get("provenance", provenance))


DEFAULT_TOML_HEADER = f"""\
# ckptsup shipped site defaults.
# Precedence: built-in < this site file (${SITE_CONFIG}, {SYSTEM_SITE_CONFIG}, or this file)
#             < job config (--config FILE) < command-line flags.  `ckptsup config show` shows provenance.
# Every knob is listed with its default; units are in the key names (_s seconds, _gb gigabytes).
# Numbers are finite and at most the bound shown; a larger figure is refused as a typo.
"""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: TOML basic strings are JSON's


def render_default_toml() -> str:
    """site_config/default.toml, generated from the schema: every knob with its help line, its
    bound and the rules it takes part in (tests/test_config.py keeps the shipped file equal)."""
    rules: dict[str, list[str]] = {}
    for section, key, factor, other, _why in RULES:
        times = "" if factor == 1 else f"{factor:g} x "
        rules.setdefault(f"{section}.{key}", []).append(f">= {times}{other}")
        rules.setdefault(f"{section}.{other}", []).append(f"<= {key}" + ("" if factor == 1 else f" / {factor:g}"))
    out = [DEFAULT_TOML_HEADER]
    for section, cls in SECTIONS.items():
        out.append(f"\n[{section}]\n")
        for fld in dataclasses.fields(cls):
            default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()  # type: ignore[operator]
            limits = ([f"at most {_fmt(fld.metadata['max'])}"] if fld.metadata.get("max") is not None else []) \
                + rules.get(f"{section}.{fld.name}", [])
            out.append(f"# {fld.metadata.get('help', '')}" + (f" [{', '.join(limits)}]" if limits else "") + "\n")
            out.append(f"{fld.name} = {_toml_value(default)}\n")
    return "".join(out)


def field_help() -> dict[str, str]:
    return {f"{s}.{f.name}": f.metadata.get("help", "") for s, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)}
