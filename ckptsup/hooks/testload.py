"""Level-3 validation: a test load of a whole checkpoint into fresh CPU state, in its own process.

    python -m ckptsup.hooks.testload STEP_DIR

Runs the same pre-load checks as resume (nothing unpickled before the manifest vouches for it),
allocates a CPU buffer for every entry DCP's metadata describes, loads everything through the
verifying reader (each item hashed as read) and decodes ckptsup's JSON entries. Prints one line;
exit 0 = ok, 1 = failed.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any


def load_all_entries(reader: Any, metadata: Any) -> dict[str, Any]:
    """Every entry `metadata` describes, loaded through `reader` into fresh CPU tensors (non-tensor
    entries with weights_only=True, through the safe planner), in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .reader import safe_load_planner

    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            state[key] = None  # a non-tensor value: replaced by the load
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    return state


def test_load(step_dir: Path) -> str:
    from . import jsontensor
    from .reader import VerifyingReader
    from .state import PREFIX

    start = time.monotonic()
    reader = VerifyingReader(step_dir, adopt=True)
    metadata = reader.read_metadata()
    state = load_all_entries(reader, metadata)
    for key, value in state.items():
        if key.startswith(PREFIX) and not key.endswith("torch_rng"):
            jsontensor.from_tensor(value)
    return (f"ok: {step_dir.name}: {len(state)} entries, {reader.bytes_read} bytes verified and loaded "
            f"in {time.monotonic() - start:.2f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ckptsup.hooks.testload STEP_DIR", file=sys.stderr)
        return 2
    step_dir = Path(argv[0])
    from .dcp_errors import failure_errors, one_line

    try:
        print(test_load(step_dir))
        return 0
    except failure_errors() + (TypeError,) as err:
        message = one_line(err)
    print(f"test load of {step_dir} FAILED: {message[:400]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
