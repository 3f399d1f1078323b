"""A DDP script that keeps its own checkpoint as nanoGPT does: rank 0 `torch.save`s it in place
(out/ckpt.pt, no temporary name) every --every steps. It knows nothing of any supervisor.

    torchrun --nproc-per-node 2 script_ckpt_train.py --steps 60 --every 10 [--out out]
             [--init_from scratch|resume|auto] [--tear-at S] [--crash-at S] [--garbage] [--step-s 0.05]

--init_from: scratch (the default, as nanoGPT's), resume (load out/ckpt.pt; fails without it, as
nanoGPT's), auto (resume when the file exists). The last --init_from=... wins (resume args go last).
Faults, each once per out/ (a marker file):
--tear-at S: at the save after step S, rank 0 writes half the file in place and SIGKILLs itself
  (a real torn file: what a node death or OOM kill mid-save leaves);
--crash-at S: rank 1 exits 1 after step S;
--garbage: every save writes random bytes instead of a checkpoint;
--hang-in-save-at S: at the save after step S, rank 0 writes half the file in place, then creates
  out/held-in-save and sleeps (a test kills its node there).
Each rank writes out/final_rank<R>.pt (the model) and rank 0 appends `start <step> <init_from>`
to out/starts.txt at each start."""
import argparse
import io
import os
import signal
import time

import torch
import torch.distributed as dist


def once(out, what):
    try:
        os.close(os.open(os.path.join(out, f".once-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--out", default="out")
    ap.add_argument("--init_from", default="scratch", choices=("scratch", "resume", "auto"))
    ap.add_argument("--tear-at", type=int, default=-1)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--garbage", action="store_true")
    ap.add_argument("--hang-in-save-at", type=int, default=-1)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "ckpt.pt")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(args.width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    start = 0
    resume = args.init_from == "resume" or (args.init_from == "auto" and os.path.exists(ckpt))
    if resume:
        state = torch.load(ckpt)   # a torn file fails here, on every attempt
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    if rank == 0:
        with open(os.path.join(args.out, "starts.txt"), "a") as fh:
            fh.write(f"start {start} {args.init_from}\n")
        print(f"init_from={args.init_from}: starting at step {start}", flush=True)
    dist.barrier()
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)   # the data is a function of the step
        x = torch.randn(16, args.width, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        done = step + 1
        if rank == 0:
            print(f"step {done} loss {loss.item():.6f}", flush=True)
        if done == args.crash_at and rank == 1 and once(args.out, "crash"):
            print(f"rank 1: crashing after step {done}", flush=True)
            os._exit(1)
        if done % args.every == 0:
            if rank == 0:
                state = {"step": done, "model": model.module.state_dict(), "opt": opt.state_dict()}
                if args.garbage:
                    with open(ckpt, "wb") as fh:
                        fh.write(os.urandom(4096))
                elif done in (args.tear_at, args.hang_in_save_at) and once(args.out, "tear"):
                    buf = io.BytesIO()
                    torch.save(state, buf)
                    data = buf.getvalue()
                    with open(ckpt, "wb") as fh:   # in place, as nanoGPT: the old version is gone now
                        fh.write(data[:len(data) // 2])
                        fh.flush()
                        os.fsync(fh.fileno())
                        if done == args.hang_in_save_at:
                            open(os.path.join(args.out, "held-in-save"), "w").close()
                            while True:   # halfway through the save: the test kills this node
                                time.sleep(1)
                        print(f"rank 0: killed halfway through the save of step {done}", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
                else:
                    torch.save(state, ckpt)
            dist.barrier()
    torch.save(model.module.state_dict(), os.path.join(args.out, f"final_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
