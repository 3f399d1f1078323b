"""The Slurm allocation this process runs in, read from the environment Slurm sets.

`SLURM_RESTART_COUNT` is informative only: the run directory's state.json is the source of truth
for attempts (docs/contracts.md §Run directory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

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

    def others(self, exclude: str | None = None) -> list[str]:
        """Nodes other than `exclude` (default: the batch host), e.g. for the watchdog."""
        skip = self.batch_host if exclude is None else exclude
        return [n for n in self.nodes if n != skip]


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get(envvars.SLURM_JOB_ID))


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
    )
