"""Level 3 for an external step folder: a test load in its own process, on global rank 0's node
(started by supervisor/node/external_testload.py: the agent never imports torch).

    python -m ckptsup.hooks.external_testload FOLDER MANIFEST

First what levels 1-2 check, from ckptsup's manifest of the folder (checkpoint/external.py): the
names and sizes, then every file's hash, `.metadata` included, so nothing is unpickled before its
bytes are the ones hashed after the save. Then DCP's own reader loads every entry the metadata
describes into CPU tensors allocated from it (non-tensor entries with weights_only=True), in one
process (no_dist). Prints one line; exit 0 = ok, 1 = failed."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ..checkpoint import external as ext
from ..checkpoint.manifest import Manifest
from ..errors import CkptsupError
from ..safe_io import read_regular

def verify(folder: Path, manifest: Manifest) -> list[str]:
    problems = ext.check_against(folder, manifest)
    if problems:
        return problems
    hashed, problems = ext.hash_files(folder, [f.path for f in manifest.files], manifest.hash_algorithm)
    return problems + ext.compare_hashes(folder.name, manifest, hashed)


def load_everything(folder: Path) -> str:
    import torch.distributed.checkpoint as dcp

    from .reader import load_metadata_bytes
    from .testload import load_all_entries

    start = time.monotonic()
    # DCP's own read_metadata is a raw pickle.load: the allow-list unpickler reads the same
    # (already hash-checked) bytes instead
    metadata = load_metadata_bytes(read_regular(folder / ".metadata", max_bytes=1 << 30, what="DCP .metadata",
                                                error=ext.ExternalError, follow_symlinks=False))

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    reader = Reader(str(folder))
    state = load_all_entries(reader, metadata)
    return f"ok: {folder.name}: {len(state)} entries loaded in {time.monotonic() - start:.2f} s"


def test_load(folder: Path, manifest_file: Path) -> tuple[bool, str]:
    try:
        data = read_regular(manifest_file, max_bytes=ext.MAX_MANIFEST_BYTES, what="external manifest",
                            error=ext.ExternalError, follow_symlinks=False)
        manifest = Manifest.from_json(data, source=str(manifest_file))
    except (CkptsupError, FileNotFoundError) as err:
        return False, f"no usable manifest: {err}"
    problems = verify(folder, manifest)
    if problems:
        return False, problems[0]
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return True, load_everything(folder)
    except (Exception, CheckpointException) as err:   # DCP's own is a BaseException; pickle, shape errors: all a failed load
        lines = [line for line in str(err).splitlines() if line.strip()]
        return False, f"test load failed: {type(err).__name__}: {(lines[-1] if lines else '')[:300]}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ckptsup.hooks.external_testload FOLDER MANIFEST", file=sys.stderr)
        return 2
    ok, line = test_load(Path(argv[0]), Path(argv[1]))
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
