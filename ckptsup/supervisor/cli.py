"""`ckptsup launch` and `ckptsup agent`: parse, validate at the edge, call the loop, exit with a
pinned ExitStatus. No torch import anywhere on this path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..env import SLURM_JOB_ID, ExitStatus
from ..errors import CkptsupError


class UsageError(CkptsupError):
    exit_code = int(ExitStatus.USAGE)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--nproc-per-node", type=int, default=None, help="ranks per node (supervisor.nproc_per_node)")
@click.option("--nodes", type=int, default=None,
              help="active nodes; the rest of the allocation are hot spares (supervisor.nodes)")
@click.option("--config", "job_config", type=click.Path(dir_okay=False), default=None, help="job TOML")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="run directory (run.run_dir; {job_id} expands); reuse it to resume a run")
@click.option("--max-restarts", type=int, default=None, help="restart budget (supervisor.max_restarts)")
@click.option("--resume/--new", "resume", default=None,
              help="the run dir holds an ended run: continue it, or move it aside and start afresh")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(nproc_per_node: int | None, nodes: int | None, job_config: str | None, run_dir: str | None,
           max_restarts: int | None, resume: bool | None, script: str, script_args: tuple[str, ...]) -> None:
    """Run SCRIPT under the supervisor: inside a Slurm allocation (one agent per active node),
    or locally on this machine. Everything after SCRIPT reaches the script untouched."""
    from ..config import load_config
    from ..rundir import RunDir
    from .loop import Job, Supervisor
    from .placement import Placement
    from .relaunch import prepare
    from .unhooked import uses_hooks

    flags = {"supervisor.nproc_per_node": nproc_per_node, "supervisor.nodes": nodes,
             "supervisor.max_restarts": max_restarts, "run.run_dir": run_dir}
    resolved = load_config(job_config=job_config, flags=flags)
    script_path = Path(script)
    if not script_path.is_file():
        raise UsageError(f"script {script} does not exist; pass the path of your training script")
    in_slurm = bool(os.environ.get(SLURM_JOB_ID))
    placement = Placement.from_slurm(os.environ, resolved.config.slurm) if in_slurm else Placement.local()
    sup = resolved.config.supervisor
    needed = sup.nodes or max(1, len(placement.nodes) - (resolved.config.sbatch.spares if in_slurm else 0))
    if needed > len(placement.nodes):
        where = f"the allocation has {len(placement.nodes)}" if in_slurm else "local mode runs one node"
        raise UsageError(f"--nodes {needed} active nodes requested but {where}; lower --nodes or allocate more")
    rd_path = resolved.config.run.run_dir.replace("{job_id}", placement.job_id)
    prepare(rd_path, resolved.config, job_id=placement.job_id, resume=resume)  # refuse, move aside, or resume
    run = RunDir.create(rd_path)
    job = Job(script=str(script_path.resolve()), script_args=list(script_args), cwd=os.getcwd(), nodes_needed=needed,
              expects_hello=uses_hooks(str(script_path)))
    status = Supervisor(resolved=resolved, job=job, run_dir=run, placement=placement).run()
    sys.exit(int(status))


@click.command(hidden=True)
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="the attempt's launch.json written by the supervisor")
@click.option("--attempt", type=int, required=True)
@click.option("--standby/--launch", default=False, help="start idle (wait for a restart command)")
def agent(spec_path: str, attempt: int, standby: bool) -> None:
    """Internal: the per-node agent started by `ckptsup launch` (srun task or child process).
    A missing, damaged or foreign spec (LaunchSpec.read: safe_io, every field checked) or secret is
    one `ckptsup: error:` line and exit 2 (USAGE), through main()."""
    from .agent import run_agent  # its first act: LaunchSpec.read(spec_path)

    sys.exit(int(run_agent(spec_path=spec_path, attempt=attempt, launch=not standby)))
