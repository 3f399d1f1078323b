"""Node health checks: before launch on every node, and after a failure on the suspects.

Checks on one node (`run_local_checks`), each a `CheckResult`:
  site:<cmd>       every [health].commands entry (argv string, shlex-split, no shell), with
                   [health].timeout_s; non-zero exit, a timeout or a missing program = unhealthy
  free_space:<t>   free space of each checkpoint tier path >= storage.min_free_gb
  shared_fs        the run dir is writable: create + write + fsync + remove a probe file
                   (in a thread, so a hung NFS mount fails the check instead of hanging us)
  gpus             the node shows the allocation's GPUs per node (the supervisor's figure,
                   `--gpus`): `nvidia-smi -L` lists at least that many; without nvidia-smi,
                   check_gpus = auto counts the devices Slurm gave the check's step (SLURM_GPUS_ON_NODE,
                   SLURM_STEP_GPUS, CUDA_VISIBLE_DEVICES: slurm/allocation.node_gpus) and
                   require fails. auto skips the check when the allocation has no GPU
  gpu_xid, gpu_ecc, gpu_remap, gpu_throttle, gpu_diag
                   with the gpus check, whichever tools are installed: XIDs from the kernel log
                   and DCGM, ECC and pending retirements, row remaps, clock throttling, dcgmi
                   diag -r 1 (supervisor/health/gpu_health.py; thresholds in [health])

On many nodes: `run_node_checks` starts one `srun --overlap` step per node at once (argv from
`node_checks_argv`) running `python -m ckptsup.supervisor.health.health`; each prints one JSON line,
which `parse_node_results` turns into a NodeHealth; a node that printed nothing is unhealthy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ... import step_lines
from ...config import Config, load_config, read_config_json
from ...env import NODE, SLURM_JOB_ID, node_name
from ...errors import CkptsupError
from ...rundir import CONFIG_JSON
from .gpu_health import gpu_checks, run_tool

DETAIL_MAX = 300
PIPE_DRAIN_S = 5.0   # after killing a timed-out check: its last output, if its pipe closes by then


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    ok: bool
    detail: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NodeHealth:
    node: str
    results: tuple[CheckResult, ...] = ()
    error: str = ""   # the node produced no result at all (srun failed, timed out, node dead)

    @property
    def ok(self) -> bool:
        return not self.error and all(r.ok for r in self.results)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        if self.error:
            return self.error
        bad = self.failed
        if bad:
            return "; ".join(f"{r.name}: {r.detail}" for r in bad)
        gpus = [r.detail for r in self.results if r.name == "gpus"]  # what the node showed of its GPUs
        return f"healthy ({gpus[0]})" if gpus else "healthy"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "ok": self.ok, "error": self.error,
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NodeHealth":
        results = tuple(CheckResult(name=str(r["name"]), ok=bool(r["ok"]), detail=str(r.get("detail", "")),
                                    duration_s=float(r.get("duration_s", 0.0))) for r in data.get("results", []))
        return cls(node=str(data["node"]), results=results, error=str(data.get("error", "")))


@dataclass(frozen=True, kw_only=True)
class CheckPaths:
    run_dir: Path
    tiers: Mapping[str, Path] = field(default_factory=dict)   # tier name -> directory


def check_paths(config: Config, run_dir: str | os.PathLike[str], *, node: str, job_id: str) -> CheckPaths:
    """The directories to check on `node`: the run dir, the shared checkpoint tier and, when
    configured, the node-local tier ({node} and {job_id} expanded). The object tier has no
    local free space to check."""
    run_dir = Path(run_dir)
    tiers: dict[str, Path] = {"shared": Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"}
    local = config.storage.node_local
    if local:
        local = local.removeprefix("file://").replace("{node}", node).replace("{job_id}", job_id)
        tiers["node_local"] = Path(local)
    return CheckPaths(run_dir=run_dir, tiers=tiers)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_MAX else text[: DETAIL_MAX - 3] + "..."


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(name: str, path: Path, min_free_gb: float,
                     disk_usage: Callable[[Path], Any] = shutil.disk_usage) -> CheckResult:
    t0 = time.monotonic()
    where = _existing_ancestor(path)
    try:
        free_gb = disk_usage(where).free / 1e9
    except OSError as err:
        return CheckResult(name=f"free_space:{name}", ok=False, detail=f"{where}: {err.strerror}",
                           duration_s=time.monotonic() - t0)
    ok = free_gb >= min_free_gb
    detail = f"{free_gb:.1f} GB free at {where} (minimum {min_free_gb:g} GB)"
    return CheckResult(name=f"free_space:{name}", ok=ok, detail=detail, duration_s=time.monotonic() - t0)


def _probe(run_dir: Path, node: str) -> None:
    probe = run_dir / f".health-{node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"ckptsup health probe\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(probe)


def check_shared_fs(run_dir: Path, node: str, timeout_s: float) -> CheckResult:
    t0 = time.monotonic()
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            _probe(run_dir, node)
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    thread = threading.Thread(target=target, name="health-shared-fs", daemon=True)
    thread.start()
    thread.join(timeout_s)
    took = time.monotonic() - t0
    if not outcome:
        return CheckResult(name="shared_fs", ok=False, detail=f"write+fsync in {run_dir} hung > {timeout_s:g}s",
                           duration_s=took)
    err = outcome[0]
    if err is not None:
        return CheckResult(name="shared_fs", ok=False, detail=f"cannot write+fsync in {run_dir}: {err}",
                           duration_s=took)
    return CheckResult(name="shared_fs", ok=True, detail=f"write+fsync+remove in {took * 1000:.0f} ms",
                       duration_s=took)


def run_command(name: str, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None) -> CheckResult:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired:
        return CheckResult(name=name, ok=False, detail=f"timed out after {timeout_s:g}s",
                           duration_s=time.monotonic() - t0)
    except (FileNotFoundError, PermissionError) as err:
        return CheckResult(name=name, ok=False, detail=f"cannot run {argv[0]}: {err.strerror}",
                           duration_s=time.monotonic() - t0)
    took = time.monotonic() - t0
    out = _clip(proc.stderr or proc.stdout)
    if proc.returncode != 0:
        return CheckResult(name=name, ok=False, detail=f"exit {proc.returncode}: {out}", duration_s=took)
    return CheckResult(name=name, ok=True, detail=_clip(proc.stdout), duration_s=took)


def check_gpus(mode: str, expected: int, timeout_s: float,
               which: Callable[[str], str | None] = shutil.which,
               env: Mapping[str, str] | None = None) -> CheckResult | None:
    """`expected`: the allocation's GPUs per node. None when there is nothing to check."""
    if mode == "off" or (mode == "auto" and expected <= 0):
        return None
    smi = which("nvidia-smi")
    if smi is None:
        if mode == "require":
            return CheckResult(name="gpus", ok=False, detail="nvidia-smi not found but [health].check_gpus = require")
        return _allocated_gpus(expected, os.environ if env is None else env)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return CheckResult(name="gpus", ok=False, detail=f"nvidia-smi -L timed out after {timeout_s:g}s",
                           duration_s=time.monotonic() - t0)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        return CheckResult(name="gpus", ok=False, detail=f"nvidia-smi -L exit {proc.returncode}: "
                           f"{_clip(proc.stderr or proc.stdout)}", duration_s=took)
    count = sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))
    want = max(1, expected)  # require with a GPU-less allocation: the node must still have one
    return CheckResult(name="gpus", ok=count >= want, detail=f"{count} GPU(s) visible (need {want})",
                       duration_s=took)


