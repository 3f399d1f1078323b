"""Lightning with ckptsup's callback (tests/helpers/lightning_train.py, 2 gloo ranks on CPU), two figures,
each against a baseline measured in the same run of this script:

1. per-step overhead: the same Lightning loop (a ~50 ms step: a small MLP plus time.sleep) with
   CkptsupCallback (no saves due: the per-step hooks, heartbeat, NaN check, the ~1/s agreement)
   and without any callback, under plain torchrun, alternated `--repeats` times. A step's time is
   the gap between consecutive batch starts on rank 0 (the script's per-step timestamps), steady
   state only (steps 10 and on).
2. fault -> Lightning's first step after resume: SIGKILL of rank 1 once the run is steady, to the
   first batch the restarted ranks start, under `ckptsup launch` (the callback, ckptsup's
   checkpoints every 10 steps) and under plain `torchrun --max-restarts 1` with Lightning's own
   resume (ModelCheckpoint every 10 steps, `trainer.fit(ckpt_path="last")`). Same script, same
   machine, this host's clock.

usage: python bench/bench_lightning.py [--repeats 2] [--steps 120]
"""
from __future__ import annotations

import argparse
import json
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
SCRIPT = ROOT / "tests" / "helpers" / "lightning_train.py"
BIN = Path(sys.executable).parent
STEP_S = 0.045     # + ~5 ms of model, optimizer and Lightning per step: ~50 ms


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSUP_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CKPTSUP_SAVE_EVERY_S": "3600"})
    return out


def step_times(out: Path, first: int = 10) -> list[float]:
    """Rank 0's gaps between consecutive batch starts (the last line of a step wins)."""
    starts: dict[int, float] = {}
    for line in (out / "samples_rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        starts[record["step"]] = record["t"]
    steps = sorted(s for s in starts if s >= first)
    return [starts[b] - starts[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


def overhead_run(mode: str, base: Path, steps: int) -> tuple[list[float], float | None]:
    work = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=base))
    os.chmod(work, 0o700)
    samples = steps * 8    # 2 ranks x batch 4: `steps` optimizer steps in one epoch
    argv = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(SCRIPT), "--mode", mode, "--epochs", "1", "--samples", str(samples),
            "--every", "0", "--step-s", str(STEP_S), "--out", str(work / "out"), "--ckpt-dir", str(work / "ck"),
            *(["--time-callback"] if mode == "ckptsup" else [])]
    proc = subprocess.run(argv, cwd=work, env=env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    timed = work / "out" / "callback_s.json"
    own = json.loads(timed.read_text()) if timed.exists() else None
    return step_times(work / "out"), (own["callback_s"] / max(1, own["steps"])) if own else None


def command(tool: str, work: Path) -> list[str]:
    args = [str(SCRIPT), "--epochs", "1000", "--samples", "800", "--every", "10", "--step-s", "0.1",
            "--out", str(work / "out")]
    if tool == "ckptsup":
        cfg = work / "job.toml"
        cfg.write_text("[health]\nenabled = false\n[checkpoint]\nadaptive_interval = false\n")
        return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg),
                "--run-dir", str(work / "run"), *args]
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", "1", *args,
            "--mode", "lightning-ckpt", "--ckpt-dir", str(work / "ck")]


def ranks(work: Path) -> dict[int, int]:
    return worker_ranks(SCRIPT, work / "out")


def batches_since(out: Path, t0: float) -> bool:
    try:
        lines = (out / "samples_rank0.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(line)["t"] > t0 for line in lines[-50:] if line.strip())


def restart_run(tool: str, base: Path, cap_s: float = 180.0) -> float | None:
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=base))
    os.chmod(work, 0o700)
    log = open(work / "console.log", "wb")
    proc = subprocess.Popen(command(tool, work), cwd=work, env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    out = work / "out"
    try:
        deadline = time.monotonic() + 300
        # steady: past two saves (step 25), and ckptsup's warm interpreters for the next launch are up
        while not (out / "samples_rank0.jsonl").exists() or '"step": 25,' not in (out / "samples_rank0.jsonl").read_text() \
                or len(ranks(work)) < 2 or (tool == "ckptsup" and b'"warm_ready"' not in _events(work)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{tool}: workload did not start; see {work / 'console.log'}")
            time.sleep(0.1)
        victim = next(pid for pid, rank in ranks(work).items() if rank == 1)
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        while time.time() - t0 < cap_s:
            if batches_since(out, t0 + 0.5):   # a batch started after the kill and the old ranks' end
                return _first_batch_after(out, t0) - t0
            time.sleep(0.05)
        return None
    finally:
        kill_launch(proc, lambda: ranks(work))
        log.close()


def _first_batch_after(out: Path, t0: float) -> float:
    times = [json.loads(line)["t"] for line in (out / "samples_rank0.jsonl").read_text().splitlines() if line.strip()]
    return min(t for t in times if t > t0 + 0.5)


def _events(work: Path) -> bytes:
    try:
        return (work / "run" / "events.jsonl").read_bytes()
    except OSError:
        return b""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip-restart", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-lightning-"))
    times: dict[str, list[float]] = {"plain": [], "ckptsup": []}
    own: list[float] = []
    for _ in range(args.repeats):
        for mode in ("plain", "ckptsup"):
            steps, inside = overhead_run(mode, base, args.steps)
            times[mode] += steps
            own += [inside] if inside is not None else []
    plain, hooked = statistics.median(times["plain"]), statistics.median(times["ckptsup"])
    mean_plain, mean_hooked = statistics.fmean(times["plain"]), statistics.fmean(times["ckptsup"])
    print(f"Lightning step, no callback:     median {plain * 1e3:.2f} ms, mean {mean_plain * 1e3:.2f} ms "
          f"({len(times['plain'])} steps)")
    print(f"Lightning step, CkptsupCallback: median {hooked * 1e3:.2f} ms, mean {mean_hooked * 1e3:.2f} ms "
          f"({len(times['ckptsup'])} steps)")
    print(f"per-step overhead: {(hooked - plain) * 1e3:+.2f} ms median = {(hooked / plain - 1) * 100:+.2f}% "
          f"(mean {(mean_hooked / mean_plain - 1) * 100:+.2f}%)", flush=True)
    if own:
        per_step = statistics.median(own)
        print(f"same run: the callback's own time {per_step * 1e6:.1f} us per {hooked * 1e3:.2f} ms step = "
              f"{per_step / hooked * 100:.2f}% (per run: {', '.join(f'{o * 1e6:.1f}' for o in own)} us)", flush=True)
    if args.skip_restart:
        return
    medians = {}
    for tool in ("ckptsup", "torchrun"):
        got = [restart_run(tool, base) for _ in range(args.repeats)]
        ok = [t for t in got if t is not None]
        medians[tool] = statistics.median(ok) if ok else None
        shown = ", ".join("> 180" if t is None else f"{t:.2f}" for t in got)
        print(f"SIGKILL of rank 1 -> Lightning's first step after resume, {tool:8s}: {shown} s", flush=True)
    if medians["ckptsup"] and medians["torchrun"]:
        print(f"torchrun --max-restarts 1 + Lightning's resume / ckptsup = "
              f"{medians['torchrun'] / medians['ckptsup']:.2f}x (> 1: ckptsup is faster)")


if __name__ == "__main__":
    main()
