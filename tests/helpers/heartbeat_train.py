"""A plain DDP script (gloo) that keeps its own checkpoint, with torch.save, and tells ckptsup only
its steps: one ckptsup.heartbeat(step, loss) per step (docs/heartbeat.md). For
tests/test_heartbeat_torchrun.py.

usage: torchrun --nproc-per-node 2 heartbeat_train.py --steps N --out DIR [--step-sleep-s S]
                [--nan-at-step K --nan-rank R]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import ckptsup  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep-s", type=float, default=0.02)
    p.add_argument("--nan-at-step", type=int, default=-1)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        x = torch.randn(8, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()          # DDP's all-reduce: the ranks move in lockstep
        opt.step()
        if step == a.nan_at_step and rank == a.nan_rank:
            loss = torch.tensor(float("nan"))
        time.sleep(a.step_sleep_s)
        ckptsup.heartbeat(step, loss.detach())
    if rank == 0:
        torch.save(model.module.state_dict(), Path(a.out) / "own.pt")  # the script's own checkpoint
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
