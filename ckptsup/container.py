"""Containers (docs/containers.md): the agents, their zygotes and the ranks run inside a container;
the supervisor stays on the batch host. One plan per job, built once at the edge from `[container]`
(`plan`), checked before the allocation is spent (`problems`), then applied to every agent step
(`ContainerPlan.srun_flags`, `.wrap`; supervisor/job/placement.py): the same srun line as on bare
metal, with the runtime's flags or wrapper. A base module: `ckptsup sbatch` (slurm/) checks and
hands on the same flags, and the agent reads CONTAINER_ENV.

- pyxis/enroot: `srun --container-image IMG --container-name NAME --container-mounts ...`; the name is
  scoped to the job, so a later step (a spare's agent, a node-path restart) on a node that imported
  the image already reuses its file system.
- oci: `srun --container BUNDLE` (Slurm's own OCI support): the bundle's config.json holds the mounts,
  so the plan checks that they cover the paths the job needs instead of adding any.
- apptainer: the agent's command wrapped in `apptainer exec --bind ... [--nv] IMAGE`.

What the agents need inside at the same path as outside: the run directory (spec, secret, events),
the checkpoint tiers on a file system, the launch directory and the script's.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from .env import CONTAINER
from .errors import CkptsupError, ConfigError

CONTAINER_ENV = CONTAINER   # the agent's environment: which runtime it runs in (agent side: node/identity.py)
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")


class Runtime(enum.StrEnum):
    NONE = "none"
    PYXIS = "pyxis"
    OCI = "oci"
    APPTAINER = "apptainer"


@dataclass(frozen=True, kw_only=True)
class Mount:
    source: str
    target: str
    flags: str = ""

    @classmethod
    def parse(cls, entry: str) -> "Mount":
        parts = entry.split(":")
        return cls(source=parts[0], target=parts[1] if len(parts) > 1 else parts[0],
                   flags=parts[2] if len(parts) > 2 else "")

    def spec(self) -> str:
        """SRC:DST[:FLAGS], the syntax pyxis's --container-mounts and apptainer's --bind share."""
        return ":".join([self.source, self.target, *([self.flags] if self.flags else [])])


def covers(targets: Iterable[str], path: str) -> bool:
    """Whether a mount at one of `targets` (paths inside) makes `path` visible at its own path."""
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


@dataclass(frozen=True, kw_only=True)
class ContainerPlan:
    runtime: Runtime
    image: str = ""
    bundle: str = ""
    mounts: tuple[Mount, ...] = ()          # the user's, then the job's own paths not under any of them
    env: tuple[str, ...] = ()
    workdir: str = ""
    python: str = "python3"
    name: str = ""                          # pyxis: {job_id} expanded
    needed: tuple[str, ...] = ()            # paths the agents need at their own path inside

    @property
    def on(self) -> bool:
        return self.runtime is not Runtime.NONE

    def agent_command(self, spec_path: str, attempt: int) -> list[str]:
        """`ckptsup agent` by the container's interpreter (the image's ckptsup, not the host's)."""
        return [self.python, "-m", "ckptsup.cli", "agent", "--spec", spec_path, "--attempt", str(attempt)]

    def srun_flags(self) -> list[str]:
        """Flags of the agents' srun step."""
        if self.runtime is Runtime.PYXIS:
            flags = [f"--container-image={self.image}", f"--container-name={self.name}"]
            if self.mounts:
                flags.append("--container-mounts=" + ",".join(m.spec() for m in self.mounts))
            if self.env:
                flags.append("--container-env=" + ",".join(self.env))
            if self.workdir:
                flags.append(f"--container-workdir={self.workdir}")
            return flags
        if self.runtime is Runtime.OCI:
            return [f"--container={self.bundle}"]
        return []

    def wrap(self, command: Sequence[str], *, gpus: int) -> list[str]:
        """The task's command: apptainer's wrapper around it; pyxis and oci wrap through srun's flags."""
        if self.runtime is not Runtime.APPTAINER:
            return list(command)
        argv = ["apptainer", "exec"]
        if self.mounts:
            argv += ["--bind", ",".join(m.spec() for m in self.mounts)]
        if gpus:
            argv.append("--nv")
        if self.workdir:
            argv += ["--pwd", self.workdir]
        return [*argv, self.image, *command]


