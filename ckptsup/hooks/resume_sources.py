"""Where a resume's checkpoints come from (docs/training.md §Resuming): the shared tier's committed
step dirs, newest first, and — with `[storage] object_store` set — the object store's copies, so
a checkpoint whose shared copy is gone or turned out corrupt is fetched back and validated instead
of falling back to an older one. Rank 0 lists and fetches (the shared tier is one file system);
every rank then loads the fetched copy through the verifying reader like any other.

The object store is listed once per resume (one LIST call); an unreachable store is a warning and
the shared tier alone, never a failed resume.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Any, NamedTuple

from ..checkpoint.catalog import Status, list_checkpoints
from ..checkpoint.commit import step_dir_name
from ..errors import CheckpointError

log = logging.getLogger("ckptsup.hooks")


class Source(enum.StrEnum):
    """A resume candidate's origin; the names are the `files_by_source` keys of checkpoint_loaded."""

    SHARED = "shared"
    OBJECT = "object"


# every key of checkpoint_loaded's files_by_source, in restore order (memory tiers: issue 14)
FILES_BY_SOURCE_KEYS = ("memory", "peer_memory", "node_local", "shared", "object")


class Candidate(NamedTuple):
    path: str          # the shared step dir to load (an object copy is fetched to exactly here)
    source: Source
    step: int | None   # None only for CKPTSUP_RESUME_FROM, whatever its name


def object_tier(config: Any, *, checkpoint_dir: str | Path, node: str, job_id: str) -> Any:
    """The configured object tier, or None (no config, no object_store)."""
    if config is None or not config.storage.object_store:
        return None
    from ..checkpoint.tiers import TierKind, tiers_from_config

    tiers = tiers_from_config(config.storage, shared_dir=checkpoint_dir, node=node, job_id=job_id)
    return next((t for t in tiers if t.kind is TierKind.OBJECT), None)


def candidates(checkpoint_dir: str | Path, *, resume_from: str = "", tier: Any = None) -> list[Candidate]:
    """Newest first; for a step held by both, the shared copy first and the object copy as its
    fallback. CKPTSUP_RESUME_FROM (the supervisor's validated pick) leads."""
    found: list[Candidate] = []
    if resume_from:
        found.append(Candidate(resume_from, Source.SHARED, None))
    shared = {i.step: str(i.path) for i in list_checkpoints(checkpoint_dir)
              if i.status in (Status.COMMITTED, Status.VALIDATED)}
    remote = set(_object_steps(tier))
    for step in sorted(set(shared) | remote, reverse=True):
        if step in shared and shared[step] != resume_from:
            found.append(Candidate(shared[step], Source.SHARED, step))
        if step in remote:
            found.append(Candidate(str(Path(checkpoint_dir) / step_dir_name(step)), Source.OBJECT, step))
    return found


def _object_steps(tier: Any) -> list[int]:
    if tier is None:
        return []
    try:
        return tier.list_steps()
    except (CheckpointError, OSError) as err:
        log.warning("ckptsup: the object store cannot be listed (%s); resuming from the shared tier only", err)
        return []


def fetch(tier: Any, candidate: Candidate, checkpoint_dir: str | Path) -> str | None:
    """Bring an object copy back to the shared tier (verified as it downloads, committed under the
    commit protocol). None when it is in place, else why not (one line)."""
    assert candidate.step is not None
    if Path(candidate.path).exists():
        return f"{candidate.path} exists (untrusted or not yet quarantined); not replacing it with the object copy"
    try:
        tier.fetch(candidate.step, Path(checkpoint_dir))
    except (CheckpointError, OSError) as err:
        return f"object copy of step {candidate.step} cannot be fetched: {err}"
    log.warning("ckptsup: fetched step %d back from the object store to %s", candidate.step, candidate.path)
    return None


def files_by_source(counts: dict[str, int], source: Source) -> dict[str, int]:
    """checkpoint_loaded's files_by_source from the verifying reader's counts (summed over ranks):
    an object copy was fetched to the shared tier and read there, so its files count as object."""
    out = dict.fromkeys(FILES_BY_SOURCE_KEYS, 0)
    out["node_local"] = counts.get("read_local_files", 0)
    out["object" if source is Source.OBJECT else "shared"] = counts.get("read_shared_files", 0)
    return out
