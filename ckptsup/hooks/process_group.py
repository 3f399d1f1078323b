"""init_process_group with the supervisor's collective timeout (docs/training.md §Process group;
docs/timeouts.md §3).

No environment variable sets init_process_group's timeout, so the supervisor passes
CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S (init and the first step: rendezvous, compilation, a checkpoint
load) and CKPTSUP_COLLECTIVE_TIMEOUT_S (steady state, derived from measured step and save times and
kept below the supervisor's own hang timeout). The session moves the default group to the steady
value after the first step, as torchtitan does (300 s -> 100 s). Scripts that initialise the
process group themselves keep working; they only miss the timeouts.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

from ..env import RankEnv

log = logging.getLogger("ckptsup.hooks")


def _timedelta(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=float(seconds))


def init_process_group(backend: str | None = None, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """torch.distributed.init_process_group(backend, timeout=<init timeout>, **kwargs).

    backend defaults to nccl when CUDA is available, else gloo. Returns the default group."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    env = RankEnv.from_environ()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = _timedelta(timeout_s if timeout_s is not None else env.collective_timeout_init_s)
    if timeout is not None and "timeout" not in kwargs:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend=backend, **kwargs)
    return dist.group.WORLD


def set_steady_timeout(seconds: float | None = None, group: Any = None) -> bool:
    """Move `group` (default: the default group) to the steady-state timeout. False when there is
    no value or this torch cannot change a live group's timeout."""
    if "torch.distributed" not in sys.modules:
        return False  # no group to move, and heartbeat() must not import torch for a script that never did
    import torch.distributed as dist

    if seconds is None:
        seconds = RankEnv.from_environ().collective_timeout_s
    if seconds is None or not (dist.is_available() and dist.is_initialized()):
        return False
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.info("ckptsup: this torch cannot change a process group's timeout; keeping the init timeout")
        return False
    setter(datetime.timedelta(seconds=float(seconds)), group)
    return True


def new_gloo_group(timeout_s: float) -> Any:
    """A gloo group over all ranks (collective: every rank calls it, in the same order)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
