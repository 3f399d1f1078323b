"""`ckptsup plan`, `ckptsup simulate`, `ckptsup report`: parse, call the pure code, render.

Durations and sizes are parsed here (not by click types) so a bad value is a ConfigError, which
`ckptsup.cli.main` prints as one line with exit status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .units import format_duration, format_pct, format_size, format_usd, parse_duration, parse_size

_DUR = "DURATION"


class OneLineCommand(click.Command):
    """Usage errors (a missing flag, a non-number) become one ConfigError line, like every other
    refused input, instead of click's usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            raise ConfigError(f"{err.format_message()} (see `ckptsup {self.name} --help`)") from None


def _dur(value: str | None, flag: str, *, allow_zero: bool = False) -> float | None:
    return None if value is None else parse_duration(value, what=flag, allow_zero=allow_zero)


def _site_cost(job_config: str | None = None, run_dir: Path | None = None) -> tuple[float, float]:
    """(price per GPU-hour, per-GPU MTBF hours): the run's resolved config when it has one, else
    the site config."""
    from ..config import load_config, read_config_json

    resolved = None
    if run_dir is not None and job_config is None:
        from ..rundir import CONFIG_JSON

        if (run_dir / CONFIG_JSON).exists():
            resolved = read_config_json(run_dir / CONFIG_JSON)
    if resolved is None:
        resolved = load_config(job_config=job_config)
    cost = resolved.config.cost
    return cost.price_per_gpu_hour, cost.gpu_mtbf_hours


def _dump(data: Any) -> str:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value
    return json.dumps(clean(data), indent=2)


# ---- plan -----------------------------------------------------------------------------------

@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gpus", type=int, required=True, help="GPUs in the gang (the job)")
@click.option("--gpus-per-node", type=int, default=8, show_default=True)
@click.option("--mtbf", metavar=_DUR, help="the job's MTBF, e.g. 3h")
@click.option("--failures", type=float, help="reference record: N failures ...")
@click.option("--over", metavar=_DUR, help="... over this long ...")
@click.option("--on-gpus", type=int, help="... on this many GPUs (scaled to --gpus)")
@click.option("--ckpt-size", metavar="SIZE", help="size of one checkpoint, e.g. 140GB, 1TB (decimal)")
@click.option("--stall", metavar=_DUR, required=True, help="blocking cost C of one checkpoint")
@click.option("--restart", metavar=_DUR, required=True, help="restart time R (detection + relaunch + load)")
@click.option("--price", type=float, help="USD per GPU-hour [site cost.price_per_gpu_hour]")
@click.option("--keep-last", type=int, default=3, show_default=True)
@click.option("--keep-daily-days", type=int, default=14, show_default=True)
@click.option("--upload-time", metavar=_DUR, help="time allowed to make one checkpoint durable [persist time, else interval]")
@click.option("--persist-time", metavar=_DUR, default="0", show_default=True,
              help="async saves: time until a checkpoint is durable (a failure in it loses it too)")
@click.option("--replace-time", metavar=_DUR, help="time to bring in a replacement node [24h]")
@click.option("--compare-stall", metavar=_DUR, help="a second strategy's stall, e.g. a synchronous save")
@click.option("--compare-persist-time", metavar=_DUR, default="0", show_default=True)
@click.option("--spot-discount", type=float, help="spot price discount, 0.6 = 60% off on-demand")
@click.option("--preemptions-per-node-day", type=float, help="spot preemptions per node per day")
@click.option("--memory-stall", metavar=_DUR, help="two levels: the stall of a memory save (shards to node memory)")
@click.option("--memory-restart", metavar=_DUR, help="two levels: the restart time from memory (with --memory-stall)")
@click.option("--memory-persist-time", metavar=_DUR, default="0", show_default=True,
              help="two levels: time until a memory save's replica is on the buddy node")
@click.option("--memory-miss", type=float, default=0.0, show_default=True,
              help="two levels: fraction of failures the memory tier cannot cover (a whole failure domain)")
