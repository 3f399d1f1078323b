"""The adaptive checkpoint interval in the loop: feeds planning.adaptive.AdaptiveInterval (disk)
and, with the memory tier on, AdaptiveMemoryInterval (memory saves, in steps) the run's events
(seeded with the earlier allocations' after a requeue) and reports new intervals; the loop sends
them to the ranks (`set_interval`) and records `interval_changed`.

The memory saves' cap is the job's real disk schedule, which only the ranks know for sure
(attach(save_every_steps=...) wins over the supervisor's environment): each rank's hello says it
(`rank_schedule`), and until one has, the config's. A `[memory] every_steps` set anywhere but the
built-in default is the user's choice: the tuner leaves it alone."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ...config import WEEK_S, Config, set_explicitly
from ...messages import SetInterval
from .preemption import STOP_RESERVE_S

MAX_SAVE_EVERY_STEPS = 10**9   # [checkpoint] save_every_steps' bound (config.py)

# state.json measured keys: the ranks' schedule outlives the supervisor (a requeue, --resume)
SCHEDULE_KEYS = {"save_every_steps": "rank_save_every_steps", "save_every_s": "rank_save_every_s"}


def rank_schedule(body: Mapping[str, Any]) -> dict[str, int | float]:
    """The disk schedule a rank reported (a hello body, or state.json's copy): save_every_steps
    (an integer >= 0, 0 = none) and save_every_s (seconds > 0), each only when well-formed. A
    rank of an older ckptsup says neither; junk is dropped, never trusted."""
    out: dict[str, int | float] = {}
    steps, seconds = body.get("save_every_steps"), body.get("save_every_s")
    if isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps <= MAX_SAVE_EVERY_STEPS:
        out["save_every_steps"] = steps
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) \
            and 0 < seconds <= WEEK_S:
        out["save_every_s"] = float(seconds)
    return out


class IntervalLevel(enum.StrEnum):
    """interval_changed.level: which save schedule changed."""

    DISK = "disk"
    MEMORY = "memory"


@dataclass(frozen=True, kw_only=True)
class IntervalChange:
    """A new interval for one level: disk (`interval_s`, jittered) or memory (`every_steps`, and
    the seconds they take at the measured step time)."""

    level: IntervalLevel
    interval_s: float | None   # memory: None before a step time is measured
    why: str
    every_steps: int | None = None

    def command(self) -> SetInterval:
        """The set_interval command."""
        if self.level is IntervalLevel.MEMORY:
            return SetInterval(memory_every_steps=self.every_steps)
        assert self.interval_s is not None
        return SetInterval(interval_s=round(self.interval_s, 3))

    def event_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"level": str(self.level), "why": self.why}
        if self.interval_s is not None:
            fields["interval_s"] = round(self.interval_s, 3)
        if self.every_steps is not None:
            fields["every_steps"] = self.every_steps
        return fields


class IntervalTuner:
    """Wires planning.adaptive's interval choices into the loop: feeds them events, reports new
    intervals. Off when checkpoint.adaptive_interval is false; the memory level also needs
    [memory] enabled and every_steps left at its default (`provenance` says), and starts there."""

    def __init__(self, config: Config, *, gpus_per_node: int = 0, provenance: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.grace_time_s: float | None = None
        self._current = float(config.checkpoint.save_every_s)
        self._adaptive = None
        self._memory = None
        # the disk schedule the memory saves must keep up with: the ranks' own once they said it
        self._disk_steps = config.checkpoint.save_every_steps
        self._disk_s: float | None = None   # None: the disk tuner's interval, which the ranks follow
        pinned = set_explicitly(provenance or {}, "memory.every_steps")
        if config.checkpoint.adaptive_interval:
            from ...planning.adaptive import AdaptiveInterval, AdaptiveMemoryInterval

            # devices that can fail: the allocation's GPUs, else the ranks (a CPU job)
            ranks = config.supervisor.nproc_per_node
            per_node = gpus_per_node or (ranks if isinstance(ranks, int) else 1)
            nodes = max(1, config.supervisor.nodes or 1)
            self._adaptive = AdaptiveInterval(gpu_mtbf_hours=config.cost.gpu_mtbf_hours, devices=nodes * per_node,
                                              initial_interval_s=self._current)
            if config.memory.enabled and not pinned:
                self._memory = AdaptiveMemoryInterval(initial_every_steps=config.memory.every_steps, nodes=nodes)
                self._memory.retarget("config", **self._memory_inputs())   # the default, held to the disk steps

    def current_s(self) -> float:
        return self._current

    def memory_every_steps(self) -> int:
        """The memory saves' schedule for the next launch: the tuned one, else [memory] every_steps."""
        return self._memory.every_steps if self._memory is not None else self.config.memory.every_steps

    def learn_schedule(self, body: Mapping[str, Any]) -> dict[str, int | float]:
        """Take the disk schedule a rank reported (its hello; state.json's copy at start); returns
        what the run state should keep (SCHEDULE_KEYS), empty when nothing was said. Retargets
        nothing: retune() does, once every rank can take a set_interval."""
        said = rank_schedule(body)
        if "save_every_steps" in said:
            self._disk_steps = int(said["save_every_steps"])
        if "save_every_s" in said:
            self._disk_s = float(said["save_every_s"])
        return {SCHEDULE_KEYS[k]: v for k, v in said.items()}

    def retune(self, cause: str) -> list[IntervalChange]:
        """The memory schedule against what is known now (after learn_schedule)."""
        if self._memory is None:
            return []
        moved = self._memory.retarget(cause, **self._memory_inputs())
        return [] if moved is None else [self._memory_change(moved)]

    def observe(self, record: dict[str, Any]) -> list[IntervalChange]:
        """Feed one event; the disk change (if any) comes first, the memory one follows it (its
        bound is the disk interval)."""
        if self._adaptive is None:
            return []
        changes = []
        change = self._adaptive.observe(record)
        if change is not None:
            self._current = change[0]
            if self._disk_s is not None:
                self._disk_s = change[0]   # the ranks take it (set_interval), whatever attach() said
            changes.append(IntervalChange(level=IntervalLevel.DISK, interval_s=change[0], why=change[1]))
        if self._memory is not None and self._memory.observe(record):
            moved = self._memory.retarget(str(record.get("event")), **self._memory_inputs())
            if moved is not None:
                changes.append(self._memory_change(moved))
        return changes

    @staticmethod
    def _memory_change(moved: tuple[int, float | None, str]) -> IntervalChange:
        return IntervalChange(level=IntervalLevel.MEMORY, interval_s=moved[1], why=moved[2], every_steps=moved[0])

    def _memory_inputs(self) -> dict[str, Any]:
        assert self._adaptive is not None
        return {"mtbf_s": self._adaptive.posterior().job_mtbf_s(self._adaptive.devices),
                "disk_interval_s": self._adaptive.interval_s if self._disk_s is None else self._disk_s,
                "disk_every_steps": self._disk_steps}

    def seed(self, earlier: list[dict[str, Any]]) -> None:
        """After a requeue: start from the earlier allocations' failures, exposure and checkpoint
        costs (events.jsonl), and launch with the intervals they imply."""
        if self._adaptive is None:
            return
        if earlier:
            self._adaptive.seed(earlier)
            target = self._adaptive.target()
            if target is not None:
                self._current = self._adaptive.interval_s = target[0]
        if self._memory is not None:
            self._memory.seed(earlier)
            memory = self._memory.target(**self._memory_inputs())
            if memory is not None:
                self._memory.every_steps = memory[0]
            else:   # nothing measured yet: still held to the disk step schedule kept in state.json
                self._memory.retarget("requeue", **self._memory_inputs())

    def preempt_window_s(self) -> float:
        return float(self.grace_time_s or 0.0)

    def preempt_budget_s(self) -> float:
        """What ranks may spend after a preemption SIGTERM (they check the save fits)."""
        return max(0.0, float(self.grace_time_s or 0.0) - STOP_RESERVE_S)
