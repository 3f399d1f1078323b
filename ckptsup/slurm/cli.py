"""`ckptsup dev-cluster ...` and `ckptsup sbatch ...`: parse, call, render."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..errors import ConfigError
from .devconf import DEFAULT_DIR, DEFAULT_PORT_BASE, ClusterSpec


def _cluster(directory: str, port_base: int):
    from .devcluster import DevCluster

    return DevCluster(ClusterSpec(dir=Path(directory), port_base=port_base))


_dir_option = click.option("--dir", "directory", default=str(DEFAULT_DIR), show_default=True,
                           type=click.Path(file_okay=False), help="directory holding all the cluster's state")
_port_option = click.option("--port-base", default=DEFAULT_PORT_BASE, show_default=True, type=click.IntRange(1024, 65000),
                            help="slurmctld port; node K listens on port-base+K (a second cluster needs another base)")


@click.group("dev-cluster")
def dev_cluster() -> None:
    """A real 5-node Slurm cluster on this machine (root; Debian slurm-wlm, munge, tini).

    Partitions: main (n1-n4, default), spares (n5, reserved), mainspare (n1-n5, for requeue
    with spares), lowprio (preemptable, GraceTime 30 s) and highprio (preempts lowprio)."""


@dev_cluster.command("up")
@_dir_option
@_port_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def up(directory: str, port_base: int, as_json: bool) -> None:
    """Start the cluster (idempotent); wait until every node is idle; print `export SLURM_CONF=...`."""
    cluster = _cluster(directory, port_base)
    seconds = cluster.up()
    if as_json:
        click.echo(json.dumps({"slurm_conf": str(cluster.conf), "ready_s": round(seconds, 3),
                               "node_local": {n: str(cluster.spec.node_local_dir(n)) for n in cluster.spec.node_names}}))
        return
    click.echo(f"# {len(cluster.spec.node_names)} nodes ready in {seconds:.1f}s; node-local dirs: "
               f"{cluster.spec.dir}/nodes/<node>/local", err=True)
    click.echo(f"export SLURM_CONF={cluster.conf}")


@dev_cluster.command("down")
@_dir_option
@_port_option
def down(directory: str, port_base: int) -> None:
    """Stop every daemon the cluster started (by recorded PID)."""
    seconds = _cluster(directory, port_base).down()
    click.echo(f"dev cluster in {directory} stopped in {seconds:.2f}s")


@dev_cluster.command("status")
@_dir_option
@_port_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(directory: str, port_base: int, as_json: bool) -> None:
    """Daemons (PIDs) and node states."""
    st = _cluster(directory, port_base).status()
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    click.echo(f"SLURM_CONF={st.conf}")
    for name, pid in st.daemons.items():
        click.echo(f"{name:<12} {'pid ' + str(pid) if pid else 'not running'}")
    for node, info in st.nodes.items():
        flag = "" if info.responding else " (not responding)"
        reason = f"  reason: {info.reason}" if info.reason else ""
        click.echo(f"{node:<12} {info.state.value}{flag}{reason}")


@dev_cluster.command("kill-node")
@click.argument("node")
@_dir_option
@_port_option
def kill_node(node: str, directory: str, port_base: int) -> None:
    """Kill every process of NODE at once (its PID namespace's init): a node death."""
    seconds = _cluster(directory, port_base).kill_node(node)
    click.echo(f"{node} killed; all its processes gone in {seconds * 1000:.0f} ms")


@dev_cluster.command("revive-node")
@click.argument("node")
@_dir_option
@_port_option
def revive_node(node: str, directory: str, port_base: int) -> None:
    """Start NODE again and return it to service."""
    seconds = _cluster(directory, port_base).revive_node(node)
    click.echo(f"{node} back in service in {seconds:.1f}s")
