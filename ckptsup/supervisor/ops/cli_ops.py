"""Operational commands: `ckptsup log`, `ckptsup watchdog`, `ckptsup requeue` (thin: parse,
call, render)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import click

from ... import console
from ...env import SLURM_JOB_ID
from ...errors import CkptsupError, ConfigError
from ...events import Event
from ...rundir import CONFIG_JSON, RunDir
from ...textsafe import literal
from .story_parts import Kind

TERMINAL_EXIT = {Event.RUN_COMPLETE, Event.GIVE_UP, Event.RUN_CANCELLED}
STARTUP_WAIT_S = 120.0  # how long the watchdog waits for the supervisor to create the run dir


def _run_dir(path: str) -> Path:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist; pass the directory `ckptsup launch` used")
    return run_dir


def _job_id(job_id: str | None) -> str:
    job_id = job_id or os.environ.get(SLURM_JOB_ID)
    if not job_id:
        raise ConfigError("no Slurm job id: pass --job-id or run inside the job (SLURM_JOB_ID)")
    return job_id


@contextlib.contextmanager
def _run_dir_files(path: Path, command: str) -> Iterator[None]:
    """The run directory's files are whatever is there (a directory where events.jsonl should be,
    a state file nested 100,000 deep): what its readers and writers do not turn into one line
    themselves becomes one here, naming the file, never a traceback."""
    try:
        yield
    except RecursionError:
        raise ConfigError(f"ckptsup {command}: a file in {path} nests too deep to be one of ckptsup's "
                          "(state.json, lease, config.json); move it aside") from None
    except OSError as err:
        where = err.filename or path
        raise ConfigError(f"ckptsup {command}: cannot use {where}: {err.strerror or err}; the run directory must "
                          "hold the files ckptsup writes (a regular events.jsonl, state.json, lease), readable and "
                          "writable by you") from None


class _StopFlag:
    """SIGTERM only sets a flag: a requeue's own SIGTERM must not cut the event and the
    finisher short (Slurm sends SIGKILL KillWait later anyway)."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        self.set = True

    def install(self) -> "_StopFlag":
        signal.signal(signal.SIGTERM, self)
        return self


@click.command("log")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="machine-readable: the events as a JSON array (JSON lines with --follow)")
@click.option("--follow", "-f", is_flag=True, help="keep printing as events are appended (until run_complete/give_up)")
@click.option("--all", "show_all", is_flag=True, help="every event as a table row (step_progress samples too), not the story")
@click.option("--attempt", type=click.IntRange(min=0), default=None, help="only attempt N")
@click.option("--since", default=None, metavar="DURATION|TIME",
              help="only what happened since: 10m, 2h, 04:50 (UTC today) or 2026-12-06T04:50:00")
@click.option("--kind", "kinds", multiple=True, type=click.Choice([k.value for k in Kind]),
              help="only lines (with --all: events) of this kind; repeatable")
def log(run_dir: str, as_json: bool, follow: bool, show_all: bool, attempt: int | None, since: str | None,
        kinds: tuple[str, ...]) -> None:
    """The restart log of RUN_DIR as a story: one line per incident (what failed, its detection,
    whom it blamed, exclusions, the decision) and per recovery (path, phases, where the resume
    loaded from), and one folded line per attempt for the routine."""
    from rich.console import Console

    from ...events import EVENTS_FILE, NODE_NOTES, ReadStats, follow_events, parse_ts, read_events
    from . import restart_log as timeline, story

    path = _run_dir(run_dir)
    selection = story.Selection(attempt=attempt, since=story.since_cutoff(since, time.time()) if since else None,
                                kinds=frozenset(Kind(k) for k in kinds))
    stats = ReadStats()
    if not follow:
        if as_json or show_all:
            chosen = [e for e in read_events(path, stats=stats) if selection.event(e)]
            if as_json:
                click.echo(json.dumps(chosen, indent=1))
            else:
                timeline.render(chosen, Console(), show_all=show_all)
        else:   # the story tells nothing of the per-node notes: they are not even parsed
            events = read_events(path, stats=stats, skip=NODE_NOTES)
            story.render(events, Console(soft_wrap=True), selection=selection, untold=stats.left_out)
        _note_skipped(stats, path / EVENTS_FILE)
        return
    console = Console(soft_wrap=True)  # one line per event, even in a narrow terminal or a pipe
    start = None
    told = story.Story()
    try:
        for event in follow_events(path, poll_s=0.25, stats=stats):
            if start is None:
                start = parse_ts(event.get("ts"))
            last = Event.parse(event.get("event")) in TERMINAL_EXIT
            if as_json:
                if selection.event(event):
                    click.echo(json.dumps(event, separators=(",", ":")))
                    sys.stdout.flush()
            elif show_all:
                for row in timeline.rows([event], show_all=show_all, start=start):
                    if selection.event(event):
                        console.print(timeline.row_text(row))
            else:   # the story as it happens: each line once the events it tells are in
                for line in told.feed(event) + (told.finish() if last else []):
                    if selection.line(line):
                        console.print(story.line_text(line, start))
            if last:
                return
    finally:
        _note_skipped(stats, path / EVENTS_FILE)


