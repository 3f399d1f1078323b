"""The process-level parts of bench/gpu_check.py: the fast-path restart under `ckptsup launch`
beside torchrun's, GPU health against the real tools, the NCCL settings of a live rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check import ROOT, Context, Skip

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "gpu_train.py"
GPU_TOOLS = ROOT / "tests" / "helpers" / "gpu_tools"   # recorded nvidia-smi / dcgmi / dmesg (the dry run)


def child_env(**extra: str) -> dict[str, str]:
    """This interpreter's ckptsup for the children, and none of an outer supervisor's variables."""
    import ckptsup

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSUP_")}
    where = str(Path(ckptsup.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([where, *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _tail(path: Path, n: int = 1500) -> str:
    from ckptsup.textsafe import literal

    try:
        return literal(path.read_text(errors="replace")[-n:], limit=n, newlines=True)
    except OSError:
        return ""


# ---- fast-path restart ------------------------------------------------------------------------------

def step_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:   # a line being written
            continue
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def keep_logs(work: Path, out: Path, tool: str) -> str:
    """A failed launch's logs (launcher, ranks, agents, events) as one archive beside the JSON:
    a device run cannot be repeated to look at them (8 files come back, 2 folders down)."""
    import tarfile

    dest = out.parent / f"restart-{tool}-logs.tar.gz"
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and (path.suffix in (".log", ".jsonl", ".json", ".txt") or path.parent.name == "stacks"):
                if path.stat().st_size < (8 << 20):
                    tar.add(path, arcname=str(path.relative_to(work)))
    return str(dest)


def restart_command(tool: str, work: Path) -> list[str]:
    steps = ["--out", str(work / "steps.jsonl"), "--save-every-steps", "10"]
    if tool == "ckptsup":   # its checkpoints go where the supervisor says (<run_dir>/checkpoints)
        cfg = work / "job.toml"
        cfg.write_text("[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n"
                       "[health]\nenabled = false\n")
        return [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "1", "--config", str(cfg),
                "--run-dir", str(work / "run"), str(TRAIN), *steps]
    # torchrun's own restart (PyTorch's defaults otherwise), the same script resuming from its checkpoint
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "3",
            str(TRAIN), *steps, "--checkpoint-dir", str(work / "ckpt")]


def time_restart(tool: str, ctx: Context, cap_s: float, *, wait_warm: bool) -> dict[str, Any]:
    """Start `tool` on the script, wait for 12 steps (a checkpoint at 10) and, under ckptsup with
    `wait_warm`, its warm interpreters; SIGKILL the rank; fault -> first step of the new rank process."""
    from faultbench import kill_launch

    from ckptsup.events import Event

    work = ctx.work / f"restart-{tool}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log_path = work / "launcher.log"
    deadline = time.monotonic() + cap_s
    row: dict[str, Any] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(restart_command(tool, work), cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(), start_new_session=True)
        pids: set[int] = set()

        def rank_pids() -> list[int]:
            return sorted(pids)
        try:
            t_start = time.monotonic()
            while True:
                lines = step_lines(work / "steps.jsonl")
                pids |= {ln["pid"] for ln in lines}
                if len(lines) >= 12 and (tool != "ckptsup" or not wait_warm or any(e.get("event") == Event.WARM_READY for e in events(work / "run"))):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    row["note"] = (f"{tool} did not reach 12 steps{' and warm_ready' if tool == 'ckptsup' and wait_warm else ''} "
                                   f"in {time.monotonic() - t_start:.0f}s (rc={proc.poll()})")
                    row["log_tail"] = _tail(log_path)
                    row["logs"] = keep_logs(work, Path(ctx.args.out), tool)
                    return row
                time.sleep(0.05)
            row["start_to_12_steps_s"] = round(time.monotonic() - t_start, 3)
            victim = lines[-1]["pid"]
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while time.monotonic() < deadline:
                new = [ln for ln in step_lines(work / "steps.jsonl") if ln["pid"] != victim and ln["mono"] > t0]
                if new:
                    pids |= {ln["pid"] for ln in new}
                    row.update(fault_to_first_step_s=round(new[0]["mono"] - t0, 3), resumed_at_step=new[0]["step"])
                    break
                if proc.poll() is not None:
                    row["note"] = f"{tool} exited (rc={proc.returncode}) without a new rank stepping"
                    break
                time.sleep(0.02)
            else:
                row["note"] = f"no step after the kill within the {cap_s:.0f}s cap"
            if tool == "ckptsup":
                evts = events(work / "run")
                done = next((e for e in evts if e.get("event") == Event.RESTART_DONE), None)
                failure = next((e for e in evts if e.get("event") == Event.FAILURE_DETECTED), None)
                if failure is not None and "mono" in failure:
                    row["fault_to_detect_s"] = round(failure["mono"] - t0, 3)
                if done is not None:
                    row.update(restart_s=done.get("restart_s"), phases=done.get("phases"), warm=done.get("warm"),
                               path=done.get("path"))
            if "fault_to_first_step_s" not in row:
                row["log_tail"] = _tail(log_path)
                row["logs"] = keep_logs(work, Path(ctx.args.out), tool)
        finally:
            kill_launch(proc, rank_pids)
    return row


def part_restart(ctx: Context) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    # the dry run: ckptsup's path alone, restarting cold (its warm interpreters take ~10 s more here)
    tools = ("ckptsup",) if ctx.dry_run else ("ckptsup", "torchrun")
    if ctx.dry_run:
        skipped["torchrun"] = "dry run: ckptsup's path only (no timing claims to compare)"
    for i, tool in enumerate(tools):
        # each tool gets its part of what is left, and never less than what a start needs
        cap = ctx.left() / (len(tools) - i)
        if cap < 20:
            skipped[tool] = f"budget: {ctx.left():.0f}s left"
            continue
        figures[tool] = time_restart(tool, ctx, cap, wait_warm=not ctx.dry_run)
    mine = figures.get("ckptsup", {}).get("fault_to_first_step_s")
    theirs = figures.get("torchrun", {}).get("fault_to_first_step_s")
    checks: dict[str, bool] = {}
    if mine is not None:
        figures["ckptsup_fault_to_first_step_s"] = mine
    if theirs is not None:
        figures["torchrun_fault_to_first_step_s"] = theirs
    if mine is not None and theirs is not None:
        figures["torchrun_over_ckptsup"] = round(theirs / mine, 3)
    checks["ckptsup restarted the rank (a step after the kill)"] = mine is not None
    if "torchrun" in figures:
        checks["torchrun restarted the rank (a step after the kill)"] = theirs is not None
    if "ckptsup" not in figures:
        raise Skip(skipped.get("ckptsup", "budget"))
    return {"figures": figures, "checks": checks, "skipped_steps": skipped}


# ---- GPU health ---------------------------------------------------------------------------------------

# every source the checks read (gpu_health.py), by the check that reads it
SOURCES = {"gpu_xid": (["dmesg"], ["dcgmi", "dmon", "-e", "230", "-c", "1"]),
           "gpu_ecc": (["nvidia-smi", "--query-gpu=QUERY", "--format=csv,noheader,nounits"],),
           "gpu_throttle": (["nvidia-smi", "--query-gpu=QUERY", "--format=csv,noheader,nounits"],),
           "gpu_remap": (["nvidia-smi", "--query-remapped-rows=REMAP", "--format=csv,noheader"],),
           "gpu_diag": (["dcgmi", "diag", "-r", "1"],)}


def _argv(argv: list[str]) -> list[str]:
    from ckptsup.supervisor.health.gpu_health import QUERY_FIELDS, REMAP_FIELDS

    return [a.replace("QUERY", ",".join(QUERY_FIELDS)).replace("REMAP", ",".join(REMAP_FIELDS)) for a in argv]


def _key(argv: list[str]) -> str:
    """A source's name in the JSON: the tool and its first argument, without the field list."""
    return " ".join(argv[:2]).split("=")[0]


