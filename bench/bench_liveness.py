"""Busy or hung at the defaults (docs/timeouts.md §Evidence): an unmodified 2-rank DDP script
(tests/helpers/plain_ddp.py, gloo, only rank 0 prints) under `ckptsup launch` with no config, and
the same script under plain torchrun as the baseline, in the same run:

  detection (--faults, each in its own runs): rank 1 of a 60-step run goes wrong at step 24:
          sleep       sleeps forever (rank 0 blocks in DDP's all-reduce);
          stop        its own process (the pid `ckptsup status --json` gives) is SIGSTOPped;
          collective  blocks in an all-reduce of a second group its peer never enters (rank 0
                      blocks in DDP's): the culprit is in a collective too;
          ckptsup: seconds from the fault (the culprit's marker file, or the SIGSTOP) to
          failure_detected, its own detect_s, who was blamed and why; a script fault comes again
          at step 45 in the restarted (warm) attempt. Beside it, the same fault once under plain
          torchrun and (--nvrx) NVRx's ft_launcher: seconds from the fault to the launcher acting,
          or still hung at --cap-s; ckptsup's time as a ratio to each. Target: the hang timeout
          in force (max(hang_min_s, 3 x p99 step), from `ckptsup status`) + EVIDENCE_WINDOW_S.
  busy    every rank computes 30 s without printing at step 10, then rank 0 alone 30 s while rank 1
          waits in dist.barrier() at step 30: failures (target 0) and busy events

  stacks  one stack collection of 8 ranks on a node (processes with torch imported and the dump
          installed), and the cost of one /proc evidence sample per rank (target: <= 1 s)

  nvrx    (with --nvrx DIR: where nvidia_resiliency_ext imports from, e.g. its wheel unpacked)
          NVRx's ft_launcher on each fault: the unmodified script at its defaults, and
          the script with NVRx heartbeats after every optimizer step (a wrapper, nothing else
          changed) at its default 45 min heartbeat timeout and at 10 s: seconds from the fault to
          ft_launcher stopping the workers, or still hung at --cap-s

  soak    (--soak-min M, alone) false positives: >= M minutes of the unmodified script alternating
          --soak-phase-s (60) s of silent computation on every rank, training, the same on rank 0
          alone while rank 1 waits in dist.barrier(), training; counts failure_detected events
          (target 0) and busy spells from the run's events.jsonl

usage: python bench/bench_liveness.py [--cap-s 40] [--busy-s 30] [--stacks-only] [--faults sleep,stop,collective]
                                     [--nvrx DIR [--nvrx-only]]
       python bench/bench_liveness.py --soak-min 30 [--soak-phase-s 60]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any
from datetime import datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
sys.path.insert(0, str(ROOT))
from ckptsup.events import read_events  # noqa: E402
from ckptsup.stack_dump import stack_file  # noqa: E402
from ckptsup.supervisor.node import evidence  # noqa: E402
from ckptsup.supervisor.job.liveness import EVIDENCE_WINDOW_S  # noqa: E402

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


# a rank as a real one looks to the tree walk: torch's intra-op threads started, `workers` DataLoader-like
# children forked from its main thread (each with torch imported, as a fork is)
TREE_HOLDER = """import multiprocessing as mp, sys, time
import torch
torch.set_num_threads({threads}); torch.randn(256, 256) @ torch.randn(256, 256)
ctx = mp.get_context("fork")
kids = [ctx.Process(target=time.sleep, args=(120,), daemon=True) for _ in range({workers})]
for k in kids:
    k.start()
