"""Monte-Carlo speed: 10,000 simulated 30-day runs, vectorised (numpy) vs a plain Python loop.

Both implement the same model (ckptsup.planning.simulate): the Python loop runs a subset of the
runs and its time is scaled per run; the ratio is measured in this one run. Target: 10,000 x
30-day runs in seconds (issue 5). Also checks that both agree on the mean waste and that the
simulation agrees with the first-order analytic waste.

    .venv/bin/python bench/bench_simulate.py [--runs 10000] [--baseline-runs 300] [--mtbf-h 3.09] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ckptsup.planning import interval as iv
from ckptsup.planning import simulate as sm


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--baseline-runs", type=int, default=300)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--mtbf-h", type=float, default=3.09, help="job MTBF (Llama 3, 16k GPUs: 3.09 h)")
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument("--restart-s", type=float, default=300.0)
    parser.add_argument("--persist-s", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    mtbf = args.mtbf_h * 3600.0
    interval = max(iv.daly_interval(args.stall_s, mtbf).interval_s, args.persist_s)
    inp = sm.SimInputs(interval_s=interval, stall_s=args.stall_s, restart_s=args.restart_s, mtbf_s=mtbf,
                       persist_s=args.persist_s, days=args.days, runs=args.runs, seed=1)
    sm.simulate(sm.SimInputs(**{**inp.__dict__, "runs": 100}))  # warm-up (imports, allocator)
    vec_s = best_of(lambda: sm.simulate(inp), 3)
    result = sm.simulate(inp).summary()
    py_waste: list[float] = []
    py_s = best_of(lambda: py_waste.extend(sm.simulate_python(inp, args.baseline_runs)), 1)
    py_per_run = py_s / args.baseline_runs
    vec_per_run = vec_s / args.runs
    analytic = sm.analytic(inp)["waste_fraction"]
    figures = {
        "runs": args.runs, "days": args.days, "job_mtbf_h": args.mtbf_h, "failures_per_run": result["failures_per_run"],
        "vectorised_s": vec_s, "vectorised_runs_per_s": args.runs / vec_s,
        "python_runs": args.baseline_runs, "python_s": py_s, "python_runs_per_s": 1 / py_per_run,
        "python_s_for_all_runs_est": py_per_run * args.runs,
        "speedup": py_per_run / vec_per_run,
        "waste_vectorised": result["waste_fraction"], "waste_python": statistics.fmean(py_waste),
        "waste_analytic": analytic,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"model: {args.runs:,} runs x {args.days:g} days, job MTBF {args.mtbf_h} h "
              f"({result['failures_per_run']:.0f} failures/run), C {args.stall_s:g}s, P {args.persist_s:g}s, "
              f"R {args.restart_s:g}s, interval {interval:.0f}s (Daly)")
        print(f"vectorised (numpy): {vec_s:.3f} s for {args.runs:,} runs  ({args.runs / vec_s:,.0f} runs/s)")
        print(f"python loop:        {py_s:.3f} s for {args.baseline_runs:,} runs  ({1 / py_per_run:,.0f} runs/s; "
              f"~{py_per_run * args.runs:.1f} s for {args.runs:,})")
        print(f"speed-up: {figures['speedup']:.1f}x")
        print(f"mean waste: vectorised {result['waste_fraction']:.4f}, python {figures['waste_python']:.4f}, "
              f"analytic first-order {analytic:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
