"""Replica fingerprints (docs/sdc.md): their throughput, and the step-time overhead at the
default [sdc] every_steps, as a ratio against a baseline measured in the same run.

1. GB/s of `fingerprint(state_tensors(model, optimizer))` over `--state-gib` of parameters +
   AdamW state (a third parameters, two thirds exp_avg / exp_avg_sq), on CPU (and on the GPU
   when one is there: `--device cuda`).
2. Step overhead: `--steps` steps of a real `--step-ms` compute step (a matmul loop calibrated
   to that time), first without checks, then with a ReplicaCheck (the all-gather on a
   one-rank gloo group) every `--every` steps (default: the [sdc] default); the ratio of the two
   wall times, and the ratio the fingerprint cost predicts (fingerprint time / (every x step)).
   Target: <= 1 %.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_fingerprint.py [--state-gib 1] [--steps 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from ckptsup.config import SdcConfig
from ckptsup.hooks.fingerprint import ReplicaCheck, fingerprint, state_tensors


def state(gib: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    per = int(gib * (1 << 30) / 3 / 4)           # float32 elements of each third
    rows = max(1, per // 4096)
    model = torch.nn.Linear(4096, rows, bias=False).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model.weight.grad = torch.zeros_like(model.weight)
    opt.step()                                    # exp_avg and exp_avg_sq exist
    return model, opt


def throughput(model, opt, *, repeats: int, device: str) -> tuple[float, float, int]:
    nbytes = sum(t.numel() * t.element_size() for _, t in state_tensors(model, opt))
    fingerprint(state_tensors(model, opt))        # warm-up (the weight vectors)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fingerprint(state_tensors(model, opt))    # ends with the device -> host transfer of the lanes
        times.append(time.perf_counter() - t0)
    best = min(times)
    return nbytes / best / 1e9, sorted(times)[len(times) // 2], nbytes


def calibrated_step(step_s: float) -> tuple[callable, float]:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ b
        n += 1
    per = (time.perf_counter() - t0) / n
    count = max(1, round(step_s / per))

    def step() -> None:
        for _ in range(count):
            a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    return step, (time.perf_counter() - t0) / 5


def overhead(model, opt, *, steps: int, every: int, step_s: float) -> dict:
    step, measured_step = calibrated_step(step_s)
    check = ReplicaCheck(model=model, optimizer=opt, rank=0, world_size=1, group=None, every_steps=every)

    def loop(with_checks: bool) -> float:
        t0 = time.perf_counter()
        for i in range(steps):
            step()
            if with_checks and check.due(i):
                check.check(i + 1)
        return time.perf_counter() - t0

    base = loop(False)
    checked = loop(True)
    base2 = loop(False)                           # the baseline again: the box's drift during the run
    baseline = (base + base2) / 2
    per_check = check.seconds / max(1, check.checks)
    return {"steps": steps, "every_steps": every, "step_s": round(measured_step, 4), "checks": check.checks,
            "baseline_s": round(baseline, 2), "baseline_spread": round(abs(base - base2) / baseline, 4),
            "checked_s": round(checked, 2), "overhead_ratio": round(checked / baseline - 1, 4),
            "per_check_s": round(per_check, 3), "predicted_ratio": round(per_check / (every * measured_step), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=SdcConfig().every_steps)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        model, opt = state(args.state_gib, args.device)
        gbps, median_s, nbytes = throughput(model, opt, repeats=args.repeats, device=args.device)
        out = {"device": args.device, "threads": torch.get_num_threads(), "state_bytes": nbytes,
               "fingerprint_gbps": round(gbps, 2), "fingerprint_median_s": round(median_s, 3)}
        if not args.skip_overhead:
            out["overhead"] = overhead(model, opt, steps=args.steps, every=args.every, step_s=args.step_ms / 1000)
        dist.destroy_process_group()
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
