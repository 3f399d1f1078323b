"""Straggler detection figures (supervisor/job/stragglers.py, hooks/compute_time.py) on this machine:
examples/train.py under `ckptsup launch`, 3 DDP ranks over gloo, 0.1 s steps. For a rank slowed
1.3x and 2x from step 100: steps from the slowdown to the `straggler` event. Without any slow
rank for --quiet-s seconds: false flags, scaled to an hour. The baseline is the same run's other
ranks: the ratio is each flagged rank's compute time over theirs (printed with the event).

    .venv/bin/python bench/bench_stragglers.py [--quiet-s 600]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW_FROM = 100


def run(work: Path, steps: int, *extra: str) -> tuple[list[dict], float]:
    cfg = work / "job.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval_s = 0.5\n[checkpoint]\nadaptive_interval = false\n"
                   "keep_daily_days = 0\ntest_load_every = 0\n")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "3", "--config", str(cfg),
                    "--run-dir", str(work / "run"), str(ROOT / "examples" / "train.py"), "--steps", str(steps),
                    "--step-sleep-s", "0.1", "--out", str(work / "out"), *extra],
                   cwd=work, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = (work / "run" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "straggler"], time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quiet-s", type=float, default=600.0)
    a = p.parse_args()
    for factor in ("1.3", "2"):
        flags, _ = run(Path(tempfile.mkdtemp(prefix="ckptsup-strag-")), SLOW_FROM + 80, "--slow-rank", "2",
                       "--slow-factor", factor, "--slow-from-step", str(SLOW_FROM))
        named = [f for f in flags if f["rank"] == 2]
        others = [f for f in flags if f["rank"] != 2]
        steps = named[0]["step"] - SLOW_FROM if named else None
        print(f"rank 2 slowed {factor}x from step {SLOW_FROM}: named after {steps} steps "
              f"(ratio {named[0]['ratio'] if named else '-'}); wrong ranks flagged: {len(others)}", flush=True)
    steps = int(a.quiet_s / 0.1)
    flags, took = run(Path(tempfile.mkdtemp(prefix="ckptsup-strag-")), steps)
    print(f"no slow rank, {steps} steps in {took:.0f} s: {len(flags)} false flag(s) = "
          f"{len(flags) * 3600 / took:.1f} per hour", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
