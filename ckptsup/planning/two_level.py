"""Two-level checkpointing (docs/planning.md §Two levels): frequent memory saves (each rank's shard
in its node's memory and on a buddy node) in front of rarer disk saves. Pure functions.

A failure resumes from the newest memory checkpoint unless the memory copy is gone too: the failed
node's buddy also failed within one disk interval (a conservative window: re-replication at the
next memory save usually closes it much sooner), or the failure is of a kind the memory tier does
not cover (`miss`: a whole failure domain, a software fault that poisons memory). Then it falls
back to the newest disk checkpoint.

Symbols, all seconds: C_m, C_d the blocking stall of a memory and of a disk save; P_m the time
until a memory save's replica is on the buddy, P_d until a disk save is durable; R_m, R_d the
restart from memory and from disk; T_m the compute between memory saves, k memory periods per disk
save (T_d = k·T_m; the k-th save is the disk save, which also refreshes the memory copy); M the
job's MTBF, M_n a node's (M × nodes).

First-order waste per unit of time (each failure costs half a period of rework on average plus the
persist time and the restart):

    W = C_m/T_m + C_d/T_d + [(1 − p)(T_m/2 + P_m + R_m) + p(T_d/2 + P_d + R_d)] / M
    p = miss + (1 − miss)(1 − exp(−T_d / M_n))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

GRID_POINTS = 240   # log-spaced disk intervals tried before the golden-section refinement
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True, kw_only=True)
class Level:
    """One checkpoint level's costs."""

    stall_s: float
    restart_s: float
    persist_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class TwoLevelInputs:
    mtbf_s: float           # the job's
    nodes: int
    memory: Level
    disk: Level
    miss: float = 0.0       # fraction of failures the memory tier cannot cover

    def validate(self) -> None:
        if not 0 < self.mtbf_s < math.inf:
            raise ConfigError(f"job MTBF {self.mtbf_s!r} must be a finite number > 0")
        if self.nodes < 1:
            raise ConfigError(f"nodes {self.nodes} must be >= 1")
        if not 0.0 <= self.miss <= 1.0:
            raise ConfigError(f"--memory-miss {self.miss!r} must be a fraction between 0 and 1")
        for prefix, level in (("--memory-", self.memory), ("--", self.disk)):
            for key, value in (("stall", level.stall_s), ("restart", level.restart_s), ("persist-time", level.persist_s)):
                if not 0 <= value < math.inf:
                    raise ConfigError(f"{prefix}{key} must be a finite number >= 0, got {value!r}")
        if self.memory.stall_s <= 0 or self.disk.stall_s <= 0:
            raise ConfigError("--memory-stall and --stall must be > 0 (each save blocks the step for a while)")


@dataclass(frozen=True, kw_only=True)
class TwoLevelWaste:
    memory_checkpoint: float   # C_m/T_m
    disk_checkpoint: float     # C_d/T_d
    rework: float
    restart: float

    @property
    def total(self) -> float:
        return self.memory_checkpoint + self.disk_checkpoint + self.rework + self.restart


@dataclass(frozen=True, kw_only=True)
class TwoLevelResult:
    memory_interval_s: float
    disk_interval_s: float
    memory_saves_per_disk_save: int
    fallback_probability: float    # p: the share of failures that resume from disk
    waste: TwoLevelWaste


def fallback_probability(*, disk_interval_s: float, node_mtbf_s: float, miss: float = 0.0) -> float:
    """p: a failure's memory copy is gone (its buddy failed within one disk interval, or a miss)."""
    both = -math.expm1(-disk_interval_s / node_mtbf_s)
    return miss + (1.0 - miss) * both


def memory_interval(*, memory: Level, mtbf_s: float, nodes: int, disk_interval_s: float, miss: float = 0.0) -> float:
    """T_m for a given disk interval: Young's at the memory level's failure rate (1 − p)/M (the
    failures a memory copy covers), never below P_m (a memory save due while the previous one is
    still being written would be skipped, or its replica queued)."""
    p = fallback_probability(disk_interval_s=disk_interval_s, node_mtbf_s=mtbf_s * max(1, nodes), miss=miss)
    young = math.sqrt(2.0 * memory.stall_s * mtbf_s / max(1.0 - p, 1e-12))
    return max(young, memory.persist_s, 1e-9)


