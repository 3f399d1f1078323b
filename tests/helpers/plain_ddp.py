"""A plain DDP training script as users write it: gloo, its own torch.save checkpoints (resumed
from the newest one), rank 0 prints `step N`. It knows nothing of the supervisor it runs under
(the word for it never appears here, so it is supervised at the process level plus progress lines).

    torchrun --nproc-per-node 2 plain_ddp.py --steps 80 --ckpt-dir D --out final.pt [--every 5]
             [--step-s 0.1] [--exit0-on-sigterm]

--exit0-on-sigterm: the way Lightning handles SIGTERM: finish the step, save, exit 0.
Faults and quiet phases for the liveness tests (each once per run: a marker file in --ckpt-dir):
--all-print: every rank prints its `step N` lines (rank 0 only by default);
--sleep-at S[,S] --sleep-rank R: rank R sleeps forever before step S (the others block in its all-reduce);
--collective-at S[,S] (with --sleep-rank R): rank R blocks forever before step S in an all-reduce
  of a second process group that its peers never enter (a collective only some ranks reach);
  the others block in DDP's all-reduce;
--busy-at S[:R][,S[:R]] --busy-s T: before step S, rank R (no R: every rank) computes for T seconds
  printing nothing; the others wait in dist.barrier() (an evaluation pass as users write it);
--read-at S[:R] (with --busy-s T): the same, but rank R reads a file slowly (64 KiB every 0.1 s):
  I/O progressing, next to no CPU (a data phase waiting on storage);
--hold-at S[,S] --hold-file F: before step S every rank reads slowly (busy, not hung) until F holds
  the line S (at most 300 s); rank 0 first writes F.held-S: a test signals a rank while it is
  there, whatever the machine's speed, then releases it.
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


def once(ckpt_dir, what):
    """True the first time `what` happens in this checkpoint dir (a resumed run does not repeat it)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    try:
        os.close(os.open(os.path.join(ckpt_dir, f".once-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def busy(seconds):
    """Compute without printing (an evaluation pass): CPU time grows, no progress line."""
    a = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def hold(path, step, rank):
    """Read slowly (as read_slowly: busy at the supervisor's I/O floor, not hung, and next to no CPU
    however loaded the machine) until `path` holds the line `step` (a test's release), at most 300 s."""
    import sys

    if rank == 0:
        with open(f"{path}.held-{step}", "w") as fh:
            fh.write(f"{step}\n")
    end = time.monotonic() + 300
    with open(sys.executable, "rb", buffering=0) as source:
        while time.monotonic() < end:
            if not source.read(64 << 10):
                source.seek(0)
            try:
                with open(path) as fh:
                    if str(step) in fh.read().split():
                        return
            except FileNotFoundError:
                pass
            time.sleep(0.1)


def read_slowly(seconds):
    """Read 64 KiB every 0.1 s (from this script's own interpreter binary, never cached away from
    rchar): I/O grows, CPU time hardly does."""
    import sys

    end = time.monotonic() + seconds
    with open(sys.executable, "rb", buffering=0) as fh:
        while time.monotonic() < end:
            if not fh.read(64 << 10):
                fh.seek(0)
            time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--exit0-on-sigterm", action="store_true")
    ap.add_argument("--all-print", action="store_true")
    ap.add_argument("--sleep-at", type=lambda t: [int(x) for x in t.split(",")], default=[])
    ap.add_argument("--sleep-rank", type=int, default=1)
    ap.add_argument("--collective-at", type=lambda t: [int(x) for x in t.split(",")], default=[])
    ap.add_argument("--busy-at", type=lambda t: dict((int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else None)
                                                     for x in t.split(",")), default={})
    ap.add_argument("--read-at", type=lambda t: dict((int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else None)
                                                     for x in t.split(",")), default={})
    ap.add_argument("--busy-s", type=float, default=30.0)
    ap.add_argument("--hold-at", type=lambda t: [int(x) for x in t.split(",")], default=[])
    ap.add_argument("--hold-file", default="")
    args = ap.parse_args()

    stop = {"flag": False}
    if args.exit0_on_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group(backend="gloo") if args.collective_at else None   # every rank creates it
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
        if step in args.sleep_at and rank == args.sleep_rank and once(args.ckpt_dir, f"sleep-{step}"):
            print(f"rank {rank}: sleeping forever before step {step}", flush=True)
            while True:
                time.sleep(3600)
        if step in args.collective_at and rank == args.sleep_rank and once(args.ckpt_dir, f"collective-{step}"):
            print(f"rank {rank}: blocked forever in an all-reduce of a second group before step {step}", flush=True)
            dist.all_reduce(torch.zeros(1), group=side)
        if step in args.hold_at and once(args.ckpt_dir, f"hold-{step}-rank{rank}"):
            hold(args.hold_file, step, rank)
        if step in args.busy_at and once(args.ckpt_dir, f"busy-{step}-rank{rank}"):
            if args.busy_at[step] in (None, rank):
                busy(args.busy_s)
            dist.barrier()
        if step in args.read_at and once(args.ckpt_dir, f"read-{step}-rank{rank}"):
            if args.read_at[step] in (None, rank):
                read_slowly(args.busy_s)
            dist.barrier()
        g = torch.Generator().manual_seed(step * 100 + rank)   # the data is a function of the step
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        done = step + 1
        if rank == 0 or args.all_print:
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
    dist.barrier()   # no rank leaves (and may be torn down) before the model is written
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
