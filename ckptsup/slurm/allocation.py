"""The Slurm allocation this process runs in, read from the environment Slurm sets.

`SLURM_RESTART_COUNT` is informative only: the run directory's state.json is the source of truth
for attempts (docs/contracts.md §Run directory).

GPUs per node are the allocation's, never the config's: SLURM_GPUS_ON_NODE, else the count of
SLURM_JOB_GPUS, else `scontrol show job -d` (`gpus_from_scontrol`); outside Slurm the count of
CUDA_VISIBLE_DEVICES. The parsers are pure and tested on literal text. Nodes are assumed alike:
the batch host's figure stands for every node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import re

import hostlist

from .. import env as envvars
from ..errors import ConfigError, NotInAllocationError


@dataclass(frozen=True, kw_only=True)
class Allocation:
    job_id: str
    nodes: list[str]            # expanded, in Slurm's order
    batch_host: str             # the node running the batch script (where the supervisor runs)
    restart_count: int          # SLURM_RESTART_COUNT, 0 on the first run
    num_nodes: int
    cpus_on_node: int | None    # SLURM_CPUS_ON_NODE of this node
    partition: str
    job_name: str
    submit_dir: str
    node: str                   # this process's node (SLURMD_NODENAME)
    gpus_on_node: int | None = None  # from the environment; None: it does not say (ask scontrol)

    def others(self, exclude: str | None = None) -> list[str]:
        """Nodes other than `exclude` (default: the batch host), e.g. for the watchdog."""
        skip = self.batch_host if exclude is None else exclude
        return [n for n in self.nodes if n != skip]


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get(envvars.SLURM_JOB_ID))


def srun_task(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(this task, the step's tasks) when this process is one of several tasks of an srun step
    (SLURM_STEP_ID is set in steps, not in the batch script); None otherwise, including a
    one-task step such as an interactive `srun --pty bash`."""
    if not env.get(envvars.SLURM_STEP_ID):
        return None
    try:
        tasks = int(env.get(envvars.SLURM_STEP_NUM_TASKS) or "1")
        task = int(env.get(envvars.SLURM_PROCID) or "0")
    except ValueError:
        return None
    return (task, tasks) if tasks > 1 else None


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw.split("(")[0])  # SLURM_CPUS_ON_NODE may read "4", tasks-per-node "2(x3)"
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not an integer; is this a Slurm allocation?") from None


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    """Read the allocation. Raises NotInAllocationError outside one."""
    job_id = env.get(envvars.SLURM_JOB_ID, "")
    if not job_id:
        raise NotInAllocationError("not inside a Slurm allocation (SLURM_JOB_ID is unset); "
                                   "submit with `ckptsup sbatch --submit` or run locally")
    nodelist = env.get(envvars.SLURM_JOB_NODELIST) or env.get(envvars.SLURM_NODELIST) or ""
    try:
        nodes = hostlist.expand_hostlist(nodelist) if nodelist else []
    except hostlist.BadHostlist:
        raise ConfigError(f"environment SLURM_JOB_NODELIST={nodelist!r} is not a Slurm hostlist") from None
    here = env.get(envvars.SLURMD_NODENAME, "")
    # read from the batch script (the supervisor's home), SLURMD_NODENAME is the batch host
    batch_host = here or (nodes[0] if nodes else "")
    return Allocation(
        job_id=job_id,
        nodes=nodes,
        batch_host=batch_host,
        restart_count=_int(env, envvars.SLURM_RESTART_COUNT, 0) or 0,
        num_nodes=_int(env, envvars.SLURM_JOB_NUM_NODES, None) or _int(env, envvars.SLURM_NNODES, None) or len(nodes),
        cpus_on_node=_int(env, envvars.SLURM_CPUS_ON_NODE, None),
        partition=env.get(envvars.SLURM_JOB_PARTITION, ""),
        job_name=env.get(envvars.SLURM_JOB_NAME, ""),
        submit_dir=env.get(envvars.SLURM_SUBMIT_DIR, ""),
        node=here,
        gpus_on_node=gpus_from_env(env),
    )


# ---- GPUs -------------------------------------------------------------------------------------