@click.option("--min-nodes", type=int, help="fewer nodes: price continuing on one node fewer (>= this) against a "
                                           "requeue when a node is lost with no spare left (supervisor.min_nodes)")
@click.option("--queue-wait", metavar=_DUR, help="with --min-nodes: a requeue's time in the queue "
                                                  "[supervisor.requeue_wait_s]")
@click.option("--shrink-horizon", metavar=_DUR, help="with --min-nodes: how long the job would run on fewer nodes "
                                                      "[supervisor.shrink_horizon_s]")
@click.option("--requeue-restart", metavar=_DUR, help="with --min-nodes: a requeued allocation's start-up "
                                                       "(supervisor start to first step) [--restart]")
@click.option("--config", "job_config", type=click.Path(dir_okay=False), help="TOML layered over the site config")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def plan(gpus: int, gpus_per_node: int, mtbf: str | None, failures: float | None, over: str | None,
         on_gpus: int | None, ckpt_size: str | None, stall: str, restart: str, price: float | None,
         keep_last: int, keep_daily_days: int, upload_time: str | None, persist_time: str,
         replace_time: str | None, compare_stall: str | None, compare_persist_time: str,
         spot_discount: float | None, preemptions_per_node_day: float | None, memory_stall: str | None,
         memory_restart: str | None, memory_persist_time: str, memory_miss: float, min_nodes: int | None,
         queue_wait: str | None, shrink_horizon: str | None, requeue_restart: str | None, job_config: str | None,
         as_json: bool) -> None:
    """How often to checkpoint, what failures cost per month, async vs sync, spot, spares, and
    memory saves in front of disk saves (two levels)."""
    from .plan import PlanInputs
    from .plan import plan as run_plan

    site_gpu_mtbf_s = None
    if price is None or (mtbf is None and failures is None):
        site_price, site_mtbf_h = _site_cost(job_config)
        price = site_price if price is None else price
        site_gpu_mtbf_s = site_mtbf_h * 3600.0
    inputs = PlanInputs(
        gpus=gpus, gpus_per_node=gpus_per_node, stall_s=parse_duration(stall, what="--stall"),   # required flags
        restart_s=parse_duration(restart, what="--restart", allow_zero=True), mtbf_s=_dur(mtbf, "--mtbf"),
        failures=failures, over_s=_dur(over, "--over"), on_gpus=on_gpus, site_gpu_mtbf_s=site_gpu_mtbf_s,
        ckpt_size_bytes=None if ckpt_size is None else parse_size(ckpt_size, what="--ckpt-size"),
        price_per_gpu_hour=price, keep_last=keep_last, keep_daily_days=keep_daily_days,
        upload_s=_dur(upload_time, "--upload-time"), persist_s=_dur(persist_time, "--persist-time", allow_zero=True) or 0.0,
        replace_s=_dur(replace_time, "--replace-time", allow_zero=True),
        compare_stall_s=_dur(compare_stall, "--compare-stall"),
        compare_persist_s=_dur(compare_persist_time, "--compare-persist-time", allow_zero=True) or 0.0,
        spot_discount=spot_discount, preemptions_per_node_day=preemptions_per_node_day,
        memory_stall_s=_dur(memory_stall, "--memory-stall"),
        memory_restart_s=_dur(memory_restart, "--memory-restart", allow_zero=True),
        memory_persist_s=_dur(memory_persist_time, "--memory-persist-time", allow_zero=True) or 0.0,
        memory_miss=memory_miss, min_nodes=min_nodes,
        requeue_restart_s=_dur(requeue_restart, "--requeue-restart", allow_zero=True),
        **_shrink_knobs(min_nodes, queue_wait, shrink_horizon, job_config))
    result = run_plan(inputs)
    if as_json:
        click.echo(_dump(result))
        return
    _print_plan(result)


