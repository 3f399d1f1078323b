"""The launch spec: what the supervisor tells every agent of an attempt."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import metadata_endpoint
from ..errors import ConfigError
from ..progress import pattern_problem
from ..safe_io import read_json
from .torchrun_args import passed_option

MAX_SPEC_BYTES = 4 << 20   # the script's argv and the ranks' environment; far below this
MONITOR_INTERVAL_S = 0.1   # torchrun --monitor-interval unless the launch line gives one: a dead worker seen in 0.1 s


@dataclass(kw_only=True)
class LaunchSpec:
    """What the supervisor tells every agent of an attempt (a 0600 JSON file in the attempt dir;
    srun gives every task the same argv, so per-node values are looked up by node name)."""

    script: str                         # a file's absolute path; the module name with `module`
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
    progress_pattern: str = "auto"      # [supervisor] progress_pattern (ckptsup/progress.py)
    tee: bool = False                   # every rank's output to the console, not only rank 0's
    module: bool = False                # torchrun -m: `script` is a module name
    no_python: bool = False             # torchrun --no-python: `script` is an executable
    warm_ranks: bool = True             # relaunches run the ranks in warm interpreters (supervisor/node/warm_pool.py)
    memory_keep: int = 0                # [memory]: bundles the agent's memory store keeps per rank; 0 = no store
    memory_max_bytes: int = 0           # [memory] max_bytes: a larger bundle is refused; 0 = no limit
    memory_addrs: dict[str, str] = dataclasses.field(default_factory=dict)  # every usable node -> the address its replica listener binds
    # torchrun's own options from the launch line (supervisor/torchrun_args.py)
    monitor_interval_s: float = MONITOR_INTERVAL_S    # torchrun --monitor-interval
    torchrun_log_dir: str = ""                       # torchrun --log-dir; "" = <log_dir>/torchrun-<node>
    torchrun_options: list[str] = dataclasses.field(default_factory=list)   # PASS options, `--opt=value`/`--flag`
    console_local_ranks: list[int] | None = None     # only these local ranks on the console (None: no filter)
    # [preemption]: the cloud whose preemption notices the agent polls (node/cloud_notice.py; auto: its DMI says)
    cloud_notice: str = "off"
    cloud_endpoints: dict[str, str] = dataclasses.field(default_factory=dict)   # cloud -> metadata service base URL

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "LaunchSpec":
        """The spec file (a regular file, bounded, never blocking); a missing, damaged or
        foreign one is one ConfigError line (the agent exits 2)."""
        try:
            data = read_json(path, max_bytes=MAX_SPEC_BYTES, what="launch spec", error=ConfigError)
        except FileNotFoundError:
            raise ConfigError(f"launch spec {path} does not exist; agents are started by `ckptsup launch`") from None
        return cls.from_json(data, source=f"launch spec {path}")

    @classmethod
    def from_json(cls, data: Any, *, source: str = "launch spec") -> "LaunchSpec":
        """A spec from its JSON object, every field checked (ConfigError naming the first bad one)."""
        fix = "it is written by `ckptsup launch` for its agents (a ckptsup of another version?)"
        if not isinstance(data, dict):
            raise ConfigError(f"{source} is not a JSON object of launch fields; {fix}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in fields)
        if unknown:
            name = unknown[0] if unknown[0].isascii() and unknown[0].isidentifier() and len(unknown[0]) <= 64 \
                else repr(unknown[0])[:40]   # a name of any length and characters: the line stays one line
            raise ConfigError(f"{source} has unknown field {name}; {fix}")
        missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and name not in data]
        if missing:
            raise ConfigError(f"{source} lacks {', '.join(missing)}; {fix}")
        for name, value in data.items():
            check, what = _CHECKS[name]
            if not check(value):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:30] + "..."
                raise ConfigError(f"{source}: {name} must be {what}, not {shown}; {fix}")
        return cls(**data)

    def write(self, path: Path) -> None:
        from ..rundir import atomic_write_json

        atomic_write_json(path, self.to_json())


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _count(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v < 2**31


def _seconds(v: Any) -> bool:
    # the bounds refuse NaN, the infinities and integers of any size (math.isfinite would overflow on them)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 7 * 86400


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _endpoint(v: Any) -> bool:
    host, _, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    # ASCII digits only: str.isdigit() is also true for '²' (which int() refuses) and '١'
    return bool(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "script": (_str, "a path"),
    "script_args": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of strings"),
    "nproc_per_node": (_count(1), "an integer >= 1"),
    "nnodes": (_count(1), "an integer >= 1"),
    "rdzv_endpoint": (_endpoint, "ADDR:PORT"),
    "rdzv_id": (_str, "a string"),
    "node_addrs": (_str_map, "an object of node -> address"),
    "env": (_str_map, "an object of variable -> string value"),
    "log_dir": (_str, "a path"),
    "heartbeat_interval_s": (lambda v: _seconds(v) and v > 0, "a number of seconds > 0"),
    "shutdown_timeout_s": (_seconds, "a number of seconds >= 0"),
    "kill_grace_s": (_seconds, "a number of seconds >= 0"),
    "cwd": (_str, "a path"),
    "rdzv_backend": (lambda v: v in ("static", "c10d"), "static or c10d"),
    "progress_pattern": (lambda v: isinstance(v, str) and pattern_problem(v) is None, "a usable progress pattern"),
    "tee": (lambda v: isinstance(v, bool), "true or false"),
    "module": (lambda v: isinstance(v, bool), "true or false"),
    "no_python": (lambda v: isinstance(v, bool), "true or false"),
    "warm_ranks": (lambda v: isinstance(v, bool), "true or false"),
    "memory_keep": (_count(0), "an integer >= 0"),
    "memory_max_bytes": (_count(0), "an integer >= 0"),
    "memory_addrs": (_str_map, "an object of node -> address"),
    "monitor_interval_s": (lambda v: _seconds(v) and v > 0, "a number of seconds > 0"),
    "torchrun_log_dir": (_str, "a path"),
    "torchrun_options": (lambda v: isinstance(v, list) and all(passed_option(a) for a in v),
                         "a list of torchrun options ckptsup passes on"),
    "console_local_ranks": (lambda v: v is None or (isinstance(v, list) and all(_count(0)(r) for r in v)),
                            "null or a list of local ranks"),
    "cloud_notice": (lambda v: v in ("auto", "aws", "gcp", "azure", "off"), "auto, aws, gcp, azure or off"),
    "cloud_endpoints": (lambda v: _str_map(v) and all(k in ("aws", "gcp", "azure") and metadata_endpoint(x) is None
                                                      for k, x in v.items()),
                        "an object of cloud -> http:// URL"),
}
