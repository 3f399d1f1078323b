"""Where a rank is, on request: every thread's Python stack, dumped by `faulthandler` when the
node agent sends STACK_SIGNAL (docs/timeouts.md §Evidence).

Rank side, no torch. faulthandler's handler is C: it writes the frames even while the main thread
is blocked inside C (a gloo or NCCL wait, time.sleep), which no Python signal handler could. It is
installed in every warm interpreter before the rank's script runs, and by the hooks in ranks that
started cold; the agent signals only processes whose SigCgt shows the handler (an unhandled
real-time signal would kill the rank). The dump appends to `<run_dir>/attempt-<N>/stacks/rank<R>.txt`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path
from typing import IO, Mapping

from .env import ATTEMPT, RUN_DIR

STACK_SIGNAL = int(signal.SIGRTMIN) + 6   # a real-time signal nobody else claims (Slurm uses USR1/TERM)
STACKS_DIR = "stacks"

_file: IO[str] | None = None   # kept open: faulthandler writes to its file descriptor


def stack_file(run_dir: str | Path, attempt: int, rank: int) -> Path:
    return Path(run_dir) / f"attempt-{attempt}" / STACKS_DIR / f"rank{rank}.txt"


def install(environ: Mapping[str, str] | None = None) -> Path | None:
    """Register the dump for this rank (idempotent); None when the environment names no run
    (a script outside ckptsup) or the file cannot be opened (never fatal to the rank)."""
    global _file
    env = os.environ if environ is None else environ
    run_dir, attempt, rank = env.get(RUN_DIR), env.get(ATTEMPT), env.get("RANK")
    if not run_dir or attempt is None or rank is None:
        return None
    try:
        path = stack_file(run_dir, int(attempt), int(rank))
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "a")
        faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return None
    if _file is not None and _file is not handle:
        _file.close()
    _file = handle
    return path
