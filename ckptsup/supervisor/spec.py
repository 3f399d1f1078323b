"""The launch spec: what the supervisor tells every agent of an attempt."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class LaunchSpec:
    """What the supervisor tells every agent of an attempt (a 0600 JSON file in the attempt dir;
    srun gives every task the same argv, so per-node values are looked up by node name)."""

    script: str
    script_args: list[str]
    nproc_per_node: int
    nnodes: int
    rdzv_endpoint: str                  # ADDR:PORT on the first active node
    rdzv_id: str
    node_addrs: dict[str, str]          # node -> address torchrun binds (--local-addr)
    env: dict[str, str]                 # CKPTSUP_* and NCCL variables for the ranks
    log_dir: str                        # per-attempt directory for torchrun/rank logs
    heartbeat_interval_s: float = 1.0
    shutdown_timeout_s: float = 60.0    # torchrun --shutdown-timeout (>= GraceTime)
    kill_grace_s: float = 10.0
    cwd: str = "."
    rdzv_backend: str = "static"        # static: node rank = position in `node_addrs`; or c10d

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "LaunchSpec":
        return cls(**json.loads(Path(path).read_text()))

    def write(self, path: Path) -> None:
        from ..rundir import atomic_write_json

        atomic_write_json(path, self.to_json())
