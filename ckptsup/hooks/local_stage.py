"""The save path's use of the node-local cache (checkpoint/local_cache.py): when to write there
first, and what to say when it cannot be used.

A cache must never cost training: an unusable node-local directory (missing and not creatable,
untrusted, read-only, too small for the next save) is one warning and saves straight to the
shared tier, as without a cache. A save whose local write or copy failed on this rank fails like
any failed save (on every rank; training goes on), and this rank then stops using the cache for
the rest of the run, so a dying local disk costs at most one checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..checkpoint.local_cache import LocalCacheUnusable, LocalCopy, NodeLocalCache, local_needed_bytes
from ..errors import CheckpointError

log = logging.getLogger("ckptsup.hooks")


class LocalStaging:
    def __init__(self, root: Path | None, *, rank: int, local_rank: int, keep_last: int) -> None:
        self.cache = NodeLocalCache(root, local_rank=local_rank, keep_last=keep_last) if root is not None else None
        self.rank = rank
        self.disabled = False
        self._warned = False

    def begin(self, *, step: int, attempt: int, state_bytes: int) -> Path | None:
        """A staging dir for this save, or None: write straight to the shared tier."""
        if self.cache is None or self.disabled:
            return None
        try:
            staging = self.cache.stage(step=step, attempt=attempt, need_bytes=local_needed_bytes(state_bytes))
        except LocalCacheUnusable as err:
            if not self._warned:  # one line, not one per save
                self._warned = True
                log.warning("ckptsup: rank %d: node-local checkpoint dir unusable (%s); saving straight to the shared "
                            "tier until it is usable again", self.rank, err)
            return None
        if self._warned:
            self._warned = False
            log.info("ckptsup: rank %d: node-local checkpoint dir %s is usable again", self.rank, self.cache.root)
        return staging

    def committed(self, staging: Path, marker: LocalCopy) -> None:
        """The save is committed on the shared tier: keep the local files as its cached copy."""
        assert self.cache is not None
        try:
            self.cache.publish(staging, marker)
        except (CheckpointError, OSError) as err:  # the checkpoint is safe on the shared tier
            log.warning("ckptsup: rank %d: could not keep the node-local copy of step %d: %s", self.rank, marker.step, err)
            self.cache.discard(staging)

    def failed(self, staging: Path, *, here: str | None) -> None:
        """The save failed; `here` is this rank's own local write/copy error, if that was the cause."""
        assert self.cache is not None
        self.cache.discard(staging)
        if here is not None and not self.disabled:
            self.disabled = True
            log.warning("ckptsup: rank %d: writing to the node-local dir %s failed (%s); saving straight to the shared "
                        "tier for the rest of this run", self.rank, self.cache.root, here)