def plan(config: Any, *, job_id: str, needed_paths: Sequence[str]) -> ContainerPlan:
    """The plan from `[container]` (config.ContainerConfig, already type-checked): `needed_paths`
    (absolute) are mounted at their own paths unless a user mount covers them (pyxis, apptainer)."""
    runtime = Runtime(config.runtime)
    if runtime is Runtime.NONE:
        if config.image or config.bundle:
            what = "container.image" if config.image else "container.bundle"
            raise ConfigError(f"{what} is set but container.runtime is none; pass --container-image (pyxis), "
                              "--container BUNDLE (oci) or --apptainer IMAGE, or set [container] runtime")
        return ContainerPlan(runtime=runtime)
    if runtime is Runtime.OCI and not config.bundle:
        raise ConfigError("container.runtime = oci needs a bundle; pass --container /path/to/bundle "
                          "(a directory with config.json and rootfs on every node)")
    if runtime is not Runtime.OCI and not config.image:
        flag = "--container-image IMAGE" if runtime is Runtime.PYXIS else "--apptainer IMAGE"
        raise ConfigError(f"container.runtime = {runtime.value} needs an image; pass {flag}")
    if runtime is Runtime.OCI and (config.mounts or config.env):
        what = "mounts" if config.mounts else "env"
        raise ConfigError(f"container.{what} does not apply to an OCI bundle (Slurm passes no mounts or variables "
                          "to it); put them in the bundle's config.json, or use pyxis or apptainer")
    user = tuple(Mount.parse(m) for m in config.mounts)
    own: list[Mount] = []
    if runtime is not Runtime.OCI:
        targets = [m.target for m in user]
        for path in _outermost(needed_paths):
            if not covers(targets, path):
                own.append(Mount(source=path, target=path))
    return ContainerPlan(runtime=runtime, image=config.image, bundle=config.bundle, mounts=user + tuple(own),
                         env=tuple(config.env), workdir=config.workdir, python=config.python,
                         name=config.name.replace("{job_id}", job_id), needed=tuple(_outermost(needed_paths)))


def _outermost(paths: Sequence[str]) -> list[str]:
    """The paths without any that lies under another (one mount serves both), in order."""
    unique = list(dict.fromkeys(os.path.normpath(p) for p in paths if p))
    return [p for p in unique if not any(o != p and covers([o], p) for o in unique)]


# ---- the checks before the allocation is spent ---------------------------------------------------

SRUN_FLAG = {Runtime.PYXIS: "--container-image", Runtime.OCI: "--container"}
FIX_FLAG = {Runtime.PYXIS: "install the pyxis SPANK plugin on the cluster, or use --apptainer IMAGE",
            Runtime.OCI: "Slurm 21.08+ with an oci.conf is needed; or use --apptainer IMAGE"}


