"""The live status of a run, as its supervisor publishes it: `<run_dir>/status.json` (0600 in the
0700 run dir, written whole and renamed in every STATUS_EVERY_S and at the end), read by
`ckptsup status` (supervisor/ops/cli_status.py) — no listener. `build_status` is pure: the loop
hands it what it knows; `HangTimeout.reason` (detection.py) says which rule set the hang timeout in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ...config import SupervisorConfig
from ...errors import ConfigError
from ...rundir import atomic_write_json
from ...safe_io import read_json
from .attempt import AttemptTracker

STATUS_FILE = "status.json"
STATUS_EVERY_S = 2.0
STATUS_CPU_SHARE = 0.02   # at most this share of the supervisor's core on status.json (16,384 nodes: ~0.5 s a publish)


def next_publish_s(cost_s: float) -> float:
    """The wait before the next publish after one that cost `cost_s` of CPU: STATUS_EVERY_S while that
    keeps its cost under STATUS_CPU_SHARE (2,048 nodes: 0.07 s), longer past it (bench_scale_ops.py)."""
    return max(STATUS_EVERY_S, cost_s / STATUS_CPU_SHARE)
STATUS_VERSION = 1
MAX_STATUS_BYTES = 64 << 20   # 16,384 nodes x 8 ranks: ~19 MB (bench_scale_ops.py), with room


@dataclass(frozen=True, kw_only=True)
class Seen:
    """What the loop knows beyond the tracker, for one status."""

    now_mono: float
    now_wall: float
    heard: Mapping[str, float]               # node -> mono of its agent's last frame (spares too)
    has_agent: Callable[[str], bool]
    warm_nodes: frozenset[str]               # nodes whose next launch starts warm
    checkpoints: Mapping[str, dict[str, Any]]  # committed | validated | durable -> {step, ts, ...}
    interval_s: float | None                 # the checkpoint interval in force
    last_commit_mono: float | None


def build_status(*, job_id: str, attempt: int, epoch: int, run_status: str, active: tuple[str, ...],
                 spares: tuple[str, ...], excluded: Mapping[str, str], tracker: AttemptTracker | None,
                 config: SupervisorConfig, seen: Seen) -> dict[str, Any]:
    steps: dict[str, int] = {}   # node -> its ranks' furthest step (one pass: 2,048 nodes x 8 ranks)
    for rank in (tracker.ranks.values() if tracker is not None else ()):
        if rank.last_step is not None:
            steps[rank.node] = max(rank.last_step, steps.get(rank.node, rank.last_step))
    nodes: dict[str, dict[str, Any]] = {}
    active_set = set(active)   # a set: `in` a 16,384-node tuple made this quadratic (bench_scale_ops.py)
    for node in (*active, *spares):
        heard = seen.heard.get(node)
        row: dict[str, Any] = {"role": "active" if node in active_set else "spare", "agent": seen.has_agent(node),
                               "heartbeat_age_s": None if heard is None else round(seen.now_mono - heard, 3),
                               "warm": node in seen.warm_nodes}
        view = tracker.node_views.get(node) if tracker is not None and node in active_set else None
        if view is not None and tracker is not None:
            p50, p99 = view.step_window.p50_p99() if view.step_window else (None, None)
            row.update(ranks_alive=list(view.ranks_alive), step=steps.get(node), step_p50_s=p50, step_p99_s=p99,
                       pids=[{"rank": r, **v} for r, v in sorted(tracker.node_pids.get(node, {}).items())])
        nodes[node] = row
    out: dict[str, Any] = {
        "v": STATUS_VERSION, "written": round(seen.now_wall, 3), "job_id": job_id, "attempt": attempt, "epoch": epoch,
        "status": run_status, "active": list(active), "spares": list(spares), "excluded": dict(excluded),
        "nodes": nodes, "checkpoints": {k: dict(v) for k, v in seen.checkpoints.items()},
        "save_interval_s": seen.interval_s, "heartbeat_interval_s": config.heartbeat_interval_s,
        "next_save_in_s": (None if seen.interval_s is None or seen.last_commit_mono is None
                           else round(seen.last_commit_mono + seen.interval_s - seen.now_mono, 1)),
    }
    if tracker is not None:
        level = tracker.level
        out.update(level=level.value if level else None, step=tracker.last_step,
                   step_p50_s=tracker.step_window.p50(), step_p99_s=tracker.step_window.p99(),
                   hang_timeout_s=round(tracker.hang_timeout().s, 3), hang_why=tracker.hang_timeout().reason(),
                   # every rank's process: pid as its node sees it, host_pid as the outermost pid
                   # namespace that node's /proc shows (docs/supervisor.md §Finding a rank)
                   ranks=[{"rank": r, **v} for r, v in sorted(tracker.pids.items())],
                   # working without progress past the hang timeout (liveness.py): not a hang
                   busy=None if tracker.busy is None or tracker.busy_since is None else
                   {"ranks": list(tracker.busy.ranks), "detail": tracker.busy.detail,
                    "for_s": round(seen.now_mono - tracker.busy_since, 1), "limit_s": config.busy_limit_s})
    return out


def publish(run_dir: Path, status: dict[str, Any]) -> None:
    atomic_write_json(run_dir / STATUS_FILE, status)


def read_status(run_dir: Path) -> dict[str, Any]:
    """The published status (one line, naming the fix, for a missing or foreign file)."""
    path = run_dir / STATUS_FILE
    try:
        data = read_json(path, max_bytes=MAX_STATUS_BYTES, what="status file", error=ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: the run has not started under this ckptsup, or its "
                          "supervisor has not published yet; try again in a few seconds") from None
    if not isinstance(data, dict) or data.get("v") != STATUS_VERSION or not isinstance(data.get("nodes"), dict):
        raise ConfigError(f"{path} is not a ckptsup status file (version {STATUS_VERSION}); move it aside")
    return data
