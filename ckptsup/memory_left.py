"""How much memory this process may still take: the node's MemAvailable, and inside a container (or any
memory cgroup with a limit) what the limit leaves. /proc/meminfo shows the host's memory even in a
container limited to a fraction of it; a memory tier sized from it alone would be OOM-killed there
(docs/containers.md). cgroup v2 (`memory.max`, `memory.current`) and v1 (`memory.limit_in_bytes`,
`memory.usage_in_bytes`) are both read, from this process's own cgroup.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60   # v1 reports "no limit" as a page-rounded 2**63-1; anything this large is none


@dataclass(frozen=True, kw_only=True)
class MemoryLeft:
    bytes: int
    source: str          # "MemAvailable", or the cgroup file whose limit binds (memory.max ...)
    limit: int = 0       # the cgroup's limit when it binds (0: MemAvailable does)


def meminfo_available(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable (0 when unreadable: then nothing fits)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cgroup_dirs(cgroup_text: str, root: Path) -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) candidates for this process's memory cgroup: its own
    path under the mount, then the mount's root (inside a cgroup namespace the path reads "/")."""
    out: list[tuple[Path, str, str]] = []
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":      # v2 (unified): a hybrid host mounts it at unified/
            for base in (root, root / "unified"):
                out += [(base / rel, "memory.max", "memory.current"), (base, "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            base = root / "memory"
            out += [(base / rel, "memory.limit_in_bytes", "memory.usage_in_bytes"),
                    (base, "memory.limit_in_bytes", "memory.usage_in_bytes")]
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def cgroup_left(cgroup_text: str, root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int, str] | None:
    """(left, limit, file) of the tightest memory limit found for this process; None without one."""
    best: tuple[int, int, str] | None = None
    for directory, limit_file, usage_file in cgroup_dirs(cgroup_text, root):
        limit, usage = _read_int(directory / limit_file), _read_int(directory / usage_file)
        if limit is None or usage is None or limit >= UNLIMITED:
            continue
        left = max(limit - usage, 0)
        if best is None or left < best[0]:
            best = (left, limit, limit_file)
    return best


def memory_left(*, meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
                root: Path = Path("/sys/fs/cgroup")) -> MemoryLeft:
    available = meminfo_available(meminfo)
    try:
        text = Path(cgroup).read_text()
    except OSError:
        text = ""
    limited = cgroup_left(text, root)
    if limited is not None and limited[0] < available:
        return MemoryLeft(bytes=limited[0], source=limited[2], limit=limited[1])
    return MemoryLeft(bytes=available, source="MemAvailable")
