"""`ckptsup launch` and `ckptsup agent`: parse, validate at the edge, call the loop, exit with a
pinned ExitStatus. No torch import anywhere on this path."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import click

from .. import console
from ..config import Resolved, load_config
from ..container import container_flags, container_options
from ..env import SLURM_JOB_ID, SLURM_STEP_ID
from .torchrun_args import UsageError

if TYPE_CHECKING:
    from .job.placement import Placement


_NOT_TORCHRUN = "(ckptsup's, not torchrun's)"


class TorchrunCommand(click.Command):
    """`ckptsup launch`: torchrun's command line goes through torchrun_args.normalize (torchrun's
    spellings, abbreviations, `-t/--tee VALUE` or a bare `--tee`, unknown options in torchrun's
    words) before click parses it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from .torchrun_args import normalize

        tokens = normalize(args, known_options(self.get_params(ctx)))
        script_at = next((i for i, t in enumerate(tokens) if not t.startswith("-")), len(tokens))
        # the spelling of the node count, for the error that compares it with the allocation
        ctx.meta["ckptsup.nodes_flag"] = next((t.split("=")[0] for t in tokens[:script_at]
                                               if t.split("=")[0] in ("--nodes", "--nnodes")), "--nnodes")
        return super().parse_args(ctx, tokens)


def known_options(params: list[click.Parameter]) -> dict[str, bool]:
    """Every option spelling of a command -> whether it takes a value."""
    return {spelling: not (p.is_flag or p.count) for p in params if isinstance(p, click.Option)
            for spelling in (*p.opts, *p.secondary_opts)}


def torchrun_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """torchrun's options that are not ckptsup's own (torchrun_args.OPTIONS: passed on, relayed,
    ignored), declared hidden; docs/drop-in.md's table says what each does."""
    from .torchrun_args import OPTIONS, Handling

    for opt in reversed(OPTIONS):
        if opt.handling is not Handling.OWN and opt.dest != "tee":
            f = click.option(*opt.spellings, opt.dest, is_flag=not opt.value, default=False if not opt.value else None,
                             hidden=True)(f)
    return f


@click.command(cls=TorchrunCommand,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", metavar="N|gpu|auto", default=None,
              help="ranks per node (supervisor.nproc_per_node): a number; gpu = the allocation's GPUs per node; "
                   "auto (default) = its GPUs per node, else 1")
@click.option("--nodes", "--nnodes", "nodes", metavar="N", default=None,
              help="active nodes; the rest of the allocation are hot spares (supervisor.nodes); torchrun's "
                   "MIN:MAX: MAX active, and a lost node with no spare left continues on >= MIN survivors when "
                   "that costs less than a requeue (supervisor.min_nodes)")
@click.option("-m", "--module", "module", is_flag=True, default=False,
              help="SCRIPT is a module name, run as `python -m SCRIPT` (torchrun's -m)")
@click.option("--no-python", "--no_python", "no_python", is_flag=True, default=False,
              help="SCRIPT is an executable, run without python (torchrun's --no-python)")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=int, default=None,
              help=f"restart budget of the whole run, all attempts {_NOT_TORCHRUN}; supervisor.max_restarts")
@click.option("-t", "--tee", "tee", metavar="[VALUE]", default=None,
              help="every rank's output on the console, prefixed [rankN]: (supervisor.tee; default: rank 0's); "
                   "torchrun's -t VALUE means the same here (torchrun's files get every stream)")
@torchrun_options
@click.option("--config", "job_config", type=click.Path(dir_okay=False), default=None, help="job TOML")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="run directory (run.run_dir; {job_id} expands); reuse it to resume a run")
@click.option("--resume/--new", "resume", default=None,
              help="the run dir holds an ended run: continue it, or move it aside and start afresh")
@click.option("--spares", type=int, default=None,
              help="hot spare nodes: without --nodes, active = the allocation's nodes minus these (sbatch.spares)")
@click.option("--signal-lead-s", type=int, default=None,
              help="seconds of warning the job gets before its time limit, --signal=B:USR1@N (sbatch.signal_lead_s)")
@click.option("--memory-every-steps", type=int, default=None, metavar="N",
              help="memory saves every N steps ([memory] every_steps); set here or in a TOML, the adaptive "
                   "interval never changes it (left unset, it retunes it, never past the job's disk saves)")
@click.option("--script-checkpoint", "script_checkpoint", multiple=True, metavar="PATH",
              help="the script's own checkpoint file (a path or a glob, relative to the launch directory; "
                   "repeatable; supervisor.script_checkpoint): each version is checked and the newest verified ones "
                   "kept; a corrupt one is put back from them before a relaunch")
