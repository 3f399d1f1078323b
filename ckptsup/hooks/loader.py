"""Loading one checkpoint on every rank, all-or-nothing.

1. every rank runs the pre-load checks (manifest, sizes, structure, .metadata hash; nothing
   unpickled before they pass) and the ranks agree (a failure anywhere fails everywhere);
2. DCP loads into fresh buffers through the verifying reader (each item hashed as it is read;
   DCP propagates a failure on any rank to all ranks);
3. only then does the state go into the live model, optimizer, scheduler, dataloader and RNG,
   so a corrupt checkpoint never leaves the model half-overwritten before the fallback.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CkptsupError, ValidationError

log = logging.getLogger("ckptsup.hooks")

TEST_DELAY_ENV = "CKPTSUP_TEST_LOAD_DELAY_S"  # fault injection (kill during a load); tests only


def _fresh_copy(targets: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(targets)


def load_checkpoint(run: Any, path: Path) -> Exception | None:
    """Load `path` into run's state on every rank. None on success (run._loaded_step is set),
    else the error (the same decision on every rank)."""
    import torch.distributed.checkpoint as dcp

    from .reader import VerifyingReader, safe_load_planner

    error: Exception | None = None
    reader = None
    targets: dict[str, Any] = {}
    try:
        reader = VerifyingReader(path)
        metadata = reader.read_metadata()
        targets = _fresh_copy(run.state.load_targets(metadata))
    except CkptsupError as err:
        error = err
    except (OSError, ValueError, RuntimeError) as err:
        error = CheckpointError(f"{path.name}: {err}")
    if not run.all_ok(error is None):
        return error or CheckpointError(f"{path.name}: another rank could not read it")
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    if delay > 0:
        print(f"ckptsup-test: rank {run.rank} delaying the load of {path.name}", file=sys.stderr, flush=True)
        time.sleep(delay)
    try:
        dcp.load(targets, storage_reader=reader, planner=safe_load_planner(), process_group=run.control_pg,
                 no_dist=run.control_pg is None)
    except CkptsupError as err:
        error = err
    except (RuntimeError, OSError, ValueError, KeyError) as err:
        # DCP wraps every rank's failure in one CheckpointException (a RuntimeError)
        text = str(err)
        error = ValidationError(f"{path.name}: {text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__}")
        if "hash" in text and "!=" in text:
            error = ValidationError(f"{path.name}: an item's hash does not match the manifest (corrupt)")
    if not run.all_ok(error is None):
        return error or ValidationError(f"{path.name}: another rank failed to load it")
    meta = run.state.apply(targets)
    run._loaded_step = int(meta.get("step", 0))
    if not meta.get("same_world", True) and run.rank == 0:
        run.reporter.emit("elastic_resume", step=run._loaded_step, saved_world_size=meta.get("saved_world_size"),
                          world_size=run.world_size, rng="re-derived from (step, rank)")
    log.info("ckptsup: rank %d resumed from %s (step %d, %d bytes verified)", run.rank, path,
             run._loaded_step, reader.bytes_read if reader else 0)
    return None