print("ready", flush=True)
time.sleep(120)
"""


def tree_cost(threads: int = 16, rounds: int = 200) -> None:
    """The per-heartbeat cost of a rank's evidence: its process alone (before issue 36) and its
    whole tree (evidence.TreeSampler: every thread's children re-found every RESCAN_S), 8 ranks."""
    for workers in (0, 2, 8):
        procs = [subprocess.Popen([sys.executable, "-c", TREE_HOLDER.format(threads=threads, workers=workers)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(8)]
        try:
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            pids = [proc.pid for proc in procs]
            alone = _per_sample(lambda pid: evidence.sample(pid), pids, rounds)
            trees = evidence.TreeSampler()
            assert all((got := trees.sample(pid)) is not None and got.children == workers for pid in pids)
            steady = _per_sample(trees.sample, pids, rounds)
            rescans = evidence.TreeSampler(clock=lambda: time.monotonic() * 1e6)   # every call a rescan
            rescan = _per_sample(rescans.sample, pids, rounds)
            nthreads = len(os.listdir(f"/proc/{pids[0]}/task"))
            print(f"tree evidence, 8 ranks of {nthreads} threads with {workers} workers each: process alone "
                  f"{alone * 1e6:.0f} us, tree {steady * 1e6:.0f} us, tree with a thread rescan {rescan * 1e6:.0f} us "
                  f"per rank per heartbeat; 8 ranks at 1 Hz with a rescan every {evidence.RESCAN_S:g} s: "
                  f"{8 * (steady + (rescan - steady) / evidence.RESCAN_S) * 100:.3f} % of a core", flush=True)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def _per_sample(sample: Any, pids: list[int], rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        for pid in pids:
            sample(pid)
    return (time.perf_counter() - t0) / (rounds * len(pids))


def launch(work: Path, *faults: str, steps: int = 60, timeout: float = 900) -> tuple[int, list[dict], float]:
    run = work / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run),
                           str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(work / "ckpt"), "--out",
                           str(work / "final.pt"), *faults], capture_output=True, text=True, timeout=timeout, cwd=work)
    return proc.returncode, read_events(run), time.monotonic() - t0


# the faults, each injected once at step 24 of a 60-step run: (what, the script's flags, the line
# the culprit prints as it goes wrong; None: the bench SIGSTOPs rank 1 while the ranks are held at
# step 24 (plain_ddp.py --hold-at; a 0.1 s step leaves no time to aim at a printed line), then
# releases them)
FAULTS = {
    "sleep": ("rank 1 sleeps forever before step 24 (rank 0 blocks in DDP's all-reduce)", ("--sleep-at", "24"),
              b"sleeping forever"),
    "stop": ("rank 1's process SIGSTOPped at step 24", ("--hold-at", "24"), None),
    "collective": ("rank 1 blocked in an all-reduce of a second group before step 24 (rank 0 in DDP's all-reduce)",
                   ("--collective-at", "24"), b"blocked forever"),
}

def held(work: Path) -> Path:
    return work / "hold"


def release(work: Path) -> None:
    with open(held(work), "a") as fh:
        fh.write("24\n")


def wait_for_path(path: Path, proc: subprocess.Popen, limit_s: float = 300) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            return True
        time.sleep(0.05)
    return False
# what NVRx's ft_launcher and torchrun print when they act on a failed worker group
ACTED = (b"closing signal", b"Worker group FAILED", b"subsequent heartbeat")


def wait_for_bytes(log: Path, what: bytes, proc: subprocess.Popen, limit_s: float = 300) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if what in log.read_bytes():
            return True
        time.sleep(0.05)
    return False


def status_json(run: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptsup.cli", "status", str(run), "--json"], capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def rank_pid(run: Path, rank: int) -> int:
    """The rank's own process as `ckptsup status --json` gives it (not a proxy)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for r in status_json(run).get("ranks") or []:
            if r["rank"] == rank:
                return int(r.get("host_pid") or r["pid"])
        time.sleep(0.2)
    raise RuntimeError(f"ckptsup status gave no pid for rank {rank}")


def kill_tree(proc: subprocess.Popen) -> None:
    """The launcher and every process under it, by pid (a SIGSTOPped rank dies of SIGKILL too)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


WARM_AT = 45   # the script faults again here, in the restarted attempt (warm interpreters: Python stacks)


def ckptsup_case(work: Path, fault: str) -> dict:
    """`ckptsup launch` at the defaults, no config, the unmodified script: each failure_detected,
    timed from the fault (the culprit's marker file, written just before it goes wrong, or the
    SIGSTOP) and as ckptsup's own detect_s (from the last progress line). A script fault comes
    again at WARM_AT in the restarted attempt (warm ranks: named from Python stacks, not only
    kernel wait channels)."""
    _, given, line = FAULTS[fault]
    work.mkdir(parents=True)
    flags = [given[0], f"{given[1]},{WARM_AT}"] if line else [*given, "--hold-file", str(held(work))]
    run, ckpt, log = work / "run", work / "ckpt", work / "ckptsup.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir",
                                 str(run), str(SCRIPT), "--steps", "60", "--ckpt-dir", str(ckpt), "--out",
                                 str(work / "final.pt"), *flags], stdout=sink, stderr=subprocess.STDOUT, cwd=work)
    stopped_at, timeout_in_force = None, None
    try:
        if wait_for_bytes(log, b"step 20 loss", proc):
            timeout_in_force = status_json(run).get("hang_timeout_s")
        if line is None and wait_for_path(Path(f"{held(work)}.held-24"), proc):
            os.kill(rank_pid(run, 1), signal.SIGSTOP)
            stopped_at = time.monotonic()
            release(work)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    events = read_events(run)
    hangs = [e for e in events if e["event"] == "failure_detected"]
    for hang, step in zip(hangs, (24, WARM_AT) if line else (24,)):
        hang["injected"] = True
        if stopped_at is not None:
            hang["after_fault_s"] = hang["mono"] - stopped_at
        elif (marker := ckpt / f".once-{flags[0][2:-3]}-{step}").exists():
            hang["after_fault_s"] = datetime.fromisoformat(hang["ts"]).timestamp() - marker.stat().st_mtime
    return {"rc": proc.returncode, "hangs": hangs, "hang_timeout_s": timeout_in_force,
            "completed": any(e["event"] == "run_complete" for e in events),
            "health_checks": sum(e["event"] == "health_check" for e in events) - 1,   # the start's is 1
            "excluded": sum(e["event"] == "node_excluded" for e in events)}