def _note_skipped(stats: Any, path: Path) -> None:
    """One stderr line when a reader skipped lines that are not events (stdout stays parseable)."""
    if stats.skipped:
        click.echo(f"ckptsup: skipped {stats.skipped} line(s) of {literal(path)} that are not ckptsup events "
                   "(torn, foreign or malformed)", err=True)


@click.command("watchdog")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="the run directory to watch")
@click.option("--job-id", default=None, help="Slurm job id (default: $SLURM_JOB_ID)")
@click.option("--poll-s", type=float, default=None, help="poll period (default: min(1, lease_stale_s/4))")
def watchdog(run_dir: str, job_id: str | None, poll_s: float | None) -> None:
    """Internal (started by the batch script on another node): requeue the job when the
    supervisor's lease goes stale (the batch host died)."""
    from ...slurm.client import SlurmClient
    from ..health.health import effective_config
    from ..job.watchdog import WatchOutcome, watch

    console.configure("watchdog")
    job = _job_id(job_id)
    stop = _StopFlag().install()
    # The batch script starts us next to the supervisor, which creates the run dir and writes
    # the effective config: give it time, so that the job's own lease settings apply.
    path = Path(run_dir)
    deadline = time.monotonic() + STARTUP_WAIT_S
    while not (path / CONFIG_JSON).exists():
        if stop.set or time.monotonic() > deadline:
            click.echo(f"ckptsup watchdog: {literal(path / CONFIG_JSON)} never appeared; nothing to watch")
            return
        time.sleep(0.5)
    with _run_dir_files(path, "watchdog"):
        config = effective_config(path)
        client = SlurmClient.from_config(config.slurm)
        result = watch(run_dir=path, job_id=job, config=config, client=client, poll_s=poll_s, stop=lambda: stop.set)
    if result.outcome is WatchOutcome.REQUEUED:
        _notify_requeue(config, path)
    click.echo(f"ckptsup watchdog: {result.outcome.value}: {literal(result.detail)}")
    if result.outcome is WatchOutcome.REFUSED:
        sys.exit(3)


@click.command("requeue")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="the run directory")
@click.option("--reason", required=True, help="why (recorded in the requeue event), e.g. supervisor_died")
@click.option("--exclude", "exclude", multiple=True, help="node to exclude (repeatable)")
@click.option("--job-id", default=None, help="Slurm job id (default: $SLURM_JOB_ID)")
@click.option("--by", default="batch_script", show_default=True, help="who requeues (recorded)")
def requeue(run_dir: str, reason: str, exclude: tuple[str, ...], job_id: str | None, by: str) -> None:
    """Requeue the job in the supervisor's absence: one fenced `requeue` event, then ExcNodeList,
    the spare partition and StartTime=now once the job is pending."""
    from ...slurm.client import SlurmClient
    from ..health.health import effective_config
    from ..job.requeue import RequeueRequest, requeue_job

    console.configure("requeue")
    job = _job_id(job_id)
    _StopFlag().install()
    with _run_dir_files(Path(run_dir), "requeue"):
        path = RunDir.create(run_dir).path  # the supervisor may have died before creating it
        config = effective_config(path)
        client = SlurmClient.from_config(config.slurm)
        result = requeue_job(client, path, RequeueRequest(job_id=job, reason=reason, exclude=tuple(exclude),
                                                          partition=config.slurm.spare_partition or None, by=by))
    if result.requeued:
        _notify_requeue(config, path)
        click.echo(literal(f"ckptsup requeue: job {job} requeued (epoch {result.epoch}, excluded "
                           f"{','.join(result.excluded) or 'none'})"))
    else:
        click.echo(f"ckptsup requeue: nothing to do: {literal(result.why_skipped)}")


def _notify_requeue(settings: Any, path: Path) -> None:
    """A requeue in the supervisor's absence (the watchdog's, the batch script's) is told as the
    supervisor tells its own ([notify]); a notifier that cannot start is a line, never the
    requeue's failure."""
    from ..job.notify import Notifier

    try:
        notifier = Notifier.from_config(settings.notify, run_dir=str(path))
    except CkptsupError as err:
        console.warning(f"ckptsup: notify: {err}", err=True)
        return
    notifier.offer_last(path)
    notifier.close()


@click.group()
def config() -> None:
    """Inspect the effective configuration."""


@config.command("show")
@click.option("--config", "job_config", type=click.Path(dir_okay=False), help="job TOML (layered over the site config)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def config_show(job_config: str | None, as_json: bool) -> None:
    """Print every effective value with where it came from (secrets redacted), then what the
    supervisor derives from them for a first attempt: the collective timeouts, the TORCH_NCCL_* /
    TORCH_FR_* environment, and why a configured value was lifted (docs/timeouts.md)."""
    from ...config import load_config
    from ..job.nccl import derived_rows

    resolved = load_config(job_config=job_config)
    rows = resolved.rows(redact=True)
    derived = derived_rows(resolved.config)  # no step or save measured yet, as at a first launch
    if as_json:
        click.echo(json.dumps(rows + derived, indent=2))
        return
    width = max(len(r["key"]) for r in rows + derived)
    _echo_rows(rows, width)
    click.echo("\nderived by the supervisor for a first attempt (no step or save measured yet):")
    _echo_rows(derived, width)


def _echo_rows(rows: list[dict[str, Any]], width: int) -> None:
    for row in rows:
        click.echo(literal(f"{row['key']:<{width}}  {json.dumps(row['value']):<28}  ({row['source']})"))
