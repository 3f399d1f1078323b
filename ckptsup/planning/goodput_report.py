"""`ckptsup report RUN_DIR`: where a run's time went — terminal (rich), JSON, PNG, HTML, Prometheus.

build_report() is pure over the events; the render_* functions only format, every text from the
events through textsafe (terminal: rich Text, never markup; PNG: no mathtext; HTML: escaped).
matplotlib is imported lazily (Agg backend) so the terminal and JSON paths never need it.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..events import Event
from ..textsafe import literal, mathtext, text as safe_text
from .accounting import CATEGORIES, account
from .adaptive import posterior
from .headline import headline
from .interval import daly_interval, young_interval
from .phase_time import busy_line, busy_time, phase_times, phases_line
from .sdc_report import prom_metrics, sdc_lines, sdc_summary
from .units import format_duration, format_pct, format_size, format_usd

BAR_COLOURS = (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)  # tab20 without its greens
LABELS = {
    "useful": "useful", "checkpoint_stall": "checkpoint stall", "memory_stall": "memory save stall",
    "lost_progress": "lost progress",
    "detection": "detection", "restart_kill": "restart: kill", "restart_health": "restart: health check",
    "restart_container": "restart: container start",
    "restart_launch": "restart: launch", "restart_rendezvous": "restart: rendezvous",
    "restart_load": "restart: load", "restart_first_step": "restart: first step", "startup": "startup",
    "teardown": "teardown", "idle_spares": "idle spares", "other": "other (unexplained)",
}


def build_report(events: Iterable[dict[str, Any]], *, price_per_gpu_hour: float, gpu_mtbf_hours: float,
                 prior_weight: float = 1.0) -> dict[str, Any]:
    events = list(events)
    acc = account(events)
    out = acc.to_dict(price_per_gpu_hour=price_per_gpu_hour)
    out["job_id"] = str(events[0].get("job_id", "")) if events else ""
    out["timeline"] = acc.timeline
    devices = acc.mean_active_devices or 1.0
    post = posterior(gpu_mtbf_hours=gpu_mtbf_hours, prior_weight=prior_weight,
                     failures=acc.failure_count, device_hours=acc.wall_s * devices / 3600.0)
    job_mtbf = post.job_mtbf_s(devices)
    out["posterior_job_mtbf_s"] = job_mtbf
    out["prior_gpu_mtbf_hours"] = gpu_mtbf_hours
    stall = out["measured_stall_s"]
    rec: dict[str, Any] = {"job_mtbf_s": job_mtbf, "stall_s": stall}
    if stall and stall > 0:
        daly = daly_interval(stall, job_mtbf)
        rec.update(interval_young_s=young_interval(stall, job_mtbf), interval_daly_s=daly.interval_s,
                   daly_capped=daly.capped)
        observed = out["observed_job_mtbf_s"]
        if observed:  # what the run alone says (few failures: noisy; the posterior is the default)
            rec["interval_daly_observed_s"] = daly_interval(stall, observed).interval_s
    out["recommended"] = rec
    out["intervals_changed"] = acc.timeline.get("intervals", [])
    out["memory_intervals_changed"] = acc.timeline.get("memory_intervals", [])
    out["loads_by_source"] = loads_by_source(events)
    out["time_per_phase_s"] = phase_times(events)   # rank 0's wall time in init, load, train, eval, save, stopping
    out["busy"] = busy_time(events)   # quiet work past the hang timeout (liveness.py): spells, seconds
    out["sdc"] = sdc_summary(events, train_s=out["time_per_phase_s"].get("train"))   # planning/sdc_report.py
    out["story"] = headline(events, acc)   # the line `ckptsup log` and `status` lead with too
    return out


def loads_by_source(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Resumes by where their files came from (checkpoint_loaded's files_by_source; older logs
    without it count as shared): loads, files and load seconds per source. A load that read from
    several sources counts once under each, with its whole load time."""
    out: dict[str, dict[str, float]] = {}
    for event in events:
        if event.get("event") != Event.CHECKPOINT_LOADED:
            continue
        files = event.get("files_by_source")
        if not isinstance(files, dict):
            files = {"shared": event.get("read_shared_files", 0), "node_local": event.get("read_local_files", 0)}
        load_s = event.get("load_s")
        load_s = float(load_s) if isinstance(load_s, (int, float)) and load_s >= 0 else 0.0
        for source, count in files.items():
            if not isinstance(source, str) or not isinstance(count, (int, float)) or count <= 0:
                continue
            row = out.setdefault(source, {"loads": 0, "files": 0, "load_s": 0.0})
            row["loads"] += 1
            row["files"] += count
            row["load_s"] += load_s
    return out


