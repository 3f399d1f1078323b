"""A DDP script (gloo, CPU) with a quiet evaluation inside `ckptsup.phase("eval")`
(tests/test_phase_local.py).

    ckptsup launch --nproc-per-node 2 phase_train.py --out DIR [--mode attach|heartbeat] [--steps 40]
        [--eval-at 20] [--eval-s 45] [--eval-rank all|0] [--sleep]

Every step prints `step N`. At step --eval-at every rank enters the eval phase; the evaluating ranks
(--eval-rank) compute for --eval-s seconds without a print or a heartbeat (matrix products and
short pauses; --sleep: time.sleep only), the others wait in dist.barrier() inside the phase. With
--mode attach ckptsup keeps the checkpoints (every 10 steps); with heartbeat the script calls
ckptsup.heartbeat per step. Writes DIR/done_rank<r> at the end.
"""
import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ckptsup


def evaluate(seconds: float, *, sleep: bool) -> None:
    end = time.monotonic() + seconds
    a = torch.randn(96, 96)
    while time.monotonic() < end:
        if sleep:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            continue
        for _ in range(20):
            a = torch.tanh(a @ a)
        time.sleep(0.02)   # half a core per rank: the other engineers' tests share the box


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("attach", "heartbeat"), default="attach")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-at", type=int, default=20)
    ap.add_argument("--eval-s", type=float, default=45.0)
    ap.add_argument("--eval-rank", choices=("all", "0"), default="all")
    ap.add_argument("--sleep", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckptsup.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = None
    step = 0
    if args.mode == "attach":
        run = ckptsup.attach(model=model, optimizer=opt, save_every_steps=10, allow_stateless_dataloader=True)
        step = run.resume()
    while step < args.steps:
        if step == args.eval_at:
            with ckptsup.phase("eval"):
                if args.eval_rank == "all" or rank == 0:
                    evaluate(args.eval_s, sleep=args.sleep)
                dist.barrier()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
        if rank == 0:
            print(f"step {step}", flush=True)
        if run is not None:
            run.step_done(step, loss=loss)
        else:
            ckptsup.heartbeat(step, loss)
        step += 1
    if run is not None:
        run.close()
    (out / f"done_rank{rank}").write_text(str(step))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