@click.option("--resume-args", "resume_args", default=None, metavar="ARGS",
              help="words (split as a shell would) added to the script's arguments on every attempt that starts "
                   "with a verified script checkpoint in place, e.g. \"--init_from=resume\" (supervisor.resume_args)")
@container_options
@click.option("--gpus-per-node", type=int, default=None, hidden=True,
              help="GPUs per node the job was submitted with (sbatch.gpus_per_node; set by `ckptsup sbatch`)")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(nproc_per_node: str | None, nodes: str | None, module: bool, no_python: bool, max_restarts: int | None,
           tee: str | None, job_config: str | None, run_dir: str | None, resume: bool | None, spares: int | None,
           signal_lead_s: int | None, memory_every_steps: int | None, script_checkpoint: tuple[str, ...],
           resume_args: str | None, gpus_per_node: int | None, script: str,
           script_args: tuple[str, ...], **torchrun: Any) -> None:
    """Run SCRIPT under the supervisor: inside a Slurm allocation (one agent per active node),
    or locally on this machine. Everything after SCRIPT reaches the script untouched.

    torchrun's whole command line works as it is (docs/drop-in.md: what ckptsup does with each of
    its options); its rendezvous flags (--standalone, --rdzv-*, --master-*, --node-rank,
    --local-addr) are ignored with one line: ckptsup picks the rendezvous."""
    from ..rundir import RunDir
    from .job.loop import Job, Supervisor
    from .job.placement import Placement
    from .job.relaunch import prepare
    from .job.unhooked import uses_hooks
    from .torchrun_args import check_target, interpret, node_range, nproc_choice

    refuse_srun_tasks(os.environ)
    console.configure("supervisor")   # a bad CKPTSUP_LOG_FORMAT stops here, in one line
    boxed = container_flags(torchrun)
    line = interpret({**torchrun, "tee": tee}, cwd=os.getcwd())
    for info in line.infos:
        console.info(f"ckptsup: {info}", err=True)
    if line.run_path:   # torchrun's --run-path wins over -m and --no-python: SCRIPT is a python file
        module = no_python = False
    least, most = node_range(nodes, flag=click.get_current_context().meta.get("ckptsup.nodes_flag", "--nnodes"))
    flags = {"supervisor.nproc_per_node": nproc_choice(nproc_per_node), "supervisor.nodes": most,
             "supervisor.min_nodes": least,
             "supervisor.max_restarts": max_restarts, "supervisor.tee": line.tee_all, "run.run_dir": run_dir,
             "supervisor.warm_ranks": False if line.cold_ranks else None,
             "sbatch.spares": spares, "sbatch.signal_lead_s": signal_lead_s, "sbatch.gpus_per_node": gpus_per_node,
             "memory.every_steps": memory_every_steps,
             "supervisor.script_checkpoint": list(script_checkpoint) or None, "supervisor.resume_args": resume_args,
             **boxed.config_flags()}
    resolved = load_config(job_config=job_config, flags=flags)
    if line.virtual_local_rank and resolved.config.storage.node_local:
        raise UsageError("--virtual-local-rank makes LOCAL_RANK 0 on every rank, and the [storage] node_local cache "
                         "keeps one directory per LOCAL_RANK; drop the flag or the node_local tier")
    target = check_target(script, module=module, no_python=no_python, cwd=os.getcwd())
    in_slurm = bool(os.environ.get(SLURM_JOB_ID))
    placement = Placement.from_slurm(os.environ, resolved.config.slurm) if in_slurm else Placement.local()
    resolved = with_ranks_per_node(resolved, placement)
    sup = resolved.config.supervisor
    needed = sup.nodes or max(1, len(placement.nodes) - (resolved.config.sbatch.spares if in_slurm else 0))
    if needed > len(placement.nodes):
        flag = click.get_current_context().meta.get("ckptsup.nodes_flag", "--nnodes")
        asked = f"{flag} {needed}" if nodes is not None else f"supervisor.nodes = {needed}:"
        where = (f"the allocation has {len(placement.nodes)} (job {placement.job_id})" if in_slurm
                 else "local mode runs 1 node")
        raise UsageError(f"{asked} active nodes requested but {where}; pass {flag} {len(placement.nodes)} or fewer "
                         "(the rest are hot spares), or allocate more")
    if sup.min_nodes > needed:
        source = resolved.provenance.get("supervisor.min_nodes", "default")
        raise UsageError(f"supervisor.min_nodes = {sup.min_nodes} ({source}) is more than the {needed} active nodes: "
                         f"MIN must be at most MAX; pass --nnodes MIN:{needed} with MIN <= {needed}")
    prom = resolved.config.report.prom_textfile.replace("{job_id}", placement.job_id)
    if prom and not Path(prom).parent.is_dir():
        raise UsageError(f"report.prom_textfile = {prom!r}: its directory does not exist; point it into "
                         "node_exporter's --collector.textfile.directory")
    rd_path = resolved.config.run.run_dir.replace("{job_id}", placement.job_id)
    placement = with_container(placement, resolved, run_dir=rd_path, script=target.script, module=target.module)
    prepare(rd_path, resolved.config, job_id=placement.job_id, resume=resume)  # refuse, move aside, or resume
    run = RunDir.create(rd_path)
    job = Job(script=target.script, script_args=list(script_args), cwd=os.getcwd(), nodes_needed=needed,
              module=target.module, no_python=target.no_python, torchrun=line,
              expects_hello=uses_hooks(target.script, module=target.module, no_python=target.no_python))
    status = Supervisor(resolved=resolved, job=job, run_dir=run, placement=placement).run()
    sys.exit(int(status))


