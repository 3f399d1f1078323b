"""`ckptsup ckpt list|verify|inspect|prune DIR`: DIR is a checkpoint_dir or one step_<N>.
Thin: parse, call the catalog/validate/retention functions, render. Each has --json.
Nothing here reads DCP's .metadata or imports torch (level 3 runs in a child process)."""

from __future__ import annotations

import enum
import json
import os
import sys
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import click

from ..errors import CheckpointError, CkptsupError, ValidationError
from ..safe_io import encodable
from ..textsafe import literal
from .catalog import CheckpointInfo, Status, inspect_step, latest_committed, latest_validated, list_checkpoints
from .commit import LOCK_NAME, pid_alive, parse_step, read_lock
from .manifest import MANIFEST_NAME
from .script_keep import KEEP_DIR, all_versions
from .trust import check_dir_trusted

PROGRESS_MIN_BYTES = 256 << 20  # below this a verify is too quick for a progress bar to help


class Target(enum.Enum):
    """What DIR names: one step_<N>, or a checkpoint_dir holding them."""

    STEP = "step"
    DIR = "dir"


def _classify(path_text: str) -> tuple[Target, Path]:
    """(Target.STEP, path) or (Target.DIR, path); one-line errors for anything else."""
    path = encodable(path_text, what="path", error=CheckpointError)
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symlink; pass the real directory (ckptsup never follows links into a checkpoint)")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint_dir or one of its step_<N> directories")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a checkpoint_dir or one of its step_<N> directories")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"{path} is not readable by you (uid {os.getuid()}); run as its owner or `chmod u+rx {path}`")
    if parse_step(path.name) is not None:
        return Target.STEP, path
    if os.path.lexists(path / MANIFEST_NAME):
        raise CheckpointError(f"{path} holds a {MANIFEST_NAME} but is not named step_<N>, so it is no checkpoint of a "
                              f"checkpoint_dir; rename it step_<its step> inside one, or pass the checkpoint_dir")
    return Target.DIR, path


def _steps_of(kind: Target, path: Path) -> list[Path]:
    if kind is Target.STEP:
        return [path]
    check_dir_trusted(path)
    return [info.path for info in list_checkpoints(path)]


def _emit_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=1, default=str))   # ensure_ascii: a surrogate becomes its escape


def _echo(text: str) -> None:
    """click.echo of text that carries file names (os.listdir decodes undecodable bytes as
    surrogate escapes), manifest fields and problems: literal (textsafe), never a crash or a
    control sequence on the terminal."""
    click.echo(literal(text))


def _human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


