"""The adaptive checkpoint interval in the loop: feeds planning.adaptive.AdaptiveInterval (disk)
and, with the memory tier on, AdaptiveMemoryInterval (memory saves, in steps) the run's events
(seeded with the earlier allocations' after a requeue) and reports new intervals; the loop sends
them to the ranks (`set_interval`) and records `interval_changed`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..config import Config
from .preemption import STOP_RESERVE_S

class IntervalLevel(enum.StrEnum):
    """interval_changed.level: which save schedule changed."""

    DISK = "disk"
    MEMORY = "memory"


@dataclass(frozen=True, kw_only=True)
class IntervalChange:
    """A new interval for one level: disk (`interval_s`, jittered) or memory (`every_steps`, and
    the seconds they take at the measured step time)."""

    level: IntervalLevel
    interval_s: float
    why: str
    every_steps: int | None = None

    def command(self) -> dict[str, Any]:
        """The set_interval body (docs/contracts.md)."""
        if self.level is IntervalLevel.MEMORY:
            return {"memory_every_steps": self.every_steps}
        return {"interval_s": round(self.interval_s, 3)}

    def event_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"level": str(self.level), "interval_s": round(self.interval_s, 3), "why": self.why}
        if self.every_steps is not None:
            fields["every_steps"] = self.every_steps
        return fields


class IntervalTuner:
    """Wires planning.adaptive's interval choices into the loop: feeds them events, reports new
    intervals. Off when checkpoint.adaptive_interval is false; the memory level also needs
    [memory] enabled, and starts from [memory] every_steps."""

    def __init__(self, config: Config, *, gpus_per_node: int = 0) -> None:
        self.config = config
        self.grace_time_s: float | None = None
        self._current = float(config.checkpoint.save_every_s)
        self._adaptive = None
        self._memory = None
        if config.checkpoint.adaptive_interval:
            from ..planning.adaptive import AdaptiveInterval, AdaptiveMemoryInterval

            # devices that can fail: the allocation's GPUs, else the ranks (a CPU job)
            ranks = config.supervisor.nproc_per_node
            per_node = gpus_per_node or (ranks if isinstance(ranks, int) else 1)
            nodes = max(1, config.supervisor.nodes or 1)
            self._adaptive = AdaptiveInterval(gpu_mtbf_hours=config.cost.gpu_mtbf_hours, devices=nodes * per_node,
                                              initial_interval_s=self._current)
            if config.memory.enabled:
                self._memory = AdaptiveMemoryInterval(initial_every_steps=config.memory.every_steps, nodes=nodes)

    def current_s(self) -> float:
        return self._current

    def memory_every_steps(self) -> int:
        """The memory saves' schedule for the next launch: the tuned one, else [memory] every_steps."""
        return self._memory.every_steps if self._memory is not None else self.config.memory.every_steps

    def observe(self, record: dict[str, Any]) -> list[IntervalChange]:
        """Feed one event; the disk change (if any) comes first, the memory one follows it (its
        bound is the disk interval)."""
        if self._adaptive is None:
            return []
        changes = []
        change = self._adaptive.observe(record)
        if change is not None:
            self._current = change[0]
            changes.append(IntervalChange(level=IntervalLevel.DISK, interval_s=change[0], why=change[1]))
        if self._memory is not None and self._memory.observe(record):
            moved = self._memory.retarget(str(record.get("event")), **self._memory_inputs())
            if moved is not None:
                changes.append(IntervalChange(level=IntervalLevel.MEMORY, interval_s=moved[1], why=moved[2], every_steps=moved[0]))
        return changes

    def _memory_inputs(self) -> dict[str, Any]:
        assert self._adaptive is not None
        return {"mtbf_s": self._adaptive.posterior().job_mtbf_s(self._adaptive.devices),
                "disk_interval_s": self._adaptive.interval_s,
                "disk_every_steps": self.config.checkpoint.save_every_steps}

    def seed(self, earlier: list[dict[str, Any]]) -> None:
        """After a requeue: start from the earlier allocations' failures, exposure and checkpoint
        costs (events.jsonl), and launch with the intervals they imply."""
        if self._adaptive is None or not earlier:
            return
        self._adaptive.seed(earlier)
        target = self._adaptive.target()
        if target is not None:
            self._current = self._adaptive.interval_s = target[0]
        if self._memory is not None:
            self._memory.seed(earlier)
            memory = self._memory.target(**self._memory_inputs())
            if memory is not None:
                self._memory.every_steps = memory[0]

    def preempt_window_s(self) -> float:
        return float(self.grace_time_s or 0.0)

    def preempt_budget_s(self) -> float:
        """What ranks may spend after a preemption SIGTERM (they check the save fits)."""
        return max(0.0, float(self.grace_time_s or 0.0) - STOP_RESERVE_S)