def _allocated_gpus(expected: int, env: Mapping[str, str]) -> CheckResult:
    """No nvidia-smi to ask (the dev cluster's fake GPUs): the devices Slurm gave this step."""
    from ...slurm.allocation import in_allocation, node_gpus

    count = node_gpus(env)
    source = "allocated by Slurm here" if in_allocation(env) else "in CUDA_VISIBLE_DEVICES"
    return CheckResult(name="gpus", ok=count >= expected,
                       detail=f"{count} GPU(s) {source}, no nvidia-smi to list them (need {expected})")


def run_local_checks(config: Config, paths: CheckPaths, *, node: str | None = None,
                     which: Callable[[str], str | None] = shutil.which,
                     gpus_per_node: int | None = None) -> list[CheckResult]:
    """Every check on this node; never raises for an unhealthy node (that is data).
    `gpus_per_node`: the allocation's (the supervisor's figure); None: this node's own."""
    node = node or node_name()
    health = config.health
    results: list[CheckResult] = []
    env = {**os.environ, NODE: node}
    for command in health.commands:
        try:
            argv = shlex.split(command)
        except ValueError as err:
            results.append(CheckResult(name=f"site:{command}", ok=False, detail=f"unparsable command: {err}"))
            continue
        if not argv:
            continue
        results.append(run_command(f"site:{command}", argv, health.timeout_s, env))
    for tier, path in paths.tiers.items():
        results.append(check_free_space(tier, Path(path), config.storage.min_free_gb))
    results.append(check_shared_fs(paths.run_dir, node, health.timeout_s))
    if gpus_per_node is None:
        from ...slurm.allocation import node_gpus

        gpus_per_node = node_gpus(os.environ)
    gpu = check_gpus(health.check_gpus, gpus_per_node, health.timeout_s, which=which)
    if gpu is not None:
        results.append(gpu)
        # XIDs, ECC, row remaps, throttling, dcgmi diag
        results.extend(CheckResult(name=f.name, ok=f.ok, detail=f.detail) for f in gpu_checks(health, run_tool(which)))
    return results