def count_devices(raw: str) -> int:
    """Entries of a device list (SLURM_JOB_GPUS, SLURM_STEP_GPUS, CUDA_VISIBLE_DEVICES): indices,
    UUIDs or MIG names. As CUDA reads it, the list ends at the first empty or negative entry, so
    unset, "" and "-1" are no GPU; Slurm's "NoDevFiles" is none either."""
    count = 0
    for item in raw.split(","):
        item = item.strip()
        if not item or item.startswith("-") or item == "NoDevFiles":
            break
        count += 1
    return count


def gpus_from_env(env: Mapping[str, str]) -> int | None:
    """This node's GPUs as Slurm's environment says: SLURM_GPUS_ON_NODE, else the count of
    SLURM_JOB_GPUS; None when neither is set (a job without GPUs, or a Slurm that sets neither)."""
    if env.get(envvars.SLURM_GPUS_ON_NODE, "") != "":
        return _int(env, envvars.SLURM_GPUS_ON_NODE, 0)
    if env.get(envvars.SLURM_JOB_GPUS, "") != "":
        return count_devices(env[envvars.SLURM_JOB_GPUS])
    return None


def local_gpus(env: Mapping[str, str]) -> int:
    """Outside Slurm: the GPUs CUDA_VISIBLE_DEVICES names (unset, empty or -1: none). The
    supervisor imports no torch, so it does not probe the machine itself."""
    return count_devices(env.get(envvars.CUDA_VISIBLE_DEVICES, ""))


def node_gpus(env: Mapping[str, str]) -> int:
    """The GPUs Slurm gave this process on its node (a health check inside a step): per node
    first (SLURM_GPUS_ON_NODE, SLURM_STEP_GPUS), then the job's, then CUDA_VISIBLE_DEVICES."""
    if not in_allocation(env):
        return local_gpus(env)
    found = gpus_from_env(env)
    if found is None and env.get(envvars.SLURM_STEP_GPUS, "") != "":
        found = count_devices(env[envvars.SLURM_STEP_GPUS])
    return local_gpus(env) if found is None else found


_NODES_GRES = re.compile(r"^\s*Nodes=(\S+)\s.*?\bGRES=(\S*)", re.M)
_TRES_PER_NODE = re.compile(r"\bTresPerNode=(\S+)")


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside parentheses ("gpu:2(IDX:0,2),nic:1" → two entries)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p]


def _index_count(idx: str) -> int | None:
    """Indices of "0-1,3" (3); None for "N/A" or anything else."""
    total = 0
    for part in idx.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        total += int(high) - int(low) + 1 if high else 1
    return total


def _gpu_count(gres: str) -> int:
    """GPUs in one GRES or TRES list: "gpu:2(IDX:0-1)", "gpu(IDX:0-1)", "gpu:a100:2",
    "gres:gpu:2", "gres/gpu:a100=2"; other GRES ("nic:1") do not count."""
    total = 0
    for entry in _split_top(gres):
        spec, _, idx = entry.partition("(")
        spec = spec.replace("=", ":").removeprefix("gres:").removeprefix("gres/")
        fields = spec.split(":")
        if fields[0] != "gpu":
            continue
        from_idx = _index_count(idx.removeprefix("IDX:").rstrip(")")) if idx.startswith("IDX:") else None
        if from_idx is not None:
            total += from_idx
        elif len(fields) > 1 and fields[-1].isdigit():
            total += int(fields[-1])
        else:
            total += 1   # "gpu" alone asks for one
    return total


def gpus_from_scontrol(text: str, node: str = "") -> int:
    """GPUs per node of the job in `scontrol show job -d` output: the per-node `GRES=` line of
    `node` (else the first such line), else `TresPerNode`; 0 when the job has none."""
    lines = _NODES_GRES.findall(text)
    for nodes, gres in lines:
        try:
            names = hostlist.expand_hostlist(nodes)
        except hostlist.BadHostlist:
            continue
        if node and node in names:
            return _gpu_count(gres)
    if lines:
        return _gpu_count(lines[0][1])
    tres = _TRES_PER_NODE.search(text)
    return _gpu_count(tres.group(1)) if tres else 0