def rank_process(root: int, rank: int) -> psutil.Process:
    """The process that runs `rank` under a launcher: the script's, with RANK in its environment."""
    for p in psutil.Process(root).children(recursive=True):
        try:
            if str(SCRIPT) in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise RuntimeError(f"rank {rank} not found under pid {root}")


def other_case(work: Path, fault: str, argv: list[str], env: dict[str, str], cap_s: float) -> float | None:
    """Another launcher (torchrun, NVRx's ft_launcher), the same fault: seconds from the fault to the
    launcher acting on it (its own words in the log, or its exit); None if still hung at cap_s."""
    _, given, line = FAULTS[fault]
    work.mkdir(parents=True, exist_ok=True)
    log = work / "launcher.log"
    flags = [*given, "--hold-file", str(held(work))] if line is None else list(given)
    with open(log, "wb") as sink:
        proc = subprocess.Popen([*argv, "--steps", "60", "--ckpt-dir", str(work / "ckpt"), "--out",
                                 str(work / "final.pt"), *flags], stdout=sink, stderr=subprocess.STDOUT, cwd=work,
                                env=env, start_new_session=True)
    fault_at, offset, found = None, 0, None
    deadline = time.monotonic() + 300 + cap_s
    try:
        while time.monotonic() < deadline and found is None:
            text = log.read_bytes()
            if fault_at is None:
                if line is None and Path(f"{held(work)}.held-24").exists():
                    rank_process(proc.pid, 1).send_signal(signal.SIGSTOP)
                    fault_at, offset = time.monotonic(), len(text)
                    release(work)
                elif line is not None and line in text:
                    fault_at, offset = time.monotonic(), text.index(line)
                elif proc.poll() is not None:
                    raise RuntimeError(f"{argv[2:4]} ended before the fault: {log}")
            elif any(w in text[offset:] for w in ACTED) or proc.poll() is not None:
                found = time.monotonic() - fault_at
            elif time.monotonic() - fault_at >= cap_s:
                break
            time.sleep(0.05)
    finally:
        kill_tree(proc)
    return found


NVRX_WRAPPER = """import runpy, sys
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.optim.optimizer import register_optimizer_step_post_hook
client = RankMonitorClient()
client.init_workload_monitoring()
register_optimizer_step_post_hook(lambda opt, args, kwargs: client.send_heartbeat())   # every rank, every step
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""
NVRX_ROWS = (("NVRx ft_launcher, unmodified script, defaults", False, ()),
             ("NVRx ft_launcher, NVRx heartbeats each step, defaults (45 min timeout)", True, ()),
             ("NVRx ft_launcher, NVRx heartbeats each step, --ft-rank-heartbeat-timeout 10", True,
              ("--ft-rank-heartbeat-timeout", "10")))


def others(base: Path, fault: str, nvrx: str, cap_s: float) -> list[tuple[str, float | None]]:
    """torchrun and (with --nvrx) NVRx's three rows on the same fault."""
    out = [("torchrun", other_case(base / "torchrun", fault, [sys.executable, "-m", "torch.distributed.run",
                                                              "--nproc-per-node", "2", str(SCRIPT)], dict(os.environ), cap_s))]
    if nvrx:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([nvrx, os.environ.get("PYTHONPATH", "")])}
        wrapper = base / "nvrx_wrap.py"
        wrapper.write_text(NVRX_WRAPPER)
        for i, (name, heartbeats, ft_args) in enumerate(NVRX_ROWS):
            entry = [str(wrapper), str(SCRIPT)] if heartbeats else [str(SCRIPT)]
            argv = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone",
                    "--nproc-per-node", "2", "--max-restarts", "1", *ft_args, *entry]
            out.append((name, other_case(base / f"nvrx-{i}", fault, argv, env, cap_s)))
    return out


