"""The dev cluster's shape and its slurm.conf, as pure data and a pure render.

The partition layout is the pattern a real site would copy for hot spares and requeue:

- ``main``      regular nodes, the default partition, never preempted;
- ``spares``    reserved spare nodes, not the default, so ordinary jobs leave them free;
- ``mainspare`` spans both: a requeued job moved here may land on a spare node (a job runs in
                exactly one partition, so ``--partition=main,spares`` would never mix them);
- ``lowprio``   preemptable (GraceTime 30 s), over every node;
- ``lowprio120`` the same with GraceTime 120 s (sites differ; the supervisor reads the value);
- ``highprio``  a higher PriorityTier over every node whose jobs take the nodes of ``lowprio``.

preempt/partition_prio refuses a cluster-wide PreemptMode=OFF, so the cluster says REQUEUE and
every partition except the two ``lowprio`` ones says OFF (docs/slurm.md §Partitions).

GPUs: every node declares ``gpu:<gpus_per_node>`` GRES backed by fake character devices under
the cluster directory (``dev/nvidia<K>``, major 195 like NVIDIA's). Slurm 22.05 drops GPU GRES
without ``File=`` (the node turns INVAL), and plain files instead of device nodes leave the GPU
variables unset; with device nodes a ``--gpus-per-node=2`` job gets SLURM_GPUS_ON_NODE=2,
SLURM_JOB_GPUS=0,1 and CUDA_VISIBLE_DEVICES=0,1 (docs/slurm.md §The dev cluster).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import hostlist

from ..errors import DevClusterError

DEFAULT_DIR = Path("/tmp/ckptsup-dev-cluster")
DEFAULT_PORT_BASE = 17000
MAIN = "main"
SPARES = "spares"
SPANNING = "mainspare"
LOWPRIO = "lowprio"
LOWPRIO_LONG = "lowprio120"
HIGHPRIO = "highprio"
DEFAULT_NODES = 5
MIN_NODES = 2                       # one main node and the reserved spare at least
MAX_NODES = 256                     # measured: 256 idle nodes up in 3.4 s, ~1.8 MB each (docs/slurm.md)
MAX_PORT = 65535


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Everything that decides the cluster's slurm.conf. Ports: slurmctld on ``port_base``,
    node K on ``port_base + K`` (``nodes + 1`` ports in all: a cluster beside it needs a base at
    least that far away). Partitions: ``main`` n1..n(nodes-spares), ``spares`` the last ``spares``
    nodes, the others every node, whatever the size."""

    dir: Path = DEFAULT_DIR
    port_base: int = DEFAULT_PORT_BASE
    nodes: int = DEFAULT_NODES
    spares: int = 1                     # nodes of the reserved ``spares`` partition
    cpus_per_node: int = 4
    real_memory_mb: int = 2000
    grace_time_s: int = 30
    long_grace_time_s: int = 120
    slurmd_timeout_s: int = 10
    kill_wait_s: int = 5
    message_timeout_s: int = 5
    cluster_name: str = "ckptsupdev"
    gpus_per_node: int = 2              # fake GPU GRES per node (0: none declared)
    first_job_id: int = 1               # clusters side by side on one host (parallel tests) get
                                        # disjoint job ids: a SLURM_JOB_ID names one cluster's job
    containers: bool = False            # oci.conf with runc and a test bundle (docs/containers.md)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir).resolve())
        check_shape(nodes=self.nodes, spares=self.spares, port_base=self.port_base)

    @property
    def node_names(self) -> list[str]:
        return [f"n{k}" for k in range(1, self.nodes + 1)]

    @property
    def main_nodes(self) -> list[str]:
        return self.node_names[: self.nodes - self.spares]

    @property
    def spare_nodes(self) -> list[str]:
        return self.node_names[self.nodes - self.spares:]

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    def node_dir(self, node: str) -> Path:
        return self.dir / "nodes" / node

    def node_local_dir(self, node: str) -> Path:
        """The node-local checkpoint tier of `node` (a per-node directory on this host)."""
        return self.node_dir(node) / "local"

    @property
    def oci_conf(self) -> Path:
        return self.dir / "oci.conf"    # slurmstepd reads it beside slurm.conf

    @property
    def bundle(self) -> Path:
        return self.dir / "bundle"      # the test bundle: `srun --container <dir>/bundle`

    @property
    def runc_root(self) -> Path:
        return self.dir / "runc"

    @property
    def cgroup_conf(self) -> Path:
        return self.dir / "cgroup.conf"  # read beside slurm.conf, like gres.conf

    @property
    def gres_conf(self) -> Path:
        return self.dir / "gres.conf"   # slurmd reads gres.conf next to slurm.conf

    def gpu_devices(self) -> list[Path]:
        """The fake GPU device nodes every node's GRES points at (shared by all nodes)."""
        return [self.dir / "dev" / f"nvidia{k}" for k in range(self.gpus_per_node)]

    def node_port(self, node: str) -> int:
        return self.port_base + int(node[1:])

    def ports(self) -> list[int]:
        return [self.port_base] + [self.node_port(n) for n in self.node_names]


