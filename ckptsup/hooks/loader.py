"""Loading one checkpoint on every rank, all-or-nothing.

1. every rank runs the pre-load checks (manifest, sizes, structure, .metadata hash; nothing
   unpickled before they pass) and the ranks agree (a failure anywhere fails everywhere);
2. DCP loads into fresh buffers through the verifying reader (each item hashed as it is read;
   DCP propagates a failure on any rank to all ranks); files whose node-local copy belongs to
   this very checkpoint are read from there, falling back to the shared copy file by file;
3. only then does the state go into the live model, optimizer, scheduler, dataloader and RNG,
   so a corrupt checkpoint never leaves the model half-overwritten before the fallback.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from ..env import TEST_LOAD_DELAY_S
from ..checkpoint.trust import CheckpointDirUntrusted
from ..errors import CheckpointError, CkptsupError, ManifestError, TrustError, ValidationError
from ..events import Event
from .dcp_errors import failure_errors, one_line, root_cause

log = logging.getLogger("ckptsup.hooks")


def _fresh_copy(targets: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(targets)


def _classify(path: Path, err: BaseException) -> Exception:
    """Corruption (the checkpoint is bad: quarantine, fall back) vs. anything else (storage,
    trust, or a checkpoint that does not fit this model: the caller stops with the message)."""
    cause = root_cause(err)
    if isinstance(cause, (ValidationError, ManifestError)):
        return type(cause)(f"{path.name}: {one_line(err)}")
    if isinstance(cause, CkptsupError):
        return cause if isinstance(cause, Exception) else CheckpointError(one_line(err))
    return CheckpointError(f"{path.name} cannot be loaded into this model/optimizer: {one_line(err)}")


def is_corruption(error: BaseException | None) -> bool:
    return isinstance(error, (ValidationError, ManifestError))


def is_untrusted(error: BaseException | None) -> bool:
    """A checkpoint we must not read (another owner, writable by others): skipped, never
    quarantined — its content may be fine (as the supervisor's pick_resume)."""
    return isinstance(error, TrustError) and not isinstance(error, CheckpointDirUntrusted)


def _agree(run: Any, path: Path, error: Exception | None) -> Exception | None:
    """Every rank takes the same decision: 0 all fine, 1 corrupt somewhere (quarantine, fall
    back), 2 untrusted somewhere (skip, fall back), 3 any other failure somewhere (stop)."""
    code = 0 if error is None else 1 if is_corruption(error) else 2 if is_untrusted(error) else 3
    agreed = run.reduce_max([code])[0]
    if agreed == 0:
        return None
    if agreed == 3 and code != 3:
        return CheckpointError(f"{path.name}: another rank could not load it (see that rank's log)")
    if agreed == 2 and code != 2:
        return TrustError(f"{path.name}: another rank may not read it (see that rank's log)")
    if agreed == 1 and error is None:
        return ValidationError(f"{path.name}: another rank found it corrupt (see that rank's log)")
    return error


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """A load that succeeded: the step it resumes at and the files read from each tier."""
    step: int
    tiers: dict[str, int]


def load_checkpoint(run: Any, path: Path) -> Loaded | Exception:
    """Load `path` into run's state on every rank: what was loaded, or the error (the same
    decision on every rank)."""
    from ..checkpoint.local_cache import find_local_files
    from .reader import VerifyingReader

    def open_reader() -> Any:
        reader = VerifyingReader(path, adopt=True)
        reader.use_local(find_local_files(run.settings.node_local_dir, path, reader.manifest))
        return reader

    delay = float(os.environ.get(TEST_LOAD_DELAY_S, "0") or 0)
    error, reader, meta = _load_agreed(run, path, open_reader, process_group=run.control_pg, delay_s=delay)
    if error is not None:
        return error
    loaded = Loaded(step=int(meta.get("step", 0)), tiers=reader.tier_counts())
    if not meta.get("same_world", True) and run.rank == 0:
        run.reporter.emit(Event.ELASTIC_RESUME, step=loaded.step, saved_world_size=meta.get("saved_world_size"),
                          world_size=run.world_size, rng="re-derived from (step, rank)")
    log.info("ckptsup: rank %d resumed from %s (step %d, %d bytes verified; files read: %d node-local, %d shared, "
             "%d node-local copies fell back to shared)", run.rank, path, loaded.step, reader.bytes_read,
             loaded.tiers["read_local_files"], loaded.tiers["read_shared_files"], loaded.tiers["local_fallback_files"])
    return loaded


def load_memory(run: Any, step: int) -> Loaded | Exception:
    """Load this rank's memory bundle of `step` (from its agent) into run's state, on every rank
    at once and all or nothing, like load_checkpoint (each rank reads its own bundle: no
    process group in DCP's load). A rank whose agent's copy fails its hashes asks for a peer
    agent's copy of the same bundle, the other ranks keep theirs (one more all-or-nothing round):
    the next source for that rank alone, never a mix of versions."""
    from ..memory_wire import MemoryChannelError
    from .memory_tier import BundleReader

    received: list[Any] = []

    def open_reader(from_peers: bool) -> Any:
        if received and not from_peers:
            # a second round for another rank's refused copy: this rank's own passed, keep it (no second transfer)
            return BundleReader(received[0])
        bundle = run.memory.client.get(step, from_peers=from_peers)
        received[:] = [bundle]
        world = bundle.manifest.extra.get("world_size")
        if world != run.world_size or bundle.manifest.extra.get("rank") != run.rank:
            raise ValidationError(f"memory bundle of step {step} is rank {bundle.manifest.extra.get('rank')} of "
                                  f"{world}, this is rank {run.rank} of {run.world_size}")
        return BundleReader(bundle)

    where = Path(f"memory step_{step}")
    mine: list[Exception] = []
    error, reader, meta = _load_agreed(run, where, lambda: open_reader(False), process_group=None,
                                       open_errors=(MemoryChannelError, OSError), local=mine)
    refused = bool(mine) and is_corruption(mine[0])   # this rank's own copy, not another rank's
    if is_corruption(error) and run.reduce_max([int(refused)])[0]:
        if refused:
            log.warning("ckptsup: rank %d: its memory copy of step %d was refused (%s); asking a peer agent for its "
                        "copy", run.rank, step, mine[0])
        error, reader, meta = _load_agreed(run, where, lambda: open_reader(refused), process_group=None,
                                           open_errors=(MemoryChannelError, OSError))
    if error is not None:
        return error
    files, source = len(reader.read_memory), reader.bundle.source
    loaded = Loaded(step=int(meta.get("step", step)),
                    tiers={"memory_files": files if source == "memory" else 0,
                           "peer_memory_files": files if source == "peer_memory" else 0})
    log.info("ckptsup: rank %d resumed from %s (step %d, %d bytes verified)", run.rank,
             "its agent's memory" if source == "memory" else "a peer agent's memory", loaded.step,
             reader.bytes_read)
    return loaded


def _load_agreed(run: Any, where: Path, open_reader: Any, *, process_group: Any, delay_s: float = 0.0,
                 open_errors: tuple[type[BaseException], ...] = (),
                 local: list[Exception] | None = None) -> tuple[Exception | None, Any, Any]:
    """The all-or-nothing load both sources share: open the reader and size fresh buffers from
    its (checked) metadata, the ranks agree; DCP loads through the reader, the ranks agree; only
    then the live state. → (error, reader, the checkpoint's meta). `local` collects this rank's
    own failure, as against the agreed one (which may be another rank's)."""
    import torch.distributed.checkpoint as dcp

    from .reader import safe_load_planner

    error: Exception | None = None
    reader = None
    targets: dict[str, Any] = {}
    try:
        reader = open_reader()
        metadata = reader.read_metadata()
        targets = _fresh_copy(run.state.load_targets(metadata))
    except (*failure_errors(), *open_errors) as err:
        error = _classify(where, err)
    if error is not None and local is not None:
        local.append(error)
    error = _agree(run, where, error)
    if error is not None:
        return error, None, None
    if delay_s > 0:
        print(f"ckptsup-test: rank {run.rank} delaying the load of {where.name}", file=sys.stderr, flush=True)
        time.sleep(delay_s)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(targets, storage_reader=reader, planner=safe_load_planner(), process_group=process_group,
                     no_dist=process_group is None)
    except failure_errors() as err:
        error = _classify(where, err)  # DCP raised the same failure on every rank (with a process group)
    if error is not None and local is not None:
        local.append(error)
    error = _agree(run, where, error)
    if error is not None:
        return error, None, None
    return None, reader, run.state.apply(targets)