def _shrink_knobs(min_nodes: int | None, queue_wait: str | None, horizon: str | None,
                  job_config: str | None) -> dict[str, float]:
    """--queue-wait and --shrink-horizon, else the config's [supervisor] requeue_wait_s and
    shrink_horizon_s (what the supervisor would use before it has measured anything)."""
    if min_nodes is None:
        if queue_wait is not None or horizon is not None or click.get_current_context().params.get("requeue_restart"):
            raise ConfigError("--queue-wait, --shrink-horizon and --requeue-restart price fewer nodes: give "
                              "--min-nodes N with them")
        return {}
    from ..config import load_config

    sup = load_config(job_config=job_config).config.supervisor
    return {"queue_wait_s": sup.requeue_wait_s if queue_wait is None else parse_duration(queue_wait, what="--queue-wait", allow_zero=True),
            "shrink_horizon_s": sup.shrink_horizon_s if horizon is None else parse_duration(horizon, what="--shrink-horizon")}


def _print_shrink(console: Any, s: dict[str, Any]) -> None:
    lost = f"{s['nodes'] - s['survivors']}/{s['nodes']}"
    cont = (f"continue on {s['survivors']} of {s['nodes']} nodes: {format_duration(s['continue_cost_s'])} "
            f"(restart + {lost} of a {format_duration(s['horizon_s'])} horizon), {format_usd(s['continue_usd'])}")
    req = (f"requeue: {format_duration(s['requeue_cost_s'])} (queue wait {format_duration(s['queue_wait_s'])} + "
           f"start-up {format_duration(s['requeue_restart_s'])}), {format_usd(s['requeue_usd'])}")
    console.print(f"a node lost with no spare left — {cont}; {req}")
    if not s["allowed"]:
        console.print(f"  → requeue: {s['survivors']} survivors is below --min-nodes {s['min_nodes']}")
    else:
        even = s["break_even_horizon_s"]
        turn = f"; continuing wins below a {format_duration(even)} horizon" if even is not None else ""
        other = "requeue" if s["choice"] == "continue" else "continuing"
        console.print(f"  → {s['choice']}: {format_usd(s['saved_usd_per_lost_node'])} less than {other} per lost "
                      f"node{turn}")


def _print_plan(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title=f"ckptsup plan — {r['gpus']} GPUs on {r['nodes']} nodes", show_header=False)
    head.add_row("job MTBF", f"{format_duration(r['job_mtbf_s'])}  ({r['mtbf_source']}; "
                             f"{r['failures_per_month']:.1f} failures/month)")
    head.add_row("paid per month", f"{format_usd(r['paid_usd_per_month'])} at {format_usd(r['price_per_gpu_hour'])}/GPU-h")
    head.add_row("storage per tier", f"{format_size(r['storage_bytes'])} "
                                     f"({r['keep_last']} last + {r['keep_daily_days']} daily)")
    bw = r["write_bandwidth_bytes_per_s"]
    head.add_row("write bandwidth", f"{format_size(bw)}/s (one checkpoint in {format_duration(r['upload_time_s'])})"
                 if bw is not None else "— (give --ckpt-size)")
    head.add_row("hot spares", f"{r['recommended_spares']} nodes (P(more failures within "
                               f"{format_duration(r['replace_time_s'])}) < {r['spare_risk']:.0%}), "
                               f"{format_usd(r['spares_usd_per_month'])}/month")
    console.print(head)
    strategies = [("this strategy", r)] + ([("compare", r["compare"])] if "compare" in r else [])
    table = Table(title="checkpoint interval and waste (at Daly's interval)")
    table.add_column("")
    for name, _ in strategies:
        table.add_column(name, justify="right")
    for label, key, fmt in (
        ("stall C", "stall_s", format_duration), ("persist P", "persist_s", format_duration),
        ("Young interval", "interval_young_s", format_duration), ("Daly interval", "interval_daly_s", format_duration),
        ("recommended interval", "interval_s", format_duration), ("waste", "waste_fraction", format_pct),
        ("  checkpoint stalls", "waste_checkpoint_fraction", format_pct),
        ("  rework", "waste_rework_fraction", format_pct), ("  restarts", "waste_restart_fraction", format_pct),
        ("lost per month", "lost_usd_per_month", format_usd)):
        table.add_row(label, *[fmt(s[key]) for _, s in strategies])
    console.print(table)
    if "compare" in r:
        console.print(f"this strategy saves {format_usd(r['savings_usd_per_month_vs_compare'])}/month over the comparison")
    if "spot_pays" in r:
        verdict = "pays" if r["spot_pays"] else "does NOT pay"
        console.print(f"spot {verdict} at {r['gpus']} GPUs: job MTBF {format_duration(r['spot_job_mtbf_s'])}, "
                      f"waste {format_pct(r['spot_waste_fraction'])}, "
                      f"{format_usd(r['spot_usd_per_useful_gpu_hour'])} vs "
                      f"{format_usd(r['on_demand_usd_per_useful_gpu_hour'])} per useful GPU-hour; "
                      f"break-even at {r['spot_break_even_gpus']} GPUs")
    if "two_level" in r:
        _print_two_level(console, r)
    if "shrink" in r:
        _print_shrink(console, r["shrink"])
    from rich.text import Text

    from ..textsafe import text as safe_text

    for warning in r["warnings"]:
        console.print(Text.assemble(("warning:", "yellow"), " ", safe_text(warning)))


