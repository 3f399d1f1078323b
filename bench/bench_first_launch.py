"""The first launch of an unmodified script (tests/helpers/plain_ddp.py, 2 gloo ranks, CPU):
start → first step and the CPU the whole launch costs, three ways on the same machine, same clock:

  zygote   `ckptsup launch` at the defaults: the agent's zygote imports torch once and forks
           torchrun and both ranks (supervisor/node/agent.py `_first_launch`)
  cold     `ckptsup launch` with `[supervisor] warm_ranks = false`: torchrun's own import, then
           one torch import per rank (what every first launch did before)
  torchrun plain `torchrun --nproc-per-node 2` (the baseline a user compares with)

"first step" = the first `step N` line rank 0 prints, timed from this process's monotonic clock
when it starts the command. CPU = user + system seconds of the command's whole process tree
(RUSAGE_CHILDREN: the agent waits on its zygote's forks, so they count too) for a run of
--steps steps that ends by itself. The three alternate, --repeats rounds; medians.

usage: python bench/bench_first_launch.py [--repeats 3] [--steps 20]
"""
from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
BIN = Path(sys.executable).parent
STEP = re.compile(r"step (\d+) loss")
WAYS = ("zygote", "cold", "torchrun")


def command(way: str, work: Path, steps: int) -> list[str]:
    args = [str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "final.pt"),
            "--step-s", "0"]
    if way == "torchrun":
        return [str(BIN / "torchrun"), "--nproc-per-node", "2", *args]
    cfg = work / "job.toml"
    cfg.write_text("[health]\nenabled = false\n" + ("[supervisor]\nwarm_ranks = false\n" if way == "cold" else ""))
    return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg),
            "--run-dir", str(work / "run"), *args]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one(way: str, base: Path, steps: int) -> tuple[float, float]:
    """(start → first step s, CPU s of the whole run)."""
    work = Path(tempfile.mkdtemp(dir=base, prefix=f"{way}-"))
    cpu0 = children_cpu()
    t0 = time.monotonic()
    proc = subprocess.Popen(command(way, work, steps), cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    first = None
    assert proc.stdout is not None
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first is None and STEP.search(line):
            first = time.monotonic() - t0
    rc = proc.wait()
    cpu = children_cpu() - cpu0
    if rc != 0 or first is None:
        raise SystemExit(f"{way}: rc={rc}, first step {first}: {''.join(tail)}")
    return first, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-first-launch-") as tmp:
        for _ in range(args.repeats):
            for way in WAYS:
                rows[way].append(one(way, Path(tmp), args.steps))
                print(f"{way:9s} start→first step {rows[way][-1][0]:5.2f} s  CPU {rows[way][-1][1]:5.2f} s", flush=True)
    med = {w: (statistics.median(r[0] for r in rows[w]), statistics.median(r[1] for r in rows[w])) for w in WAYS}
    print(f"medians of {args.repeats} ({args.steps} steps each):")
    for way in WAYS:
        print(f"  {way:9s} start→first step {med[way][0]:5.2f} s   CPU {med[way][1]:5.2f} s")
    print(f"first step: cold / zygote = {med['cold'][0] / med['zygote'][0]:.2f}x, "
          f"torchrun / zygote = {med['torchrun'][0] / med['zygote'][0]:.2f}x")
    print(f"CPU: cold - zygote = {med['cold'][1] - med['zygote'][1]:.2f} s a launch "
          f"(cold / zygote = {med['cold'][1] / med['zygote'][1]:.2f}x); torchrun {med['torchrun'][1]:.2f} s")


if __name__ == "__main__":
    main()
