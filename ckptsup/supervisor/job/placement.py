"""Where agents run: the local machine (one agent child) or a Slurm allocation (one srun step of
agents on every usable node, started once; supervisor/job/agent_set.py). Everything placement-specific lives here so the loop is the same in both."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ...config import PORT_SPREAD
from ...env import JOB_ID, NODE, SLURM_JOB_END_TIME, node_name
from ...errors import CkptsupError, ConfigError
from ... import console
from ...container import CONTAINER_ENV, ContainerPlan, Runtime
from .step_completion import AGENTS_STEP_NAME

# the agents' srun: a node's death ends only that node's agent (--no-kill: agent_set.py), and the
# step has a name the job's end can find it by in `squeue --steps` (step_completion.py)
AGENT_STEP_FLAGS = ("--kill-on-bad-exit=0", "--no-kill", f"--job-name={AGENTS_STEP_NAME}")


# Slurm's variables of one task (the batch script's, here): wrong for any agent on another node
PER_TASK_VARIABLES = ("SLURMD_NODENAME", "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_TASK_PID",
                      "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_GTIDS")


def free_port_in(host: str, base: int, start: int, span: int = PORT_SPREAD + 1) -> int | None:
    """The first port of [base, base+span) free on `host` right now, probing from base+start and
    wrapping; None when none is (or `host` is not an address of this machine). Ports stay inside
    the documented range so that a firewall rule for it covers every rendezvous of ours."""
    for i in range(span):
        port = base + (start + i) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    return None
                continue
            return port
    return None


def partition_grace_time(client: Any, partition: str) -> float | None:
    """GraceTime of the job's partition: how long a preempted job's steps live after SIGTERM."""
    if not partition:
        return None
    from ...slurm.parsers import parse_key_values

    try:
        fields = parse_key_values(client.run(["scontrol", "show", "partition", "-o", partition]).stdout)
    except CkptsupError:
        return None
    raw = fields.get("GraceTime", "")
    return float(raw) if raw.isdigit() else None


def job_end_time(env: Mapping[str, str]) -> float | None:
    """SLURM_JOB_END_TIME as Unix seconds; None when unset, not a number or 0 (no limit)."""
    raw = env.get(SLURM_JOB_END_TIME, "").strip()
    return float(raw) if raw.isdigit() and int(raw) > 0 else None


def agent_command(spec_path: str, attempt: int) -> list[str]:
    """`ckptsup agent` by the same interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "ckptsup.cli", "agent", "--spec", spec_path, "--attempt", str(attempt)]