def _print_two_level(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = r["two_level"]
    table = Table(title="two levels: memory saves in front of disk saves")
    table.add_column("")
    table.add_column("disk only", justify="right")
    table.add_column("memory + disk", justify="right")
    rows = (("memory interval", "—", format_duration(t["memory_interval_s"])),
            ("disk interval", format_duration(r["interval_s"]), format_duration(t["disk_interval_s"])),
            ("failures resumed from disk", "100%", format_pct(t["fallback_probability"])),
            ("waste", format_pct(r["waste_fraction"]), format_pct(t["waste_fraction"])),
            ("  memory stalls", "—", format_pct(t["waste_memory_checkpoint_fraction"])),
            ("  disk stalls", format_pct(r["waste_checkpoint_fraction"]), format_pct(t["waste_disk_checkpoint_fraction"])),
            ("  rework", format_pct(r["waste_rework_fraction"]), format_pct(t["waste_rework_fraction"])),
            ("  restarts", format_pct(r["waste_restart_fraction"]), format_pct(t["waste_restart_fraction"])),
            ("lost per month", format_usd(r["lost_usd_per_month"]), format_usd(t["lost_usd_per_month"])))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"memory saves every {format_duration(t['memory_interval_s'])} "
                  f"({t['memory_saves_per_disk_save']} per disk save) save "
                  f"{format_usd(t['savings_usd_per_month_vs_disk_only'])}/month over disk saves alone")


# ---- simulate -------------------------------------------------------------------------------

@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gpus", type=int, default=1024, show_default=True, help="GPUs in the gang")
@click.option("--mtbf", metavar=_DUR, help="the job's MTBF [site prior cost.gpu_mtbf_hours / gpus]")
@click.option("--failures", type=float, help="reference record: N failures ...")
@click.option("--over", metavar=_DUR, help="... over this long ...")
@click.option("--on-gpus", type=int, help="... on this many GPUs")
@click.option("--stall", metavar=_DUR, required=True, help="blocking cost C of one checkpoint")
@click.option("--restart", metavar=_DUR, required=True, help="restart time R")
@click.option("--interval", metavar=_DUR, help="compute time between checkpoints [Daly's]")
@click.option("--persist-time", metavar=_DUR, default="0", show_default=True, help="async: time until durable (0 = sync)")
@click.option("--distribution", type=click.Choice(["exponential", "weibull"]), default="exponential", show_default=True)
@click.option("--weibull-shape", type=float, default=0.7, show_default=True)
@click.option("--spares", type=int, default=0, show_default=True)
@click.option("--replace-time", metavar=_DUR, default="0", show_default=True,
              help="a failed node is back in the spare pool after this long (0 = never wait)")
