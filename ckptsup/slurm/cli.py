"""`ckptsup dev-cluster ...` and `ckptsup sbatch ...`: parse, call, render."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from ..errors import DevClusterError
from ..container import container_flags, container_options
from ..textsafe import literal
from .devconf import DEFAULT_DIR, DEFAULT_NODES, DEFAULT_PORT_BASE, MAX_NODES, MIN_NODES, ClusterSpec, nodes_in_conf


def _cluster(directory: str, port_base: int, first_job_id: int = 1, *, containers: bool = False,
             nodes: int | None = None):
    """The cluster in `directory`: `nodes` nodes (`up`), else as many as its slurm.conf declares
    (the commands after `up`), else the default."""
    from .devcluster import DevCluster

    if not _PLAIN_PATH.match(directory):
        # the path goes into slurm.conf and the nodes' start scripts, where spaces, '#', '=',
        # quotes or shell characters would end, split or extend a value
        raise DevClusterError(f"--dir {directory!r} may hold only letters, digits and / . _ - +; choose a plain path")
    if nodes is None:
        try:
            nodes = nodes_in_conf((Path(directory) / "slurm.conf").read_text(errors="replace"))
        except OSError:
            nodes = None
    return DevCluster(ClusterSpec(dir=Path(directory), port_base=port_base, first_job_id=first_job_id,
                                  containers=containers, nodes=DEFAULT_NODES if nodes is None else nodes))


def _ranks(raw: str | None) -> int | str | None:
    """--nproc-per-node as `ckptsup launch` takes it: a number or a word (render checks which)."""
    if raw is None:
        return None
    raw = raw.strip().lower()
    return int(raw) if re.fullmatch(r"[+-]?\d{1,9}", raw) else raw


_PLAIN_PATH = re.compile(r"^[A-Za-z0-9/._+-]+$")
_dir_option = click.option("--dir", "directory", default=str(DEFAULT_DIR), show_default=True,
                           type=click.Path(file_okay=False), help="directory holding all the cluster's state")
_port_option = click.option("--port-base", default=DEFAULT_PORT_BASE, show_default=True, type=click.IntRange(1024, 65000),
                            help="slurmctld port; node K listens on port-base+K (a second cluster needs a base "
                                 "more than N away)")


@click.group("dev-cluster")
def dev_cluster() -> None:
    """A real Slurm cluster of N nodes on this machine (5 by default; root; Debian slurm-wlm, munge, tini).

    Partitions: main (n1-n(N-1), default), spares (nN, reserved), mainspare (every node, for
    requeue with spares), lowprio (preemptable, GraceTime 30 s) and highprio (preempts lowprio).
    The commands after `up` read N from the cluster's slurm.conf."""


@dev_cluster.command("up")
@_dir_option
@_port_option
@click.option("--first-job-id", default=1, show_default=True, type=click.IntRange(1, 60_000_000),
              help="Slurm's FirstJobId: clusters side by side get disjoint job ids (a SLURM_JOB_ID then names one)")
@click.option("--containers", is_flag=True,
              help="also configure Slurm's OCI containers with runc (oci.conf) and a test bundle in DIR/bundle: "
                   "`srun --container DIR/bundle`, `ckptsup launch --container DIR/bundle` (docs/containers.md)")
@click.option("--nodes", default=DEFAULT_NODES, show_default=True, type=int,
              help=f"nodes n1..nN ({MIN_NODES} to {MAX_NODES}): main n1..n(N-1), the spare nN; ports port-base..port-base+N")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def up(directory: str, port_base: int, first_job_id: int, containers: bool, nodes: int, as_json: bool) -> None:
    """Start the cluster (idempotent); wait until every node is idle; print `export SLURM_CONF=...`."""
    cluster = _cluster(directory, port_base, first_job_id, containers=containers, nodes=nodes)
    seconds = cluster.up()
    if as_json:
        click.echo(json.dumps({"slurm_conf": str(cluster.conf), "ready_s": round(seconds, 3),
                               "node_local": {n: str(cluster.spec.node_local_dir(n)) for n in cluster.spec.node_names}}))
        return
    click.echo(literal(f"# {len(cluster.spec.node_names)} nodes ready in {seconds:.1f}s; node-local dirs: "
                       f"{cluster.spec.dir}/nodes/<node>/local"), err=True)   # paths: literal
    click.echo(literal(f"export SLURM_CONF={cluster.conf}"))


@dev_cluster.command("down")
@_dir_option
@_port_option
def down(directory: str, port_base: int) -> None:
    """Stop every daemon the cluster started (by recorded PID)."""
    if not Path(directory).is_dir():
        click.echo(f"no dev cluster in {literal(directory)}; nothing to stop")
        return
    seconds = _cluster(directory, port_base).down()
    click.echo(f"dev cluster in {literal(directory)} stopped in {seconds:.2f}s")


@dev_cluster.command("status")
@_dir_option
@_port_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(directory: str, port_base: int, as_json: bool) -> None:
    """Daemons (PIDs) and node states."""
    cluster = _cluster(directory, port_base)
    if not Path(directory).is_dir():
        raise DevClusterError(f"no dev cluster in {directory} (no such directory); start one with "
                              f"`ckptsup dev-cluster up --dir {directory}`")
    st = cluster.status()
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    click.echo(literal(f"SLURM_CONF={st.conf}"))
    for name, pid in st.daemons.items():
        click.echo(f"{name:<12} {'pid ' + str(pid) if pid else 'not running'}")
    for node, info in st.nodes.items():
        flag = "" if info.responding else " (not responding)"
        reason = f"  reason: {info.reason}" if info.reason else ""
        click.echo(literal(f"{node:<12} {info.state.value}{flag}{reason}"))   # a reason is anyone's scontrol text


