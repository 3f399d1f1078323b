"""memory_left.py: what a process may still take — MemAvailable, or a container's cgroup limit when
tighter (a memory tier sized from the host's MemAvailable would be OOM-killed in a limited container)."""

from __future__ import annotations

from pathlib import Path

from ckptsup.memory_left import UNLIMITED, cgroup_left, memory_left


def _meminfo(tmp_path: Path, kib: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {kib * 2} kB\nMemAvailable: {kib} kB\n")
    return str(path)


def test_a_v2_limit_tighter_than_the_host_binds(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    own = root / "job.slice" / "n1.root.7.0.0"
    own.mkdir(parents=True)
    (own / "memory.max").write_text(str(8 << 30))
    (own / "memory.current").write_text(str(3 << 30))
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/job.slice/n1.root.7.0.0\n")
    left = memory_left(meminfo=_meminfo(tmp_path, 64 << 20), cgroup=str(cgroup), root=root)
    assert (left.bytes, left.limit, left.source) == (5 << 30, 8 << 30, "memory.max")


def test_v1_on_a_hybrid_host_and_max_means_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "memory" / "box").mkdir(parents=True)
    (root / "memory" / "box" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (root / "memory" / "box" / "memory.usage_in_bytes").write_text(str(1 << 30))
    (root / "unified").mkdir()
    (root / "unified" / "memory.max").write_text("max")
    (root / "unified" / "memory.current").write_text("1")
    text = "4:memory:/box\n0::/\n"
    assert cgroup_left(text, root) == (1 << 30, 2 << 30, "memory.limit_in_bytes")
    # no limit anywhere (v1's "none" is a page-rounded 2**63-1): MemAvailable decides
    (root / "memory" / "box" / "memory.limit_in_bytes").write_text(str(UNLIMITED * 8 - 4096))
    assert cgroup_left(text, root) is None
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(text)
    left = memory_left(meminfo=_meminfo(tmp_path, 1000), cgroup=str(cgroup), root=root)
    assert (left.bytes, left.limit, left.source) == (1000 * 1024, 0, "MemAvailable")


def test_a_limit_looser_than_memavailable_changes_nothing_and_junk_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text(str(1 << 50))
    (root / "memory.current").write_text("junk")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/\nnot a line\n")
    assert memory_left(meminfo=_meminfo(tmp_path, 1000), cgroup=str(cgroup), root=root).source == "MemAvailable"
    assert memory_left(meminfo=_meminfo(tmp_path, 1000), cgroup=str(tmp_path / "absent"), root=root).bytes == 1024000
    assert memory_left().bytes > 0   # this machine's