@dataclass(kw_only=True)
class Placement:
    job_id: str
    nodes: tuple[str, ...]                  # every usable node of the allocation, in order
    addrs: dict[str, str] = field(default_factory=dict)
    slurmd_ports: dict[str, int] = field(default_factory=dict)   # each node's slurmd port (the dead-node probe)
    in_slurm: bool = False
    slurm: Any = None                       # SlurmClient inside an allocation
    grace_time_s: float | None = None       # the partition's preemption GraceTime (None: unknown)
    here: str = ""                          # the node the supervisor runs on (the batch host)
    gpus_per_node: int = 0                  # the allocation's (slurm/allocation.py), never the config's
    end_time: float | None = None           # the job's end, Unix seconds (SLURM_JOB_END_TIME; None: unknown)
    container: ContainerPlan = field(default_factory=lambda: ContainerPlan(runtime=Runtime.NONE))   # container.py

    @classmethod
    def local(cls, env: Mapping[str, str] | None = None) -> "Placement":
        from ...slurm.allocation import local_gpus

        env = os.environ if env is None else env
        node = node_name(env)
        return cls(job_id=env.get(JOB_ID, "local"), nodes=(node,), addrs={node: "127.0.0.1"},
                   gpus_per_node=local_gpus(env))

    @classmethod
    def from_slurm(cls, env: Mapping[str, str], slurm_config: Any) -> "Placement":
        from ...slurm.allocation import allocation_from_env
        from ...slurm.client import SlurmClient

        alloc = allocation_from_env(env)
        client = SlurmClient.from_config(slurm_config)
        addrs, ports = {}, {}
        for node in alloc.nodes:
            try:
                addrs[node], port = client.node_endpoint(node)
                if port is not None:
                    ports[node] = port
            except CkptsupError as err:  # names resolve on real clusters; the address is a refinement
                console.warning(f"ckptsup: NodeAddr of {node} unavailable ({err}); using its name", err=True)
                addrs[node] = node
        gpus = alloc.gpus_on_node
        if gpus is None:  # the environment does not say: ask Slurm (0 for a job without GPUs)
            try:
                gpus = client.job_gpus_per_node(alloc.job_id, alloc.batch_host)
            except CkptsupError as err:
                console.warning(f"ckptsup: GPUs of job {alloc.job_id} unknown ({err}); counting none", err=True)
                gpus = 0
        return cls(job_id=alloc.job_id, nodes=tuple(alloc.nodes), addrs=addrs, slurmd_ports=ports, in_slurm=True,
                   slurm=client,
                   grace_time_s=partition_grace_time(client, alloc.partition), here=alloc.batch_host,
                   gpus_per_node=gpus, end_time=job_end_time(env))

    def job_end_time(self) -> float | None:
        """The job's end at its time limit, Unix seconds: SLURM_JOB_END_TIME (newer Slurm sets it),
        else squeue's end_time (asked when needed: only fewer nodes vs a requeue prices it); None
        outside Slurm, without a limit or when Slurm does not answer."""
        if self.end_time is not None or not self.in_slurm or self.slurm is None:
            return self.end_time
        try:
            info = self.slurm.job_info(self.job_id)
        except CkptsupError:
            return None
        return None if info is None or info.end_time is None else float(info.end_time)

    def slurmd_down(self, nodes: Sequence[str], timeout_s: float) -> set[str]:
        """Of `nodes`, those whose slurmd does not answer a connection within `timeout_s` (probed
        at once, in parallel): dead, or cut off from this host. Outside Slurm, or for a node
        whose slurmd port is unknown, none."""
        from concurrent.futures import ThreadPoolExecutor

        from ...slurm.client import SlurmClient

        known = [n for n in nodes if self.in_slurm and n in self.slurmd_ports]
        if not known:
            return set()
        with ThreadPoolExecutor(max_workers=min(len(known), 32)) as pool:
            answers = dict(zip(known, pool.map(
                lambda n: SlurmClient.slurmd_answers(self.addrs.get(n) or n, self.slurmd_ports[n], timeout_s), known)))
        return {n for n, up in answers.items() if not up}

    def rdzv_endpoint(self, first_node: str, base_port: int, attempt: int) -> str:
        """ADDR:PORT of the attempt's store on its first node, always in [base_port,
        base_port+PORT_SPREAD]. The offset is spread by job and attempt, so that jobs sharing a
        node (and an attempt whose old store lingers) rarely collide; when the first node is
        this host the port is also probed free. A collision on another node fails torchrun at
        once, which the policy retries on the next attempt's port."""
        addr = self.addrs.get(first_node, "127.0.0.1")
        spread = (sum(map(ord, self.job_id)) * 97 + attempt) % (PORT_SPREAD + 1)
        if not self.in_slurm or first_node == self.here:
            # probed here: start from our pid too, so that supervisors sharing this host (every
            # local-mode job is "local") do not probe the same port and race for it until torchrun binds
            port = free_port_in(addr, base_port, (spread + os.getpid()) % (PORT_SPREAD + 1))
            if port is not None:
                return f"{addr}:{port}"
        return f"{addr}:{base_port + spread}"

    def agent_argv(self, nodes: Sequence[str], spec_path: str, attempt: int) -> list[str]:
        box = self.container
        command = box.agent_command(spec_path, attempt) if box.on else agent_command(spec_path, attempt)
        if not self.in_slurm:
            if len(nodes) != 1:
                raise ConfigError(f"local mode runs one node, asked for {len(nodes)}; use --nodes 1 or run inside Slurm")
            return command
        from ...slurm.client import SlurmClient

        exe = shutil.which("ckptsup")
        if exe and not box.on:
            command = [exe, *command[3:]]
        return SlurmClient.srun_argv(nodes=list(nodes), command=box.wrap(command, gpus=self.gpus_per_node),
                                     job_id=self.job_id,
                                     extra=[*AGENT_STEP_FLAGS, *box.srun_flags()])

    def agent_env(self, node_hint: str | None) -> dict[str, str]:
        env = dict(os.environ)
        if not self.in_slurm and node_hint:
            env[NODE] = node_hint
        if self.container.on:
            env[CONTAINER_ENV] = self.container.runtime.value   # the agent's hello says where it runs
            # the batch host's own task variables: slurmstepd replaces them for a bare task, but an OCI
            # container gets srun's environment as it is (docs/containers.md), where they would name this node
            for key in PER_TASK_VARIABLES:
                env.pop(key, None)
        return env