def read_run(run_dir: str | os.PathLike[str], *, stats: Any = None) -> list[dict[str, Any]]:
    """The run's events (bad lines skipped and counted in `stats`, an events.ReadStats); one
    ConfigError line when there are none or the file cannot be read."""
    from ..events import EVENTS_FILE, NODE_NOTES, read_events

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"run directory {str(path)!r} does not exist; give the run dir that holds {EVENTS_FILE}")
    if not (path / EVENTS_FILE).exists():
        raise ConfigError(f"{str(path / EVENTS_FILE)!r} not found; is {str(path)!r} a ckptsup run directory?")
    try:
        events = read_events(path, stats=stats, skip=NODE_NOTES)
    except OSError as err:
        raise ConfigError(f"cannot read {str(path / EVENTS_FILE)!r}: {err.strerror}; it must be the run's events file, "
                          "readable by you") from None
    if not events:
        raise ConfigError(f"{str(path / EVENTS_FILE)!r} holds no ckptsup events (empty, or not one line is a JSON "
                          "event); give the run directory of a run that has started")
    return [e for e in events if e["event"] not in NODE_NOTES]


def breakdown_rows(rep: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(label, device-hours, share of paid, USD) for useful and every non-zero badput category."""
    paid = rep["paid_device_hours"] or 0.0
    price = rep["price_per_gpu_hour"]
    rows = [("useful", rep["useful_device_hours"])]
    rows += [(k, rep["badput_device_hours"][k]) for k in CATEGORIES if rep["badput_device_hours"][k] > 0]
    return [(LABELS[k], h, h / paid if paid else 0.0, h * price) for k, h in rows]


def render_terminal(rep: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    if rep.get("story"):
        console.print(safe_text(rep["story"], "bold"))
    summary = Table(title=safe_text(f"ckptsup goodput report — job {rep['job_id'] or '?'}"), show_header=False)
    for label, value in _summary_pairs(rep):
        summary.add_row(safe_text(label), safe_text(value))
    console.print(summary)
    table = Table(title="where the paid time went")
    for col in ("category", "device-hours", "share", "cost"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for label, hours, share, usd in breakdown_rows(rep):
        table.add_row(safe_text(label), f"{hours:,.3f}", format_pct(share), format_usd(usd))
    table.add_row("paid (total)", f"{rep['paid_device_hours']:,.3f}", "100.00%", format_usd(rep["paid_usd"]))
    console.print(table)
    sdc = Table(title="silent data corruption (SDC), NaN and restores", show_header=False)
    for label, value in sdc_lines(rep.get("sdc") or {}):
        sdc.add_row(safe_text(label), safe_text(value))
    console.print(sdc)
    for note in rep["notes"]:
        console.print(Text.assemble(("note:", "yellow"), " ", safe_text(note)))


def _summary_pairs(rep: dict[str, Any]) -> list[tuple[str, str]]:
    rec = rep["recommended"]
    failures = ", ".join(f"{k} {v}" for k, v in sorted(rep["failures"].items())) or "none"
    pairs = [
        ("goodput", format_pct(rep["goodput_fraction"])),
        ("paid", f"{rep['paid_device_hours']:,.3f} device-h  {format_usd(rep['paid_usd'])} "
                 f"at {format_usd(rep['price_per_gpu_hour'])}/device-h"),
        ("badput", f"{rep['badput_total_device_hours']:,.3f} device-h  "
                   f"{format_usd(sum(rep['badput_usd'].values()))}"),
        ("wall (allocated)", format_duration(rep["wall_s"])),
        ("queue after requeues (not paid)", format_duration(rep["queue_s"])),
        ("allocations / attempts / requeues", f"{rep['allocations']} / {rep['attempts']} / {rep['requeues']}"),
        ("ended", rep["end_reason"]),
        ("supervision (attempt: level)", "; ".join(lv for a in rep["attempt_rows"] for lv in a.get("levels") or [])
         or "not logged"),
        ("failures", failures),
        ("observed job MTBF", format_duration(rep["observed_job_mtbf_s"]) if rep["observed_job_mtbf_s"] else
         f"no failures in {format_duration(rep['wall_s'])}"),
        ("posterior job MTBF (prior + run)", format_duration(rep["posterior_job_mtbf_s"])),
        ("measured stall C / write", f"{format_duration(rep['measured_stall_s'])} / {format_duration(rep['measured_write_s'])}"
                                     f"  ({rep['checkpoints']} checkpoints, {format_size(rep['checkpoint_bytes'])} each)"),
        *([("measured memory stall C_m / write", f"{format_duration(rep['measured_memory_stall_s'])} / "
             f"{format_duration(rep['measured_memory_write_s'])}  ({rep['memory_saves']} memory saves)"
             + _memory_interval_text(rep))] if rep.get("memory_saves") else []),
        ("measured detection + restart R", f"{format_duration(rep['measured_detect_s'])} + {format_duration(rep['measured_restart_s'])}"),
        ("checkpoint loads by source", "; ".join(
            f"{source} {int(row['loads'])} ({int(row['files'])} file{'s' if int(row['files']) != 1 else ''}, "
            f"{format_duration(row['load_s'])})"
            for source, row in sorted(rep.get("loads_by_source", {}).items())) or "none"),
        ("time per phase (rank 0, wall)", phases_line(rep.get("time_per_phase_s") or {})),
        ("busy without progress (working, not hung)", busy_line(rep.get("busy"))),
    ]
    if "interval_daly_s" in rec:
        text = (f"Daly {format_duration(rec['interval_daly_s'])} (Young {format_duration(rec['interval_young_s'])})"
                f" at the posterior MTBF")
        if "interval_daly_observed_s" in rec:
            text += f"; {format_duration(rec['interval_daly_observed_s'])} at the observed MTBF"
        pairs.append(("interval plan recommends now", text))
    return pairs


def _memory_interval_text(rep: dict[str, Any]) -> str:
    """The adaptive memory interval the supervisor chose last (interval_changed, level memory)."""
    changes = rep.get("memory_intervals_changed") or []
    if not changes:
        return ""
    _, steps, seconds, _ = changes[-1]
    return (f", adaptive interval {steps:g} steps" if steps is not None else "") + \
        (f" (~{format_duration(seconds)})" if seconds is not None else "")


def render_png(rep: dict[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).write_bytes(png_bytes(rep))


def time_axis_unit(span_s: float) -> tuple[str, float]:
    """(unit, seconds per unit) for a timeline `span_s` long: s below 2 min, min below 2 h, else h.

    So a 40 s test run does not read 0.002 h and a 3-day run does not read 259,200 s.
    """
    if span_s < 120:
        return "s", 1.0
    if span_s < 7200:
        return "min", 60.0
    return "h", 3600.0


def _timeline_span_s(tl: dict[str, Any]) -> float:
    """Seconds from the first event to the end of the last attempt (every point lies inside)."""
    return max((end for _, end, *_ in tl.get("attempts", [])), default=0.0)


def png_bytes(rep: dict[str, Any]) -> bytes:
    with warnings.catch_warnings():   # a job id or kind in a script the font lacks: a box, not a warning per glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from font", category=UserWarning)
        return _png_bytes(rep)


def _png_bytes(rep: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    tl = rep["timeline"]
    unit, per_unit = time_axis_unit(_timeline_span_s(tl))
    fig, (ax, bar) = plt.subplots(2, 1, figsize=(11, 6.5), gridspec_kw={"height_ratios": [3, 1]})
    try:
        scaled = lambda s: s / per_unit  # noqa: E731
        for i, (start, end, attempt, reason) in enumerate(tl.get("attempts", [])):
            ax.axvspan(scaled(start), scaled(end), color="tab:blue" if i % 2 == 0 else "tab:cyan", alpha=0.06)
            if i:
                prev_end = tl["attempts"][i - 1][1]
                if start > prev_end:
                    ax.axvspan(scaled(prev_end), scaled(start), color="grey", alpha=0.25,
                               label="queued (not paid)" if i == 1 else None)
        prog = tl.get("progress", [])
        if prog:
            ax.plot([scaled(t) for t, _ in prog], [math.nan if s is None else s for _, s in prog], ".-", ms=3, lw=1,
                    label="training step (restarts resume from the checkpoint)")
        ck = [(t, s) for t, s in tl.get("checkpoints", []) if s is not None]
        if ck:
            ax.plot([scaled(t) for t, _ in ck], [s for _, s in ck], "g^", ms=6, label="checkpoint committed")
        for j, (t, kind) in enumerate(tl.get("failures", [])):
            ax.axvline(scaled(t), color="red", ls="--", lw=1, label="failure" if j == 0 else None)
            ax.annotate(mathtext(kind, limit=60), (scaled(t), 0), rotation=90, fontsize=7, color="red", va="bottom")
        for j, (t, _) in enumerate(tl.get("restarts", [])):
            ax.axvline(scaled(t), color="orange", ls=":", lw=1.2, label="restart done" if j == 0 else None)
        ax.set_xlabel(f"wall time since first event ({unit})")
        ax.set_ylabel("step")
        ax.set_title(f"job {mathtext(rep['job_id'], limit=80)}: progress, goodput {format_pct(rep['goodput_fraction'])}")
        if ax.get_legend_handles_labels()[0]:   # a run with no progress yet has nothing to label
            ax.legend(loc="upper left", fontsize=8)
        left = 0.0
        cmap = plt.get_cmap("tab20")
        for i, (label, device_hours, share, _) in enumerate(breakdown_rows(rep)):
            color = "tab:green" if label == "useful" else cmap(BAR_COLOURS[i % len(BAR_COLOURS)])
            bar.barh([0], [share * 100], left=left, color=color,
                     label=f"{label} {share:.1%}")
            left += share * 100
        bar.set_xlim(0, 100)
        bar.set_yticks([])
        bar.set_xlabel("share of paid device-time (%)")
        if bar.get_legend_handles_labels()[0]:
            bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=7, frameon=False)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        return buf.getvalue()
    finally:
        plt.close(fig)


def render_html(rep: dict[str, Any], path: str | os.PathLike[str]) -> None:
    image = base64.b64encode(png_bytes(rep)).decode("ascii")
    esc = lambda value: html.escape(literal(value))  # noqa: E731  (a lone surrogate cannot be written as UTF-8)
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary_pairs(rep))
    rows = "".join(f"<tr><td>{esc(label)}</td><td>{h:,.3f}</td><td>{share:.2%}</td><td>{esc(format_usd(usd))}</td></tr>"
                   for label, h, share, usd in breakdown_rows(rep))
    attempts = "".join(f"<tr><td>{esc(', '.join(str(n) for n in a['attempts']))}</td><td>{esc(format_duration(a['wall_s']))}</td>"
                       f"<td>{a['active_devices']:g} + {a['spare_devices']:g}</td><td>{a['failures']}</td>"
                       f"<td>{esc(', '.join(a.get('levels') or ['-']))}</td>"
                       f"<td>{esc(a['end_reason'])}</td></tr>" for a in rep["attempt_rows"])
    sdc = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in sdc_lines(rep.get("sdc") or {}))
    notes = "".join(f"<li>{esc(n)}</li>" for n in rep["notes"])
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ckptsup report {esc(rep['job_id'])}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:left}}
td:nth-child(n+2){{text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>ckptsup goodput report — job {esc(rep['job_id'])}</h1>
<p><strong>{esc(rep.get('story', ''))}</strong></p>
<table>{summary}</table>
<img alt="progress timeline and badput" src="data:image/png;base64,{image}">
<h2>Where the paid time went</h2>
<table><tr><th>category</th><th>device-hours</th><th>share</th><th>cost</th></tr>{rows}
<tr><th>paid (total)</th><th>{rep['paid_device_hours']:,.3f}</th><th>100%</th><th>{esc(format_usd(rep['paid_usd']))}</th></tr></table>
<h2>Allocations</h2>
<table><tr><th>attempts</th><th>wall</th><th>devices (active + spare)</th><th>failures</th><th>supervision (attempt: level)</th><th>ended</th></tr>{attempts}</table>
<p>Queue time after requeues (not paid): {esc(format_duration(rep['queue_s']))}.</p>
<h2>Silent data corruption (SDC), NaN and restores</h2>
<table>{sdc}</table>
{f'<h2>Notes</h2><ul>{notes}</ul>' if notes else ''}
</body></html>
"""
    Path(path).write_text(page, encoding="utf-8")


def prom_text(rep: dict[str, Any]) -> str:
    """Prometheus text exposition format, for node_exporter's textfile collector."""
    job = prom_label(rep["job_id"])
    lines: list[str] = []

    def metric(name: str, help_text: str, samples: list[tuple[str, float | None]], kind: str = "gauge") -> None:
        samples = [(labels, value) for labels, value in samples if value is not None and math.isfinite(value)]
        if not samples:
            return
        lines.append(f"# HELP ckptsup_{name} {help_text}")
        lines.append(f"# TYPE ckptsup_{name} {kind}")
        for labels, value in samples:
            lines.append(f"ckptsup_{name}{{job_id=\"{job}\"{labels}}} {value:.9g}")

    metric("goodput_ratio", "Useful over paid device-time.", [("", rep["goodput_fraction"])])
    metric("paid_device_hours", "Allocated device-hours, spares included.", [("", rep["paid_device_hours"])])
    metric("useful_device_hours", "Device-hours in steps whose progress survived.", [("", rep["useful_device_hours"])])
    metric("badput_device_hours", "Badput device-hours by category.",
           [(f',category="{k}"', v) for k, v in rep["badput_device_hours"].items()])
    metric("badput_usd", "Badput cost by category at the site price.",
           [(f',category="{k}"', v) for k, v in rep["badput_usd"].items()])
    metric("queue_seconds", "Wall time queued after requeues (not paid).", [("", rep["queue_s"])])
    metric("attempts", "Attempts of the run (in-allocation restarts included).", [("", float(rep["attempts"]))])
    metric("allocations", "Allocations of the run (the first plus one per requeue).", [("", float(rep["allocations"]))])
    metric("failures", "Failures detected, by kind.",
           [(f',kind="{prom_label(k)}"', float(v)) for k, v in rep["failures"].items()])
    metric("observed_job_mtbf_seconds", "Allocated wall time per failure.", [("", rep["observed_job_mtbf_s"])])
    metric("measured_stall_seconds", "Mean blocking stall per checkpoint.", [("", rep["measured_stall_s"])])
    metric("measured_memory_stall_seconds", "Mean blocking stall per memory save.", [("", rep.get("measured_memory_stall_s"))])
    metric("measured_restart_seconds", "Mean restart time.", [("", rep["measured_restart_s"])])
    metric("recommended_interval_seconds", "Daly interval from measured stall and posterior MTBF.",
           [("", rep["recommended"].get("interval_daly_s"))])
    for name, help_text, kind, samples in prom_metrics(rep.get("sdc") or {}):   # the live textfile's too
        metric(name, help_text, [(labels, _number(v)) for labels, v in samples], kind)
    return "\n".join(lines) + "\n"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def render_prom(rep: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Atomic write (the collector must never read half a file)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(prom_text(rep), encoding="utf-8")
    os.replace(tmp, target)


def prom_label(value: str) -> str:
    """A label value of the exposition format: the text as textsafe shows it (a control character
    or a lone surrogate as its backslash escape: no raw ESC or CR in the textfile, and it can be
    written as UTF-8), then backslash, quote and line feed escaped as the format wants."""
    text = literal(value, limit=1024)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
