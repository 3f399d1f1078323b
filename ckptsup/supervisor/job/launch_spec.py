"""What an attempt launches: the job as the user asked for it (`Job`, from `ckptsup launch`'s
command line) and the launch spec every agent of the attempt starts torchrun from (`launch_spec`:
supervisor/spec.py's LaunchSpec, written to attempt-<N>/launch.json by the loop). The spec is
built from plain values — the config, the placement, the attempt's ids, its resume point, its
timeouts and the checkpoint schedule the interval tuner holds — so it is testable without a loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...config import AUTO, CLOUDS, Config
from ...rundir import RunDir
from ..spec import MONITOR_INTERVAL_S, LaunchSpec
from ..torchrun_args import TorchrunLine
from . import recovery
from .interval_tuner import IntervalTuner
from .nccl import Timeouts
from .placement import Placement

MIN_SHUTDOWN_TIMEOUT_S = 60.0   # torchrun's own shutdown wait, unless its command line set one


@dataclass(kw_only=True)
class Job:
    script: str            # a file's absolute path; the module name with `module`
    script_args: list[str]
    cwd: str
    nodes_needed: int
    expects_hello: bool = True   # the script uses ckptsup's hooks (recovery.uses_hooks): no hello in time is a hang
    module: bool = False   # torchrun -m
    no_python: bool = False  # torchrun --no-python: `script` is an executable
    torchrun: TorchrunLine = field(default_factory=TorchrunLine)   # torchrun's other options (torchrun_args.py)


@dataclass(frozen=True, kw_only=True)
class AttemptIds:
    """Who the attempt is: the ranks' job id, attempt and epoch, and where it logs."""

    job_id: str
    attempt: int
    epoch: int
    attempt_dir: Path


def launch_spec(*, config: Config, job: Job, script_args: list[str], placement: Placement, run_dir: RunDir,
                ckpt_dir: Path, ids: AttemptIds, nodes: tuple[str, ...], resume_from: str, timeouts: Timeouts,
                interval: IntervalTuner) -> LaunchSpec:
    """The attempt's launch spec on `nodes` (the first hosts the rendezvous). `script_args`: the
    job's, or with the script's resume arguments (script_checkpoint.py); `interval` is only read."""
    sup, line = config.supervisor, job.torchrun
    env = recovery.rank_env(config, run_dir=run_dir.path, config_json=run_dir.config_json_path,
                            secret_path=run_dir.secret_path, ckpt_dir=ckpt_dir,
                            job_id=ids.job_id, attempt=ids.attempt, epoch=ids.epoch,
                            resume_from=resume_from, timeouts=timeouts, save_every_s=interval.current_s(),
                            preempt_budget_s=interval.preempt_budget_s(),
                            memory_every_steps=interval.memory_every_steps())
    memory = config.memory
    return LaunchSpec(script=job.script, script_args=script_args,
                      nproc_per_node=sup.nproc_per_node, nnodes=len(nodes),
                      rdzv_endpoint=placement.rdzv_endpoint(nodes[0], sup.rdzv_port, ids.attempt),
                      rdzv_id=f"ckptsup-{ids.job_id}-{ids.attempt}",
                      node_addrs={n: placement.addrs.get(n, n) for n in nodes}, env=env,
                      log_dir=str(ids.attempt_dir), heartbeat_interval_s=sup.heartbeat_interval_s,
                      shutdown_timeout_s=max(MIN_SHUTDOWN_TIMEOUT_S, sup.kill_grace_s, interval.preempt_window_s())
                      if line.shutdown_timeout_s is None else float(line.shutdown_timeout_s),
                      monitor_interval_s=line.monitor_interval_s or MONITOR_INTERVAL_S,
                      torchrun_log_dir=line.log_dir, torchrun_options=list(line.passed),
                      console_local_ranks=line.console_local_ranks(sup.nproc_per_node),
                      kill_grace_s=sup.kill_grace_s, cwd=job.cwd, rdzv_backend=sup.rdzv_backend,
                      progress_pattern=sup.progress_pattern, tee=sup.tee,
                      module=job.module, no_python=job.no_python, warm_ranks=sup.warm_ranks,
                      memory_keep=memory.keep if memory.enabled else 0,
                      # auto: each rank checks its own fit (memory_tier.fit_budget); the agent takes what comes
                      memory_max_bytes=0 if memory.max_bytes == AUTO else memory.max_bytes,
                      memory_addrs={n: placement.addrs.get(n, n) for n in placement.nodes} if memory.enabled else {},
                      cloud_notice=config.preemption.cloud_notice,
                      cloud_endpoints={cloud: getattr(config.preemption, f"{cloud}_endpoint") for cloud in CLOUDS})
