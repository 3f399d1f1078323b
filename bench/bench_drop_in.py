"""Restart of an UNMODIFIED script (tests/helpers/plain_ddp.py: plain DDP, gloo, its own
torch.save checkpoints, prints `step N`): fault → first step after resume, under `ckptsup launch`
(process level + progress lines) and under `torchrun --max-restarts 3`, same script, same machine,
same clock (the bench_restart.py method: SIGKILL of rank 1 from outside, times from this host's
monotonic clock; "first step" = the first `step N` line the new rank 0 prints). ckptsup's fault
comes once its warm rank interpreters are up (the `warm_ready` event, seconds after each start).

usage: python bench/bench_drop_in.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultbench import kill_launch, worker_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
BIN = Path(sys.executable).parent
STEP = re.compile(rb"step (\d+) loss")


def command(tool: str, work: Path) -> list[str]:
    args = [str(SCRIPT), "--steps", "100000", "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "final.pt"),
            "--every", "10", "--step-s", "0.1"]
    if tool == "ckptsup":
        cfg = work / "job.toml"
        cfg.write_text("[health]\nenabled = false\n")
        return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg),
                "--run-dir", str(work / "run"), *args]
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", "3", *args]


def ranks(work: Path) -> dict[int, int]:
    return worker_ranks(SCRIPT, work / "ckpt")


def _events(work: Path) -> bytes:
    try:
        return (work / "run" / "events.jsonl").read_bytes()
    except OSError:
        return b""


def one(tool: str, base: Path, cap_s: float = 120.0) -> float | None:
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=base))
    log_path = work / "console.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(command(tool, work), cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(STEP.findall(log_path.read_bytes())) < 20 or len(ranks(work)) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{tool}: workload did not start; see {log_path}")
            time.sleep(0.1)
        while tool == "ckptsup" and b'"warm_ready"' not in _events(work):
            if time.monotonic() > deadline:
                raise SystemExit(f"{tool}: no warm_ready event; see {work / 'run'}")
            time.sleep(0.1)   # the steady state: a fault before the warm interpreters restarts cold
        old = ranks(work)
        victim = next(pid for pid, rank in old.items() if rank == 1)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        running_at = None
        while time.monotonic() - t0 < cap_s:
            current = ranks(work)
            if running_at is None and len([p for p in current if p not in old]) >= 2:
                running_at = len(log_path.read_bytes())
            if running_at is not None and STEP.search(log_path.read_bytes()[running_at:]):
                return time.monotonic() - t0
            time.sleep(0.02)
        return None
    finally:
        kill_launch(proc, lambda: ranks(work))
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-drop-in-"))
    medians = {}
    for tool in ("ckptsup", "torchrun"):
        times = [one(tool, base) for _ in range(args.repeats)]
        ok = [t for t in times if t is not None]
        medians[tool] = statistics.median(ok) if ok else None
        shown = ", ".join("> 120" if t is None else f"{t:.2f}" for t in times)
        print(f"unmodified script  {tool:9s} SIGKILL of rank 1 → first step after resume: {shown} s "
              f"(median {medians[tool]:.2f} s)" if ok else f"{tool}: no restart within 120 s", flush=True)
    if medians["ckptsup"] and medians["torchrun"]:
        print(f"torchrun --max-restarts / ckptsup = {medians['torchrun'] / medians['ckptsup']:.2f}x "
              f"(> 1: ckptsup is faster)")


if __name__ == "__main__":
    main()
