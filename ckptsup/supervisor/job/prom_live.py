"""The live status as a Prometheus textfile for node_exporter's textfile collector
(`[report] prom_textfile`), rewritten with status.json (supervisor/job/status.py) while the job runs.
Conventional names and units (`_seconds`, `_ratio`); every sample has `job_id`. Goodput is the
restart log's (planning/accounting.py), recomputed after each commit (progress counts as useful
once saved) and otherwise every GOODPUT_EVERY_S: it reads the whole log; the SDC, NaN and
restore figures (planning/sdc_report.py) come from the same read. `ckptsup report --prom` writes the end-of-run figures (planning/goodput_report.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ...planning.goodput_report import prom_label
from ...planning.sdc_report import prom_metrics

GOODPUT_EVERY_S = 60.0


def live_text(status: dict[str, Any], goodput: float | None, sdc: dict[str, Any] | None = None) -> str:
    """`sdc`: planning/sdc_report.sdc_summary of the restart log, recomputed with goodput."""
    job = prom_label(status.get("job_id", ""))
    lines: list[str] = []

    def metric(name: str, help_text: str, samples: list[tuple[str, Any]], kind: str = "gauge") -> None:
        good = [(labels, float(v)) for labels, v in samples
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if not good:
            return
        lines.append(f"# HELP ckptsup_{name} {help_text}")
        lines.append(f"# TYPE ckptsup_{name} {kind}")
        lines.extend(f'ckptsup_{name}{{job_id="{job}"{labels}}} {value:.9g}' for labels, value in good)

    nodes = {n: r for n, r in (status.get("nodes") or {}).items() if isinstance(r, dict)}
    metric("status_timestamp_seconds", "When the supervisor last published (Unix time); stale = supervisor gone.",
           [("", status.get("written"))])
    metric("run_running", "1 while the run is running, 0 once it ended.", [("", 1 if status.get("status") == "running" else 0)])
    metric("attempt", "The current attempt (0 = first launch).", [("", status.get("attempt"))])
    metric("step", "The last step any rank reported.", [("", status.get("step"))])
    metric("step_duration_seconds", "Step time over recent steps, by quantile.",
           [(',quantile="0.5"', status.get("step_p50_s")), (',quantile="0.99"', status.get("step_p99_s"))])
    metric("nodes", "Nodes of the allocation by role.",
           [(',role="active"', len(status.get("active") or [])), (',role="spare"', len(status.get("spares") or [])),
            (',role="excluded"', len(status.get("excluded") or {}))])
    metric("node_heartbeat_age_seconds", "Seconds since the node's agent last spoke.",
           [(f',node="{prom_label(n)}"', r.get("heartbeat_age_s")) for n, r in nodes.items()])
    metric("node_agent_up", "1 when the node's agent runs.",
           [(f',node="{prom_label(n)}"', 1 if r.get("agent") else 0) for n, r in nodes.items()])
    metric("node_ranks_alive", "Ranks alive on the node, as its agent's last heartbeat said.",
           [(f',node="{prom_label(n)}"', len(r.get("ranks_alive") or [])) for n, r in nodes.items() if r.get("role") == "active"])
    metric("checkpoint_step", "Step of the last checkpoint per tier (committed, validated, durable).",
           [(f',tier="{prom_label(t)}"', c.get("step")) for t, c in (status.get("checkpoints") or {}).items()
            if isinstance(c, dict)])
    metric("next_save_seconds", "Seconds until the next time-based save is due.", [("", status.get("next_save_in_s"))])
    metric("hang_timeout_seconds", "The hang timeout in force.", [("", status.get("hang_timeout_s"))])
    metric("goodput_ratio", "Useful over paid device-time so far.", [("", goodput)])
    for name, help_text, kind, samples in prom_metrics(sdc or {}):   # the same as `ckptsup report --prom`
        metric(name, help_text, samples, kind)
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Atomic (the collector must never read half a file), 0644 like node_exporter's own files:
    it holds figures and node names, never a secret."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)