def problems(p: ContainerPlan, *, srun_help: Callable[[], str], which: Callable[[str], str | None] = shutil.which,
             exists: Callable[[str], bool] = os.path.exists) -> list[str]:
    """What stops the plan before any step starts, one line each naming the fix (empty: none seen
    from the batch host; the nodes are assumed to see the same file systems and software)."""
    out: list[str] = []
    if not p.on:
        return out
    flag = SRUN_FLAG.get(p.runtime)
    try:
        helped = srun_help() if flag is not None else ""
    except CkptsupError:   # no srun here to ask (sbatch on a login node without one): the job's launch asks
        flag = None
    if flag is not None and not re.search(rf"(^|\s){re.escape(flag)}[=\s,]", helped, re.M):
        out.append(f"this cluster's srun has no {flag} option (srun --help): {FIX_FLAG[p.runtime]}")
    if p.runtime is Runtime.APPTAINER and which("apptainer") is None:
        out.append("apptainer is not on PATH on the batch host; install Apptainer on the nodes, or load its module "
                   "before `ckptsup launch`")
    if p.runtime is Runtime.APPTAINER and not _URI.match(p.image) and not exists(p.image):
        out.append(f"apptainer image {p.image} does not exist; build it (apptainer build train.sif docker://...) "
                   "or pass a docker:// URI")
    if p.runtime is Runtime.PYXIS and p.image.startswith(("/", "./")) and not exists(p.image):
        out.append(f"container image {p.image} does not exist; import it (enroot import -o FILE.sqsh docker://...) "
                   "or pass a registry image such as nvcr.io#nvidia/pytorch:24.05-py3")
    for m in p.mounts:
        if not exists(m.source):
            out.append(f"container mount source {m.source} does not exist; create it or drop the mount")
    if p.runtime is Runtime.OCI:
        out += bundle_problems(p.bundle, needed=p.needed)
    return out


def bundle_problems(bundle: str, *, needed: Sequence[str] = ()) -> list[str]:
    """An OCI bundle that Slurm cannot run, or that hides a path the job needs (Slurm adds no mounts)."""
    config_path = Path(bundle) / "config.json"
    if not Path(bundle).is_dir():
        return [f"OCI bundle {bundle} is not a directory; pass the directory holding config.json and rootfs"]
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        why = err.strerror if isinstance(err, OSError) else "not JSON"
        return [f"OCI bundle {bundle}: config.json unreadable ({why}); create it with `runc spec` in the bundle"]
    if not isinstance(config, dict):
        return [f"OCI bundle {bundle}: config.json is not an object; create it with `runc spec` in the bundle"]
    out = []
    root = config.get("root")
    root = root if isinstance(root, dict) else {}
    rootfs = Path(bundle) / str(root.get("path", "rootfs"))
    if not rootfs.is_dir():
        out.append(f"OCI bundle {bundle}: its root {rootfs} is not a directory; unpack the image's file system there")
    targets = [m.get("destination", "") for m in config.get("mounts", []) if isinstance(m, dict)]
    hidden = [p for p in _outermost(needed) if not covers([t for t in targets if isinstance(t, str)], p)]
    if hidden:
        out.append(f"OCI bundle {bundle} does not mount {', '.join(hidden)}, which the job needs at the same path "
                   "inside; add a bind mount for each to config.json's mounts")
    return out


# ---- the flags (`ckptsup launch` and `ckptsup sbatch`: sbatch hands them on to the launch line) ----

