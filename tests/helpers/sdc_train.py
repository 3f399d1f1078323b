"""A tiny DDP job with ckptsup.attach for the SDC tests (tests/test_sdc_real.py): `--flip STEP:RANK`
(repeatable) flips one bit of one weight on that rank right after that step's optimizer step,
the first time only (a marker file in --out), like a memory error would; the loss stays finite.
`--per-rank-model`: no DDP, each rank its own differently seeded plain module (as a pipeline stage
holds other bytes than its peers): nothing to compare. At the end each rank writes its parameters to --out/final_rank<r>.pt."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptsup
from ckptsup.hooks.fingerprint import flip_bit
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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every-steps", type=int, default=10)
    p.add_argument("--flip", action="append", default=[])
    p.add_argument("--crash", action="append", default=[], help="STEP:RANK raises after that step, once")
    p.add_argument("--per-rank-model", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    flips = [tuple(int(x) for x in f.split(":")) for f in args.flip]
    crashes = [tuple(int(x) for x in f.split(":")) for f in args.crash]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckptsup.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(rank if args.per_rank_model else 0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = net if args.per_rank_model else nn.parallel.DistributedDataParallel(net)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(240, 8, generator=gen)
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
            flip_bit(net, param=0, index=3, bit=12)   # a low mantissa bit: the loss stays finite
            print(f"rank {rank}: flipped a bit after step {step}", flush=True)
        if fires(out, step, rank, crashes):
            raise RuntimeError(f"injected crash after step {step} on rank {rank}")
        run.step_done(step, loss=loss.detach())
        step += 1
    checks = run.replicas.checks if run.replicas is not None else 0
    run.close()
    torch.save({"params": {k: v.detach().clone() for k, v in net.state_dict().items()}, "checks": checks},
               out / f"final_rank{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
