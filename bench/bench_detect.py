"""Time to detect a fault, per fault kind, ckptsup beside its peers on the same workload and fault
(examples/train.py, 2 gloo ranks on this machine; fault injected into rank 1 from outside):

  crash  SIGKILL of rank 1           hang  SIGSTOP of rank 1 (a rank stuck, its peer in a collective)

Peers: torchrun --max-restarts 3 with PyTorch's default timeouts (no hang detection; the gloo
collective timeout is 30 min, so it is reported as "> cap"), and NVIDIA's ft_launcher
(nvidia-resiliency-ext 0.4.1, rank heartbeat timeout = ckptsup's hang timeout) when installed
(`pip install nvidia-resiliency-ext==0.4.1`). Columns (seconds after the fault, one clock):
  detect   the tool's detection (ckptsup: its failure_detected event; peers: first reaction)
  running  every rank of the new group exists again
  step     the new group finished its first step

usage: python bench/bench_detect.py [--cap-s 60] [--hang-timeout-s 5] [--tools ckptsup,torchrun,ft_launcher]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultbench import have_ft_launcher, run_one  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-s", type=float, default=60.0)
    p.add_argument("--hang-timeout-s", type=float, default=5.0)
    p.add_argument("--tools", default="ckptsup,torchrun,ft_launcher")
    p.add_argument("--faults", default="crash,hang")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    a = p.parse_args()
    tools = [t for t in a.tools.split(",") if t != "ft_launcher" or have_ft_launcher()]
    if "ft_launcher" in a.tools and "ft_launcher" not in tools:
        print("ft_launcher not installed (pip install nvidia-resiliency-ext==0.4.1): skipped")
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-detect-"))
    results = []
    for fault in a.faults.split(","):
        for tool in tools:
            r = run_one(tool, fault, base, cap_s=a.cap_s, hang_timeout_s=a.hang_timeout_s)
            results.append(r)
            print(f"{fault:5s} {tool:11s} detect {r.cell(r.detect_s, a.cap_s):>7s}  running {r.cell(r.running_s, a.cap_s):>7s}"
                  f"  step {r.cell(r.stepping_s, a.cap_s):>7s}  {r.note}", flush=True)
    print(f"\nhang timeout {a.hang_timeout_s:g}s for ckptsup and ft_launcher; cap {a.cap_s:g}s; work dir {base}")
    for fault in a.faults.split(","):
        mine = next((r for r in results if r.tool == "ckptsup" and r.fault == fault), None)
        for r in results:
            if r.fault != fault or r.tool == "ckptsup" or mine is None:
                continue
            for what in ("detect_s", "running_s", "stepping_s"):
                theirs, ours = getattr(r, what), getattr(mine, what)
                if ours is None:
                    continue
                ratio = "inf (never)" if theirs is None else f"{theirs / max(ours, 1e-3):.1f}x"
                print(f"{fault}: {r.tool} {what} / ckptsup {what} = {ratio}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
