"""The HF Trainer with ckptsup.integrations.hf.CkptsupCallback (tests/helpers/hf_train.py: a tiny
PreTrainedModel, the Trainer's own DataLoaderShard, DDP with 2 gloo ranks on CPU), two figures,
each against a baseline measured in the same invocation on the same machine:

1. per-step overhead: the same Trainer loop with and without the callback, each step made 50 ms
   long inside forward (--work-s 0.05), no checkpoint due during the measurement; runs
   alternate (none, ckptsup, none, ckptsup, ...) so drift on a shared box hits both alike; the
   figure is the median step time (rank 0, from its per-step timestamps, the first 10 steps
   left out).
2. fault -> HF's first step after resume: SIGKILL of rank 1 from outside, then the first step a new
   group finishes (bench_drop_in.py's method, this host's monotonic clock), under `ckptsup launch`
   (ckptsup's checkpoints, resume_path) and under plain `torchrun --max-restarts 1` with HF's own
   checkpoints (save_steps) and train(resume_from_checkpoint=True); both save every 10 steps.
   ckptsup's fault comes once its warm rank interpreters are up (the `warm_ready` event).

usage: python bench/bench_hf.py [--repeats 3] [--overhead-steps 300] [--skip-restart] [--skip-overhead]
"""
from __future__ import annotations

import argparse
import os
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
SCRIPT = ROOT / "tests" / "helpers" / "hf_train.py"
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSUP_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return out


def step_times(path: Path) -> list[float]:
    stamps = [float(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]
    return [b - a for a, b in zip(stamps, stamps[1:])]


# ---- 1. per-step overhead ------------------------------------------------------------------------

def callback_share(path: Path) -> tuple[float, float]:
    """(callback seconds per step, wall seconds per step) over the steps after the first 10."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    first, last = rows[10], rows[-1]
    n = len(rows) - 11
    return (float(last[2]) - float(first[2])) / n, (float(last[0]) - float(first[0])) / n


def overhead_run(mode: str, base: Path, steps: int, port: int) -> tuple[float, tuple[float, float] | None]:
    work = Path(tempfile.mkdtemp(prefix=f"overhead-{mode}-", dir=base))
    os.chmod(work, 0o700)
    epochs = -(-steps // 6)   # 6 steps per epoch
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(SCRIPT), "--out", str(work / "out"), "--mode", mode,
            "--epochs", str(epochs), "--work-s", "0.05", "--save-every-steps", "0",
            "--checkpoint-dir", str(work / "ckpt"), *(["--time-callback"] if mode == "ckptsup" else [])]
    run_env = {**env(), "CKPTSUP_SAVE_EVERY_S": "36000"}
    subprocess.run(argv, env=run_env, check=True, capture_output=True, timeout=900)
    path = work / "out" / "steps_rank0.log"
    return statistics.median(step_times(path)[10:]), callback_share(path) if mode == "ckptsup" else None


def overhead(base: Path, steps: int, pairs: int) -> None:
    times: dict[str, list[float]] = {"none": [], "ckptsup": []}
    shares: list[tuple[float, float]] = []
    for i in range(pairs):
        for mode in ("none", "ckptsup"):
            median, share = overhead_run(mode, base, steps, 29700 + 2 * i + (mode == "ckptsup"))
            times[mode].append(median)
            if share is not None:
                shares.append(share)
            print(f"  {mode:8s} run {i + 1}: median step {median * 1000:.3f} ms"
                  + (f"; inside the callback {share[0] * 1e6:.1f} us/step" if share else ""), flush=True)
    cb_s = statistics.median(s[0] for s in shares)
    wall_s = statistics.median(s[1] for s in shares)
    print(f"same run: the callback's own time {cb_s * 1e6:.1f} us per {wall_s * 1000:.2f} ms step = "
          f"{cb_s / wall_s * 100:.3f}% (target <= 1% of a 50 ms step)", flush=True)
    none, with_cb = statistics.median(times["none"]), statistics.median(times["ckptsup"])
    print(f"across runs (alternating; noisy on a shared box): median step without the callback {none * 1000:.3f} ms, "
          f"with it {with_cb * 1000:.3f} ms: {(with_cb - none) / none * 100:+.2f}%", flush=True)


# ---- 2. fault -> first step after resume -----------------------------------------------------------

def restart_command(tool: str, work: Path) -> list[str]:
    args = [str(SCRIPT), "--out", str(work / "out"), "--epochs", "2000", "--save-every-steps", "10",
            "--step-sleep-s", "0.1"]
    if tool == "ckptsup":
        cfg = work / "job.toml"
        cfg.write_text("[health]\nenabled = false\n[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\n"
                       "test_load_every = 0\n")
        return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg),
                "--run-dir", str(work / "run"), *args]
    # --standalone: a c10d rendezvous on a free port, a fresh store prefix per round (torchrun's
    # static rendezvous on its default 29500 can collide with another job on a shared box, and its
    # restarted gloo group then meets the dead round's addresses: ~20 s of connect retries, or a failure)
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *args,
            "--mode", "hf"]



def ranks(work: Path) -> dict[int, int]:
    return worker_ranks(SCRIPT, work / "out")


def lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def one_restart(tool: str, base: Path, cap_s: float = 60.0) -> float | None:
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=base))
    os.chmod(work, 0o700)
    steps = work / "out" / "steps_rank0.log"
    log = open(work / "console.log", "wb")
    proc = subprocess.Popen(restart_command(tool, work), cwd=work, env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while lines(steps) < 25 or len(ranks(work)) < 2 or (
                tool == "ckptsup" and b'"warm_ready"' not in _read(work / "run" / "events.jsonl")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{tool}: workload did not start; see {work / 'console.log'}")
            time.sleep(0.1)
        old = ranks(work)
        victim = next(pid for pid, rank in old.items() if rank == 1)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        running_at = None
        while time.monotonic() - t0 < cap_s:
            if running_at is None and len([p for p in ranks(work) if p not in old]) >= 2:
                running_at = lines(steps)
            if running_at is not None and lines(steps) > running_at:
                return time.monotonic() - t0
            time.sleep(0.02)
        return None
    finally:
        kill_launch(proc, lambda: ranks(work))
        log.close()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def restart(base: Path, repeats: int) -> None:
    medians = {}
    for tool in ("ckptsup", "torchrun"):
        times = [one_restart(tool, base) for _ in range(repeats)]
        ok = [t for t in times if t is not None]
        medians[tool] = statistics.median(ok) if ok else None
        shown = ", ".join("> 60" if t is None else f"{t:.2f}" for t in times)
        print(f"HF Trainer  {tool:9s} SIGKILL of rank 1 -> first step after resume: {shown} s"
              + (f" (median {medians[tool]:.2f} s)" if ok else ""), flush=True)
    if medians["ckptsup"] and medians["torchrun"]:
        print(f"torchrun --max-restarts 1 + HF resume / ckptsup = {medians['torchrun'] / medians['ckptsup']:.2f}x "
              f"(> 1: ckptsup is faster)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overhead-steps", type=int, default=300)
    ap.add_argument("--overhead-pairs", type=int, default=2)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-restart", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-hf-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if not args.skip_overhead:
        overhead(base, args.overhead_steps, args.overhead_pairs)
    if not args.skip_restart:
        restart(base, args.repeats)


if __name__ == "__main__":
    main()
