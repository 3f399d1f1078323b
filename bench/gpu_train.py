"""The small CUDA training script of gpu_check's restart part: an MLP on the GPU (CPU in a dry
run) with ckptsup.attach, one JSON line per step in --out (step, this process's pid, the host's
monotonic clock), so that the parent can SIGKILL the rank and time fault -> first step after the
resume, CUDA context creation and the checkpoint load included, under any launcher.

    python bench/gpu_train.py --out steps.jsonl [--checkpoint-dir DIR] [--steps N] [--save-every-steps K]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import ckptsup


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--save-every-steps", type=int, default=10)
    p.add_argument("--step-sleep-s", type=float, default=0.05)
    p.add_argument("--width", type=int, default=1024)
    a = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=a.checkpoint_dir, save_every_steps=a.save_every_steps)
    step = run.resume()
    log = os.open(a.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    x = torch.randn(256, a.width, device=device)
    while step < a.steps:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        os.write(log, (json.dumps({"step": step, "pid": os.getpid(), "mono": time.monotonic()}) + "\n").encode())
        time.sleep(a.step_sleep_s)
        run.step_done(step, loss=loss.item())
        step += 1
    run.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