# ---- many nodes through one srun step ---------------------------------------------------------

def node_checks_argv(nodes: Sequence[str], run_dir: str | os.PathLike[str], *, job_id: str | None = None,
                     python: str = sys.executable, gpus_per_node: int | None = None) -> list[str]:
    """argv of an `srun --overlap` step running the checks once on each of `nodes`."""
    from ...slurm.client import SlurmClient

    gpus = [] if gpus_per_node is None else ["--gpus", str(gpus_per_node)]
    return SlurmClient.srun_argv(nodes=list(nodes), command=[python, "-m", "ckptsup.supervisor.health.health",
                                                             "--run-dir", str(run_dir), *gpus],
                                 input_all=False, job_id=job_id, extra=["--kill-on-bad-exit=0"])


def step_timeout_s(config: Config) -> float:
    """Upper bound of one node's checks, plus srun's own start-up."""
    per = config.health.timeout_s
    return per * (len(config.health.commands) + 2) + 15.0


def parse_node_results(stdout: str, nodes: Iterable[str], *, failure: str = "") -> dict[str, NodeHealth]:
    """One JSON line per node → {node: NodeHealth}; nodes without a line are unhealthy."""
    found: dict[str, NodeHealth] = {}
    joiner = step_lines.Joiner(max_bytes=1 << 20)
    for piece in stdout.splitlines():
        whole = joiner.feed(piece.encode(errors="replace"))
        if whole is None:
            continue
        line = whole.decode(errors="replace").strip()
        if not line.startswith("{"):
            continue
        try:
            health = NodeHealth.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError):
            continue
        found[health.node] = health
    out = {}
    for node in nodes:
        out[node] = found.get(node) or NodeHealth(
            node=node, error=f"no health result from {node}" + (f" ({_clip(failure)})" if failure else ""))
    return out


