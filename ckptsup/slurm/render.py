"""Rendering an sbatch template: a pure function of the template text and SbatchParams.

Placeholders are `{{name}}` (bash owns `$`); an unknown or missing placeholder is an error, so a
template and its parameters cannot drift apart silently. Every value that reaches a `#SBATCH`
line is checked for characters that would end or change the directive; every value that reaches
the shell is quoted.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..env import ExitStatus
from ..errors import ConfigError

PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
JOB_ID = "{job_id}"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")
MAX_NODES = 100_000      # above any real cluster: a bigger figure is a typo
MAX_PER_NODE = 4096      # GPUs, CPUs or ranks on one node
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(\d+-\d+)$|^(UNLIMITED|INFINITE)$", re.I)


@dataclass(frozen=True, kw_only=True)
class SbatchParams:
    """Everything a rendered script depends on (from the [sbatch] config section and flags)."""

    run_dir: str                       # absolute; may contain {job_id} (→ %j / $SLURM_JOB_ID)
    script: str                        # the training script, passed to `ckptsup launch`
    script_args: tuple[str, ...] = ()
    module: bool = False               # `ckptsup launch -m`: script is a module name
    no_python: bool = False            # `ckptsup launch --no-python`: script is an executable
    nodes: int = 2
    spares: int = 0
    job_name: str = "ckptsup"
    time: str = "24:00:00"
    partition: str = ""
    account: str = ""
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    signal_lead_s: int = 120
    extra_directives: tuple[str, ...] = ()
    job_config: str = ""               # --config FILE handed to `ckptsup launch`
    nproc_per_node: int | str = 0      # 0: leave it to the config; or "gpu" / "auto"
    ckptsup: str = "ckptsup"           # how the job calls ckptsup (absolute path from the CLI)
    container_args: tuple[str, ...] = ()   # `ckptsup launch`'s container flags (docs/containers.md)
    launch_command: str = ""           # override (tests substitute a trivial command)
    requeue_command: str = ""
    watchdog_command: str = ""

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares


def _directive_value(name: str, value: str) -> str:
    if not value or any(c.isspace() for c in value) or "#" in value:
        raise ConfigError(f"sbatch.{name} = {value!r} must be non-empty with no spaces or '#'")
    return value


def _shell_path(path: str) -> str:
    """Quote `path` for bash, turning {job_id} into "${SLURM_JOB_ID}"."""
    parts = path.split(JOB_ID)
    return '"${SLURM_JOB_ID}"'.join(shlex.quote(p) if p else "" for p in parts)


def check_params(p: SbatchParams) -> None:
    """Refuse values that Slurm would reject or that would change the script; one line each."""
    if p.nodes < 1:
        raise ConfigError(f"sbatch.nodes = {p.nodes} must be >= 1")
    if p.spares < 0:
        raise ConfigError(f"sbatch.spares = {p.spares} must be >= 0")
    if p.total_nodes > MAX_NODES:
        raise ConfigError(f"sbatch.nodes + sbatch.spares = {p.total_nodes} is more than any cluster has "
                          f"(at most {MAX_NODES:,}); check the number")
    if isinstance(p.nproc_per_node, str) and p.nproc_per_node not in ("gpu", "auto"):
        raise ConfigError(f"nproc_per_node = {p.nproc_per_node!r} must be a number, gpu or auto")
    for name in ("gpus_per_node", "cpus_per_task", "nproc_per_node"):
        value = getattr(p, name)
        if isinstance(value, int) and not 0 <= value <= MAX_PER_NODE:
            raise ConfigError(f"{name} = {value} must be between 0 (leave it to the site) and {MAX_PER_NODE}")
    if p.signal_lead_s < 1 or p.signal_lead_s > 65535:
        raise ConfigError(f"sbatch.signal_lead_s = {p.signal_lead_s} must be between 1 and 65535 seconds")
    if not _TIME.match(p.time):
        raise ConfigError(f"sbatch.time = {p.time!r} is not a Slurm time; use e.g. 24:00:00 or 2-00:00:00")
    for name in ("partition", "account", "job_name"):
        value = getattr(p, name)
        if value and not _SAFE_NAME.match(value):
            raise ConfigError(f"sbatch.{name} = {value!r} may hold only letters, digits and _ . , + -")
    if not Path(p.run_dir.replace(JOB_ID, "x")).is_absolute():
        raise ConfigError(f"run directory {p.run_dir!r} must be absolute (ckptsup sbatch resolves it)")
    _directive_value("run_dir", p.run_dir)
    for extra in p.extra_directives:
        if not extra.startswith("-") or "\n" in extra or "\r" in extra:
            raise ConfigError(f"sbatch.extra_directives entry {extra!r} must be one option such as \"--qos=high\"")


def _directives(p: SbatchParams) -> str:
    lines = []
    if p.partition:
        lines.append(f"--partition={p.partition}")
    if p.account:
        lines.append(f"--account={p.account}")
    if p.gpus_per_node:
        lines.append(f"--gpus-per-node={p.gpus_per_node}")
    if p.cpus_per_task:
        lines.append(f"--cpus-per-task={p.cpus_per_task}")
    lines += list(p.extra_directives)
    return "\n".join(f"#SBATCH {line}" for line in lines) if lines else "# (no site-specific directives)"


def _launch(p: SbatchParams) -> str:
    if p.launch_command:
        return p.launch_command
    # the allocation's shape as submitted, so that the supervisor's [sbatch] values inside the
    # job are these (also after a requeue, whatever the site file says by then)
    argv = [shlex.quote(p.ckptsup), "launch", "--run-dir", '"$RUN_DIR"', "--nodes", str(p.nodes),
            "--spares", str(p.spares), "--gpus-per-node", str(p.gpus_per_node), "--signal-lead-s", str(p.signal_lead_s)]
    if p.nproc_per_node:
        argv += ["--nproc-per-node", str(p.nproc_per_node)]
    if p.job_config:
        argv += ["--config", shlex.quote(p.job_config)]
    argv += [shlex.quote(a) for a in p.container_args]
    argv += [*(["-m"] if p.module else []), *(["--no-python"] if p.no_python else []),
             shlex.quote(p.script), *(shlex.quote(a) for a in p.script_args)]
    return " ".join(argv)


def no_requeue_statuses() -> str:
    """The `case` pattern of statuses the script does not requeue (env.should_requeue)."""
    return "|".join(str(int(s)) for s in ExitStatus if not s.requeues)


def template_values(p: SbatchParams) -> dict[str, str]:
    check_params(p)
    ckptsup = shlex.quote(p.ckptsup)
    return {
        "job_name": p.job_name,
        "total_nodes": str(p.total_nodes),
        "nodes": str(p.nodes),
        "spares": str(p.spares),
        "time": p.time,
        "signal_lead_s": str(p.signal_lead_s),
        "output": p.run_dir.replace(JOB_ID, "%j") + "/slurm-%j.out",
        "directives": _directives(p),
        "run_dir": _shell_path(p.run_dir),
        "launch_command": _launch(p),
        "requeue_command": p.requeue_command or f'{ckptsup} requeue --run-dir "$RUN_DIR"',
        "watchdog_command": p.watchdog_command or f'{ckptsup} watchdog --run-dir "$RUN_DIR"',
        "no_requeue_statuses": no_requeue_statuses(),
    }


def render(template_text: str, values: dict[str, str]) -> str:
    """Substitute `{{name}}`; a name ckptsup does not provide is an error (a site template
    may leave any value out)."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ConfigError(f"sbatch template uses {{{{{name}}}}}, which ckptsup does not provide; "
                              f"known: {', '.join(sorted(values))}")
        return values[name]

    return PLACEHOLDER.sub(sub, template_text)


