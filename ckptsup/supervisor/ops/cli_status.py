"""`ckptsup status RUN_DIR|JOB_ID [--json] [--watch]`: the job as it is now, from what its
supervisor publishes (supervisor/job/status.py) plus goodput so far from the restart log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

import click

from ...config import load_config
from ...errors import ConfigError
from ...events import read_events
from ...planning.phase_time import busy_line, phases_line
from ...planning.sdc_report import sdc_line
from ...textsafe import text as safe_text
from .cli_ops import _run_dir_files
from ..job.status import STATUS_EVERY_S, read_status
from . import node_table

FINISHED = ("done", "gave_up", "cancelled")


def resolve_run_dir(target: str) -> Path:
    """A run directory, or a job id whose run directory is the configured `sbatch.run_dir`."""
    path = Path(target)
    if path.is_dir():
        return path
    if target.isdigit():
        pattern = load_config().config.run.run_dir
        guess = Path(pattern.replace("{job_id}", target))
        if guess.is_dir():
            return guess
        raise ConfigError(f"no run directory for job {target} at {guess} (run.run_dir = {pattern!r}); "
                          "pass the run directory itself")
    raise ConfigError(f"{target} is neither a run directory nor a job id; pass the directory `ckptsup launch` used")


def goodput(run: Path, *, live: bool = False) -> dict[str, Any]:
    """Goodput so far, the time per phase (planning/phase_time.py; `live`: the open phase runs to
    now) and the SDC, NaN and restore figures (planning/sdc_report.py)."""
    from ...planning.accounting import account
    from ...planning.phase_time import busy_time, phase_times
    from ...planning.headline import headline
    from ...planning.sdc_report import sdc_summary

    events = read_events(run)
    acc = account(events)
    paid = acc.paid_device_s
    phases = phase_times(events, until=time.time() if live else None)
    return {"story": headline(events, acc), "goodput": acc.useful_device_s / paid if paid else None,
            "paid_device_s": round(paid, 1),
            "badput_device_s": {k: round(v, 1) for k, v in acc.badput_device_s.items() if round(v, 1) > 0},
            "time_per_phase_s": phases, "sdc": sdc_summary(events, train_s=phases.get("train")),
            "busy": busy_time(events, until=time.time() if live else None)}


def snapshot(run: Path) -> dict[str, Any]:
    with _run_dir_files(run, "status"):
        out = read_status(run)
        out["age_s"] = round(time.time() - float(out.get("written", 0)), 1)
        out.update(goodput(run, live=out.get("status") not in FINISHED))
    return out


def _s(value: Any, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value:.3g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _pids(pids: Any) -> str:
    """rank:pid per rank process, the node's own pid view (host_pid after a slash when it differs)."""
    cells = []
    for entry in pids if isinstance(pids, list) else ():
        if isinstance(entry, dict):
            pid, host = entry.get("pid"), entry.get("host_pid")
            cells.append(f"{entry.get('rank')}:{pid}" + (f"/{host}" if host not in (None, pid) else ""))
    return " ".join(cells) or "-"


def render(st: dict[str, Any], nodes_pattern: str | None = None) -> Any:
    from rich.console import Group

    head = [*([st["story"]] if st.get("story") else []),   # the run in one line, as `ckptsup log` and `report` lead
            f"job {st.get('job_id')}  attempt {st.get('attempt')}  epoch {st.get('epoch')}  {st.get('status')}"
            f"  (published {_s(st.get('age_s'))} ago)",
            f"step {st.get('step', '-')}  step p50 {_s(st.get('step_p50_s'))} p99 {_s(st.get('step_p99_s'))}"
            f"  supervised at the {st.get('level') or '-'} level",
            f"hang timeout {_s(st.get('hang_timeout_s'))}: {st.get('hang_why', '-')}",
            *([f"busy for {_s(busy.get('for_s'))} (killed at busy_limit_s {_s(busy.get('limit_s'))}): {busy.get('detail')}"]
              if isinstance(busy := st.get("busy"), dict) else []),
            f"next save in {_s(st.get('next_save_in_s'))} (interval {_s(st.get('save_interval_s'))})"]
    ckpts = st.get("checkpoints") or {}
    head.append("checkpoints: " + ", ".join(f"{tier} step {ckpts[tier].get('step')}" for tier in
                                             ("committed", "validated", "durable") if tier in ckpts) or "checkpoints: none yet")
    gp = st.get("goodput")
    bad = ", ".join(f"{k} {v:g}s" for k, v in sorted((st.get("badput_device_s") or {}).items()))
    head.append(f"goodput {'-' if gp is None else f'{gp:.1%}'} of {_s(st.get('paid_device_s'))} device-time"
                + (f"; badput: {bad}" if bad else ""))
    head.append(f"time per phase (rank 0): {phases_line(st.get('time_per_phase_s') or {})}; "
                f"busy without progress: {busy_line(st.get('busy'))}")
    head.append(sdc_line(st.get("sdc")))
    if isinstance(st.get("excluded"), dict) and st["excluded"]:
        head.append("excluded: " + ", ".join(f"{n} ({why})" for n, why in st["excluded"].items()))
    return Group(*(safe_text(line) for line in head), *node_tables(st, nodes_pattern))


