"""DCP's FileSystemWriter, made to hand back the storage layout on every torch we run on.

ckptsup hashes each saved item from `Metadata.storage_data` (file, offset, length), read from
the metadata `dcp.save` returns. torch 2.13's `FileSystemWriter.finish` fills that field on the
caller's object; torch 2.11's (the GPU machines' torch) fills it on a `dataclasses.replace`
copy, so the returned metadata had `storage_data = None` and every save failed there. This
writer's `finish` fills the caller's object itself, from the same write results; on a
multi-rank save that object is what the coordinator broadcasts to every rank.
"""
from __future__ import annotations

from typing import Any


def filesystem_writer(path: Any, *, sync_files: bool, thread_count: int, overwrite: bool) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    class LayoutKeepingWriter(FileSystemWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            super().finish(metadata, results)
            if getattr(metadata, "storage_data", None) is None:
                metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}

    return LayoutKeepingWriter(path, sync_files=sync_files, thread_count=thread_count, overwrite=overwrite)
