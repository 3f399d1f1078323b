"""Collectives the integrations use before `attach` (torch.distributed's default group, which the
framework has initialised), and the step of ckptsup's own newest checkpoint, weighed against a
framework's own (lightning_ckpt.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("ckptsup.integrations")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def broadcast(decide: Callable[[], Any]) -> Any:
    """Rank 0 decides (`decide` is called there only); every rank gets its answer."""
    import torch.distributed as dist

    if not _distributed():
        return decide()
    box: list[Any] = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ckptsup_newest_step(settings: Any, env: Any) -> int:
    """Collective. The step ckptsup's own resume would reach at most: its newest committed disk
    checkpoint (CKPTSUP_RESUME_FROM first) or the newest memory copy every rank holds; 0: none.
    Only rank 0's answer counts (it alone lists the disk)."""
    from ..checkpoint.commit import parse_step
    from ..checkpoint.trust import CheckpointDirUntrusted
    from ..hooks.memory_tier import newest_common
    from .hf_state import candidates, held_steps, memory_client

    common = newest_common(all_gather(held_steps(memory_client(settings, env, rank()))))
    newest = common[0] if common else 0
    if rank() == 0:
        try:
            paths = candidates(settings.checkpoint_dir, env.resume_from)
        except CheckpointDirUntrusted as err:
            log.warning("ckptsup: %s", err)
            paths = []
        steps = [parse_step(Path(p).name) for p in paths]
        newest = max([newest] + [s for s in steps if s is not None])
    return newest
