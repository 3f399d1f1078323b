"""Busy or hung at the defaults (docs/timeouts.md §Evidence): an unmodified 2-rank DDP script
(tests/helpers/plain_ddp.py, gloo, only rank 0 prints) under `ckptsup launch` with no config, and
the same script under plain torchrun as the baseline, in the same run:

  sleep   rank 1 sleeps forever before step 24 (rank 0 blocks in its all-reduce): seconds from the
          last progress line to failure_detected, and who was named; torchrun: is the job still
          hung `--cap-s` after the fault (its gloo timeout is 30 min)?
  busy    every rank computes 30 s without printing at step 10, then rank 0 alone 30 s while rank 1
          waits in dist.barrier() at step 30: failures (target 0) and busy events

  stacks  one stack collection of 8 ranks on a node (processes with torch imported and the dump
          installed), and the cost of one /proc evidence sample per rank (target: <= 1 s)

  nvrx    (with --nvrx DIR: where nvidia_resiliency_ext imports from, e.g. its wheel unpacked)
          NVRx's ft_launcher on the same sleeping rank: the unmodified script at its defaults, and
          the script with NVRx heartbeats after every optimizer step (a wrapper, nothing else
          changed) at its default 45 min heartbeat timeout and at 10 s: seconds from the fault to
          ft_launcher stopping the workers, or still hung at --cap-s

  soak    (--soak-min M, alone) false positives: >= M minutes of the unmodified script alternating
          --soak-phase-s (60) s of silent computation on every rank, training, the same on rank 0
          alone while rank 1 waits in dist.barrier(), training; counts failure_detected events
          (target 0) and busy spells from the run's events.jsonl

usage: python bench/bench_liveness.py [--cap-s 40] [--busy-s 30] [--stacks-only] [--nvrx DIR [--nvrx-only]]
       python bench/bench_liveness.py --soak-min 30 [--soak-phase-s 60]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
sys.path.insert(0, str(ROOT))
from ckptsup.events import read_events  # noqa: E402
from ckptsup.stack_dump import stack_file  # noqa: E402
from ckptsup.supervisor import evidence  # noqa: E402

HOLDER = "import time\nfrom ckptsup.stack_dump import install\ninstall()\nimport torch\nprint('ready', flush=True)\ntime.sleep(120)\n"


def stacks_of_eight(base: Path) -> None:
    procs = []
    for rank in range(8):
        env = {**os.environ, "CKPTSUP_RUN_DIR": str(base), "CKPTSUP_ATTEMPT": "0", "RANK": str(rank),
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True))
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        pids = {rank: proc.pid for rank, proc in enumerate(procs)}
        files = {rank: stack_file(base, 0, rank) for rank in pids}
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            got = evidence.take_stacks(pids, files)
            took.append(time.monotonic() - t0)
            assert len(got) == 8
        t0 = time.monotonic()
        for _ in range(100):
            for pid in pids.values():
                evidence.sample(pid)
        per = (time.monotonic() - t0) / 800
        print(f"stacks of 8 ranks: {', '.join(f'{x * 1000:.0f} ms' for x in took)} (target <= 1 s); "
              f"one /proc evidence sample {per * 1e6:.0f} us per rank per heartbeat")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def launch(work: Path, *faults: str, steps: int = 60, timeout: float = 900) -> tuple[int, list[dict], float]:
    run = work / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run),
                           str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(work / "ckpt"), "--out",
                           str(work / "final.pt"), *faults], capture_output=True, text=True, timeout=timeout, cwd=work)
    return proc.returncode, read_events(run), time.monotonic() - t0


def torchrun_still_hung(work: Path, cap_s: float) -> bool:
    """Plain torchrun, the same sleeping rank: True if nothing ended the job within cap_s of the
    fault (the sleeping rank's own line)."""
    log = work / "torchrun.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                                 "--steps", "60", "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "final.pt"),
                                 "--sleep-at", "24"], stdout=sink, stderr=subprocess.STDOUT, cwd=work)
    fault_at, deadline = None, time.monotonic() + 300
    while time.monotonic() < deadline:
        if fault_at is None and b"sleeping forever" in log.read_bytes():
            fault_at = time.monotonic()
        if proc.poll() is not None:
            return False
        if fault_at is not None and time.monotonic() - fault_at >= cap_s:
            break
        time.sleep(0.2)
    proc.kill()
    subprocess.run(["pkill", "-KILL", "-f", str(work / "ckpt")], check=False)
    proc.wait()
    return True


