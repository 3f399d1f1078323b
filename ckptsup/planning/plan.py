"""`ckptsup plan` as a pure function: PlanInputs → a result dict (the `--json` object).

Everything is in seconds, bytes and USD. A month is 730 hours. The CLI parses units and renders;
this module only decides (and refuses impossible inputs with one ConfigError line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import interval as iv
from .units import DAY_S, MONTH_S, format_duration

MONTH_H = MONTH_S / 3600.0
DEFAULT_REPLACE_S = 24 * 3600.0  # a failed node back in the pool (repair or replacement) in a day
SPARE_RISK = 0.01
MAX_GPUS = 10_000_000   # beyond any cluster: a larger figure is a typo, and it would overflow the maths


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    gpus: int
    stall_s: float
    restart_s: float
    gpus_per_node: int = 8
    mtbf_s: float | None = None             # the job's MTBF
    failures: float | None = None           # or a reference record: N failures ...
    over_s: float | None = None             # ... over this long ...
    on_gpus: int | None = None              # ... on this many GPUs
    site_gpu_mtbf_s: float | None = None    # fallback: the site prior per GPU
    ckpt_size_bytes: float | None = None
    price_per_gpu_hour: float = 2.0
    keep_last: int = 3
    keep_daily_days: int = 14
    upload_s: float | None = None
    persist_s: float = 0.0
    replace_s: float | None = None
    compare_stall_s: float | None = None
    compare_persist_s: float = 0.0
    spot_discount: float | None = None
    preemptions_per_node_day: float | None = None
    memory_stall_s: float | None = None     # two levels (two_level.py): a memory save's stall ...
    memory_restart_s: float | None = None   # ... the restart from memory ...
    memory_persist_s: float = 0.0           # ... until the replica is on the buddy node
    memory_miss: float = 0.0                # failures the memory tier cannot cover
    min_nodes: int | None = None            # fewer nodes (--min-nodes): price continuing on nodes-1 vs a requeue ...
    queue_wait_s: float = 900.0             # ... a requeue's time in the queue ...
    shrink_horizon_s: float = 3600.0        # ... how long the job would run on fewer nodes
    requeue_restart_s: float | None = None  # ... a requeued allocation's start-up (None: restart_s)


def validate(inp: PlanInputs) -> None:
    """Refuse what cannot be planned, naming the flag and the fix."""
    if inp.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {inp.gpus_per_node} must be >= 1")
    if inp.gpus > MAX_GPUS or inp.gpus_per_node > MAX_GPUS:
        raise ConfigError(f"--gpus {inp.gpus} / --gpus-per-node {inp.gpus_per_node}: at most {MAX_GPUS:,} "
                          "(more than any cluster has); check the number")
    if inp.gpus < inp.gpus_per_node:
        raise ConfigError(f"--gpus {inp.gpus} is fewer than one node (--gpus-per-node {inp.gpus_per_node}); "
                          "give at least one whole node")
    if inp.stall_s <= 0:
        raise ConfigError("--stall must be > 0 (the blocking cost of one checkpoint, e.g. 30s)")
    for flag, value in (("--restart", inp.restart_s), ("--persist-time", inp.persist_s),
                        ("--compare-persist-time", inp.compare_persist_s), ("--price", inp.price_per_gpu_hour)):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {value!r}")
    if inp.keep_last < 1:
        raise ConfigError(f"--keep-last {inp.keep_last} must be >= 1 (the newest checkpoint is always kept)")
    if inp.keep_daily_days < 0:
        raise ConfigError(f"--keep-daily-days {inp.keep_daily_days} must be >= 0")
    record = (inp.failures, inp.over_s, inp.on_gpus)
    if inp.mtbf_s is not None and any(v is not None for v in record):
        raise ConfigError("give either --mtbf or --failures/--over/--on-gpus, not both")
    if any(v is not None for v in record) and any(v is None for v in record):
        raise ConfigError("--failures, --over and --on-gpus go together (N failures over DURATION on G GPUs)")
    if inp.mtbf_s is None and inp.failures is None and inp.site_gpu_mtbf_s is None:
        raise ConfigError("no failure rate: give --mtbf DURATION or --failures N --over DURATION --on-gpus G")
    if inp.compare_stall_s is not None and inp.compare_stall_s <= 0:
        raise ConfigError("--compare-stall must be > 0")
    if (inp.spot_discount is None) != (inp.preemptions_per_node_day is None):
        raise ConfigError("--spot-discount and --preemptions-per-node-day go together")
    if inp.spot_discount is not None and not 0 < inp.spot_discount < 1:
        raise ConfigError(f"--spot-discount {inp.spot_discount} must be a fraction between 0 and 1 (0.6 = 60% off)")
    if (inp.memory_stall_s is None) != (inp.memory_restart_s is None):
        raise ConfigError("--memory-stall and --memory-restart go together (a memory save's stall and the restart "
                          "from memory, e.g. --memory-stall 2s --memory-restart 1m)")
    if inp.memory_stall_s is None and (inp.memory_persist_s or inp.memory_miss):
        raise ConfigError("--memory-persist-time and --memory-miss need --memory-stall and --memory-restart")
    if inp.min_nodes is not None:
        nodes = math.ceil(inp.gpus / inp.gpus_per_node)
        if not 1 <= inp.min_nodes <= nodes:
            raise ConfigError(f"--min-nodes {inp.min_nodes} must be at least 1 and at most the job's {nodes} nodes "
                              f"(--gpus {inp.gpus} / --gpus-per-node {inp.gpus_per_node})")
        for flag, value in (("--queue-wait", inp.queue_wait_s), ("--shrink-horizon", inp.shrink_horizon_s),
                            ("--requeue-restart", inp.requeue_restart_s or 0.0)):
            if value < 0 or not math.isfinite(value):
                raise ConfigError(f"{flag} must be a finite number >= 0, got {value!r}")
    if inp.preemptions_per_node_day is not None and not 0 <= inp.preemptions_per_node_day < math.inf:
        raise ConfigError(f"--preemptions-per-node-day {inp.preemptions_per_node_day} must be a finite number >= 0")


def job_mtbf(inp: PlanInputs) -> tuple[float, str]:
    if inp.mtbf_s is not None:
        if inp.mtbf_s <= 0:
            raise ConfigError("--mtbf must be > 0")
        return inp.mtbf_s, "--mtbf"
    if inp.failures is not None:
        mtbf = iv.job_mtbf_from_record(failures=inp.failures, over_s=inp.over_s or 0.0,
                                       on_gpus=inp.on_gpus or 0, gpus=inp.gpus)
        return mtbf, (f"{inp.failures:g} failures over {format_duration(inp.over_s)} on {inp.on_gpus} GPUs, "
                      f"scaled to {inp.gpus}")
    assert inp.site_gpu_mtbf_s is not None
    return inp.site_gpu_mtbf_s / inp.gpus, "site prior cost.gpu_mtbf_hours / gpus"


def strategy_keys(res: iv.StrategyResult, *, stall_s: float, persist_s: float, paid_month: float) -> dict[str, Any]:
    total = res.waste.total
    scale = 1.0 if total <= 1.0 else 1.0 / total  # past 100% the parts are shown as shares of it
    waste = min(total, 1.0)
    return {
        "stall_s": stall_s,
        "persist_s": persist_s,
        "interval_young_s": res.interval_young_s,
        "interval_daly_s": res.interval_daly_s,
        "interval_s": res.interval_s,
        "waste_fraction": waste,
        "waste_checkpoint_fraction": res.waste.checkpoint * scale,
        "waste_rework_fraction": res.waste.rework * scale,
        "waste_restart_fraction": res.waste.restart * scale,
        "goodput_fraction": 1.0 - waste,
        "lost_usd_per_month": waste * paid_month,
    }


def plan(inp: PlanInputs) -> dict[str, Any]:
    validate(inp)
    mtbf, source = job_mtbf(inp)
    nodes = math.ceil(inp.gpus / inp.gpus_per_node)
    warnings: list[str] = []
    if inp.gpus % inp.gpus_per_node:
        warnings.append(f"{inp.gpus} GPUs is not a whole number of {inp.gpus_per_node}-GPU nodes; "
                        f"planning {nodes} nodes, priced at {inp.gpus} GPUs")
    paid_month = inp.gpus * MONTH_H * inp.price_per_gpu_hour
    main = iv.evaluate(iv.Strategy(mtbf_s=mtbf, stall_s=inp.stall_s, restart_s=inp.restart_s,
                                   persist_s=inp.persist_s))
    _warn(main, inp.stall_s, mtbf, warnings, label="")
    out: dict[str, Any] = {
        "gpus": inp.gpus, "gpus_per_node": inp.gpus_per_node, "nodes": nodes,
        "job_mtbf_s": mtbf, "gpu_mtbf_s": mtbf * inp.gpus, "mtbf_source": source,
        "restart_s": inp.restart_s, "price_per_gpu_hour": inp.price_per_gpu_hour,
        "paid_usd_per_month": paid_month,
        "failures_per_month": MONTH_S / mtbf,
    }
    out.update(strategy_keys(main, stall_s=inp.stall_s, persist_s=inp.persist_s, paid_month=paid_month))

    # storage and bandwidth: one checkpoint durable within the upload time (default: the interval)
    upload = inp.upload_s if inp.upload_s is not None else (inp.persist_s or main.interval_s)
    out["upload_time_s"] = upload
    if inp.ckpt_size_bytes is not None:
        out["ckpt_size_bytes"] = inp.ckpt_size_bytes
        out["storage_bytes"] = iv.storage_bytes(size_bytes=inp.ckpt_size_bytes, keep_last=inp.keep_last,
                                                keep_daily_days=inp.keep_daily_days)
        out["write_bandwidth_bytes_per_s"] = inp.ckpt_size_bytes / upload
    else:
        out["storage_bytes"] = None
        out["write_bandwidth_bytes_per_s"] = None
    out["keep_last"], out["keep_daily_days"] = inp.keep_last, inp.keep_daily_days

    # hot spares: node failures of the gang are Poisson at `nodes` × per-node rate
    replace = inp.replace_s if inp.replace_s is not None else DEFAULT_REPLACE_S
    node_rate = 1.0 / mtbf  # any GPU failure takes its node out; the gang's failures are its nodes'
    spares = iv.recommended_spares(node_failures_per_s=node_rate, replace_s=replace, risk=SPARE_RISK)
    out.update({"replace_time_s": replace, "recommended_spares": spares,
                "spares_usd_per_month": spares * inp.gpus_per_node * MONTH_H * inp.price_per_gpu_hour,
                "spare_risk": SPARE_RISK})

    if inp.compare_stall_s is not None:
        other = iv.evaluate(iv.Strategy(mtbf_s=mtbf, stall_s=inp.compare_stall_s, restart_s=inp.restart_s,
                                        persist_s=inp.compare_persist_s))
        _warn(other, inp.compare_stall_s, mtbf, warnings, label="compare: ")
        cmp = strategy_keys(other, stall_s=inp.compare_stall_s, persist_s=inp.compare_persist_s,
                            paid_month=paid_month)
        cmp["job_mtbf_s"] = mtbf
        cmp["paid_usd_per_month"] = paid_month
        cmp["recommended_spares"] = spares
        if inp.ckpt_size_bytes is not None:
            cmp_upload = inp.upload_s if inp.upload_s is not None else (inp.compare_persist_s or other.interval_s)
            cmp["storage_bytes"] = out["storage_bytes"]
            cmp["write_bandwidth_bytes_per_s"] = inp.ckpt_size_bytes / cmp_upload
        else:
            cmp["storage_bytes"] = cmp["write_bandwidth_bytes_per_s"] = None
        out["compare"] = cmp
        out["savings_usd_per_month_vs_compare"] = cmp["lost_usd_per_month"] - out["lost_usd_per_month"]

    if inp.spot_discount is not None and inp.preemptions_per_node_day is not None:
        out.update(_spot(inp, mtbf, main, paid_month))
    if inp.memory_stall_s is not None:
        out["two_level"] = _two_level(inp, mtbf, nodes, paid_month, disk_only_lost=out["lost_usd_per_month"])
    if inp.min_nodes is not None:
        out["shrink"] = _shrink(inp, nodes, paid_month / MONTH_H / 3600.0)
    out["warnings"] = warnings
    return out


def _shrink(inp: PlanInputs, nodes: int, usd_per_s: float) -> dict[str, Any]:
    """One node lost with no spare left: continue on nodes-1 (when >= --min-nodes) or requeue
    (planning/shrink.py, the same arithmetic as the supervisor's `decide`)."""
    from .shrink import Figure, ShrinkInputs, break_even_horizon_s, price

    assert inp.min_nodes is not None
    survivors = nodes - 1
    given = "configured"
    inputs = ShrinkInputs(nodes=nodes, survivors=max(survivors, 0),
                          horizon=Figure(value_s=inp.shrink_horizon_s, source=given),
                          restart=Figure(value_s=inp.restart_s, source=given),
                          queue_wait=Figure(value_s=inp.queue_wait_s, source=given),
                          requeue_restart=Figure(value_s=inp.restart_s if inp.requeue_restart_s is None
                                                 else inp.requeue_restart_s, source=given))
    p = price(inputs)
    allowed = survivors >= inp.min_nodes
    choice = "continue" if allowed and p.continue_wins else "requeue"
    return {"nodes": nodes, "survivors": survivors, "min_nodes": inp.min_nodes, "allowed": allowed,
            "horizon_s": inp.shrink_horizon_s, "queue_wait_s": inp.queue_wait_s, "restart_s": inp.restart_s,
            "requeue_restart_s": inputs.requeue_restart.value_s,
            "continue_cost_s": p.continue_s, "requeue_cost_s": p.requeue_s, "choice": choice,
            "break_even_horizon_s": break_even_horizon_s(inputs),
            # job-seconds lost x the whole job's price per second
            "continue_usd": p.continue_s * usd_per_s, "requeue_usd": p.requeue_s * usd_per_s,
            # what the choice saves over the other way, per lost node (0 when fewer are not allowed)
            "saved_usd_per_lost_node": abs(p.requeue_s - p.continue_s) * usd_per_s if allowed else 0.0}


def _spot(inp: PlanInputs, mtbf: float, main: iv.StrategyResult, paid_month: float) -> dict[str, Any]:
    assert inp.spot_discount is not None and inp.preemptions_per_node_day is not None
    nodes = math.ceil(inp.gpus / inp.gpus_per_node)
    per_node_s = inp.preemptions_per_node_day / DAY_S
    spot_mtbf = 1.0 / (1.0 / mtbf + nodes * per_node_s)  # any preempted node stops the gang
    spot = iv.evaluate(iv.Strategy(mtbf_s=spot_mtbf, stall_s=inp.stall_s, restart_s=inp.restart_s,
                                   persist_s=inp.persist_s))
    od_waste = min(main.waste.total, 1.0)
    spot_waste = min(spot.waste.total, 1.0)
    spot_price = inp.price_per_gpu_hour * (1.0 - inp.spot_discount)
    od_useful = iv.cost_per_useful_hour(inp.price_per_gpu_hour, od_waste)
    spot_useful = iv.cost_per_useful_hour(spot_price, spot_waste)
    break_even = iv.spot_break_even_gpus(gpu_mtbf_s=mtbf * inp.gpus, gpus_per_node=inp.gpus_per_node,
                                         stall_s=inp.stall_s, restart_s=inp.restart_s, persist_s=inp.persist_s,
                                         preemptions_per_node_s=per_node_s, discount=inp.spot_discount)
    return {
        "spot_discount": inp.spot_discount,
        "preemptions_per_node_day": inp.preemptions_per_node_day,
        "spot_job_mtbf_s": spot_mtbf,
        "spot_interval_s": spot.interval_s,
        "spot_waste_fraction": spot_waste,
        "spot_paid_usd_per_month": paid_month * (1.0 - inp.spot_discount),
        "on_demand_usd_per_useful_gpu_hour": od_useful,
        "spot_usd_per_useful_gpu_hour": spot_useful if math.isfinite(spot_useful) else None,
        "spot_pays": spot_useful <= od_useful,
        "spot_break_even_gpus": break_even,
    }


def _two_level(inp: PlanInputs, mtbf: float, nodes: int, paid_month: float, *, disk_only_lost: float) -> dict[str, Any]:
    """Memory saves in front of this strategy's disk saves (docs/planning.md §Two levels)."""
    from . import two_level as tl

    assert inp.memory_stall_s is not None and inp.memory_restart_s is not None
    res = tl.optimize(tl.TwoLevelInputs(
        mtbf_s=mtbf, nodes=nodes, miss=inp.memory_miss,
        memory=tl.Level(stall_s=inp.memory_stall_s, restart_s=inp.memory_restart_s, persist_s=inp.memory_persist_s),
        disk=tl.Level(stall_s=inp.stall_s, restart_s=inp.restart_s, persist_s=inp.persist_s)))
    w = min(res.waste.total, 1.0)
    return {
        "memory_stall_s": inp.memory_stall_s, "memory_restart_s": inp.memory_restart_s,
        "memory_persist_s": inp.memory_persist_s, "memory_miss": inp.memory_miss,
        "memory_interval_s": res.memory_interval_s, "disk_interval_s": res.disk_interval_s,
        "memory_saves_per_disk_save": res.memory_saves_per_disk_save,
        "fallback_probability": res.fallback_probability,
        "waste_fraction": w,
        "waste_memory_checkpoint_fraction": res.waste.memory_checkpoint,
        "waste_disk_checkpoint_fraction": res.waste.disk_checkpoint,
        "waste_rework_fraction": res.waste.rework,
        "waste_restart_fraction": res.waste.restart,
        "goodput_fraction": 1.0 - w,
        "lost_usd_per_month": w * paid_month,
        "savings_usd_per_month_vs_disk_only": disk_only_lost - w * paid_month,
    }


def _warn(res: iv.StrategyResult, stall_s: float, mtbf: float, warnings: list[str], *, label: str) -> None:
    if res.daly_capped:
        warnings.append(f"{label}stall {format_duration(stall_s)} is at least 2 x MTBF {format_duration(mtbf)}: "
                        "Daly's T = M branch applies; the job will spend most of its time checkpointing "
                        "or redoing work — cut the stall or the gang size")
    if res.persist_bound:
        warnings.append(f"{label}persist time exceeds Daly's interval {format_duration(res.interval_daly_s)}: "
                        "saves would queue, so the interval is raised to the persist time")
    if res.waste.total > 1.0:
        warnings.append(f"{label}first-order waste is {res.waste.total:.0%} (> 100%): this job cannot make "
                        "progress at this failure rate; shown capped at 100%")
    elif stall_s / mtbf > 0.01:
        warnings.append(f"{label}C/M = {stall_s / mtbf:.3f} > 1%: Young's interval is noticeably too long; "
                        "use Daly's (recommended)")
