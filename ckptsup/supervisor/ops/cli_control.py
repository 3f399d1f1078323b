"""`ckptsup save-now RUN_DIR`, `ckptsup stop RUN_DIR [--no-save]` and `ckptsup replace RUN_DIR NODE`: an operator's request to a
live run (supervisor/job/control.py), acknowledged by its supervisor in the restart log. Each prints
the acknowledgement and exits 0 when accepted; a run that is not live, a refusal or no answer is
one line and exit 1 (USAGE, 2, for a wrong run directory)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from ...config import load_config
from ...errors import ConfigError
from ...events import Event, read_events
from ...rundir import RunDir, RunStatus
from ...textsafe import literal
from .cli_ops import _run_dir, _run_dir_files
from ..job.control import ACK_WAIT_S, NODE_NAME, ControlCommand, ControlRequest, Outcome, control_dir, submit


def _live(run: RunDir, command: str) -> None:
    """Refuse (one line) unless a supervisor runs this run now: state running, lease fresh."""
    state = run.load_state()
    if state.status is not RunStatus.RUNNING:
        raise ConfigError(f"ckptsup {command}: run {run.path} is not live (status {state.status.value}); "
                          "there is nothing to send it to")
    stale_s = load_config().config.supervisor.lease_stale_s
    age = run.lease_age_s()
    if age is None or age > stale_s:
        seen = "no lease" if age is None else f"its lease is {age:.0f}s old"
        raise ConfigError(f"ckptsup {command}: run {run.path} has no live supervisor ({seen}, stale after "
                          f"{stale_s:g}s); is the job running? (`squeue`, `ckptsup log {run.path}`)")


def _ack(run: Path, request: ControlRequest, wait_s: float) -> dict | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for event in read_events(run):
            if event.get("event") == Event.CONTROL and event.get("request") == request.id:
                return event
        time.sleep(0.2)
    return None


def _send(run_dir: str, command: ControlCommand, *, save: bool, wait_s: float, node: str | None = None) -> None:
    name = command.value.replace("_", "-")
    path = _run_dir(run_dir)
    run = RunDir(path=path)
    with _run_dir_files(path, name):
        _live(run, name)
        request = submit(path, command, save=save, node=node)
    ack = _ack(path, request, wait_s)
    if ack is None:
        (control_dir(path) / f"{request.id}.json").unlink(missing_ok=True)
        raise ConfigError(f"ckptsup {name}: the supervisor did not acknowledge request {request.id} in "
                          f"{wait_s:g}s; it was withdrawn (see `ckptsup log {path}`)")
    line = f"request {request.id} ({command.value}): {ack.get('outcome')}: {ack.get('detail', '')}"
    if ack.get("outcome") != Outcome.ACCEPTED:
        raise ConfigError(f"ckptsup {name}: {line}")
    click.echo(literal(f"ckptsup {name}: {line} (at step {ack.get('step')})"))   # the ack's detail is the supervisor's text
    sys.stdout.flush()


@click.command("save-now")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--wait-s", type=click.FloatRange(min=1, max=3600), default=ACK_WAIT_S, show_default=True,
              help="how long to wait for the supervisor's acknowledgement")
def save_now(run_dir: str, wait_s: float) -> None:
    """Ask the running job of RUN_DIR for a checkpoint at its next step boundary."""
    _send(run_dir, ControlCommand.SAVE_NOW, save=True, wait_s=wait_s)


@click.command("stop")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--no-save", is_flag=True, help="stop without a checkpoint first")
@click.option("--wait-s", type=click.FloatRange(min=1, max=3600), default=ACK_WAIT_S, show_default=True,
              help="how long to wait for the supervisor's acknowledgement")
def stop(run_dir: str, no_save: bool, wait_s: float) -> None:
    """Stop the running job of RUN_DIR: checkpoint (unless --no-save), stop, no requeue; the
    supervisor exits 8 (CANCELLED), which the sbatch template does not requeue."""
    _send(run_dir, ControlCommand.STOP, save=not no_save, wait_s=wait_s)


@click.command("replace")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("node")
@click.option("--wait-s", type=click.FloatRange(min=1, max=3600), default=ACK_WAIT_S, show_default=True,
              help="how long to wait for the supervisor's acknowledgement")
def replace(run_dir: str, node: str, wait_s: float) -> None:
    """Move NODE's ranks to a spare at the next checkpoint: the job checkpoints now, restarts on
    the node path without NODE, and excludes it (drained when [slurm] drain_bad_nodes)."""
    if not NODE_NAME.fullmatch(node):
        raise ConfigError(f"ckptsup replace: {node[:60]!r} is not a node name (letters, digits, . _ -)")
    _send(run_dir, ControlCommand.REPLACE, save=True, wait_s=wait_s, node=node)