@dataclass(frozen=True, kw_only=True)
class ContainerFlags:
    image: str | None = None        # --container-image (pyxis)
    bundle: str | None = None       # --container (oci)
    apptainer: str | None = None    # --apptainer
    mounts: str | None = None       # --container-mounts SRC:DST[:FLAGS],...
    env: str | None = None          # --container-env NAME,...
    workdir: str | None = None      # --container-workdir
    python: str | None = None       # --container-python

    SPELLINGS = {"image": "--container-image", "bundle": "--container", "apptainer": "--apptainer",
                 "mounts": "--container-mounts", "env": "--container-env", "workdir": "--container-workdir",
                 "python": "--container-python"}

    def config_flags(self) -> dict[str, Any]:
        """The `[container]` values these flags set (None: not given)."""
        chosen = [(n, v) for n, v in (("image", self.image), ("bundle", self.bundle), ("apptainer", self.apptainer)) if v]
        if len(chosen) > 1:
            given = " and ".join(self.SPELLINGS[n] for n, _ in chosen)
            raise ConfigError(f"{given} exclude each other: pass one runtime (--container-image for pyxis, "
                              "--container BUNDLE for Slurm's OCI, --apptainer IMAGE)")
        flags: dict[str, Any] = {}
        if chosen:
            name, value = chosen[0]
            runtime = {"image": Runtime.PYXIS, "bundle": Runtime.OCI, "apptainer": Runtime.APPTAINER}[name]
            flags["container.runtime"] = runtime.value
            if runtime is Runtime.OCI:
                flags["container.bundle"] = os.path.abspath(value)
            else:   # a local image file is named by its absolute path, a registry's as it is
                local = value.startswith(("/", "./", "../")) or value.endswith((".sif", ".sqsh", ".squashfs"))
                flags["container.image"] = os.path.abspath(value) if local and not _URI.match(value) else value
        flags["container.mounts"] = [m for m in self.mounts.split(",") if m] if self.mounts else None
        flags["container.env"] = [e for e in self.env.split(",") if e] if self.env else None
        flags["container.workdir"] = self.workdir
        flags["container.python"] = self.python
        return flags

    def argv(self) -> list[str]:
        """The same flags again, for the launch line of a job script."""
        out: list[str] = []
        for name, spelling in self.SPELLINGS.items():
            value = getattr(self, name)
            if value:
                out += [spelling, value]
        return out


# ---- the click options of both commands ----------------------------------------------------------

def container_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The container flags of `ckptsup launch` and `ckptsup sbatch` (docs/containers.md); they
    reach the command as one `container` keyword (ContainerFlags)."""
    options = [
        click.option("--container-image", "container_image", metavar="IMAGE", default=None,
                     help="run the agents and ranks in this pyxis/enroot image (container.runtime = pyxis)"),
        click.option("--container", "container_bundle", metavar="BUNDLE", default=None,
                     help="run them in this OCI bundle through Slurm's own srun --container (container.runtime = oci)"),
        click.option("--apptainer", "container_apptainer", metavar="IMAGE", default=None,
                     help="run them with apptainer exec IMAGE (container.runtime = apptainer)"),
        click.option("--container-mounts", "container_mounts", metavar="SRC:DST[:FLAGS],...", default=None,
                     help="extra mounts (container.mounts); the run dir, checkpoint tiers, launch directory and "
                          "script are mounted at their own paths anyway"),
        click.option("--container-env", "container_env", metavar="NAME,...", default=None,
                     help="pyxis: variables whose host value overrides the image's (container.env)"),
        click.option("--container-workdir", "container_workdir", metavar="DIR", default=None,
                     help="working directory inside (container.workdir)"),
        click.option("--container-python", "container_python", metavar="PYTHON", default=None,
                     help="the interpreter inside that has ckptsup and torch (container.python; default python3)"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def container_flags(values: dict[str, Any]) -> ContainerFlags:
    """The container options out of a command's keywords (removed from `values`)."""
    return ContainerFlags(image=values.pop("container_image"), bundle=values.pop("container_bundle"),
                          apptainer=values.pop("container_apptainer"), mounts=values.pop("container_mounts"),
                          env=values.pop("container_env"), workdir=values.pop("container_workdir"),
                          python=values.pop("container_python"))


def needed_paths(config: Any, *, run_dir: str, cwd: str, script: str, module: bool) -> list[str]:
    """The paths the agents and ranks need at their own path inside a container: the run directory
    (spec, secret, events), the launch directory, the script's, the checkpoint tiers on a file system."""
    paths = [run_dir, cwd]
    if not module:
        paths.append(os.path.dirname(os.path.join(cwd, script)))
    for raw in (config.checkpoint.dir, config.checkpoint.external_dir, config.storage.node_local.removeprefix("file://")):
        head = raw.split("{", 1)[0]   # {node}, {job_id}: the fixed directory above them
        if "{" in raw and not head.endswith("/"):
            head = os.path.dirname(head)
        if head:
            paths.append(os.path.join(cwd, head))
    return [os.path.abspath(p) for p in paths]
