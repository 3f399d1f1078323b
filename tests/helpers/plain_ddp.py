"""A plain DDP training script as users write it: gloo, its own torch.save checkpoints (resumed
from the newest one), rank 0 prints `step N`. It knows nothing of the supervisor it runs under
(the word for it never appears here, so it is supervised at the process level plus progress lines).

    torchrun --nproc-per-node 2 plain_ddp.py --steps 80 --ckpt-dir D --out final.pt [--every 5]
             [--step-s 0.1] [--exit0-on-sigterm]

--exit0-on-sigterm: the way Lightning handles SIGTERM: finish the step, save, exit 0.
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist


def newest(ckpt_dir):
    steps = [int(n[5:-3]) for n in os.listdir(ckpt_dir) if n.startswith("step_") and n.endswith(".pt")]
    return max(steps) if steps else None


def save(ckpt_dir, step, model, opt):
    tmp = os.path.join(ckpt_dir, f".tmp_step_{step}.pt")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, os.path.join(ckpt_dir, f"step_{step}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--exit0-on-sigterm", action="store_true")
    args = ap.parse_args()

    stop = {"flag": False}
    if args.exit0_on_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
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
        g = torch.Generator().manual_seed(step * 100 + rank)   # the data is a function of the step
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        done = step + 1
        if rank == 0:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
        flag = torch.tensor([1 if stop["flag"] else 0])
        dist.all_reduce(flag)
        if done % args.every == 0 or flag.item():
            if rank == 0:
                save(args.ckpt_dir, done, model.module, opt)
            dist.barrier()
        if flag.item():
            if rank == 0:
                print(f"SIGTERM: saved step {done}, exiting 0", flush=True)
            dist.destroy_process_group()
            return
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
