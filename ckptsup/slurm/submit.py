"""`ckptsup sbatch`: resolve config + flags into SbatchParams, render, and submit.

Slurm does not create the directory of `--output`, so the run directory exists (0700) before
the job can start: when its name holds {job_id}, the job is submitted held, the directory is
made, and the job is released."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import load_config
from ..errors import CkptsupError, ConfigError
from ..resources import sbatch_templates_dir
from ..rundir import ensure_private_dir
from .client import SlurmClient
from .render import JOB_ID, SbatchParams, params_from_config, render_sbatch, resolve_template

SCRIPT_NAME = "job.sbatch"


@dataclass(frozen=True, kw_only=True)
class Prepared:
    params: SbatchParams
    template: Path
    text: str


@dataclass(frozen=True, kw_only=True)
class Submitted:
    job_id: str
    run_dir: Path
    script_path: Path


def ckptsup_executable() -> str:
    """The ckptsup the job should call: this one (the venv's), else whatever is on PATH."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "ckptsup" and argv0.exists():
        return str(argv0.resolve())
    return shutil.which("ckptsup") or "ckptsup"


def prepare(*, flags: Mapping[str, Any], job_config: str | None, script: str,
            script_args: Sequence[str] = (), nproc_per_node: int | str | None = None,
            cwd: Path | None = None, ckptsup: str | None = None, module: bool = False,
            no_python: bool = False, container_args: Sequence[str] = ()) -> Prepared:
    cwd = cwd or Path.cwd()
    resolved = load_config(job_config=job_config, flags=flags)
    config = resolved.config
    run_dir = config.run.run_dir
    if not Path(run_dir.replace(JOB_ID, "x")).is_absolute():
        run_dir = str(cwd / run_dir)
    script_path = _target(script, cwd, module=module, no_python=no_python)
    params = params_from_config(
        config.sbatch, run_dir=run_dir, script=script_path, script_args=script_args, module=module,
        no_python=no_python,
        nproc_per_node=nproc_per_node or 0,
        job_config=str(Path(job_config).resolve()) if job_config else "",
        ckptsup=ckptsup or ckptsup_executable(), container_args=tuple(container_args))
    check_container(resolved, run_dir=run_dir, cwd=cwd, script=script_path, module=module)
    template = resolve_template(config.sbatch.template, sbatch_templates_dir())
    return Prepared(params=params, template=template, text=render_sbatch(template.read_text(), params))


def check_container(resolved: Any, *, run_dir: str, cwd: Path, script: str, module: bool) -> None:
    """A container option's problems found here, before the job waits in the queue: the image,
    bundle or mounts missing, srun without the runtime's option (ckptsup/container.py)."""
    from ..container import needed_paths, plan, problems

    box = plan(resolved.config.container, job_id="{job_id}",
               needed_paths=needed_paths(resolved.config, run_dir=run_dir.split(JOB_ID, 1)[0] or run_dir, cwd=str(cwd),
                                            script=script, module=module))
    found = problems(box, srun_help=lambda: SlurmClient().run(["srun", "--help"]).stdout)
    if found:
        raise ConfigError("; ".join(found))


_DOTTED = re.compile(r"^[^\W\d]\w*(\.[^\W\d]\w*)*$")   # as supervisor/torchrun_args.py


def _target(script: str, cwd: Path, *, module: bool, no_python: bool) -> str:
    """SCRIPT as the job's `ckptsup launch` will take it (it checks again inside the job): a
    module name is passed as is (it is imported in the job's working directory, the submit dir)."""
    if module and no_python:
        raise ConfigError("-m and --no-python exclude each other (a module needs python); pass one of them")
    if module:
        if not _DOTTED.match(script) or script.endswith(".py"):
            raise ConfigError(f"-m {script[:60]!r} is not a module name; pass dotted Python names, e.g. -m pkg.train")
        return script
    path = script if Path(script).is_absolute() else str(cwd / script)
    if Path(path).is_dir():
        raise ConfigError(f"training script {script} is a directory; pass the path of your train.py")
    if not Path(path).is_file():
        raise ConfigError(f"training script {script} does not exist; pass the path of your train.py")
    if no_python and not os.access(path, os.X_OK):
        raise ConfigError(f"--no-python: {script} is not executable; chmod +x it, or drop --no-python")
    return path


def write_script(path: Path, text: str) -> Path:
    """Write a job script 0700 (our mode from the first byte, not the umask's); an unwritable
    place is one ConfigError line."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    except OSError as err:
        raise ConfigError(f"cannot write the job script to {str(path)!r}: {err.strerror}; pick a writable path") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o700)  # an existing file keeps its old mode through O_TRUNC
    return path


def submit_script(prepared: Prepared, *, client: SlurmClient | None = None) -> Submitted:
    """Create the run directory (0700) and submit. With {job_id} in the run directory the job
    is submitted held and released once its directory exists."""
    client = client or SlurmClient()
    run_dir = prepared.params.run_dir
    if JOB_ID not in run_dir:
        path = ensure_private_dir(Path(run_dir))
        script = write_script(path / SCRIPT_NAME, prepared.text)
        return Submitted(job_id=client.submit(script), run_dir=path, script_path=script)
    with tempfile.TemporaryDirectory(prefix="ckptsup-sbatch-") as tmp:
        staged = write_script(Path(tmp) / SCRIPT_NAME, prepared.text)
        job_id = client.submit(staged, ["--hold"])
    try:
        path = ensure_private_dir(Path(run_dir.replace(JOB_ID, job_id)))
        script = write_script(path / SCRIPT_NAME, prepared.text)
    except CkptsupError:
        client.cancel(job_id)  # never leave a held job whose output has nowhere to go
        raise
    client.release(job_id)
    return Submitted(job_id=job_id, run_dir=path, script_path=script)