NVRX_WRAPPER = """import runpy, sys
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.optim.optimizer import register_optimizer_step_post_hook
client = RankMonitorClient()
client.init_workload_monitoring()
register_optimizer_step_post_hook(lambda opt, args, kwargs: client.send_heartbeat())   # every rank, every step
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def nvrx_detect_s(work: Path, nvrx: str, cap_s: float, *, heartbeats: bool, ft_args: tuple[str, ...] = ()) -> float | None:
    """NVRx's ft_launcher, the same sleeping rank: seconds from the fault (the sleeping rank's
    line) to ft_launcher closing the workers; None if still hung at cap_s."""
    work.mkdir(parents=True, exist_ok=True)
    wrapper = work / "nvrx_wrap.py"
    wrapper.write_text(NVRX_WRAPPER)
    entry = [str(wrapper), str(SCRIPT)] if heartbeats else [str(SCRIPT)]
    log = work / "ft_launcher.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([nvrx, os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone",
                                 "--nproc-per-node", "2", "--max-restarts", "1", *ft_args, *entry, "--steps", "60",
                                 "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "final.pt"), "--sleep-at", "24"],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True)
    fault_at, found, deadline = None, None, time.monotonic() + 300 + cap_s
    while time.monotonic() < deadline and found is None:
        text = log.read_bytes()
        if fault_at is None and b"sleeping forever" in text:
            fault_at = time.monotonic()
        elif fault_at is not None:
            after = text[text.index(b"sleeping forever"):]
            if any(w in after for w in (b"closing signal", b"Worker group FAILED", b"subsequent heartbeat")) \
                    or proc.poll() is not None:
                found = time.monotonic() - fault_at
            elif time.monotonic() - fault_at >= cap_s:
                break
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass   # it ended by itself
    subprocess.run(["pkill", "-KILL", "-f", str(work / "ckpt")], check=False)
    proc.wait()
    return found


def nvrx_rows(base: Path, nvrx: str, cap_s: float, ckptsup_detect: float | None) -> None:
    for name, heartbeats, ft_args in (("unmodified script, defaults", False, ()),
                                      ("NVRx heartbeats each step, defaults (45 min timeout)", True, ()),
                                      ("NVRx heartbeats each step, --ft-rank-heartbeat-timeout 10", True,
                                       ("--ft-rank-heartbeat-timeout", "10"))):
        got = nvrx_detect_s(base / f"nvrx-{len(name)}", nvrx, cap_s, heartbeats=heartbeats, ft_args=ft_args)
        ratio = f" -> ckptsup {ckptsup_detect / got:.2f} x NVRx's time" if got and ckptsup_detect else \
            (f" -> ckptsup < {ckptsup_detect / cap_s:.2f} x" if ckptsup_detect and got is None else "")
        print(f"NVRx ft_launcher, {name}: " + (f"workers stopped {got:.2f} s after the fault" if got is not None
                                                 else f"still hung {cap_s:g} s after the fault") + ratio)


SOAK_TRAIN_STEPS = 20   # steps of 0.5 s between quiet phases (~10 s of training, p99 step measured)


def soak(base: Path, minutes: float, phase_s: float) -> None:
    """False positives: quiet phases (all ranks, then rank 0 alone with rank 1 in a barrier) with
    training between them, for >= `minutes`, at the defaults; every failure_detected is a false hang."""
    phases = int(minutes * 60 // phase_s) + 1
    at = [f"{SOAK_TRAIN_STEPS * (i + 1)}" + ("" if i % 2 == 0 else ":0") for i in range(phases)]
    steps = SOAK_TRAIN_STEPS * (phases + 1)
    (base / "soak").mkdir()
    print(f"soak: {phases} quiet phases of {phase_s:g} s ({', '.join(at)}), {steps} steps of 0.5 s; load: "
          f"{os.getloadavg()}", flush=True)
    rc, events, wall = launch(base / "soak", "--busy-at", ",".join(at), "--busy-s", str(phase_s), "--step-s", "0.5",
                              steps=steps, timeout=phases * phase_s * 3 + 1800)
    failures = [e for e in events if e["event"] == "failure_detected"]
    busy = [e for e in events if e["event"] == "busy"]
    over = [e for e in events if e["event"] == "busy_over"]
    print(f"soak: {wall / 60:.1f} min wall, rc {rc}; failure_detected {len(failures)} (target 0) "
          f"{[(e.get('kind'), e.get('detail')) for e in failures]}; busy spells {len(busy)} "
          f"(ranks {[b['ranks'] for b in busy]}), ended {len(over)} "
          f"(busy_s {[round(o['busy_s'], 1) for o in over]}); load at the end {os.getloadavg()}; run dir {base / 'soak'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-s", type=float, default=40.0)
    p.add_argument("--busy-s", type=float, default=30.0)
    p.add_argument("--stacks-only", action="store_true")
    p.add_argument("--nvrx", default="", help="a directory nvidia_resiliency_ext imports from")
    p.add_argument("--nvrx-only", action="store_true", help="with --nvrx: ckptsup's sleeping rank and NVRx only")
    p.add_argument("--soak-min", type=float, default=0.0, help="run only the false-positive soak, this long")
    p.add_argument("--soak-phase-s", type=float, default=60.0)
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-liveness-"))
    if a.soak_min:
        soak(base, a.soak_min, a.soak_phase_s)
        return 0
    rows = []
    if not a.nvrx_only:
        stacks_of_eight(base)
    if a.stacks_only:
        return 0

    (base / "sleep").mkdir()
    rc, events, wall = launch(base / "sleep", "--sleep-at", "24")
    failures = [e for e in events if e["event"] == "failure_detected"]
    hang = failures[0] if failures else None
    (base / "torchrun").mkdir()
    baseline = torchrun_still_hung(base / "torchrun", a.cap_s)
    detect = hang["detect_s"] if hang else None
    rows.append({"case": "sleeping rank", "rc": rc, "detect_s": detect, "named_rank": hang and hang["rank"],
                 "detail": hang and hang["detail"], "torchrun": f"> {a.cap_s:g} s (still hung)" if baseline else "ended"})
    print(f"sleeping rank: ckptsup detected in {detect:.2f} s at the defaults (target <= 15 s), rank {hang['rank']} named: "
          f"{hang['detail']}" if hang else "sleeping rank: NOT detected")
    if baseline and detect:
        print(f"  torchrun: still hung {a.cap_s:g} s after the fault -> ckptsup is < {detect / a.cap_s:.2f} x torchrun's time")
    if a.nvrx:
        nvrx_rows(base, a.nvrx, a.cap_s, detect)
    if a.nvrx_only:
        return 0

    (base / "busy").mkdir()
    rc, events, wall = launch(base / "busy", "--busy-at", "10,30:0", "--busy-s", str(a.busy_s))
    failures = [e for e in events if e["event"] == "failure_detected"]
    busy = [e for e in events if e["event"] == "busy"]
    rows.append({"case": "busy", "rc": rc, "failures": len(failures), "busy": [b["ranks"] for b in busy], "wall_s": wall})
    print(f"busy ({a.busy_s:g} s on every rank, then {a.busy_s:g} s on rank 0 while rank 1 waits in a barrier): "
          f"{len(failures)} failures (target 0), busy spells {[b['ranks'] for b in busy]}, rc {rc}, {wall:.0f} s wall")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
