"""The adaptive checkpoint interval in the loop: feeds planning.adaptive.AdaptiveInterval the
run's events (seeded with the earlier allocations' after a requeue) and reports new intervals."""

from __future__ import annotations

from typing import Any

from ..config import Config
from .preemption import STOP_RESERVE_S


class IntervalTuner:
    """Wires planning.adaptive.AdaptiveInterval (E) into the loop: feeds it events, reports new
    intervals. Off when checkpoint.adaptive_interval is false."""

    def __init__(self, config: Config, *, gpus_per_node: int = 0) -> None:
        self.config = config
        self.grace_time_s: float | None = None
        self._current = float(config.checkpoint.save_every_s)
        self._adaptive = None
        if config.checkpoint.adaptive_interval:
            from ..planning.adaptive import AdaptiveInterval

            # devices that can fail: the allocation's GPUs, else the ranks (a CPU job)
            ranks = config.supervisor.nproc_per_node
            per_node = gpus_per_node or (ranks if isinstance(ranks, int) else 1)
            self._adaptive = AdaptiveInterval(gpu_mtbf_hours=config.cost.gpu_mtbf_hours,
                                              devices=max(1, config.supervisor.nodes or 1) * per_node,
                                              initial_interval_s=self._current)

    def current_s(self) -> float:
        return self._current

    def observe(self, record: dict[str, Any]) -> tuple[float, str] | None:
        if self._adaptive is None:
            return None
        change = self._adaptive.observe(record)
        if change is not None:
            self._current = change[0]
        return change

    def seed(self, earlier: list[dict[str, Any]]) -> None:
        """After a requeue: start from the earlier allocations' failures, exposure and checkpoint
        costs (events.jsonl), and launch with the interval they imply."""
        if self._adaptive is None or not earlier:
            return
        self._adaptive.seed(earlier)
        target = self._adaptive.target()
        if target is not None:
            self._current = self._adaptive.interval_s = target[0]

    def preempt_window_s(self) -> float:
        return float(self.grace_time_s or 0.0)

    def preempt_budget_s(self) -> float:
        """What ranks may spend after a preemption SIGTERM (they check the save fits)."""
        return max(0.0, float(self.grace_time_s or 0.0) - STOP_RESERVE_S)
