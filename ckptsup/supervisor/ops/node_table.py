"""`ckptsup status`'s node table at scale (pure): the published nodes (supervisor/job/status.py) grouped
by state, the slowest in full, or the ones a pattern names. At 2,048 nodes a row each printed 2,048
rows and took 2 s to render (16 s at 16,384, bench/bench_scale_ops.py); the groups say the same at a
glance: how many are up, late, gone or spare, and which ones to look at.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

DETAIL_NODES = 16     # up to this many nodes, a row each (a small job's table as before)
SLOWEST = 5           # nodes shown in full below the groups
LATE_BEATS = 3        # a heartbeat older than this many periods makes a node `late`
EXAMPLES = 3          # node names shown per group


class NodeState(enum.StrEnum):
    """A node as its row says, worst first (the groups' order)."""

    GONE = "active, agent gone"
    LATE = "active, heartbeat late"
    UP = "active, up"
    SPARE_GONE = "spare, agent gone"
    SPARE = "spare, up"


def state_of(row: Mapping[str, Any], late_s: float = LATE_BEATS * 1.0) -> NodeState:
    spare = row.get("role") == "spare"
    if not row.get("agent"):
        return NodeState.SPARE_GONE if spare else NodeState.GONE
    if spare:
        return NodeState.SPARE
    age = row.get("heartbeat_age_s")
    return NodeState.LATE if isinstance(age, (int, float)) and age > late_s else NodeState.UP


@dataclass(kw_only=True)
class Group:
    state: NodeState
    count: int = 0
    warm: int = 0
    max_age_s: float | None = None
    min_step: int | None = None
    max_step: int | None = None
    examples: list[str] = field(default_factory=list)   # the stalest first: the ones to look at


def by_state(rows: Mapping[str, Mapping[str, Any]], heartbeat_interval_s: Any = 1.0) -> list[Group]:
    """One group per state present, worst state first; O(nodes log nodes). `heartbeat_interval_s`:
    the published beat period (a node is late past LATE_BEATS of them)."""
    period = heartbeat_interval_s if isinstance(heartbeat_interval_s, (int, float)) and heartbeat_interval_s > 0 else 1.0
    groups: dict[NodeState, Group] = {}
    stalest: dict[NodeState, list[tuple[float, str]]] = {}
    for node, row in rows.items():
        state = state_of(row, LATE_BEATS * period)
        g = groups.get(state)
        if g is None:
            g = groups[state] = Group(state=state)
        g.count += 1
        g.warm += bool(row.get("warm"))
        age, step = row.get("heartbeat_age_s"), row.get("step")
        if isinstance(age, (int, float)):
            g.max_age_s = age if g.max_age_s is None else max(g.max_age_s, age)
        if isinstance(step, int):
            g.min_step = step if g.min_step is None else min(g.min_step, step)
            g.max_step = step if g.max_step is None else max(g.max_step, step)
        stalest.setdefault(state, []).append((-age if isinstance(age, (int, float)) else 0.0, node))
    for state, g in groups.items():
        g.examples = [node for _, node in sorted(stalest[state])[:EXAMPLES]]
    return [groups[s] for s in NodeState if s in groups]


def slowest(rows: Mapping[str, Mapping[str, Any]], count: int = SLOWEST) -> dict[str, Mapping[str, Any]]:
    """The active nodes with the highest step p99, then the furthest behind: the stragglers' suspects."""
    def key(item: tuple[str, Mapping[str, Any]]) -> tuple[float, float]:
        row = item[1]
        p99, step = row.get("step_p99_s"), row.get("step")
        return (-p99 if isinstance(p99, (int, float)) else 0.0, step if isinstance(step, int) else 0)
    active = [(n, r) for n, r in rows.items() if r.get("role") == "active" and
              (isinstance(r.get("step_p99_s"), (int, float)) or isinstance(r.get("step"), int))]
    return dict(sorted(active, key=key)[:count])


def matching(rows: Mapping[str, Mapping[str, Any]], pattern: str) -> dict[str, Mapping[str, Any]]:
    """The rows whose node a shell pattern of `pattern` (comma-separated: any of them) names."""
    parts = [p.strip() for p in pattern.split(",") if p.strip()]
    if not parts:
        return {}
    names = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in parts))
    return {node: row for node, row in rows.items() if names.match(node)}
