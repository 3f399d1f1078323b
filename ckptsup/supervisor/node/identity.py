"""Who the agent is and where it runs: its node's name, inside a container or not, and what it
tells the supervisor about itself first (`hello`: versions, pid namespace, container, /dev/shm).

Bare metal, Slurm's slurmstepd gives every task SLURMD_NODENAME. Slurm's OCI containers (22.05,
checked on the dev cluster: docs/containers.md) get only srun's own environment — no SLURMD_NODENAME, no
SLURM_PROCID — and the hostname is the bundle's ("runc"). What does tell the node there: the
container id Slurm hands the runtime, `%n.%u.%j.%s.%t` in Slurm's documented oci.conf (node, user,
job, step, task), which is the container's cgroup path in /proc/self/cgroup; else a hostname that
is one of the step's nodes (a container sharing the host's UTS namespace, pyxis's and apptainer's
default).
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import time
from pathlib import Path
from typing import Callable, Mapping

import hostlist

from ...env import NODE, SLURMD_NODENAME
from ...errors import ConfigError

SLURM_JOB = "SLURM_JOB_ID"
SLURM_STEP = "SLURM_STEP_ID"
STEP_NODES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
# the last component of a cgroup path that is Slurm's OCI container id %n.%u.%j.%s.%t
_CONTAINER_ID = re.compile(r"(?:^|/)(?P<node>[^/]+)\.(?P<user>[^./]+)\.(?P<job>\d+)\.(?P<step>\d+)\.(?P<task>\d+)$")
SMALL_SHM = 1 << 30   # /dev/shm smaller than this in a container: DataLoader workers and NCCL run short


def node_from_cgroup(cgroup_text: str, environ: Mapping[str, str]) -> str | None:
    """The node in Slurm's OCI container id, when this process's cgroup path is one (of this job and step)."""
    for line in cgroup_text.splitlines():
        match = _CONTAINER_ID.search(line.split(":", 2)[-1].rstrip("/"))
        if match is None:
            continue
        if environ.get(SLURM_JOB) and match["job"] != environ[SLURM_JOB]:
            continue
        if environ.get(SLURM_STEP, "").isdigit() and match["step"] != environ[SLURM_STEP]:
            continue
        return match["node"]
    return None


def step_nodes(environ: Mapping[str, str]) -> list[str]:
    for key in STEP_NODES:
        if environ.get(key):
            try:
                return list(hostlist.expand_hostlist(environ[key]))
            except hostlist.BadHostlist:
                return []
    return []


def agent_node(environ: Mapping[str, str], *, cgroup_text: str, hostname: str) -> tuple[str, str]:
    """(node, how it was found). Raises ConfigError, one line naming the fix, when nothing tells."""
    for key in (NODE, SLURMD_NODENAME):
        if environ.get(key):
            return environ[key], key
    if not environ.get(SLURM_JOB):
        return hostname, "hostname"   # outside Slurm: the machine is the node
    node = node_from_cgroup(cgroup_text, environ)
    if node is not None:
        return node, "container id"
    nodes = step_nodes(environ)
    for name in (hostname, hostname.split(".")[0]):
        if name in nodes:
            return name, "hostname"
    raise ConfigError(f"the agent cannot tell which node it runs on: no {SLURMD_NODENAME} (a container gets only "
                      f"srun's environment), no Slurm container id %n.%u.%j.%s.%t in /proc/self/cgroup, and the "
                      f"hostname {hostname[:64]!r} is not one of the step's nodes; give the container the host's "
                      "hostname (no UTS namespace) or use Slurm's container id in oci.conf (docs/containers.md)")


def this_node() -> tuple[str, str]:
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = ""
    return agent_node(os.environ, cgroup_text=cgroup, hostname=socket.gethostname())


def torch_missing(container: str, *, python: str, find: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """In a container, an image without torch: one line before any launch (the agent itself needs
    none, so without this the ranks would crash at import, attempt after attempt)."""
    if not container or find("torch") is not None:
        return None
    return (f"No module named 'torch' for {python} in the {container} container: use an image with PyTorch, "
            "or set [container] python to an interpreter that has it")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 when unreadable): ranks in a container have another one than the host."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_free(path: str = "/dev/shm") -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def process_age_s() -> float:
    """Seconds since this process started (its exec; /proc/self/stat's starttime), 0 when unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - started, 0.0)


def shm_warning(node: str, container: str, free: int) -> str | None:
    """One line when a container's /dev/shm is small: DataLoader workers hand batches through it
    and NCCL's intra-node transport uses it; Docker's and runc's default is 64 MiB."""
    if not container or free >= SMALL_SHM:
        return None
    return (f"ckptsup agent: /dev/shm in the {container} container on {node} has {free / 2**20:.0f} MiB free: "
            "DataLoader workers and NCCL need more; mount a larger tmpfs there (OCI config.json: a tmpfs at "
            "/dev/shm with size=...) or bind the host's /dev/shm")


def started_monotonic() -> float:
    """The monotonic time this process started at (for the container phase)."""
    return time.monotonic() - process_age_s()