def with_container(placement: Placement, resolved: Resolved, *, run_dir: str, script: str, module: bool) -> Placement:
    """`placement` with the job's container plan, checked before any step starts (one line each problem)."""
    from ..container import needed_paths, plan, problems

    box = plan(resolved.config.container, job_id=placement.job_id,
               needed_paths=needed_paths(resolved.config, run_dir=run_dir, cwd=os.getcwd(), script=script, module=module))
    if not box.on:
        return placement
    if not placement.in_slurm:
        raise UsageError(f"container.runtime = {box.runtime.value} ({resolved.provenance.get('container.runtime')}) "
                         "needs a Slurm allocation: local mode runs on this machine's Python; drop the container "
                         "option or run inside sbatch/salloc")
    found = problems(box, srun_help=lambda: placement.slurm.run(["srun", "--help"]).stdout)
    if found:
        raise UsageError("; ".join(found))
    return dataclasses.replace(placement, container=box)


def refuse_srun_tasks(env: Mapping[str, str]) -> None:
    """`srun ckptsup launch` (one task per node) would start a supervisor per node, each launching
    the whole job: every task exits 2, task 0 says why and what to do instead."""
    from ..slurm.allocation import srun_task

    found = srun_task(env)
    if found is None:
        return
    task, tasks = found
    if task == 0:
        click.echo(f"ckptsup launch: started by srun as {tasks} tasks (SLURM_STEP_ID={env.get(SLURM_STEP_ID)}): "
                   "it is the job's one supervisor and starts its own srun step for the nodes; call it once from "
                   "the batch script, without srun in front (`ckptsup sbatch` writes such a script)", err=True)
    sys.exit(2)


def with_ranks_per_node(resolved: Resolved, placement: Placement) -> Resolved:
    """`resolved` with supervisor.nproc_per_node an integer: gpu/auto become the allocation's
    GPUs per node (auto: else 1), recorded as coming from the allocation. Everything after the
    edge (the loop, the launch spec, the tracker) counts ranks with it."""
    from .torchrun_args import resolve_nproc

    sup = resolved.config.supervisor
    ranks, why = resolve_nproc(sup.nproc_per_node, placement.gpus_per_node, in_slurm=placement.in_slurm)
    if not why:
        return resolved
    key = "supervisor.nproc_per_node"
    config = dataclasses.replace(resolved.config, supervisor=dataclasses.replace(sup, nproc_per_node=ranks))
    was = resolved.provenance.get(key, "default")
    return Resolved(config=config, provenance={**resolved.provenance,
                                                key: f"allocation ({sup.nproc_per_node} from {was}: {why})"})


@click.command(hidden=True)
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="the attempt's launch.json written by the supervisor")
@click.option("--attempt", type=int, required=True)
@click.option("--standby/--launch", default=False, help="start idle (wait for a restart command)")
def agent(spec_path: str, attempt: int, standby: bool) -> None:
    """Internal: the per-node agent started by `ckptsup launch` (srun task or child process).
    A missing, damaged or foreign spec (LaunchSpec.read: safe_io, every field checked) or secret is
    one `ckptsup: error:` line and exit 2 (USAGE), through main()."""
    from .node.agent import run_agent  # its first act: LaunchSpec.read(spec_path)

    from .node.identity import this_node   # in a container: no SLURMD_NODENAME (node/identity.py)

    console.configure(f"agent {this_node()[0]}")

    sys.exit(int(run_agent(spec_path=spec_path, attempt=attempt, launch=not standby)))