@dev_cluster.command("kill-node")
@click.argument("node")
@_dir_option
@_port_option
def kill_node(node: str, directory: str, port_base: int) -> None:
    """Kill every process of NODE at once (its PID namespace's init): a node death."""
    cluster = _cluster(directory, port_base)
    if not cluster.node_running(node):
        raise DevClusterError(f"{node} is not running in the cluster in {directory}; nothing to kill "
                              f"(see `ckptsup dev-cluster status --dir {directory}`)")
    seconds = cluster.kill_node(node)
    click.echo(f"{literal(node)} killed; all its processes gone in {seconds * 1000:.0f} ms")


@dev_cluster.command("revive-node")
@click.argument("node")
@_dir_option
@_port_option
def revive_node(node: str, directory: str, port_base: int) -> None:
    """Start NODE again and return it to service."""
    seconds = _cluster(directory, port_base).revive_node(node)
    click.echo(f"{literal(node)} back in service in {seconds:.1f}s")


@click.command("sbatch", context_settings={"allow_interspersed_args": False})
@click.option("--config", "job_config", type=click.Path(dir_okay=False), default=None,
              help="job TOML (layered over the site config; also handed to `ckptsup launch`)")
@click.option("--nodes", type=int, default=None, help="active nodes (sbatch.nodes)")
@click.option("--spares", type=int, default=None, help="hot spare nodes in the allocation (sbatch.spares)")
@click.option("--partition", default=None, help="partition (sbatch.partition)")
@click.option("--account", default=None, help="account (sbatch.account)")
@click.option("--time", "time_limit", default=None, help="time limit, Slurm format (sbatch.time)")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (sbatch.gpus_per_node)")
@click.option("--cpus-per-task", type=int, default=None, help="CPUs per agent task (sbatch.cpus_per_task)")
@click.option("--job-name", default=None, help="job name (sbatch.job_name)")
@click.option("--signal-lead-s", type=int, default=None, help="seconds of warning before the time limit (sbatch.signal_lead_s)")
@click.option("--template", default=None, help="template name in sbatch_templates/ or a path (sbatch.template)")
@click.option("--extra-directive", "extra", multiple=True, help="extra #SBATCH option, repeatable (sbatch.extra_directives)")
@click.option("--run-dir", default=None, help="run directory; {job_id} expands (run.run_dir)")
@click.option("--nproc-per-node", metavar="N|gpu|auto", default=None,
              help="ranks per node, handed to `ckptsup launch` (gpu: the allocation's GPUs per node)")
@click.option("-m", "--module", "module", is_flag=True, default=False,
              help="SCRIPT is a module name, run as `python -m SCRIPT` (as ckptsup launch -m)")
@click.option("--no-python", "no_python", is_flag=True, default=False,
              help="SCRIPT is an executable (as ckptsup launch --no-python)")
@container_options
@click.option("--output", "output", type=click.Path(dir_okay=False), default=None, help="write the script here instead of stdout")
@click.option("--submit", is_flag=True, help="create the run directory (0700) and submit the script")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def sbatch(job_config, nodes, spares, partition, account, time_limit, gpus_per_node, cpus_per_task,
           job_name, signal_lead_s, template, extra, run_dir, nproc_per_node, module, no_python, output, submit,
           as_json, script, script_args, **container) -> None:
    """Render the sbatch template for SCRIPT [ARGS] with site defaults and these flags;
    `--submit` submits it (after creating the run directory, which Slurm would not)."""
    from .submit import prepare, submit_script, write_script

    flags = {"sbatch.nodes": nodes, "sbatch.spares": spares, "sbatch.partition": partition,
             "sbatch.account": account, "sbatch.time": time_limit, "sbatch.gpus_per_node": gpus_per_node,
             "sbatch.cpus_per_task": cpus_per_task, "sbatch.job_name": job_name,
             "sbatch.signal_lead_s": signal_lead_s, "sbatch.template": template,
             "sbatch.extra_directives": list(extra) if extra else None, "run.run_dir": run_dir}
    boxed = container_flags(container)
    prepared = prepare(flags={**flags, **boxed.config_flags()}, job_config=job_config, script=script,
                       script_args=script_args, nproc_per_node=_ranks(nproc_per_node), module=module,
                       no_python=no_python, container_args=boxed.argv())
    if output:
        write_script(Path(output), prepared.text)
    if not submit:
        if as_json:
            click.echo(json.dumps({"run_dir": prepared.params.run_dir, "template": str(prepared.template),
                                   "script": prepared.text}))
        elif not output:
            click.echo(prepared.text, nl=False)
        return
    result = submit_script(prepared)
    if as_json:
        click.echo(json.dumps({"job_id": result.job_id, "run_dir": str(result.run_dir),
                               "script": str(result.script_path)}))
        return
    click.echo(literal(f"Submitted batch job {result.job_id}; run directory {result.run_dir}"))
    click.echo(literal(f"follow it with: ckptsup log --follow {result.run_dir}"))
