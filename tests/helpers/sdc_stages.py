"""A mixed layout for tests/test_sdc_hsdp.py: two "pipeline stages" on 3 gloo ranks — ranks 0 and 2
train stage A under DDP over their own subgroup (replicas of each other), rank 1 trains stage B,
a plain module of other bytes (no replica) — every rank under ckptsup.attach. The replica check is
a collective: rank 1 must take part (with nothing to compare) or ranks 0 and 2 would wait for it.
`--flip STEP:RANK` (repeatable) flips one bit of that rank's first weight after that step, the first time only."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ckptsup
from sdc_hsdp import fires   # this folder is the script's: sys.path[0]


class StageB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)   # FQNs other than stage A's: one checkpoint holds both stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every-steps", type=int, default=5)
    p.add_argument("--flip", action="append", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckptsup.init_process_group(backend="gloo")
    rank = dist.get_rank()
    stage_a = dist.new_group([0, 2])   # every rank calls new_group
    torch.manual_seed(0 if rank in (0, 2) else 1)
    if rank in (0, 2):
        model: nn.Module = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
                                                               process_group=stage_a)
    else:
        model = StageB()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    run = ckptsup.attach(model=model, optimizer=opt, save_every_steps=args.save_every_steps)
    step = run.resume()
    flips = [tuple(int(x) for x in f.split(":")) for f in args.flip]
    while step < args.steps:
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(4, 8, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fires(out, step, rank, flips):
            with torch.no_grad():
                next(model.parameters()).view(-1).view(torch.int32)[3] ^= 1 << 12
        run.step_done(step, loss=loss.detach())
        step += 1
    run.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