@click.option("--runs", type=int, default=10_000, show_default=True)
@click.option("--days", type=float, default=30.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--scale-to", default="1024,16384", show_default=True, help="gang sizes to extrapolate to (GPUs)")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="two levels: nodes = GPUs / this")
@click.option("--memory-stall", metavar=_DUR, help="two levels: the stall of a memory save (with --memory-restart)")
@click.option("--memory-restart", metavar=_DUR, help="two levels: the restart time from memory")
@click.option("--memory-persist-time", metavar=_DUR, default="0", show_default=True,
              help="two levels: time until a memory save's replica is on the buddy node")
@click.option("--memory-interval", metavar=_DUR, help="two levels: compute between memory saves [optimal]")
@click.option("--memory-saves-per-disk", type=int, help="two levels: memory saves per disk save [optimal]")
@click.option("--memory-miss", type=float, default=0.0, show_default=True,
              help="two levels: fraction of failures the memory tier cannot cover")
@click.option("--json", "as_json", is_flag=True)
def simulate(gpus: int, mtbf: str | None, failures: float | None, over: str | None, on_gpus: int | None,
             stall: str, restart: str, interval: str | None, persist_time: str, distribution: str,
             weibull_shape: float, spares: int, replace_time: str, runs: int, days: float, seed: int,
             scale_to: str, gpus_per_node: int, memory_stall: str | None, memory_restart: str | None,
             memory_persist_time: str, memory_interval: str | None, memory_saves_per_disk: int | None,
             memory_miss: float, as_json: bool) -> None:
    """Monte-Carlo of runs under failures: waste vs the analytic model, Young vs Daly, scale-out,
    and memory saves in front of disk saves (two levels) against disk saves alone."""
    import time

    from . import interval as iv
    from . import simulate as sm

    from .plan import MAX_GPUS

    if not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus must be between 1 and {MAX_GPUS:,} (got {gpus})")
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0 (got {seed})")
    if mtbf is not None:
        job_mtbf = parse_duration(mtbf, what="--mtbf")
    elif failures is not None:
        if over is None or on_gpus is None:
            raise ConfigError("--failures, --over and --on-gpus go together")
        job_mtbf = iv.job_mtbf_from_record(failures=failures, over_s=parse_duration(over, what="--over"),
                                           on_gpus=on_gpus, gpus=gpus)
    else:
        job_mtbf = _site_cost()[1] * 3600.0 / gpus
    try:
        sizes = tuple(int(x) for x in scale_to.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--scale-to {scale_to!r}: give GPU counts separated by commas, e.g. 1024,16384") from None
    if any(not 1 <= s <= MAX_GPUS for s in sizes):
        raise ConfigError(f"--scale-to: every gang size must be between 1 and {MAX_GPUS:,}")
    stall_s = parse_duration(stall, what="--stall")
    persist_s = parse_duration(persist_time, what="--persist-time", allow_zero=True)
    chosen = (parse_duration(interval, what="--interval") if interval is not None
              else max(iv.daly_interval(stall_s, job_mtbf).interval_s, persist_s))
    base = sm.SimInputs(interval_s=chosen, stall_s=stall_s, restart_s=parse_duration(restart, what="--restart", allow_zero=True),
                        mtbf_s=job_mtbf, persist_s=persist_s, days=days, runs=runs, distribution=distribution,
                        weibull_shape=weibull_shape, spares=spares,
                        replace_s=parse_duration(replace_time, what="--replace-time", allow_zero=True), seed=seed)
    started = time.perf_counter()
    main = sm.simulate(base).summary()
    elapsed = time.perf_counter() - started
    result = {"inputs": {f: getattr(base, f) for f in base.__dataclass_fields__}, "gpus": gpus,
              "simulated": main, "analytic": sm.analytic(base), "elapsed_s": elapsed,
              "young_vs_daly": sm.compare_intervals(base),
              "extrapolation": sm.extrapolate(base, gpu_mtbf_s=job_mtbf * gpus, gang_sizes=sizes,
                                              runs=max(1, runs // 10))}
    if memory_stall is not None or memory_restart is not None:
        result["two_level"] = _simulate_two_level(
            base, gpus=gpus, gpus_per_node=gpus_per_node, memory_stall=memory_stall, memory_restart=memory_restart,
            memory_persist_time=memory_persist_time, memory_interval=memory_interval,
            memory_saves_per_disk=memory_saves_per_disk, memory_miss=memory_miss, disk_only=main)
    if as_json:
        click.echo(_dump(result))
        return
    _print_sim(result)


def _simulate_two_level(base: Any, *, gpus: int, gpus_per_node: int, memory_stall: str | None,
                        memory_restart: str | None, memory_persist_time: str, memory_interval: str | None,
                        memory_saves_per_disk: int | None, memory_miss: float, disk_only: dict[str, Any]) -> dict[str, Any]:
    """The same failures with memory saves in front of the disk saves; (T_m, k) optimal unless given."""
    import dataclasses

    from . import simulate as sm
    from . import two_level as tl

    if memory_stall is None or memory_restart is None:
        raise ConfigError("--memory-stall and --memory-restart go together (e.g. --memory-stall 2s --memory-restart 1m)")
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node} must be >= 1")
    level = tl.Level(stall_s=parse_duration(memory_stall, what="--memory-stall"),
                     restart_s=parse_duration(memory_restart, what="--memory-restart", allow_zero=True),
                     persist_s=parse_duration(memory_persist_time, what="--memory-persist-time", allow_zero=True))
    nodes = max(1, math.ceil(gpus / gpus_per_node))
    model = tl.TwoLevelInputs(mtbf_s=base.mtbf_s, nodes=nodes, memory=level, miss=memory_miss,
                              disk=tl.Level(stall_s=base.stall_s, restart_s=base.restart_s, persist_s=base.persist_s))
    best = tl.optimize(model)
    t_m = parse_duration(memory_interval, what="--memory-interval") if memory_interval is not None else best.memory_interval_s
    k = memory_saves_per_disk if memory_saves_per_disk is not None else best.memory_saves_per_disk_save
    if k < 1:
        raise ConfigError(f"--memory-saves-per-disk {k} must be >= 1")
    p = tl.fallback_probability(disk_interval_s=k * t_m, node_mtbf_s=base.mtbf_s * nodes, miss=memory_miss)
    two = dataclasses.replace(base, interval_s=t_m, memory=sm.MemoryLevel(
        stall_s=level.stall_s, restart_s=level.restart_s, persist_s=level.persist_s, saves_per_disk=k,
        fallback_probability=p))
    sim = sm.simulate(two).summary()
    analytic = tl.waste(model, memory_interval_s=t_m, saves_per_disk=k)
    return {"nodes": nodes, "memory_interval_s": t_m, "disk_interval_s": k * t_m, "memory_saves_per_disk_save": k,
            "fallback_probability": p, "simulated": sim,
            "analytic": {"waste_fraction": analytic.total, "waste_memory_checkpoint_fraction": analytic.memory_checkpoint,
                         "waste_disk_checkpoint_fraction": analytic.disk_checkpoint,
                         "waste_rework_fraction": analytic.rework, "waste_restart_fraction": analytic.restart},
            "disk_only_waste_fraction": disk_only["waste_fraction"],
            "waste_ratio_vs_disk_only": sim["waste_fraction"] / disk_only["waste_fraction"]
            if disk_only["waste_fraction"] > 0 else None}


def _print_sim(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    inp, sim, ana = r["inputs"], r["simulated"], r["analytic"]
    console.print(f"{sim['runs']:,} runs x {inp['days']:g} days, {inp['distribution']} failures, job MTBF "
                  f"{format_duration(inp['mtbf_s'])}, C {format_duration(inp['stall_s'])}, R "
                  f"{format_duration(inp['restart_s'])}, P {format_duration(inp['persist_s'])}, interval "
                  f"{format_duration(inp['interval_s'])} — simulated in {r['elapsed_s']:.2f}s")
    table = Table(title="waste")
    for col in ("", "simulated (mean)", "p5 – p95", "analytic (first order)"):
        table.add_column(col, justify="right")
    table.add_row("total", format_pct(sim["waste_fraction"]),
                  f"{format_pct(sim['waste_p05'])} – {format_pct(sim['waste_p95'])}", format_pct(ana["waste_fraction"]))
    for part in ("checkpoint", "rework", "restart"):
        key = f"waste_{part}_fraction"
        table.add_row(part, format_pct(sim[key]), "", format_pct(ana[key]))
    console.print(table)
    yd = r["young_vs_daly"]
    console.print(f"Young {format_duration(yd['interval_young_s'])} ({format_pct(yd['young_waste_fraction'])} simulated) vs "
                  f"Daly {format_duration(yd['interval_daly_s'])} ({format_pct(yd['daly_waste_fraction'])}); "
                  f"Young/Daly = {yd['young_over_daly']:.3f}")
    ext = Table(title="the same costs at other gang sizes")
    for col in ("GPUs", "MTBF", "Young", "Daly", "Y/D", "analytic", "sim Daly", "sim Young"):
        ext.add_column(col, justify="right")
    for row in r["extrapolation"]:
        ext.add_row(f"{row['gpus']:,}", format_duration(row["job_mtbf_s"]), format_duration(row["interval_young_s"]),
                    format_duration(row["interval_daly_s"]) + (" (T=M)" if row["daly_capped"] else ""),
                    f"{row['interval_young_s'] / row['interval_daly_s']:.2f}",
                    format_pct(row["analytic_waste_fraction"]), format_pct(row["sim_waste_daly"]),
                    format_pct(row["sim_waste_young"]))
    console.print(ext)
    if "two_level" in r:
        t = r["two_level"]
        ratio = t["waste_ratio_vs_disk_only"]
        console.print(f"two levels: memory saves every {format_duration(t['memory_interval_s'])}, a disk save every "
                      f"{t['memory_saves_per_disk_save']} ({format_duration(t['disk_interval_s'])}), "
                      f"{format_pct(t['fallback_probability'])} of failures back to disk: waste "
                      f"{format_pct(t['simulated']['waste_fraction'])} simulated, "
                      f"{format_pct(t['analytic']['waste_fraction'])} analytic; disk only "
                      f"{format_pct(t['disk_only_waste_fraction'])}"
                      + (f" (ratio {ratio:.2f})" if ratio is not None else ""))


# ---- report ---------------------------------------------------------------------------------

@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
@click.option("--png", "png", type=click.Path(dir_okay=False), help="write a timeline + badput PNG here")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="write one self-contained HTML page here")
@click.option("--prom", "prom", type=click.Path(dir_okay=False), help="write a Prometheus textfile here")
@click.option("--price", type=float, help="USD per device-hour [the run's / site cost.price_per_gpu_hour]")
@click.option("--config", "job_config", type=click.Path(dir_okay=False), help="TOML layered over the site config")
def report(run_dir: str, as_json: bool, png: str | None, html_path: str | None, prom: str | None,
           price: float | None, job_config: str | None) -> None:
    """Where a run's time went: goodput, badput by category, in hours and dollars."""
    from . import goodput_report as rp

    from ..events import EVENTS_FILE, ReadStats
    from ..textsafe import literal

    path = Path(run_dir)
    stats = ReadStats()
    events = rp.read_run(path, stats=stats)
    if stats.skipped:  # on stderr: the JSON on stdout stays one object
        click.echo(f"ckptsup: skipped {stats.skipped} line(s) of {literal(path / EVENTS_FILE)} that are not ckptsup events "
                   "(torn, foreign or malformed)", err=True)
    site_price, gpu_mtbf_h = _site_cost(job_config, path)
    if price is not None and not 0 <= price < math.inf:
        raise ConfigError(f"--price must be a finite number >= 0 (USD per device-hour), got {price!r}")
    rep = rp.build_report(events, price_per_gpu_hour=site_price if price is None else price,
                          gpu_mtbf_hours=gpu_mtbf_h)
    for target, render in ((png, rp.render_png), (html_path, rp.render_html), (prom, rp.render_prom)):
        if target is not None:
            try:
                render(rep, target)
            except OSError as err:
                raise ConfigError(f"cannot write {target!r}: {err.strerror}; pick a writable path") from None
    if as_json:
        click.echo(_dump(rep))
        return
    rp.render_terminal(rep)
    for target in (png, html_path, prom):
        if target:
            click.echo(f"wrote {literal(target)}")