def read_sources(runner: Any, timeout_s: float) -> dict[str, dict[str, Any]]:
    """What each tool answers on this machine: missing, its exit status, the start of its output."""
    from ckptsup.textsafe import literal

    out: dict[str, dict[str, Any]] = {}
    for argvs in SOURCES.values():
        for argv in argvs:
            key = _key(argv)
            if key in out:
                continue
            if argv[:2] == ["dcgmi", "diag"]:
                timeout = max(timeout_s, 120.0)
            else:
                timeout = timeout_s
            t0 = time.monotonic()
            ran = runner(_argv(argv), timeout)
            took = round(time.monotonic() - t0, 3)
            out[key] = ({"present": False} if ran is None else
                        {"present": True, "rc": ran.rc, "s": took, "out": literal(ran.out[:600], limit=600, newlines=True),
                         "err": literal(ran.err[:300], limit=300, newlines=True)})
    return out


def verdicts(sources: dict[str, dict[str, Any]], findings: list[Any]) -> dict[str, dict[str, Any]]:
    """Per check: ok / failed / unknown. A check with no finding is unknown (its tool is missing);
    one whose every source is missing or unreadable but that still says ok is flagged
    `absent_as_healthy` (the issue's rule: an absent source is unknown, never healthy)."""
    by_name = {f.name: f for f in findings}
    out: dict[str, dict[str, Any]] = {}
    for check, argvs in SOURCES.items():
        readable = [_key(a) for a in argvs if sources.get(_key(a), {}).get("present") and sources[_key(a)].get("rc") == 0]
        finding = by_name.get(check)
        if finding is None:
            out[check] = {"status": "unknown", "why": "no source: " + ", ".join(_key(a) for a in argvs) + " missing"}
            continue
        entry = {"status": "ok" if finding.ok else "failed", "detail": finding.detail, "read": readable}
        if finding.ok and not readable:
            entry["absent_as_healthy"] = True
        out[check] = entry
    return out


def health_round(runner: Any) -> dict[str, Any]:
    from ckptsup.config import Config
    from ckptsup.supervisor.health.gpu_health import gpu_checks

    health = Config().health
    sources = read_sources(runner, health.timeout_s)
    t0 = time.monotonic()
    findings = gpu_checks(health, runner)
    return {"checks_s": round(time.monotonic() - t0, 3), "sources": sources, "verdicts": verdicts(sources, findings)}


