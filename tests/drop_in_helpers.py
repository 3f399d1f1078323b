"""Shared by the drop-in tests: an unmodified DDP script (tests/helpers/plain_ddp.py), its
uninterrupted reference under plain torchrun, and finding its steps; and, for every test that
signals a rank, finding the rank's real process (rank_processes, real_rank). Starting runs and
reading their events: run_helpers.py."""
import re
from pathlib import Path

import psutil
import torch

from run_helpers import uninterrupted

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "plain_ddp.py"
STEP_LINE = re.compile(rb"step (\d+) loss")


def rank_processes(script: Path, marker: Path) -> dict[int, psutil.Process]:
    """The processes that run `script`'s ranks (real_rank: a warm interpreter, not its proxy) in
    the run whose command line names `marker` (the test's own checkpoint dir or output), by global
    rank. One finder for every test that signals a rank (drop-in, Lightning, HF, torchtitan, ...)."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = words(p.info["cmdline"] or [])   # a rank is titled `ckptsup rank R: ...`
        launcher = "torch.distributed.run" in cmd or cmd[:2] == ["ckptsup", "torchrun:"]
        if str(script) in cmd and str(marker) in cmd and not launcher:
            try:
                env = p.environ()
                if "RANK" in env and "LOCAL_RANK" in env:
                    out[int(env["RANK"])] = real_rank(p)
            except psutil.Error:
                continue   # it ended meanwhile
    return out


def env_processes(**match: str | None) -> list[psutil.Process]:
    """Host processes whose environment has every KEY=VALUE of `match` (None: KEY set, to any value).
    A dev-cluster node's PIDs are the host's; a warm rank's proxy has its rank's environment, the warm
    interpreter has its zygote's (real_rank, with_real_ranks find it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if all(key in env if want is None else env.get(key) == want for key, want in match.items()):
            found.append(proc)
    return found


def with_real_ranks(procs: list[psutil.Process]) -> list[psutil.Process]:
    """`procs` (found by a rank's environment: a cold rank or a warm rank's proxy) and, for each proxy,
    the warm interpreter that runs its rank (real_rank): what must be gone when the ranks are."""
    out = list(procs)
    for proc in procs:
        try:
            real = real_rank(proc)
        except (psutil.Error, AssertionError):
            continue   # it ended meanwhile
        if real.pid not in {p.pid for p in out}:
            out.append(real)
    return out


def rank_process(script: Path, marker: Path, rank: int) -> psutil.Process:
    found = rank_processes(script, marker)
    if rank not in found:
        raise AssertionError(f"rank {rank} of {script.name} ({marker}) not found; ranks seen: {sorted(found)}")
    return found[rank]


def newest_step(run: Path) -> int:
    """The newest `step N` line in the newest attempt's rank logs (-1: none yet)."""
    attempts = sorted(run.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    if not attempts:
        return -1
    found = [int(s) for log in attempts[-1].glob("ranks-*.log") for s in STEP_LINE.findall(log.read_bytes())]
    return max(found, default=-1)


def reference(tmp_path: Path, steps: int) -> dict:
    """The same script, uninterrupted, under plain torchrun (2 ranks): the final model."""
    out = tmp_path / "ref.pt"
    uninterrupted(SCRIPT, "--steps", str(steps), "--ckpt-dir", str(tmp_path / "ref-ckpt"), "--out", str(out),
                  "--step-s", "0", cwd=tmp_path)
    return torch.load(out)


def same_model(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def words(cmd: list[str]) -> list[str]:
    """A process's command line as words: a titled rank (`ckptsup rank R: SCRIPT ARGS`, one
    NUL-padded string in /proc) and an untitled one match the same way."""
    return " ".join(cmd).split()


def real_rank(proc: psutil.Process) -> psutil.Process:
    """The process that runs a rank. A cold worker is the rank itself; a warm_proxy worker stands in
    for a warm rank interpreter (docs/supervisor.md §Warm restarts): the agent's child (its zygote
    forked it; the proxy is torchrun's, torchrun the agent's) of the proxy's local rank, in use
    (titled `ckptsup rank R: ...` once it runs the rank, or still `ckptsup warm interpreter L: PATH`
    with its socket gone), with the same working directory. Signals meant for the rank's process
    (SIGSTOP) must go there."""
    cmd = proc.cmdline()
    if not any(part == "ckptsup.rankside.warm_proxy" or part.endswith("rankside/warm_proxy.py") for part in cmd):
        return proc   # a warm worker is `python -S .../rankside/warm_proxy.py SCRIPT` (agent.WARM_PROXY)
    env, cwd = proc.environ(), proc.cwd()
    agent = proc.parent().parent()
    for child in agent.children():
        try:
            title = " ".join(words(child.cmdline()))
            waiting = title.startswith(f"ckptsup warm interpreter {env.get('LOCAL_RANK')}: ") \
                and not Path(title.split(": ", 1)[1]).exists()
            if (title.startswith(f"ckptsup rank {env.get('RANK')}: ") or waiting) and child.cwd() == cwd:
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no warm rank interpreter behind proxy {proc.pid}")