class _OSErrorsAsOneLine(click.Group):
    """A file the catalog meets mid-command (unreadable, vanished) is a one-line error, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            raise CheckpointError(f"{where}{err.strerror or err}; check that the path exists and is readable by you") from None


@click.group(cls=_OSErrorsAsOneLine)
def ckpt() -> None:
    """Inspect, verify and prune checkpoints (a checkpoint_dir or one step_<N>)."""


@ckpt.command("list")
@click.argument("directory", metavar="DIR")
@click.option("--all", "include_quarantined", is_flag=True, help="include quarantined checkpoints")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def list_cmd(directory: str, include_quarantined: bool, as_json: bool) -> None:
    """List checkpoints: step, status, validated level, size, creation time."""
    kind, path = _classify(directory)
    if kind is Target.STEP:
        infos = [inspect_step(path)]
    else:
        check_dir_trusted(path)
        infos = list_checkpoints(path, include_quarantined=include_quarantined)
    if as_json:
        _emit_json([i.to_json() for i in infos])
        return
    if not infos:
        _echo(f"{path}: no checkpoints")
        return
    _echo(f"{'STEP':>10}  {'STATUS':<11}  {'LEVEL':>5}  {'SIZE':>9}  {'CREATED':<25}  PROBLEM")
    for info in infos:
        created = info.manifest.created_at[:25] if info.manifest else "-"
        size = _human_bytes(info.manifest.total_bytes if info.manifest else None)
        level = str(info.validated_level) if info.validated_level else "-"
        _echo(f"{info.step:>10}  {info.status.value:<11}  {level:>5}  {size:>9}  {created:<25}  {info.problem[:100]}")


def _progress_bar(total: int, enabled: bool):
    if not enabled or total < PROGRESS_MIN_BYTES:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=True)


@ckpt.command("verify")
@click.argument("directory", metavar="DIR")
@click.option("--level", type=click.IntRange(1, 3), default=2, show_default=True,
              help="1 sizes+hashes, 2 + structure (torch-free), 3 + test load in a child process")
@click.option("--quarantine", "do_quarantine", is_flag=True, help="move failing checkpoints to quarantine/ (never deletes)")
@click.option("--progress/--no-progress", default=None, help="progress bar on stderr (default: when it is a terminal)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def verify_cmd(directory: str, level: int, do_quarantine: bool, progress: bool | None, as_json: bool) -> None:
    """Verify checkpoints and record the result; exits non-zero when any fails."""
    from .validate import quarantine, validate

    kind, path = _classify(directory)
    steps = _steps_of(kind, path)
    if not steps:
        raise CheckpointError(f"{path}: no step_<N> directories to verify")
    show = sys.stderr.isatty() if progress is None else progress
    total = sum(i.manifest.total_bytes for i in map(inspect_step, steps) if i.manifest is not None)
    rows: list[dict[str, Any]] = []
    with _progress_bar(total, show) as bar:
        task = bar.add_task("verifying", total=total) if bar is not None else None
        advance: Callable[[int], None] | None = (lambda n: bar.advance(task, n)) if bar is not None else None
        for step_dir in steps:
            result = validate(step_dir, level=level, progress=advance)
            row: dict[str, Any] = {"path": str(step_dir), "ok": result.ok, "level": result.level, "level_passed": result.level_passed,
                   "problems": result.problems, "duration_s": round(result.duration_s, 3), "bytes": result.bytes_checked,
                   "untrusted": result.untrusted}
            if not result.ok and do_quarantine and not result.untrusted:   # quarantine is for content only
                row["quarantined_to"] = str(quarantine(step_dir, result.problems[0] if result.problems else "verify failed"))
            rows.append(row)
    if as_json:
        _emit_json(rows)
    else:
        for row in rows:
            name = Path(row["path"]).name
            if row["ok"]:
                _echo(f"{name}: ok (level {row['level_passed']}, {_human_bytes(row['bytes'])}, {row['duration_s']:.2f} s)")
            else:
                _echo(f"{name}: FAILED at level {row['level_passed'] + 1}: {row['problems'][0] if row['problems'] else '?'}")
                for extra in row["problems"][1:5]:
                    _echo(f"    {extra}")
                if "quarantined_to" in row:
                    _echo(f"    moved to {row['quarantined_to']}")
                elif row["untrusted"]:
                    _echo("    not checked: a permission problem, not its content (fix it as above and verify again; "
                          "never quarantined)")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        raise ValidationError(f"{len(failed)} of {len(rows)} checkpoint(s) failed verification at level {level}")


@ckpt.command("inspect")
@click.argument("directory", metavar="DIR")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def inspect_cmd(directory: str, as_json: bool) -> None:
    """Show a checkpoint's manifest (never its pickled .metadata), or a checkpoint_dir summary; for a
    run dir with a script checkpoint (--script-checkpoint), its verified versions."""
    kind, path = _classify(directory)
    if kind is Target.STEP:
        info = inspect_step(path)
        payload = info.to_json()
        if info.manifest is not None:
            m = info.manifest
            payload.update(mesh=m.mesh, versions=m.versions, extra=m.extra, epoch=m.epoch, hash_algorithm=m.hash_algorithm,
                           items=len(m.items), file_list=[{"path": f.path, "size": f.size, "hash": f.hash} for f in m.files])
        if as_json:
            _emit_json(payload)
            return
        _print_step(info, payload)
        return
    check_dir_trusted(path)
    if (path / KEEP_DIR).is_dir():   # a run dir: its script checkpoint's verified versions
        _print_script_versions(path, as_json)
        return
    infos = list_checkpoints(path, include_quarantined=True)
    committed, validated = latest_committed(path), latest_validated(path)
    lock = read_lock(path / LOCK_NAME)
    summary = {
        "checkpoint_dir": str(path),
        "latest_committed": committed.step if committed else None,
        "latest_validated": validated.step if validated else None,
        "counts": {s.value: sum(i.status is s for i in infos) for s in Status},
        "bytes": sum(i.manifest.total_bytes for i in infos if i.manifest is not None),
        "writer": None if lock is None else {"pid": lock.pid, "host": lock.host, "epoch": lock.epoch, "job_id": lock.job_id},
    }
    if as_json:
        _emit_json(summary)
        return
    for key, value in summary.items():
        _echo(f"{key:<17} {value if not isinstance(value, int) or key != 'bytes' else _human_bytes(value)}")


def _print_script_versions(run_dir: Path, as_json: bool) -> None:
    """The verified versions of the script's own checkpoint files kept in a run dir (script_keep.py)."""
    rows = [v.row() for v in all_versions(run_dir)]
    if as_json:
        _emit_json({"run_dir": str(run_dir), "script_checkpoints": rows})
        return
    if not rows:
        _echo(f"{run_dir}: no verified script checkpoint versions")
        return
    _echo(f"{'PATH':<30}  {'VERSION':<20}  {'SIZE':>9}  {'STEP':>8}  {'VERIFIED':<25}  {'CHECK':>8}")
    for row in rows:
        step = "-" if row["step"] is None else row["step"]
        _echo(f"{str(row['path']):<30}  {str(row['version']):<20}  {_human_bytes(row['bytes']):>9}  "   # type: ignore[arg-type]
              f"{step:>8}  {str(row['verified']):<25}  {row['check_s']:>7}s")