# srun's refusal for the job, not a node: a requeued job's batch script can start while Slurm still
# completes its previous run's steps (seen on the dev cluster after a preemption: every node's check
# refused at once, every node drained). Asked again a moment later; the nodes are never blamed for it.
_JOB_NOT_READY = re.compile(r"Job/step already completing or completed", re.I)
JOB_NOT_READY_TRIES = 15   # bounded at ~15 s: on a loaded controller the old run may take longer than 5 s to finish
JOB_NOT_READY_WAIT_S = 1.0


def run_node_checks(nodes: Sequence[str], run_dir: str | os.PathLike[str], config: Config, *,
                    job_id: str | None = None, env: Mapping[str, str] | None = None,
                    gpus_per_node: int | None = None) -> dict[str, NodeHealth]:
    """Run the checks on `nodes`, one `srun --overlap` step per node, all at once, and wait for
    them (bounded). One step per node so that a node Slurm already refuses (DOWN) or that hangs
    fails alone and never blames the healthy ones; a refusal of the job itself is asked again."""
    out: dict[str, NodeHealth] = {}
    left = list(nodes)
    for attempt in range(JOB_NOT_READY_TRIES):
        found = _check_once(left, run_dir, config, job_id=job_id, env=env, gpus_per_node=gpus_per_node)
        out.update(found)
        left = [n for n, h in found.items() if h.error and _JOB_NOT_READY.search(h.error)]
        if not left or attempt == JOB_NOT_READY_TRIES - 1:
            return out
        time.sleep(JOB_NOT_READY_WAIT_S)
    return out


def _check_once(nodes: Sequence[str], run_dir: str | os.PathLike[str], config: Config, *,
                job_id: str | None, env: Mapping[str, str] | None, gpus_per_node: int | None) -> dict[str, NodeHealth]:
    timeout = step_timeout_s(config)
    procs = {}
    for node in nodes:
        procs[node] = subprocess.Popen(node_checks_argv([node], run_dir, job_id=job_id, gpus_per_node=gpus_per_node),
                                       stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                       env=None if env is None else dict(env))
    deadline = time.monotonic() + timeout
    out: dict[str, NodeHealth] = {}
    for node, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                stdout, _ = proc.communicate(timeout=PIPE_DRAIN_S)
            except subprocess.TimeoutExpired:   # a child of the check still holds the pipe: do not wait on it
                stdout = ""
            out.update(parse_node_results(stdout or "", [node], failure=f"health step timed out after {timeout:g}s"))
            continue
        failure = "" if proc.returncode == 0 else f"srun exit {proc.returncode}: {stderr.strip()}"
        out.update(parse_node_results(stdout, [node], failure=failure))
    return out


def effective_config(run_dir: str | os.PathLike[str]) -> Config:
    """The config the supervisor resolved (run_dir/config.json), else the layered default."""
    path = Path(run_dir) / CONFIG_JSON
    if path.exists():
        return read_config_json(path).config
    return load_config().config


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptsup.supervisor.health.health",
                                     description="run ckptsup's node health checks here; print one JSON line")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--node", default=None)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--gpus", type=int, default=None, help="the allocation's GPUs per node (else this node's)")
    args = parser.parse_args(argv)
    node = args.node or node_name()
    job_id = args.job_id or os.environ.get(SLURM_JOB_ID, "local")
    try:
        config = effective_config(args.run_dir)
    except CkptsupError as err:  # reported as this node's result, one line
        _say_result(NodeHealth(node=node, error=f"config unreadable: {err}"))
        return 1
    paths = check_paths(config, args.run_dir, node=node, job_id=job_id)
    health = NodeHealth(node=node, results=tuple(run_local_checks(config, paths, node=node, gpus_per_node=args.gpus)))
    _say_result(health)
    return 0 if health.ok else 1


def _say_result(health: NodeHealth) -> None:
    """This node's one JSON line; long, it goes in pieces (srun merges every node's stdout)."""
    line = (json.dumps(health.to_dict()) + "\n").encode()
    sys.stdout.buffer.write(step_lines.pieces(line, health.node.encode()))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    sys.exit(_main())
