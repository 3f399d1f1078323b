"""Straggler detection (pure): which rank computes slower than the others, from the `compute_s`
its hooks report (hooks/compute_time.py: step time minus time blocked in collectives; under DDP
the step wall times are all the same, the fast ranks waiting for the slow one).

Every `window_steps` steps of every measured rank, each rank's median compute time is compared
with the median of the *other* ranks' medians (with the straggler included, two ranks' median
would hide it). A rank at least `ratio` times slower — and slower by MIN_GAP_S, so that the noise
of millisecond steps is no evidence — gets a strike; `windows` strikes in a row flag it, once per
attempt. Ranks that report no compute time (not DDP) are not compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIN_GAP_S = 0.002


@dataclass(frozen=True, kw_only=True)
class Straggler:
    rank: int
    node: str
    ratio: float          # its median compute time over the other ranks' median
    compute_s: float      # its median compute time in the last window
    others_s: float       # the other ranks' median
    windows: int          # windows in a row it was that much slower
    step: int             # the step that closed the last window

    def evidence(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "ratio": round(self.ratio, 3),
                "compute_s": round(self.compute_s, 6), "others_s": round(self.others_s, 6),
                "windows": self.windows, "step": self.step}


@dataclass(kw_only=True)
class StragglerDetector:
    ratio: float
    window_steps: int
    windows: int
    samples: dict[int, list[float]] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)
    strikes: dict[int, int] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)

    def add(self, *, rank: int, node: str, step: int, compute_s: float) -> list[Straggler]:
        self.samples.setdefault(rank, []).append(compute_s)
        self.nodes[rank] = node
        if len(self.samples) < 2 or any(len(v) < self.window_steps for v in self.samples.values()):
            return []
        medians = {r: statistics.median(v[-self.window_steps:]) for r, v in self.samples.items()}
        for values in self.samples.values():
            values.clear()
        found = []
        for r, mine in medians.items():
            others = statistics.median(m for o, m in medians.items() if o != r)
            slower = others > 0 and mine >= self.ratio * others and mine - others >= MIN_GAP_S
            self.strikes[r] = self.strikes.get(r, 0) + 1 if slower else 0
            if self.strikes[r] >= self.windows and r not in self.flagged:
                self.flagged.add(r)
                found.append(Straggler(rank=r, node=self.nodes[r], ratio=mine / others, compute_s=mine,
                                       others_s=others, windows=self.strikes[r], step=step))
        return found