def check_shape(*, nodes: int, spares: int, port_base: int) -> None:
    """The cluster's size, checked at the edge: one line naming the flag to change."""
    if not MIN_NODES <= nodes <= MAX_NODES:
        raise DevClusterError(f"--nodes {nodes}: the dev cluster runs {MIN_NODES} to {MAX_NODES} nodes on one machine "
                              f"(a main node and a reserved spare at least); choose --nodes between {MIN_NODES} "
                              f"and {MAX_NODES}")
    if not 1 <= spares < nodes:
        raise DevClusterError(f"{spares} reserved spare node(s) of {nodes}: the spares partition needs at least one "
                              f"node and main at least one; choose between 1 and {nodes - 1} spare nodes")
    if port_base + nodes > MAX_PORT:
        raise DevClusterError(f"--nodes {nodes} from --port-base {port_base} needs ports up to {port_base + nodes}, "
                              f"past {MAX_PORT}; choose a --port-base of at most {MAX_PORT - nodes}")


def nodes_in_conf(text: str) -> int | None:
    """How many nodes a slurm.conf of ours declares (its one NodeName line), None without one:
    the size of a cluster already written, for the commands after `up` (down, status, kill-node)."""
    for line in text.splitlines():
        if line.startswith("NodeName="):
            try:
                return len(hostlist.expand_hostlist(line.split()[0].partition("=")[2]))
            except hostlist.BadHostlist:
                return None
    return None


def _hl(nodes: list[str]) -> str:
    return hostlist.collect_hostlist(nodes)