def _print_step(info: CheckpointInfo, payload: dict[str, Any]) -> None:
    _echo(f"{info.path}: {info.status.value}" + (f" ({info.problem})" if info.problem else ""))
    if info.manifest is None:
        return
    for key in ("step", "checkpoint_id", "job_id", "attempt", "epoch", "world_size", "created_at", "hash_algorithm", "items"):
        _echo(f"  {key:<15} {payload.get(key)}")
    _echo(f"  {'bytes':<15} {_human_bytes(payload['bytes'])} in {payload['files']} files")
    replicas = info.manifest.extra.get("replicas")
    if isinstance(replicas, dict):   # docs/sdc.md: whether the replicas agreed at this step
        agree = replicas.get("agree")
        line = (f"agreed ({replicas.get('copies')} copies)" if agree is True else
                f"DISAGREED ({replicas.get('copies')} copies; in dispute: {replicas.get('disputed')}): never resumed from"
                if agree is False else str(agree))
        _echo(f"  {'replicas':<15} {line}")
    if info.validation:
        v = info.validation
        _echo(f"  {'validation':<15} {'ok' if v.get('ok') else 'FAILED'} level {v.get('level')} at {v.get('ts')}")


@ckpt.command("prune")
@click.argument("directory", metavar="DIR")
@click.option("--keep-last", type=click.IntRange(min=1), default=None, help="keep the newest K (default: config checkpoint.keep_last)")
@click.option("--keep-daily-days", type=click.IntRange(min=0), default=None,
              help="also keep the newest of each of the last D days (default: config checkpoint.keep_daily_days)")
@click.option("--dry-run", is_flag=True, help="print the plan, delete nothing")
@click.option("--force", is_flag=True, help="prune even while a live writer holds the directory")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def prune_cmd(directory: str, keep_last: int | None, keep_daily_days: int | None, dry_run: bool, force: bool, as_json: bool) -> None:
    """Apply retention: keep the last K + one a day for D days + the newest validated."""
    from .retention import apply_retention

    kind, path = _classify(directory)
    if kind is Target.STEP:
        raise CheckpointError(f"{path} is one checkpoint; prune takes the checkpoint_dir that holds it ({path.parent})")
    check_dir_trusted(path)
    if keep_last is None or keep_daily_days is None:
        from ..config import load_config

        cfg = load_config().config.checkpoint
        keep_last = cfg.keep_last if keep_last is None else keep_last
        keep_daily_days = cfg.keep_daily_days if keep_daily_days is None else keep_daily_days
    lock = read_lock(path / LOCK_NAME)
    if lock is not None and not dry_run and not force and lock.pid <= 0:
        raise CkptsupError(f"{path / LOCK_NAME} is not a lock ckptsup can read, so a writer may be active; "
                           f"if no job writes here, remove it, or use --dry-run, or --force")
    if lock is not None and not dry_run and not force and (lock.host != _hostname() or pid_alive(lock.pid)):
        raise CkptsupError(f"{path} is being written by pid {lock.pid} on {lock.host}; its own retention runs there "
                           f"(checkpoints being validated or promoted are protected only in that process). Use --dry-run, or --force")
    result = apply_retention(path, keep_last=keep_last, keep_daily_days=keep_daily_days,
                             clock=lambda: datetime.now(timezone.utc), dry_run=dry_run)
    if as_json:
        _emit_json({"keep": result.keep, "delete": result.delete, "deleted": result.deleted, "skipped": result.skipped,
                    "needs_test_load": result.needs_test_load, "dry_run": dry_run})
        return
    verb = "would delete" if dry_run else "deleted"
    _echo(f"keep {len(result.keep)}: {', '.join(map(str, result.keep)) or '-'}")
    _echo(f"{verb} {len(result.delete)}: {', '.join(map(str, result.delete)) or '-'}")
    if result.skipped:
        _echo(f"left alone (incomplete or rejected; see `ckptsup ckpt verify`): {', '.join(map(str, result.skipped))}")


def _hostname() -> str:
    import socket

    return socket.gethostname()