def detection(base: Path, fault: str, nvrx: str, cap_s: float) -> dict:
    what = FAULTS[fault][0]
    mine = ckptsup_case(base / fault / "ckptsup", fault)
    hangs = mine["hangs"]
    after = hangs[0].get("after_fault_s") if hangs else None
    target = None if mine["hang_timeout_s"] is None else mine["hang_timeout_s"] + EVIDENCE_WINDOW_S
    print(f"{what}:", flush=True)
    if not hangs:
        print(f"  ckptsup launch, defaults, unmodified: NOT detected (rc {mine['rc']}) -> target MISSED")
    labels = ("cold ranks", f"again at step {WARM_AT}, warm ranks") if FAULTS[fault][2] else ("cold ranks",)
    for i, hang in enumerate(hangs):
        if not hang.get("injected"):
            print(f"  ckptsup: another failure, not injected (attempt {hang['attempt']}): {hang['kind']}, detect_s "
                  f"{hang['detect_s']:.2f}, rank {hang['rank']} blamed: {hang['detail']}; ranks_seen {hang.get('ranks_seen')}")
            continue
        which, a = labels[i], hang["after_fault_s"]
        met = "met" if a is not None and target is not None and a <= target else "MISSED"
        print(f"  ckptsup launch, defaults, unmodified ({which}): {hang['kind']} "
              + (f"{a:.2f} s after the fault" if a is not None else "(fault time unknown)")
              + f" (detect_s {hang['detect_s']:.2f} from the last progress; hang timeout in force {mine['hang_timeout_s']} s,"
              f" target <= {target} s: {met}); rank {hang['rank']} blamed: {hang['detail']}", flush=True)
    print(f"  ckptsup: rc {mine['rc']}, {len(hangs)} failure(s), completed {mine['completed']}, "
          f"{mine['health_checks']} health check(s) after a failure, {mine['excluded']} node(s) excluded")
    rows = []
    for name, got in others(base / fault, fault, nvrx, cap_s):
        ratio = ("" if after is None else f" -> ckptsup {after / got:.2f} x" if got else f" -> ckptsup < {after / cap_s:.2f} x")
        print(f"  {name}: " + (f"acted {got:.2f} s after the fault" if got is not None
                                 else f"still hung {cap_s:g} s after the fault") + ratio, flush=True)
        rows.append({"launcher": name, "after_fault_s": got})
    return {"fault": fault, "ckptsup": [{k: h.get(k) for k in ("injected", "after_fault_s", "detect_s", "rank", "detail")}
                                        for h in hangs],
            "target_s": target, "rc": mine["rc"], "health_checks": mine["health_checks"], "others": rows}


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
    p.add_argument("--tree-only", action="store_true", help="only the per-heartbeat cost of a rank's tree evidence")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"a comma list of {', '.join(FAULTS)}")
    p.add_argument("--nvrx", default="", help="a directory nvidia_resiliency_ext imports from")
    p.add_argument("--nvrx-only", action="store_true", help="the detection rows only (no stacks, no busy row)")
    p.add_argument("--soak-min", type=float, default=0.0, help="run only the false-positive soak, this long")
    p.add_argument("--soak-phase-s", type=float, default=60.0)
    a = p.parse_args()
    faults = [f for f in a.faults.split(",") if f]
    if unknown := [f for f in faults if f not in FAULTS]:
        p.error(f"--faults: unknown {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    base = Path(tempfile.mkdtemp(prefix="ckptsup-bench-liveness-"))
    if a.soak_min:
        soak(base, a.soak_min, a.soak_phase_s)
        return 0
    if a.tree_only:
        tree_cost()
        return 0
    if not a.nvrx_only:
        stacks_of_eight(base)
        tree_cost()
    if a.stacks_only:
        return 0
    print(f"load at the start: {os.getloadavg()}", flush=True)
    rows = [detection(base, fault, a.nvrx, a.cap_s) for fault in faults]
    if not a.nvrx_only:
        (base / "busy").mkdir()
        rc, events, wall = launch(base / "busy", "--busy-at", "10,30:0", "--busy-s", str(a.busy_s))
        failures = [e for e in events if e["event"] == "failure_detected"]
        busy = [e for e in events if e["event"] == "busy"]
        rows.append({"case": "busy", "rc": rc, "failures": len(failures), "busy": [b["ranks"] for b in busy], "wall_s": wall})
        print(f"busy ({a.busy_s:g} s on every rank, then {a.busy_s:g} s on rank 0 while rank 1 waits in a barrier): "
              f"{len(failures)} failures (target 0), busy spells {[b['ranks'] for b in busy]}, rc {rc}, {wall:.0f} s wall")
    print(f"load at the end: {os.getloadavg()}; work dir {base}")
    print(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