def render_slurm_conf(spec: ClusterSpec, *, controller_host: str | None = None) -> str:
    """slurm.conf for `spec`. Pure apart from the default controller name (this host's name,
    which slurmctld insists on)."""
    host = controller_host or socket.gethostname().split(".")[0]
    d = spec.dir
    first, last = spec.node_port(spec.node_names[0]), spec.node_port(spec.node_names[-1])
    all_nodes = _hl(spec.node_names)
    lines = [
        "# Generated by `ckptsup dev-cluster up`; every path lives under the cluster directory.",
        f"ClusterName={spec.cluster_name}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={spec.port_base}",
        *([f"FirstJobId={spec.first_job_id}"] if spec.first_job_id != 1 else []),
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # our own munged: nothing of the system's munge is touched
        f"AuthInfo=socket={spec.munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={d}/ctld/state",
        f"SlurmctldPidFile={d}/ctld/slurmctld.pid",
        f"SlurmctldLogFile={d}/ctld/slurmctld.log",
        f"SlurmdSpoolDir={d}/nodes/%n/spool",
        f"SlurmdPidFile={d}/nodes/%n/slurmd.pid",
        f"SlurmdLogFile={d}/nodes/%n/slurmd.log",
        # one slurmd per PID namespace: linuxproc sees the node's own /proc (--mount-proc)
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        # trust the configured CPUs/memory, not this host's (several nodes share its cores)
        "SlurmdParameters=config_overrides",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1,sched_interval=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={d}/ctld/jobcomp.txt",
        "JobRequeue=1",
        # a DOWN node that registers again (revive-node) returns to service by itself
        "ReturnToService=2",
        # short timers keep Slurm's slow paths (node DOWN, kill, requeue) test-sized
        f"SlurmdTimeout={spec.slurmd_timeout_s}",
        "SlurmctldTimeout=10",
        f"MessageTimeout={spec.message_timeout_s}",
        f"KillWait={spec.kill_wait_s}",
        "InactiveLimit=0",
        "MinJobAge=300",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        *(["GresTypes=gpu"] if spec.gpus_per_node else []),
        f"NodeName={all_nodes} NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{first}-{last}] "
        f"CPUs={spec.cpus_per_node} RealMemory={spec.real_memory_mb}"
        + (f" Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else "") + " State=UNKNOWN",
        f"PartitionName={MAIN} Nodes={_hl(spec.main_nodes)} Default=YES MaxTime=INFINITE State=UP "
        "PriorityTier=1 PreemptMode=OFF OverSubscribe=NO",
        f"PartitionName={SPARES} Nodes={_hl(spec.spare_nodes)} Default=NO MaxTime=INFINITE State=UP "
        "PriorityTier=1 PreemptMode=OFF",
        f"PartitionName={SPANNING} Nodes={all_nodes} Default=NO MaxTime=INFINITE State=UP "
        "PriorityTier=1 PreemptMode=OFF",
        f"PartitionName={LOWPRIO} Nodes={all_nodes} Default=NO MaxTime=INFINITE State=UP "
        f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={spec.grace_time_s}",
        f"PartitionName={LOWPRIO_LONG} Nodes={all_nodes} Default=NO MaxTime=INFINITE State=UP "
        f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={spec.long_grace_time_s}",
        f"PartitionName={HIGHPRIO} Nodes={all_nodes} Default=NO MaxTime=INFINITE State=UP "
        "PriorityTier=10 PreemptMode=OFF",
    ]
    return "\n".join(lines) + "\n"


def parse_slurm_version(text: str) -> tuple[int, int]:
    """`slurmd -V` ("slurm 24.11.5", "slurm-wlm 22.05.8") → (24, 11)."""
    match = re.search(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"no Slurm version in {text.strip()!r}")
    return int(match.group(1)), int(match.group(2))


# Version differences of the dev cluster's config live here (parsers.py holds the output ones).
CGROUP_DISABLED_SINCE = (24, 5)   # CgroupPlugin=disabled exists from 24.05 (22.05 refuses it)


def render_cgroup_conf(version: tuple[int, int]) -> str | None:
    """cgroup.conf beside slurm.conf, or None for none. 24.05+ slurmd and slurmstepd load a
    cgroup plugin even with task/none and proctrack/linuxproc, and fail where the nodes share
    one cgroup tree (several slurmd on one host, in namespaces); `disabled` turns it off."""
    if version < CGROUP_DISABLED_SINCE:
        return None
    return ("# Generated by `ckptsup dev-cluster up`: no cgroup plugin (the nodes share this host's tree).\n"
            "CgroupPlugin=disabled\n")


def render_gres_conf(spec: ClusterSpec) -> str:
    """gres.conf for `spec`: every node's GPUs are the fake device nodes of `gpu_devices`."""
    lines = ["# Generated by `ckptsup dev-cluster up`: fake GPUs (device nodes under the cluster directory)."]
    if spec.gpus_per_node:
        files = f"{spec.dir}/dev/nvidia" + (f"[0-{spec.gpus_per_node - 1}]" if spec.gpus_per_node > 1 else "0")
        lines.append(f"NodeName={_hl(spec.node_names)} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


# ---- containers (`dev-cluster up --containers`; docs/containers.md) -------------------------------
# System directories the test bundle binds read-only: the host's Python, libraries and tools run inside.
BUNDLE_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")


def render_oci_conf(spec: ClusterSpec) -> str:
    """oci.conf beside slurm.conf: Slurm 22.05's keys (docs/containers.md) with runc. The container id is
    Slurm's documented %n.%u.%j.%s.%t (node, user, job, step, task), which is how an agent inside
    learns its node (supervisor/node/identity.py); runc's state lives under the cluster directory,
    one directory a node (wiped when the node starts, as a reboot would), so clusters side by side
    never see each other's containers."""
    root = f"{spec.runc_root}/%n"
    cid = "%n.%u.%j.%s.%t"
    return ("# Generated by `ckptsup dev-cluster up --containers`: srun --container=BUNDLE runs the step in runc.\n"
            f'RunTimeQuery="runc --root {root} state {cid}"\n'
            f'RunTimeKill="runc --root {root} kill -a {cid}"\n'
            f'RunTimeDelete="runc --root {root} delete --force {cid}"\n'
            f'RunTimeRun="runc --root {root} run {cid} -b %b"\n')


def render_bundle_config(*, binds: list[str], writable: list[str], hide: Sequence[str] = ()) -> dict:
    """config.json of the test bundle: an empty read-only rootfs with the host's system directories
    and `binds` read-only and `writable` read-write at their own paths; new pid, ipc, uts and mount
    namespaces, the host's network (the agents' memory channel and torch's rendezvous use it). Its
    /dev/shm is runc's default 64 MiB tmpfs, as a site's bundle often has. `hide`: files covered
    by /dev/null inside (Slurm's commands: the agents must never need one)."""
    mounts: list[dict] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    for path in [*BUNDLE_SYSTEM_DIRS, *binds]:
        mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind", "ro"]})
    for path in writable:
        mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind", "rw"]})
    for path in hide:
        mounts.append({"destination": path, "type": "bind", "source": "/dev/null", "options": ["bind", "ro"]})
    return {
        "ociVersion": "1.0.2-dev",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["sh"], "cwd": "/",
                    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                    "capabilities": {k: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_SYS_PTRACE"]
                                     for k in ("bounding", "effective", "permitted", "ambient")},
                    "noNewPrivileges": True},
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "runc",
        "mounts": mounts,
        "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]},
                  "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]},
    }
