"""torchtitan's 3-D layout on 4 gloo ranks, for tests/test_sdc_hsdp.py: tensor parallel on a `tp`
mesh dimension, then FSDP2 (`fully_shard`) on the (replicate, shard) dimensions of the same mesh,
(2 replicas, 1 shard, 2 tp). Three AdamW steps, then each rank writes what ckptsup's replica check
sees — its Replication, its replica group and its fingerprint — to OUT/rank<R>.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ckptsup.hooks import fingerprint as fp


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(3):   # each replica its own data: the gradients are averaged across replicas
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + mesh["replicate"].get_local_rank()))
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    seen = {"replication": fp.replication(model).value, "group": list(fp.replica_group(model, rank)),
            "fingerprint": fp.fingerprint(fp.state_tensors(model, opt))}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