def part_gpu_health(ctx: Context) -> dict[str, Any]:
    from ckptsup.supervisor.health.gpu_health import run_tool

    rounds: dict[str, Any] = {}
    if ctx.dry_run:   # the recorded tools, and none at all
        rounds["recorded"] = health_round(run_tool(lambda name: str(GPU_TOOLS / name) if (GPU_TOOLS / name).exists() else None))
        rounds["missing"] = health_round(run_tool(lambda name: None))
    else:
        rounds["this_machine"] = health_round(run_tool())
    checks: dict[str, bool] = {}
    for label, r in rounds.items():
        flagged = [c for c, v in r["verdicts"].items() if v.get("absent_as_healthy")]
        checks[f"{label}: no absent source reported healthy"] = not flagged
        missing = [k for k, s in r["sources"].items() if not s["present"]]
        checks[f"{label}: missing sources ({', '.join(missing) or 'none'}) -> unknown"] = all(
            v["status"] == "unknown" for c, v in r["verdicts"].items()
            if all(_key(a) in missing for a in SOURCES[c]))
    if "recorded" in rounds:
        checks["recorded: nvidia-smi checks read ok"] = all(
            rounds["recorded"]["verdicts"][c]["status"] == "ok" for c in ("gpu_ecc", "gpu_throttle", "gpu_remap"))
    if "this_machine" in rounds:
        sources = rounds["this_machine"]["sources"]
        query = sources.get(_first_key(sources, "nvidia-smi"), {})
        checks["nvidia-smi present"] = bool(query.get("present"))
        checks["nvidia-smi --query-gpu answered (exit 0)"] = query.get("rc") == 0
    return {"figures": rounds, "checks": checks}


def _first_key(sources: dict[str, Any], tool: str) -> str:
    return next((k for k in sources if k.split()[0] == tool), "")


# ---- NCCL ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_nccl(ctx: Context) -> dict[str, Any]:
    from ckptsup import env as envvars
    from ckptsup.config import Config
    from ckptsup.supervisor.job.nccl import flight_recorder_dir, nccl_env

    config = Config()
    run_dir = ctx.work / "nccl-run"
    # an attempt that has measured its steps and one save: the steady timeout is then derived, not the init value
    exported = nccl_env(config, run_dir=run_dir, attempt=0, step_times=[0.2] * 50, save_times=[2.0])
    flight_recorder_dir(run_dir, 0).mkdir(parents=True, exist_ok=True)
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env = child_env(**exported, **rank)
    timeout = max(10.0, ctx.left())
    try:
        proc = subprocess.run([sys.executable, str(HERE / "gpu_rank_nccl.py")], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=ctx.work)
    except subprocess.TimeoutExpired:
        raise Skip(f"the rank did not finish within {timeout:.0f}s") from None
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GPU_CHECK_NCCL ")), None)
    if proc.returncode != 0 or line is None:
        from ckptsup.textsafe import literal

        raise RuntimeError(f"the rank exited {proc.returncode}: {literal(proc.stderr[-600:], limit=600)}")
    seen = json.loads(line.split(" ", 1)[1])
    want_init = float(exported[envvars.COLLECTIVE_TIMEOUT_INIT_S])
    want_steady = float(exported[envvars.COLLECTIVE_TIMEOUT_S])
    figures = {"backend": seen["backend"], "exported": exported, "live": seen,
               "init_timeout_s": seen["init_timeout_s"], "steady_timeout_s": seen["steady_timeout_s"],
               "want_init_s": want_init, "want_steady_s": want_steady}
    watchdog = [envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING, envvars.TORCH_NCCL_ENABLE_MONITORING,
                envvars.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, envvars.TORCH_NCCL_DUMP_ON_TIMEOUT,
                envvars.TORCH_NCCL_TRACE_BUFFER_SIZE, envvars.TORCH_FR_BUFFER_SIZE]
    checks = {f"backend is {'nccl' if ctx.device == 'cuda' else 'gloo'}": seen["backend"] == ("nccl" if ctx.device == "cuda" else "gloo"),
              "all_reduce on the device": bool(seen["all_reduce_ok"]),
              "live init timeout = CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S": seen["init_timeout_s"] == want_init,
              "moved to the steady timeout": bool(seen["moved_to_steady"]),
              "live steady timeout = CKPTSUP_COLLECTIVE_TIMEOUT_S": seen["steady_timeout_s"] == want_steady,
              "watchdog variables seen by the rank as exported": all(seen["env"].get(k) == exported[k] for k in watchdog)}
    dump = seen.get("fr_dump", {})
    figures["fr_dump"] = dump
    if ctx.device == "cuda":   # gloo keeps no flight recorder of its own in every torch: a dry run records only
        checks["flight recorder dumped, naming the all-reduce"] = bool(dump.get("path")) and bool(dump.get("names_all_reduce"))
    return {"figures": figures, "checks": checks}
