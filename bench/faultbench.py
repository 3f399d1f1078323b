"""Shared harness of bench_detect.py and bench_restart.py: run the same workload (examples/train.py,
2 gloo ranks) under a launcher, inject a fault into rank 1 from outside, and time what follows the
same way for every launcher, from this host's monotonic clock:

  acted      the launcher did something about it: a rank process of the old group is gone
             (SIGKILLed victims excluded: their death is the fault, not the reaction)
  running    every rank of a new group exists (new PIDs) — "ranks running again"
  stepping   a new group finished its first step (samples file grew after `running`)

ckptsup also records its own `failure_detected` (detect) and `restart_done` (phases) events.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ckptsup.events import Event

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
NVRX_TRAIN = ROOT / "bench" / "nvrx_train.py"
BIN = Path(sys.executable).parent
WORKLOAD = ["--steps", "100000", "--save-every-steps", "10", "--step-sleep-s", "0.1"]


@dataclass(kw_only=True)
class Result:
    tool: str
    fault: str
    acted_s: float | None = None
    running_s: float | None = None
    stepping_s: float | None = None
    detect_s: float | None = None          # the tool's own detection, where it reports one
    phases: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def cell(self, value: float | None, cap: float) -> str:
        return f"> {cap:g}" if value is None else f"{value:.2f}"


def have_ft_launcher() -> bool:
    return (BIN / "ft_launcher").exists()


def command(tool: str, work: Path, *, hang_timeout_s: float) -> list[str]:
    out = ["--out", str(work / "out"), "--checkpoint-dir", str(work / "ckpt")]
    if tool == "ckptsup":  # checkpoints go where the supervisor looks: <run_dir>/checkpoints
        out = out[:2]
        cfg = work / "job.toml"
        cfg.write_text(f"[supervisor]\nhang_timeout_s = {hang_timeout_s}\n[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n"
                       "[health]\nenabled = false\n")
        return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--config", str(cfg),
                "--run-dir", str(work / "run"), str(TRAIN), *WORKLOAD, *out]
    if tool == "torchrun":  # PyTorch defaults: no hang detection, gloo collective timeout 30 min
        return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", "3", str(TRAIN), *WORKLOAD, *out]
    if tool == "ft_launcher":
        return [str(BIN / "ft_launcher"), "--nproc-per-node", "2", "--max-restarts", "3",
                f"--ft-rank-heartbeat-timeout={hang_timeout_s}", "--ft-initial-rank-heartbeat-timeout=120",
                "--ft-workload-check-interval=0.5", str(NVRX_TRAIN), *WORKLOAD, *out]
    raise ValueError(tool)


def ranks(work: Path) -> dict[int, int]:
    """{pid: rank} of the workload's rank processes (matched by the unique --out path)."""
    found = {}
    needle = str(work / "out")
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or []).split()   # a titled rank: `ckptsup rank R: SCRIPT ARGS`
        if needle in cmd and any(str(TRAIN) in c or str(NVRX_TRAIN) in c for c in cmd):
            try:
                rank = proc.environ().get("RANK")
                if rank is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = int(rank)
            except psutil.Error:
                continue
    return found


def worker_ranks(script: Path, marker: Path) -> dict[int, int]:
    """{pid: rank} of a script's rank processes whose command line holds `marker` (a path unique
    to the run). A worker is `python [-u] SCRIPT ...` (cold) or `python -S
    .../ckptsup/rankside/warm_proxy.py SCRIPT ...` (warm: it stands in for its rank), or titled `ckptsup rank
    R: SCRIPT ...` once its hooks ran (a warm interpreter so titled has no RANK in /proc); the launchers name
    the script later in their command lines."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or []).split()   # a titled rank: `ckptsup rank R: SCRIPT ARGS`
        worker = (str(script) in cmd[:3] or cmd[:2] == ["ckptsup", "rank"]
                  or any(c == "ckptsup.rankside.warm_proxy" or c.endswith("rankside/warm_proxy.py") for c in cmd[:4]))
        if worker and str(script) in cmd and str(marker) in cmd:
            try:
                env = proc.environ()
                if "LOCAL_RANK" in env and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = int(env["RANK"])
            except (psutil.Error, KeyError, ValueError):
                continue
    return found


def samples(work: Path) -> int:
    path = work / "out" / "samples_rank0.jsonl"
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def events(work: Path) -> list[dict]:
    path = work / "run" / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def restart_events(work: Path, *, wait_s: float) -> list[dict]:
    """The run's events once `restart_done` is among them, or after `wait_s`. The supervisor records
    it when rank 0's first step after resume reaches it, which may be after the samples file grew:
    reading at once would race it (and tear the run down before it is written)."""
    deadline = time.monotonic() + wait_s
    while True:
        evts = events(work)
        if any(e["event"] == Event.RESTART_DONE for e in evts) or time.monotonic() >= deadline:
            return evts
        time.sleep(0.05)


def run_one(tool: str, fault: str, base: Path, *, cap_s: float, hang_timeout_s: float,
            warm_steps_bytes: int = 2000) -> Result:
    work = base / f"{tool}-{fault}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = open(work / "launcher.log", "w")
    proc = subprocess.Popen(command(tool, work, hang_timeout_s=hang_timeout_s), cwd=work, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    result = Result(tool=tool, fault=fault)
    try:
        deadline = time.monotonic() + 240
        while samples(work) < warm_steps_bytes or len(ranks(work)) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                result.note = f"workload did not start (rc={proc.poll()}); see {work / 'launcher.log'}"
                return result
            time.sleep(0.2)
        while tool == "ckptsup" and not any(e["event"] == Event.WARM_READY for e in events(work)):
            if proc.poll() is not None or time.monotonic() > deadline:
                result.note = "no warm_ready event: the restart below starts cold"
                break
            time.sleep(0.2)   # a fault before the warm interpreters are up restarts cold (docs/supervisor.md)
        old = ranks(work)
        victim = next(pid for pid, rank in old.items() if rank == 1)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
        size_at_running = None
        while time.monotonic() - t0 < cap_s:
            now = time.monotonic()
            current = ranks(work)
            if result.acted_s is None and any(p not in current for p in old if not (fault == "crash" and p == victim)):
                result.acted_s = now - t0
            new = [p for p in current if p not in old]
            if result.running_s is None and len(new) >= 2:
                result.running_s = now - t0
                size_at_running = samples(work)
            if size_at_running is not None and samples(work) > size_at_running:
                result.stepping_s = time.monotonic() - t0
                break
            time.sleep(0.02)
        if tool == "ckptsup":
            evts = restart_events(work, wait_s=5.0 if result.stepping_s is not None else 0.0)
            failure = next((e for e in evts if e["event"] == Event.FAILURE_DETECTED), None)
            if failure is not None:
                result.detect_s = failure["mono"] - t0
            restart = next((e for e in evts if e["event"] == Event.RESTART_DONE), None)
            if restart is not None:
                result.phases = restart["phases"]
        elif result.acted_s is not None:
            result.detect_s = result.acted_s
        return result
    finally:
        kill_launch(proc, lambda: ranks(work))
        log.close()


def kill_launch(proc: subprocess.Popen, rank_pids) -> None:
    """Leave nothing of a launcher run behind: its process tree, its session, and the ranks that
    `rank_pids()` still finds (torchrun starts them in their own sessions; stopped ones resumed
    first so that they can die)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    for member in family:
        try:
            member.kill()
        except psutil.Error:
            pass
    _signal_all(rank_pids(), signal.SIGCONT)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal_all(rank_pids(), signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)
    _signal_all(rank_pids(), signal.SIGKILL)


def _signal_all(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
