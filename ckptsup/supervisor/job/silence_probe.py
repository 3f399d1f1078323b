"""A silent node found in seconds, not after node_silence_s (issue 38): an agent that missed
SUSPECT_BEATS heartbeats while others talk has its node's slurmd asked, off the loop; a slurmd
that does not answer means the node is dead, and the loop gets a node_down at once (~2 s after the
last heartbeat at the defaults, against node_silence_s = 5 s). A slurmd that answers means a live
node whose agent is slow (a loaded box) or stuck: nothing happens here, and node_silence_s still
decides (detection.detect_node_down). One probe a node per silence: it is asked again only after
its agent spoke.

The decision (`due`) is pure; the probes run on a small thread pool (the loop never waits on a
connect); `take` hands back the verdicts.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .observations import Failure, FailureKind

SUSPECT_BEATS = 2          # heartbeats missed before the node's slurmd is asked
MIN_SUSPECT_S = 1.0        # however short the heartbeat interval
PROBE_TIMEOUT_S = 0.5      # a slurmd that does not accept a connection in this long: its node is gone


def suspect_after_s(heartbeat_interval_s: float) -> float:
    return max(SUSPECT_BEATS * heartbeat_interval_s, MIN_SUSPECT_S)


def due(silent: Sequence[tuple[str, float, float]], asked: dict[str, float]) -> list[str]:
    """Of (node, last_heard, silent_for) silent past the suspect threshold, those not asked since
    they were last heard."""
    return [node for node, last_heard, _ in silent if asked.get(node) != last_heard]


@dataclass
class SilenceProbe:
    """Asks the slurmd of nodes whose agents went silent; `down(nodes, timeout_s) -> set` is
    Placement.slurmd_down (the Slurm seam)."""

    down: Callable[[Sequence[str], float], set[str]]
    asked: dict[str, float] = field(default_factory=dict)   # node -> its last_heard when its slurmd was asked
    pending: list[tuple[Future, dict[str, float]]] = field(default_factory=list)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1,
                                                                                 thread_name_prefix="silence-probe"))

    def offer(self, silent: Sequence[tuple[str, float, float]]) -> None:
        """Start probes for the silent nodes not asked yet (returns at once)."""
        nodes = due(silent, self.asked)
        if not nodes:
            return
        heard = {node: last for node, last, _ in silent if node in nodes}
        self.asked.update(heard)
        self.pending.append((self.pool.submit(self.down, nodes, PROBE_TIMEOUT_S), heard))

    def take(self, now: float, still_silent: Callable[[str, float], bool], step: int | None) -> Failure | None:
        """A node_down for a probed node whose slurmd did not answer and whose agent has not spoken
        since it was asked (a verdict on a node that came back meanwhile is dropped)."""
        finished = [(f, heard) for f, heard in self.pending if f.done()]
        self.pending = [(f, heard) for f, heard in self.pending if not f.done()]
        for future, heard in finished:
            try:
                dead = future.result()
            except Exception:   # a probe that failed says nothing: node_silence_s still decides
                continue
            for node in sorted(dead):
                if still_silent(node, heard[node]):
                    return Failure(kind=FailureKind.NODE_DOWN, node=node, step=step, detect_s=now - heard[node],
                                   suspects=(node,),
                                   detail=f"agent silent for {now - heard[node]:.1f}s and its slurmd does not answer")
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