def waste(inp: TwoLevelInputs, *, memory_interval_s: float, saves_per_disk: int) -> TwoLevelWaste:
    t_m, k = memory_interval_s, saves_per_disk
    t_d = k * t_m
    p = fallback_probability(disk_interval_s=t_d, node_mtbf_s=inp.mtbf_s * inp.nodes, miss=inp.miss)
    m, d = inp.memory, inp.disk
    # the k-th save of a disk period is the disk save, so memory stalls are k-1 of every k saves
    memory_stall = (k - 1) * m.stall_s / t_d
    rework = ((1.0 - p) * (t_m / 2.0 + m.persist_s) + p * (t_d / 2.0 + d.persist_s)) / inp.mtbf_s
    restart = ((1.0 - p) * m.restart_s + p * d.restart_s) / inp.mtbf_s
    return TwoLevelWaste(memory_checkpoint=memory_stall, disk_checkpoint=d.stall_s / t_d, rework=rework,
                         restart=restart)


def optimize(inp: TwoLevelInputs) -> TwoLevelResult:
    """The (T_m, k) of least first-order waste. For a given disk interval, the memory interval is
    Young's at the memory level's failure rate, (1 − p)/M; the disk interval is searched (log grid,
    then golden section), k rounded to the better neighbour. T_m never drops below P_m (replicas
    would queue) and T_d below P_d."""
    inp.validate()

    def best_k_for(t_d: float) -> tuple[float, int, float]:
        t_m = memory_interval(memory=inp.memory, mtbf_s=inp.mtbf_s, nodes=inp.nodes, disk_interval_s=t_d, miss=inp.miss)
        best: tuple[float, int, float] | None = None
        for k in {max(1, math.floor(t_d / t_m)), max(1, math.ceil(t_d / t_m))}:
            t_m_k = max(t_d / k, inp.memory.persist_s)
            if k * t_m_k < inp.disk.persist_s:
                continue
            total = waste(inp, memory_interval_s=t_m_k, saves_per_disk=k).total
            if best is None or total < best[0]:
                best = (total, k, t_m_k)
        if best is None:   # the disk persist time bounds T_d from below
            k = max(1, math.ceil(inp.disk.persist_s / t_m))
            t_m_k = max(t_m, inp.memory.persist_s)
            best = (waste(inp, memory_interval_s=t_m_k, saves_per_disk=k).total, k, t_m_k)
        return best

    lo, hi = math.log(max(inp.disk.persist_s, inp.memory.stall_s, 1e-3)), math.log(100.0 * inp.mtbf_s)
    if hi <= lo:
        hi = lo + 1.0
    grid = [lo + (hi - lo) * i / (GRID_POINTS - 1) for i in range(GRID_POINTS)]
    scores = [best_k_for(math.exp(g))[0] for g in grid]
    i = min(range(GRID_POINTS), key=scores.__getitem__)
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, GRID_POINTS - 1)]
    for _ in range(60):
        c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
        if best_k_for(math.exp(c))[0] <= best_k_for(math.exp(d))[0]:
            b = d
        else:
            a = c
    candidates = [best_k_for(math.exp(x)) for x in (a, b, grid[i])]
    total, k, t_m = min(candidates, key=lambda c: c[0])
    t_d = k * t_m
    return TwoLevelResult(memory_interval_s=t_m, disk_interval_s=t_d, memory_saves_per_disk_save=k,
                          fallback_probability=fallback_probability(disk_interval_s=t_d, node_mtbf_s=inp.mtbf_s * inp.nodes,
                                                                    miss=inp.miss),
                          waste=waste(inp, memory_interval_s=t_m, saves_per_disk=k))
