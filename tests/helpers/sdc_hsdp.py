"""HSDP with FSDP2 (fully_shard on a 2-D (replicate, shard) mesh), or with `--fsdp1` FSDP1's
HYBRID_SHARD on the same mesh, and ckptsup.attach, for tests/test_sdc_hsdp.py. `--mesh R,S`: R
replicas of S shards (world = R x S, gloo on CPU).
`--flip STEP:RANK` (repeatable) flips one bit of that rank's local shard of the first weight right
after that step's optimizer step, the first time only (a marker file in --out)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptsup
from ckptsup.hooks.sampler import ResumableDistributedSampler


def fires(out: Path, step: int, rank: int, flips: list[tuple[int, int]]) -> bool:
    if (step, rank) not in flips:
        return False
    try:
        os.close(os.open(out / f".flip-{step}-rank{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="2,2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every-steps", type=int, default=5)
    p.add_argument("--flip", action="append", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 HYBRID_SHARD instead of FSDP2")
    args = p.parse_args()
    replicas, shards = (int(x) for x in args.mesh.split(","))
    flips = [tuple(int(x) for x in f.split(":")) for f in args.flip]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckptsup.init_process_group(backend="gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.fsdp1:   # one flat parameter per rank: its shard of the whole model
        model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
                                         device_id=torch.device("cpu"))
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(480, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = StatefulDataLoader(data, batch_size=4, sampler=ResumableDistributedSampler(data, seed=0), drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ckptsup.attach(model=model, optimizer=opt, dataloader=loader, save_every_steps=args.save_every_steps)
    step = run.resume()
    batches = iter(loader)
    while step < args.steps:
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if fires(out, step, rank, flips):
            with torch.no_grad():   # one low mantissa bit of this rank's shard: the loss stays finite
                local = (FullyShardedDataParallel.fsdp_modules(model)[0]._handle.flat_param if args.fsdp1
                         else model[0].weight.to_local())
                local.view(-1).view(torch.int32)[3] ^= 1 << 12
            print(f"rank {rank}: flipped a bit after step {step}", flush=True)
        run.step_done(step, loss=loss.detach())
        step += 1
    run.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
