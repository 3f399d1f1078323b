"""A small, real training script with ckptsup: an MLP with dropout on synthetic regression data,
AdamW with a warmup schedule, torchdata's StatefulDataLoader fed by ckptsup's
ResumableDistributedSampler, DDP under torchrun (gloo on CPU, NCCL on GPU), or one plain process.

    python examples/train.py --steps 50
    torchrun --nproc-per-node 2 examples/train.py --steps 200 --save-every-steps 20
    ckptsup launch examples/train.py --steps 200          # under the supervisor

The ckptsup part is the ten lines marked `# ckptsup`.

Flags (the supervisor's and the checkpoint tests use them):
  --steps N               total optimizer steps (the run ends at step N, resumed or not)
  --save-every-steps K    checkpoint every K steps (else the config / supervisor interval)
  --checkpoint-dir DIR    checkpoint_dir (else CKPTSUP_CHECKPOINT_DIR / config)
  --step-sleep-s S        sleep S seconds inside each step, to make steps ~50-200 ms
  --batch-size B          per-rank batch size (default 4); --dataset-size N (default 512)
  --seed S                model/data seed (default 0)
  --nan-at-step S[,S...]  rank --nan-rank (default 0) reports a NaN loss at step S (each listed)
  --crash-at-step S[,S]   rank --crash-rank (default 0) raises at step S (exit 1)
  --hang-at-step S[,S]    rank --hang-rank (default 0) sleeps forever at step S
  --flip-at-step S[,S]    rank --flip-rank (default 0) flips one bit of a first-layer weight right
                          after step S's optimizer step, as a memory error would (the loss stays
                          finite; ckptsup's replica fingerprints catch it: docs/sdc.md)
  --fault-mode once|always  `once` (default) fires each injected fault only the first time:
                          a marker file in --out (else next to the checkpoint dir) records it
  --hold-at-step S --hold-file F  before step S every rank waits, inside ckptsup.phase("eval")
                          (signs of life, no step), until F exists (at most 300 s): a test holds
                          the run there until it has found the rank it will signal. S = --steps:
                          before the final save (`run.close()`)
  --damage-after-resume   after a resume, re-initialise the first layer on every rank alike: a
                          restore that went wrong (the loss jumps; the supervisor warns)
  --out DIR               write DIR/samples_rank<r>.jsonl (sample ids of every step, with the
                          world size and the rank's pid, appended as the run goes) and, at the end, DIR/final_rank<r>.pt (model + optimizer
                          state) and DIR/final.json (sha256 of the parameters, final step)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptsup
from ckptsup.hooks.fingerprint import flip_bit
from ckptsup.hooks.sampler import ResumableDistributedSampler


class Synthetic(torch.utils.data.Dataset):
    """y = x @ w + noise; each sample carries its id so tests can check the data order."""

    def __init__(self, size: int, dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed + 1000)
        self.x = torch.randn(size, dim, generator=gen)
        self.y = self.x @ torch.randn(dim, 1, generator=gen) + 0.1 * torch.randn(size, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every-steps", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dataset-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup-steps", type=int, default=10)
    for fault in ("nan", "crash", "hang", "flip"):
        p.add_argument(f"--{fault}-at-step", type=steps, default=())
        p.add_argument(f"--{fault}-rank", type=int, default=0)
    p.add_argument("--fault-mode", choices=("once", "always"), default="once")
    p.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --slow-factor x --step-sleep-s")
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument("--damage-after-resume", action="store_true")
    p.add_argument("--hold-at-step", type=int, default=None)
    p.add_argument("--hold-file", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if (args.hold_at_step is None) != (args.hold_file is None):
        p.error("--hold-at-step and --hold-file go together")
    return args


def hold(path: Path, most_s: float = 300.0) -> None:
    """Wait for `path` in an eval phase: the supervisor sees signs of life, not a hang. Bounded,
    so a test that failed before its release leaves no run behind."""
    deadline = time.monotonic() + most_s
    with ckptsup.phase("eval"):
        while not path.exists() and time.monotonic() < deadline:
            ckptsup.phase_heartbeat()
            time.sleep(0.05)


def steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a step or a comma-separated list of steps") from None


def fault_fires(args: argparse.Namespace, kind: str, step: int, rank: int, marker_dir: Path) -> bool:
    if step not in getattr(args, f"{kind}_at_step") or getattr(args, f"{kind}_rank") != rank:
        return False
    if args.fault_mode == "always":
        return True
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker = marker_dir / f".fault-{kind}-{step}-rank{rank}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        ckptsup.init_process_group()                                   # ckptsup
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    model: nn.Module = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(args.hidden, 1)).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    dataset = Synthetic(args.dataset_size, args.dim, args.seed)
    sampler = ResumableDistributedSampler(dataset, seed=args.seed)
    loader = StatefulDataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup_steps))
    progress = {"samples_seen": 0}

    run = ckptsup.attach(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,   # ckptsup
                         extra={"progress": progress}, checkpoint_dir=args.checkpoint_dir,     # ckptsup
                         save_every_steps=args.save_every_steps)                               # ckptsup
    step = run.resume()                                                                        # ckptsup
    if args.damage_after_resume and step > 0:
        with torch.no_grad():   # the same on every rank: DDP's replicas stay equal, the loss jumps
            first = (model.module if distributed else model)[0]
            first.weight.fill_(3.0)
            first.bias.fill_(3.0)
    marker_dir = Path(args.out) if args.out else run.settings.checkpoint_dir.parent

    samples_log = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        samples_log = os.open(Path(args.out) / f"samples_rank{rank}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    batches = iter(loader)
    while step < args.steps:
        try:
            ids, x, y = next(batches)
        except StopIteration:                 # end of an epoch: the sampler moves to the next one
            batches = iter(loader)
            ids, x, y = next(batches)
        if step == args.hold_at_step:
            hold(Path(args.hold_file))
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if fault_fires(args, "flip", step, rank, marker_dir):   # silent data corruption, for tests
            flip_bit(model.module if distributed else model, param=0, index=3, bit=12)
            print(f"rank {rank}: flipped a bit after step {step}", flush=True)
        progress["samples_seen"] += len(ids)
        if samples_log is not None:
            # world and pid: which attempt a line belongs to, when a resume continues at the next step
            os.write(samples_log, (json.dumps({"step": step, "ids": ids.tolist(), "world": int(os.environ.get("WORLD_SIZE", "1")),
                                               "pid": os.getpid()}) + "\n").encode())
        if args.step_sleep_s:
            slow = rank == args.slow_rank and step >= args.slow_from_step   # a straggler, for tests
            time.sleep(args.step_sleep_s * (args.slow_factor if slow else 1.0))
        if fault_fires(args, "crash", step, rank, marker_dir):
            raise RuntimeError(f"injected crash at step {step} on rank {rank}")
        if fault_fires(args, "hang", step, rank, marker_dir):
            print(f"rank {rank}: injected hang at step {step}", flush=True)
            while True:
                time.sleep(3600)
        reported = loss.detach()
        if fault_fires(args, "nan", step, rank, marker_dir):
            reported = torch.tensor(float("nan"))
        print(f"step {step} rank {rank} loss {float(reported):.6f}", flush=True)
        run.step_done(step, loss=reported)                                                     # ckptsup
        step += 1
    if step == args.hold_at_step:   # S = --steps: after the last step, before the final save
        hold(Path(args.hold_file))
    run.close()                                                                                # ckptsup

    if args.out:
        write_final(args.out, model, opt, rank, step)
    if distributed:
        dist.destroy_process_group()
    return 0


def write_final(out: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    state = {"model": {k: v.detach().cpu() for k, v in plain.state_dict().items()}, "optim": opt.state_dict()}
    torch.save(state, Path(out) / f"final_rank{rank}.pt")
    if rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(state["model"].items()):
            digest.update(name.encode())
            digest.update(tensor.numpy().tobytes())
        (Path(out) / "final.json").write_text(json.dumps({"params_sha256": digest.hexdigest(), "step": step}))


if __name__ == "__main__":
    sys.exit(main())
