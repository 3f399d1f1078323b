"""The script checkpoint check (ckptsup/checkpoint/script_file.py) against `cat FILE > /dev/null`
of the same ~1 GB torch.save file, page cache warm for both (the two alternate, so that a noisy
neighbour's drift hits both), and the step-time overhead of a CPU training loop while the
supervisor's keeper copies and checks that file in another process, over and over. The keeper runs
throughout and is stopped (SIGSTOP) and continued in alternate windows of the loop: the overhead
compares the median step of the windows it ran in with those it was stopped in, so drift on a shared
box cancels out.

    .venv/bin/python bench/bench_script_checkpoint.py [--gb 1.0] [--reps 5] [--dir /tmp] [--windows 8]

Targets (issue 36): check throughput >= 0.8 x cat's; step-time overhead <= 2 %."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
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


def keeper_loop(path: str, run_dir: str) -> None:
    """In a child process, as the supervisor: take (copy + check) the file over and over, until
    SIGTERM; then print how many takes it finished."""
    from ckptsup.checkpoint.script_keep import Keeper, lower_priority

    print("keeper priority: " + (", ".join(lower_priority()) or "unchanged"), file=sys.stderr, flush=True)  # as the supervisor's keeper thread
    keeper = Keeper(run_dir=Path(run_dir), target=Path(path), path="ckpt.pt", keep=2)
    takes = 0

    def done(*_: object) -> None:
        print(takes, flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, done)
    while True:
        os.utime(path)   # a new version each time (its mtime moved)
        taken = keeper.take(step=takes)
        assert taken.version is not None, taken
        takes += 1


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
    ap.add_argument("--windows", type=int, default=8, help="windows of each kind (keeper running, stopped)")
    ap.add_argument("--window-steps", type=int, default=40)
    ap.add_argument("--keeper-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.keeper_child:
        keeper_loop(args.keeper_child[0], args.keeper_child[1])
        return
    from ckptsup.checkpoint import script_file

    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench-script-ckpt-"))
    try:
        path = work / "ckpt.pt"
        size = make_file(path, args.gb)
        subprocess.run(f"cat {path} > /dev/null", shell=True, check=True)   # page cache warm
        verdict = script_file.check(path)
        assert verdict.ok, verdict
        cats, checks = [], []
        for _ in range(args.reps):   # alternating: drift on a shared box hits both
            cats += timed(lambda: subprocess.run(f"cat {path} > /dev/null", shell=True, check=True), 1)
            checks += timed(lambda: script_file.check(path), 1)
        cat, check = statistics.median(cats), statistics.median(checks)
        print(f"file: {size / 1e9:.2f} GB torch.save, {verdict.entries} entries; CRC-32 backend: "
              f"{script_file.crc_backend()}; {os.cpu_count()} CPUs")
        print(f"cat > /dev/null: median {cat:.3f} s ({size / cat / 1e9:.2f} GB/s) of {args.reps}")
        print(f"check:           median {check:.3f} s ({size / check / 1e9:.2f} GB/s) of {args.reps}")
        print(f"throughput ratio check/cat: {cat / check:.2f} (target >= 0.8: {'met' if cat / check >= 0.8 else 'missed'})")

        steps(30)   # warm up
        child = subprocess.Popen([sys.executable, __file__, "--keeper-child", str(path), str(work / "run")],
                                 stdout=subprocess.PIPE, text=True)
        running, stopped = [], []
        start = time.monotonic()
        try:
            time.sleep(0.5)   # its import
            for _ in range(args.windows):
                running.append(statistics.median(steps(args.window_steps)))
                child.send_signal(signal.SIGSTOP)
                time.sleep(0.2)   # what it had in flight (write-back) settles
                stopped.append(statistics.median(steps(args.window_steps)))
                child.send_signal(signal.SIGCONT)
        finally:
            child.send_signal(signal.SIGCONT)
            child.terminate()
        takes = int((child.communicate()[0] or "0").strip() or 0)
        seconds = time.monotonic() - start
        base, busy = statistics.median(stopped), statistics.median(running)
        print(f"step: median {base * 1e3:.2f} ms with the keeper stopped, {busy * 1e3:.2f} ms with it copying and "
              f"checking ({args.windows} windows of {args.window_steps} steps each; {takes} takes of "
              f"{size / 1e9:.2f} GB finished in {seconds:.1f} s, about half of it running)")
        overhead = busy / base - 1
        pairs = sorted(r / s_ - 1 for r, s_ in zip(running, stopped))
        print(f"step-time overhead: {overhead * 100:+.1f} % (medians of the windows; window pairs "
              f"{pairs[0] * 100:+.1f} to {pairs[-1] * 100:+.1f} %) (target <= 2 %: {'met' if overhead <= 0.02 else 'missed'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
