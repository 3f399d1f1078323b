"""Real DCP checkpoints for the `.metadata` allow-list tests (tests/test_hooks_metadata.py).

`python tests/dcp_helpers.py OUT` (a child process: it needs a process group for the DTensor)
writes the state of `build_state()` twice:
  OUT/plain/           DCP's FileSystemWriter, as DCP writes it (no manifest)
  OUT/ck/step_7/       the same state through ckptsup's commit path (manifest with the item index)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any


def build_state(seed: int = 0, *, dtensor_mesh: Any = None) -> dict[str, Any]:
    """A model + optimizer (after a step, so it has state), a scheduler, and a torchtitan-like
    state: nested dicts of tensors and plain values, several dtypes and a channels-last tensor.
    With a mesh, "dtensor" is a DTensor sharded over it; without, the same values as a tensor."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    model_sd, optim_sd = get_state_dict(model, opt)
    full = torch.randn(4, 6)
    if dtensor_mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        sharded: Any = distribute_tensor(full, dtensor_mesh, [Shard(0)])
    else:
        sharded = full
    return {
        "model": model_sd,
        "optimizer": optim_sd,
        "lr_scheduler": sched.state_dict(),
        "train_state": {"step": 7, "ntokens_seen": 123456, "log_steps": [1, 2, 3], "elapsed_s": 1.5, "tag": "run-a",
                        "nothing": None, "nested": {"a": {"b": {"c": torch.arange(5)}}, "pair": [1, 2]}},
        "dataloader": {"rank_0": {"epoch": 1, "sample": 40}},
        "dtensor": sharded,
        "bf16": torch.randn(3).to(torch.bfloat16),
        "channels_last": torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last),
        "int8": torch.arange(5, dtype=torch.int8),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0),
    }


def write_both(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    from ckptsup.checkpoint.commit import commit, describe_files_and_items, make_tmp_dir
    from ckptsup.checkpoint.hashing import hash_file
    from ckptsup.checkpoint.manifest import METADATA_NAME, Manifest
    from ckptsup.hooks.writer import item_key

    dist.init_process_group("gloo", init_method=f"file://{out}/pg-store", rank=0, world_size=1)
    try:
        state = build_state(dtensor_mesh=init_device_mesh("cpu", (1,)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=FileSystemWriter(out / "plain"))
            tmp = make_tmp_dir(out / "ck", step=7, attempt=0)
            metadata = dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=False))
    finally:
        dist.destroy_process_group()
    chunks: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(info.relative_path, []).append((item_key(index), int(info.offset), int(info.length)))
    for path in tmp.iterdir():
        path.chmod(0o600)   # DCP creates its files with the umask's mode
    files, items = describe_files_and_items(tmp, "xxh3-128", chunks)
    manifest = Manifest(step=7, files=files, items=items, metadata_hash=hash_file(tmp / METADATA_NAME, "xxh3-128"))
    commit(tmp, manifest, checkpoint_dir=out / "ck")


if __name__ == "__main__":
    write_both(Path(sys.argv[1]))
