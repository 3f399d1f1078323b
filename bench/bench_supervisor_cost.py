"""Supervisor and agent cost in a steady run: `ckptsup launch examples/train.py` locally with 2 gloo
ranks; after the first step, CPU (% of one core) and RSS of the supervisor and the agent are
sampled for --seconds, beside the ranks' own CPU for scale.

usage: python bench/bench_supervisor_cost.py [--seconds 30]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptsup-cost-"))
    (work / "job.toml").write_text("[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    proc = subprocess.Popen([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config",
                             str(work / "job.toml"), "--run-dir", str(work / "run"), str(ROOT / "examples" / "train.py"),
                             "--steps", "100000", "--save-every-steps", "50", "--step-sleep-s", "0.05",
                             "--out", str(work / "out")], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        events = work / "run" / "events.jsonl"
        deadline = time.monotonic() + 180
        while not (events.exists() and '"first_step"' in events.read_text()):
            if time.monotonic() > deadline or proc.poll() is not None:
                print("the run did not start")
                return 1
            time.sleep(0.5)
        sup = psutil.Process(proc.pid)
        agent = next(c for c in sup.children() if "agent" in " ".join(c.cmdline()))
        ranks = [c for c in agent.children(recursive=True) if "train.py" in " ".join(c.cmdline())]
        def cpu(procs):  # noqa: E306
            return sum(sum(pr.cpu_times()[:2]) for pr in procs)
        c0 = (cpu([sup]), cpu([agent]), cpu(ranks))
        t0 = time.monotonic()
        time.sleep(a.seconds)
        span = time.monotonic() - t0
        c1 = (cpu([sup]), cpu([agent]), cpu(ranks))
        pct = [100 * (b - x) / span for x, b in zip(c0, c1)]
        print(f"steady run, 2 ranks, {span:.0f}s sampled")
        print(f"supervisor  CPU {pct[0]:5.2f}% of a core   RSS {sup.memory_info().rss / 2**20:6.1f} MB")
        print(f"agent       CPU {pct[1]:5.2f}% of a core   RSS {agent.memory_info().rss / 2**20:6.1f} MB")
        print(f"ranks (2)   CPU {pct[2]:5.1f}% of a core   (for scale)")
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
