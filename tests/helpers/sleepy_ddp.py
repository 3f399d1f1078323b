"""An unmodified DDP script (no supervisor import, rank 0 prints `step N`, its own torch.save
checkpoints) with faults of its own, once per run (a marker file in the checkpoint dir):

    --sleep-rank R --sleep-at N   rank R sleeps forever after step N (repeatable) (the others then block in
                                  the next all_reduce): a user-code hang.
    --quiet-s S --quiet-at N      every rank computes S seconds without printing after step N
                                  (an evaluation pass), once.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def newest(ckpt_dir):
    steps = [int(n[5:-3]) for n in os.listdir(ckpt_dir) if n.startswith("step_") and n.endswith(".pt")]
    return max(steps) if steps else None


def once(ckpt_dir, what):
    """True the first time `what` is asked for in this checkpoint dir (every rank sees the same)."""
    marker = os.path.join(ckpt_dir, f".done-{what}")
    if os.path.exists(marker):
        return False
    dist.barrier()
    if dist.get_rank() == 0:
        open(marker, "w").close()
    dist.barrier()
    return True


def compute(seconds):
    deadline = time.monotonic() + seconds
    a = torch.randn(64, 64)
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--sleep-rank", type=int, default=-1)
    ap.add_argument("--sleep-at", type=int, action="append", default=[])
    ap.add_argument("--all-print", action="store_true")   # every rank prints its step lines
    ap.add_argument("--quiet-s", type=float, default=0.0)
    ap.add_argument("--quiet-at", type=int, default=-1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    start = 0
    found = newest(args.ckpt_dir)
    if found is not None:
        state = torch.load(os.path.join(args.ckpt_dir, f"step_{found}.pt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        done = step + 1
        if rank == 0 or args.all_print:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
        if done % args.every == 0:
            if rank == 0:
                tmp = os.path.join(args.ckpt_dir, f".tmp_step_{done}.pt")
                torch.save({"step": done, "model": model.module.state_dict(), "opt": opt.state_dict()}, tmp)
                os.replace(tmp, os.path.join(args.ckpt_dir, f"step_{done}.pt"))
            dist.barrier()
        if done == args.quiet_at and once(args.ckpt_dir, "quiet"):
            compute(args.quiet_s)
            dist.barrier()
        if done in args.sleep_at and once(args.ckpt_dir, f"sleep-{done}") and rank == args.sleep_rank:
            while True:
                time.sleep(3600)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
