"""The script checkpoint check (ckptsup/checkpoint/script_file.py) against `cat FILE > /dev/null`
of the same ~1 GB torch.save file, page cache warm for both, and the step-time overhead of a CPU
training loop while the supervisor's keeper copies and checks that file in another process.

    .venv/bin/python bench/bench_script_checkpoint.py [--gb 1.0] [--reps 5] [--dir /tmp]

Targets (issue 36): check throughput >= 0.8 x cat's; step-time overhead <= 2 %."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_file(path: Path, gb: float) -> int:
    import torch

    n = max(1, int(gb * (1 << 30) / (64 << 20)))
    g = torch.Generator().manual_seed(0)
    torch.save({f"layer{i}.weight": torch.randn(16 << 20, generator=g) for i in range(n)}, path)
    return path.stat().st_size


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def keeper_loop(path: str, run_dir: str, seconds: float) -> None:
    """In a child process, as the supervisor: take (copy + check) the file over and over."""
    from ckptsup.checkpoint.script_keep import Keeper

    os.nice(10)   # as the supervisor's keeper thread (script_checkpoint.NICE)
    keeper = Keeper(run_dir=Path(run_dir), target=Path(path), path="ckpt.pt", keep=2)
    end = time.monotonic() + seconds
    takes = 0
    while time.monotonic() < end:
        os.utime(path)   # a new version each time (its mtime moved)
        taken = keeper.take(step=takes)
        assert taken.version is not None, taken
        takes += 1
    print(takes, flush=True)


def steps(n: int) -> list[float]:
    """A steady CPU training step (one thread): its times."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 512)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        for _ in range(4):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keeper-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.keeper_child:
        keeper_loop(args.keeper_child[0], args.keeper_child[1], float(args.keeper_child[2]))
        return
    from ckptsup.checkpoint import script_file

    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench-script-ckpt-"))
    try:
        path = work / "ckpt.pt"
        size = make_file(path, args.gb)
        subprocess.run(f"cat {path} > /dev/null", shell=True, check=True)   # page cache warm
        verdict = script_file.check(path)
        assert verdict.ok, verdict
        cat = statistics.median(timed(lambda: subprocess.run(f"cat {path} > /dev/null", shell=True, check=True),
                                      args.reps))
        check = statistics.median(timed(lambda: script_file.check(path), args.reps))
        print(f"file: {size / 1e9:.2f} GB torch.save, {verdict.entries} entries; CRC-32 backend: "
              f"{script_file.crc_backend()}; {os.cpu_count()} CPUs")
        print(f"cat > /dev/null: median {cat:.3f} s ({size / cat / 1e9:.2f} GB/s) of {args.reps}")
        print(f"check:           median {check:.3f} s ({size / check / 1e9:.2f} GB/s) of {args.reps}")
        print(f"throughput ratio check/cat: {cat / check:.2f} (target >= 0.8: {'met' if cat / check >= 0.8 else 'missed'})")

        steps(30)   # warm up
        base1 = steps(args.steps)
        seconds = sum(base1) * 1.2
        child = subprocess.Popen([sys.executable, __file__, "--keeper-child", str(path), str(work / "run"),
                                  str(seconds)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)
        loaded = steps(args.steps)
        takes = int((child.communicate()[0] or "0").strip() or 0)
        base2 = steps(args.steps)
        base = statistics.median(base1 + base2)
        busy = statistics.median(loaded)
        mean_base, mean_busy = statistics.mean(base1 + base2), statistics.mean(loaded)
        print(f"step: median {base * 1e3:.2f} ms alone, {busy * 1e3:.2f} ms with the keeper copying and checking "
              f"({takes} takes of {size / 1e9:.2f} GB in {seconds:.1f} s); mean {mean_base * 1e3:.2f} / "
              f"{mean_busy * 1e3:.2f} ms")
        overhead = busy / base - 1
        print(f"step-time overhead: {overhead * 100:+.1f} % median, {(mean_busy / mean_base - 1) * 100:+.1f} % mean "
              f"(target <= 2 %: {'met' if overhead <= 0.02 else 'missed'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
