"""Interval maths (docs/planning.md §`ckptsup plan`): Young, Daly, expected waste, spares, spot,
storage. Pure functions.

Symbols: C the blocking cost of one checkpoint (s), M the job's MTBF (s), R the restart time (s),
P the persist time of an async save (s; 0 for a synchronous one), T the compute time between
checkpoints (s). All seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young (1974): T = sqrt(2·C·M)."""
    _positive(stall_s=stall_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s)


@dataclass(frozen=True, kw_only=True)
class DalyResult:
    interval_s: float
    capped: bool  # True when C >= 2M and Daly's T = M branch applied


def daly_interval(stall_s: float, mtbf_s: float) -> DalyResult:
    """Daly (2006) eq. 37: T = sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C for C < 2M, else T = M."""
    _positive(stall_s=stall_s, mtbf_s=mtbf_s)
    if stall_s >= 2.0 * mtbf_s:
        return DalyResult(interval_s=mtbf_s, capped=True)
    ratio = stall_s / (2.0 * mtbf_s)
    tau = math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s
    return DalyResult(interval_s=tau, capped=False)


@dataclass(frozen=True, kw_only=True)
class Waste:
    checkpoint: float  # C/T: stalls
    rework: float      # (T/2 + P)/M: work lost since the newest durable checkpoint
    restart: float     # R/M

    @property
    def total(self) -> float:
        return self.checkpoint + self.rework + self.restart


def expected_waste(*, interval_s: float, stall_s: float, mtbf_s: float, restart_s: float,
                   persist_s: float = 0.0) -> Waste:
    """First-order expected waste C/T + (T/2 + P + R)/M, split into its three parts
    (docs/planning.md §`ckptsup plan`).

    It is a fraction of paid time only while it is small; callers show it capped at 1."""
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    _non_negative(stall_s=stall_s, restart_s=restart_s, persist_s=persist_s)
    return Waste(checkpoint=stall_s / interval_s,
                 rework=(interval_s / 2.0 + persist_s) / mtbf_s,
                 restart=restart_s / mtbf_s)


def job_mtbf_from_record(*, failures: float, over_s: float, on_gpus: int, gpus: int) -> float:
    """Scale a reference record (N failures over D on G GPUs) to a gang of `gpus`: a failure of any
    GPU stops the whole job, so the job MTBF is the per-GPU MTBF (D·G/N) divided by `gpus`."""
    if not failures > 0 or not math.isfinite(failures):
        raise ConfigError(f"--failures {failures:g} must be a finite number > 0 (a record with no failures gives no MTBF; use --mtbf)")
    _positive(over_s=over_s)
    if on_gpus < 1 or gpus < 1:
        raise ConfigError("--on-gpus and --gpus must be >= 1")
    return over_s * on_gpus / failures / gpus


def recommended_spares(*, node_failures_per_s: float, replace_s: float, risk: float = 0.01,
                       max_spares: int = 10_000) -> int:
    """Smallest S such that P(more than S node failures within one replacement time) < risk,
    with failures Poisson at the gang's node failure rate (docs/planning.md §`ckptsup plan`)."""
    _non_negative(node_failures_per_s=node_failures_per_s, replace_s=replace_s)
    mean = node_failures_per_s * replace_s
    if mean == 0:
        return 0
    # accumulate P(X <= S) in log space so large means do not underflow e^-mean
    log_pmf = -mean
    cdf = math.exp(log_pmf)
    spares = 0
    while 1.0 - cdf >= risk and spares < max_spares:
        spares += 1
        log_pmf += math.log(mean) - math.log(spares)
        cdf += math.exp(log_pmf)
    return spares


def poisson_tail(mean: float, spares: int) -> float:
    """P(X > spares) for X ~ Poisson(mean)."""
    log_pmf = -mean
    cdf = math.exp(log_pmf)
    for k in range(1, spares + 1):
        log_pmf += math.log(mean) - math.log(k) if mean > 0 else -math.inf
        cdf += math.exp(log_pmf)
    return max(0.0, 1.0 - cdf)


def cost_per_useful_hour(price: float, waste: float) -> float:
    """$ per useful GPU-hour: price / (1 − waste). price × (1 + waste) is its first-order form
    (docs/planning.md §`ckptsup plan`); the exact one matters for spot, whose waste can be large.
    Infinite when waste >= 1."""
    return math.inf if waste >= 1.0 else price / (1.0 - waste)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to checkpoint a given job, evaluated at Daly's interval."""

    mtbf_s: float
    stall_s: float
    restart_s: float
    persist_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StrategyResult:
    interval_young_s: float
    interval_daly_s: float
    interval_s: float        # the recommended one: Daly's, raised to P when saves would queue
    daly_capped: bool
    persist_bound: bool
    waste: Waste


def evaluate(strategy: Strategy) -> StrategyResult:
    young = young_interval(strategy.stall_s, strategy.mtbf_s)
    daly = daly_interval(strategy.stall_s, strategy.mtbf_s)
    # An async save must be durable before the next one starts, or saves queue up behind it.
    interval = max(daly.interval_s, strategy.persist_s)
    waste = expected_waste(interval_s=interval, stall_s=strategy.stall_s, mtbf_s=strategy.mtbf_s,
                           restart_s=strategy.restart_s, persist_s=strategy.persist_s)
    return StrategyResult(interval_young_s=young, interval_daly_s=daly.interval_s, interval_s=interval,
                          daly_capped=daly.capped, persist_bound=strategy.persist_s > daly.interval_s,
                          waste=waste)


def spot_break_even_gpus(*, gpu_mtbf_s: float, gpus_per_node: int, stall_s: float, restart_s: float,
                         persist_s: float, preemptions_per_node_s: float, discount: float,
                         max_nodes: int = 1 << 22) -> int:
    """Largest gang (in GPUs, whole nodes) at which spot still costs no more per useful GPU-hour
    than on-demand; 0 when spot never pays, `max_nodes·gpus_per_node` when it always does.
    Spot's waste grows with the gang (every node can be preempted), so the test is monotone."""

    def spot_pays(nodes: int) -> bool:
        gpus = nodes * gpus_per_node
        mtbf = gpu_mtbf_s / gpus
        spot_mtbf = 1.0 / (1.0 / mtbf + nodes * preemptions_per_node_s)
        od = evaluate(Strategy(mtbf_s=mtbf, stall_s=stall_s, restart_s=restart_s, persist_s=persist_s))
        sp = evaluate(Strategy(mtbf_s=spot_mtbf, stall_s=stall_s, restart_s=restart_s, persist_s=persist_s))
        return (cost_per_useful_hour(1.0 - discount, min(sp.waste.total, 1.0))
                <= cost_per_useful_hour(1.0, min(od.waste.total, 1.0)))

    if not spot_pays(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_nodes and spot_pays(hi):
        lo, hi = hi, hi * 2
    if hi > max_nodes:
        return max_nodes * gpus_per_node
    while hi - lo > 1:  # invariant: spot pays at lo, not at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if spot_pays(mid) else (lo, mid)
    return lo * gpus_per_node


def storage_bytes(*, size_bytes: float, keep_last: int, keep_daily_days: int) -> float:
    """Retention footprint per tier: size × (keep_last + daily keepers)."""
    return size_bytes * (keep_last + keep_daily_days)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{name} = {value!r} must be a finite number > 0")


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0 or not math.isfinite(value):
            raise ConfigError(f"{name} = {value!r} must be a finite number >= 0")
