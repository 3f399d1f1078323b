"""A node's /proc evidence as its heartbeats carry it, kept packed until a silence is judged.

Every heartbeat carries each rank's CPU time, I/O and state (messages.pack_evidence). Parsed into a
sample per rank at every beat, that was the largest part of the supervisor's work per heartbeat
(at 2,048 nodes x 8 ranks: ~35 of ~77 us, BENCHMARKS.md §Scale). Evidence is read only while an
attempt is suspect (liveness.judge), so a beat only appends the packed string to its node's recent
ones; `watch` parses them into the tracker's RankEvidence when a suspicion begins and every beat
after it folds in at once, as before, until `unwatch`. Pure (no clock of its own, no I/O).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ...messages import unpack_evidence
from .liveness import EVIDENCE_WINDOW_S, RankEvidence

# what a suspicion's first verdict needs of the past: the rates window (liveness._inside keeps the
# samples of the last window + 1 s) and a little slack for beats that come late
RECENT_S = EVIDENCE_WINDOW_S + 2.0


@dataclass(kw_only=True)
class NodeEvidence:
    node: str
    recent: deque[tuple[float, str]] = field(default_factory=deque)   # (supervisor mono, packed), oldest first
    last_nonempty: tuple[float, str] | None = None   # the last beat that listed a rank (ranks that left: stale, not unknown)
    watched: bool = False

    def add(self, now: float, packed: str, into: dict[int, RankEvidence]) -> None:
        """One heartbeat's evidence; folded into `into` at once while watched."""
        self.recent.append((now, packed))
        while now - self.recent[0][0] > RECENT_S:
            self.recent.popleft()
        if packed:
            self.last_nonempty = (now, packed)
        if self.watched:
            self._fold(now, packed, into)

    def watch(self, into: dict[int, RankEvidence]) -> None:
        """Parse what is kept into `into`: the same samples a fold at every beat would hold for the
        rates window (the last beat that listed ranks first, when they have left since)."""
        if self.watched:
            return
        self.watched = True
        kept = list(self.recent)
        if self.last_nonempty is not None and (not kept or self.last_nonempty[0] < kept[0][0]):
            kept.insert(0, self.last_nonempty)
        for when, packed in kept:
            self._fold(when, packed, into)

    def unwatch(self) -> None:
        self.watched = False

    def _fold(self, now: float, packed: str, into: dict[int, RankEvidence]) -> None:
        for rank, cpu_s, io_bytes, state, children, children_cpu_s in unpack_evidence(packed):
            ev = into.get(rank)
            if ev is None or ev.node != self.node:
                ev = into[rank] = RankEvidence(rank=rank, node=self.node)
            ev.add(now, cpu_s, io_bytes, state, children, children_cpu_s)
