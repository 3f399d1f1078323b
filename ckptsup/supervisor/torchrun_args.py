"""torchrun's command line under `ckptsup launch` (pure): what ckptsup accepts as torchrun does,
what it resolves itself, and what it refuses, each refusal one line with the knob to use.

click tokenizes (supervisor/cli.py declares the accepted options, torchrun's spellings as
aliases); an option click does not know lands where SCRIPT should be, and `refusal` names it:

- accepted: `-m/--module`, `--no-python`, `--nproc-per-node/--nproc_per_node N|gpu|auto`,
  `--nnodes N` (= `--nodes`), `--max-restarts` (ckptsup's restart budget), `--tee` (ours: every
  rank's output on the console; it takes no value);
- resolved here, not by torchrun: `gpu` is the allocation's GPUs per node (torchrun's raises on a
  CPU node), `auto` the same or 1 without GPUs (torchrun's means the host's cores);
- accepted and ignored, in one info line: the rendezvous group (ckptsup picks it: `[supervisor]
  rdzv_backend`, `rdzv_port`);
- refused: an elastic `--nnodes MIN:MAX`, and the flags whose job ckptsup does (restarts, monitoring, logs,
  signals, shutdown).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import AUTO, GPU
from ..env import ExitStatus
from ..errors import CkptsupError


class UsageError(CkptsupError):
    exit_code = int(ExitStatus.USAGE)


_RDZV = "ckptsup picks the rendezvous of every attempt on its first active node"
_LOGS = "ckptsup writes every rank's output to <run_dir>/attempt-<N>/ranks-<node>.log; --tee shows it on the console"

# torchrun option (every spelling) -> why ckptsup refuses it, and what to do instead
REFUSED: dict[str, str] = {
    **dict.fromkeys(("--monitor-interval", "--monitor_interval"),
                    "ckptsup watches the ranks itself ([supervisor] heartbeat_interval_s); drop the flag"),
    **dict.fromkeys(("--start-method", "--start_method"), "ckptsup's agent starts the ranks; drop the flag"),
    **dict.fromkeys(("--event-log-handler", "--event_log_handler"),
                    "ckptsup records events in <run_dir>/events.jsonl; drop the flag"),
    "--role": "ckptsup runs one role of workers; drop the flag",
    **dict.fromkeys(("--run-path", "--run_path"), "every rank runs in its own process under ckptsup; drop the flag"),
    **dict.fromkeys(("--log-dir", "--log_dir", "-r", "--redirects", "--local-ranks-filter", "--local_ranks_filter",
                     "--duplicate-stdout-filters", "--duplicate_stdout_filters", "--duplicate-stderr-filters",
                     "--duplicate_stderr_filters", "--logs-specs", "--logs_specs"), f"{_LOGS}; drop the flag"),
    "-t": f"{_LOGS}; use --tee (it takes no value)",
    **dict.fromkeys(("--signals-to-handle", "--signals_to_handle"),
                    "ckptsup handles the signals (preemption, time limit) and stops the ranks itself; drop the flag"),
    **dict.fromkeys(("--shutdown-timeout", "--shutdown_timeout"),
                    "ckptsup derives it from [supervisor] kill_grace_s and the partition's GraceTime; drop the flag"),
    **dict.fromkeys(("--numa-binding", "--numa_binding"),
                    "not passed on under ckptsup; bind CPUs with Slurm (--cpu-bind) and drop the flag"),
    **dict.fromkeys(("--virtual-local-rank", "--virtual_local_rank"),
                    "not supported under ckptsup (LOCAL_RANK is the rank's index on its node); drop the flag"),
}

_TEE_VALUE = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")   # torchrun's --tee 3 / --tee 0:3,1:0
_DOTTED = re.compile(r"^[^\W\d]\w*(\.[^\W\d]\w*)*$")


RENDEZVOUS = ("standalone", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr", "master_port",
              "node_rank", "local_addr")


def rendezvous_ignored(given: dict[str, str | bool | None]) -> str:
    """torchrun's rendezvous group (--standalone, --rdzv-*, --master-*, --node-rank, --local-addr):
    accepted and ignored, said in one info line ("" when none was given)."""
    shown = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {str(v)[:40]}")
             for k in RENDEZVOUS if (v := given.get(k)) not in (None, False)]
    if not shown:
        return ""
    return (f"ckptsup picks the rendezvous ([supervisor] rdzv_backend, rdzv_port); {', '.join(shown)} ignored")


def refusal(option: str) -> UsageError:
    """The one-line error for an option before SCRIPT that `ckptsup launch` does not accept."""
    name = option.split("=", 1)[0]
    reason = REFUSED.get(name)
    if reason is not None:
        return UsageError(f"{name}: {reason}")
    return UsageError(f"unknown option {name[:60]} before SCRIPT; `ckptsup launch --help` lists the options "
                      "(your script's own arguments go after SCRIPT)")


def nproc_choice(raw: str | None, *, flag: str = "--nproc-per-node") -> int | str | None:
    """`--nproc-per-node`: a number (its bounds are the config's), gpu or auto; None when unset."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in (GPU, AUTO):
        return value
    if re.fullmatch(r"[+-]?\d{1,9}", value):
        return int(value)
    if value in ("cpu", "xpu"):
        raise UsageError(f"{flag} {raw}: ckptsup sets ranks per node from the allocation; "
                         f"pass a number, {GPU} (its GPUs per node) or {AUTO} (its GPUs, else 1)")
    raise UsageError(f"{flag} {raw[:40]!r} must be a number, {GPU} or {AUTO}")


def node_count(raw: str | None, *, flag: str = "--nnodes") -> int | None:
    """`--nodes` / `--nnodes`: a number of active nodes; torchrun's elastic MIN:MAX is refused
    (N:N is N)."""
    if raw is None:
        return None
    low, sep, high = raw.strip().partition(":")
    if not re.fullmatch(r"\d{1,9}", low) or (sep and not re.fullmatch(r"\d{1,9}", high)):
        raise UsageError(f"{flag} {raw[:40]!r} must be a number of nodes")
    if sep and int(low) != int(high):
        raise UsageError(f"{flag} {raw}: ckptsup fixes the node count (no elastic MIN:MAX range; hot spares "
                         "replace failed nodes); use --nodes N")
    return int(low)


def check_tee(tee: bool, script: str) -> None:
    """torchrun's `--tee 3` would leave its value where SCRIPT goes: say so instead of looking
    for a script called 3."""
    if tee and _TEE_VALUE.match(script) and not os.path.exists(script):
        raise UsageError(f"--tee takes no value under ckptsup (it shows every rank's output on the console); "
                         f"drop the {script}")


def resolve_nproc(choice: int | str, gpus_per_node: int, *, in_slurm: bool) -> tuple[int, str]:
    """Ranks per node for a choice, with where it came from ("" when it was a number)."""
    if isinstance(choice, int):
        return choice, ""
    if gpus_per_node > 0:
        return gpus_per_node, f"{gpus_per_node} GPU(s) per node"
    if choice == AUTO:
        return 1, "no GPU in the allocation: 1"
    if in_slurm:
        fix = "submit with --gpus-per-node N (sbatch, ckptsup sbatch) or pass --nproc-per-node N"
        where = "the allocation has no GPUs (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS and scontrol name none)"
    else:
        fix = "set CUDA_VISIBLE_DEVICES (e.g. 0,1) or pass --nproc-per-node N"
        where = "this machine names no GPU (CUDA_VISIBLE_DEVICES is unset, empty or -1)"
    raise UsageError(f"--nproc-per-node {GPU}: {where}; {fix}")


@dataclass(frozen=True, kw_only=True)
class Target:
    """What torchrun runs on every node: a script file, a module (`-m`) or an executable
    (`--no-python`)."""

    script: str           # an absolute path for files, the module name for -m
    module: bool = False
    no_python: bool = False


def check_target(script: str, *, module: bool, no_python: bool, cwd: str | os.PathLike[str],
                 which: Callable[[str], str | None] = shutil.which) -> Target:
    """Check SCRIPT as torchrun will run it; an option in its place is refused by name."""
    if script.startswith("-") and len(script) > 1:
        raise refusal(script)
    if module and no_python:
        raise UsageError("-m and --no-python exclude each other (a module needs python); pass one of them")
    if module:
        if script.endswith(".py"):   # a dotted name, but python -m would look for a module `py`
            raise UsageError(f"-m {script[:60]} names a file; pass its module name ({script[:-3][:60]}), "
                             "or drop -m to run the file")
        if not _DOTTED.match(script):
            raise UsageError(f"-m {script[:60]!r} is not a module name; pass dotted Python names, e.g. -m pkg.train")
        return Target(script=script, module=True)
    path = Path(cwd, script)
    if no_python:
        if "/" not in script:
            found = which(script)
            if found is None:
                raise UsageError(f"--no-python: {script} is not on PATH; pass the path of the executable")
            return Target(script=str(Path(found).resolve()), no_python=True)
        if not path.is_file():
            raise UsageError(f"--no-python: {script} does not exist; pass the path of the executable")
        if not os.access(path, os.X_OK):
            raise UsageError(f"--no-python: {script} is not executable; chmod +x it, or drop --no-python")
        return Target(script=str(path.resolve()), no_python=True)
    if path.is_dir():
        raise UsageError(f"script {script} is a directory; pass the path of your training script (or -m MODULE)")
    if not path.is_file():
        raise UsageError(f"script {script} does not exist; pass the path of your training script (or -m MODULE)")
    return Target(script=str(path.resolve()))