def node_tables(st: dict[str, Any], pattern: str | None = None) -> list[Any]:
    """The nodes: one row each for a small job or the nodes `pattern` names; past DETAIL_NODES, one row
    per state (node_table.py) and the SLOWEST nodes in full (2,048 rows said nothing at a glance)."""
    rows = {node: row for node, row in st["nodes"].items() if isinstance(row, dict)}
    if pattern is not None:
        picked = node_table.matching(rows, pattern)
        if not picked:
            return [safe_text(f"no node matches {pattern!r} (of {len(rows)})")]
        return [_detail(picked)]
    if len(rows) <= node_table.DETAIL_NODES:
        return [_detail(rows)]
    from rich.table import Table

    summary = Table(show_edge=False, pad_edge=False)
    for column in ("state", "nodes", "heartbeat (max)", "step (min-max)", "warm", "examples"):
        summary.add_column(column)
    for group in node_table.by_state(rows, st.get("heartbeat_interval_s")):
        cells = (group.state, str(group.count), _s(group.max_age_s) + (" ago" if group.max_age_s is not None else ""),
                 "-" if group.min_step is None else f"{group.min_step}-{group.max_step}", str(group.warm),
                 ", ".join(group.examples))
        summary.add_row(*(safe_text(cell) for cell in cells))
    slow = node_table.slowest(rows)
    return [summary, *([safe_text(f"slowest {len(slow)} of {len(rows)} nodes (step p99, then furthest behind; "
                                  f"--nodes PATTERN for any):"), _detail(slow)] if slow else [])]


def _detail(rows: Mapping[str, Mapping[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for column in ("node", "role", "agent", "heartbeat", "ranks", "step", "step p50", "step p99", "warm", "pids"):
        table.add_column(column)
    for node, row in rows.items():
        cells = (node, str(row.get("role", "?")), "up" if row.get("agent") else "GONE",
                 _s(row.get("heartbeat_age_s")) + (" ago" if row.get("heartbeat_age_s") is not None else ""),
                 ",".join(map(str, row.get("ranks_alive") or [])) or "-", _s(row.get("step"), ""),
                 _s(row.get("step_p50_s")), _s(row.get("step_p99_s")), "yes" if row.get("warm") else "-",
                 _pids(row.get("pids")))
        table.add_row(*(safe_text(cell) for cell in cells))   # every cell is the file's text: never markup
    return table


@click.command("status")
@click.argument("target", metavar="RUN_DIR|JOB_ID")
@click.option("--json", "as_json", is_flag=True, help="machine-readable (one JSON object; JSON lines with --watch)")
@click.option("--watch", is_flag=True, help=f"refresh every {STATUS_EVERY_S:g}s until the run ends (Ctrl-C stops)")
@click.option("--nodes", "nodes_pattern", metavar="PATTERN",
              help="one row for each node PATTERN names (a shell pattern, e.g. 'gpu-1[0-3]*'; commas: several) "
                   f"instead of a row per state past {node_table.DETAIL_NODES} nodes")
def status(target: str, as_json: bool, watch: bool, nodes_pattern: str | None) -> None:
    """The job as it is now: attempt, nodes (active, spare, excluded) with each agent's heartbeat
    age, ranks alive, step and step times, each rank's pid; the last checkpoint per tier; goodput so far; the
    next save; the hang timeout in force and why."""
    from rich.console import Console

    run = resolve_run_dir(target)
    console = Console()
    if not watch:
        st = snapshot(run)
        click.echo(json.dumps(st)) if as_json else console.print(render(st, nodes_pattern))
        return
    if as_json:
        while True:
            st = snapshot(run)
            click.echo(json.dumps(st))
            if st.get("status") in FINISHED:
                return
            time.sleep(STATUS_EVERY_S)
    from rich.live import Live

    with Live(render(snapshot(run), nodes_pattern), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(STATUS_EVERY_S)
                st = snapshot(run)
                live.update(render(st, nodes_pattern))
                if st.get("status") in FINISHED:
                    return
        except KeyboardInterrupt:
            return
