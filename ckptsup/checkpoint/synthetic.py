"""Synthetic checkpoints written by plain Python through the real commit path: DCP-shaped
(per-rank `__<r>_0.distcp` shard files holding items back to back, a `.metadata` blob, an item
index in the manifest). Used by tests, benchmarks and `make demo`; nothing here is a fake of the
commit protocol itself.
"""

from __future__ import annotations

import os
import random
from datetime import datetime
from pathlib import Path

from .commit import commit, describe_files, make_tmp_dir
from .hashing import hash_bytes, hash_file
from .manifest import METADATA_NAME, ItemEntry, Manifest


def write_synthetic(checkpoint_dir: str | os.PathLike[str], *, step: int, ranks: int = 2, items_per_rank: int = 4,
                    item_bytes: int = 4096, algorithm: str = "xxh3-128", epoch: int = 0, attempt: int = 0,
                    job_id: str = "synthetic", created_at: datetime | None = None, seed: int | None = None,
                    run_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write and commit one checkpoint; returns its step dir."""
    rng = random.Random(step if seed is None else seed)
    tmp = make_tmp_dir(checkpoint_dir, step=step, attempt=attempt)
    items: list[ItemEntry] = []
    for rank in range(ranks):
        name = f"__{rank}_0.distcp"
        offset = 0
        fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for i in range(items_per_rank):
                data = rng.randbytes(item_bytes)
                os.write(fd, data)
                items.append(ItemEntry(key=f"model.layer{i}.weight@rank{rank}", file=name, offset=offset,
                                       length=len(data), hash=hash_bytes(data, algorithm)))
                offset += len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
    meta = tmp / METADATA_NAME
    fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"synthetic-dcp-metadata:" + str(step).encode())
    finally:
        os.close(fd)
    manifest = Manifest(step=step, job_id=job_id, attempt=attempt, epoch=epoch, world_size=ranks,
                        files=describe_files(tmp, algorithm), items=items, metadata_hash=hash_file(meta, algorithm),
                        hash_algorithm=algorithm, versions={"ckptsup": "synthetic"})
    if created_at is not None:
        manifest.created_at = created_at.isoformat()
    return commit(tmp, manifest, checkpoint_dir=checkpoint_dir, run_dir=run_dir)