def render_sbatch(template_text: str, params: SbatchParams) -> str:
    return render(template_text, template_values(params))


def resolve_template(name: str, templates_dir: Path) -> Path:
    """A template name in sbatch_templates/ or a path to one."""
    candidate = Path(name)
    if candidate.is_absolute() or "/" in name:
        path = candidate
    else:
        path = templates_dir / name
    if not path.is_file():
        shipped = sorted(p.name for p in templates_dir.glob("*.sbatch")) if templates_dir.is_dir() else []
        raise ConfigError(f"sbatch template {name!r} not found; use a path or one of: {', '.join(shipped) or '(none)'}")
    return path


def params_from_config(sbatch_config, *, run_dir: str, script: str, script_args: Sequence[str] = (),
                       **overrides) -> SbatchParams:
    """SbatchParams from the effective `[sbatch]` section plus explicit values."""
    c = sbatch_config
    base = dict(nodes=c.nodes, spares=c.spares, job_name=c.job_name, time=c.time, partition=c.partition,
                account=c.account, gpus_per_node=c.gpus_per_node, cpus_per_task=c.cpus_per_task,
                signal_lead_s=int(c.signal_lead_s), extra_directives=tuple(c.extra_directives))
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SbatchParams(run_dir=run_dir, script=script, script_args=tuple(script_args), **base)
