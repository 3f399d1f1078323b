"""The adaptive checkpoint interval: Daly's formula fed with what the run measures.

Pure: it consumes events (dicts as in events.jsonl) and reads an injected clock; the supervisor
wires it in, forwards each returned interval to the hooks and writes an `interval_changed` event.

Failure rate — a Gamma–Poisson (conjugate) update per device:
  prior   λ ~ Gamma(α0, β0) with α0 = prior_weight (pseudo-failures) and β0 = α0 · gpu_mtbf_hours
          (pseudo device-hours), so the prior mean rate is 1 / gpu_mtbf_hours;
  data    n failures (failure_detected, user errors excluded) over E device-hours of exposure;
  post    λ | data ~ Gamma(α0 + n, β0 + E); the posterior mean device MTBF is (β0 + E)/(α0 + n)
          and the job MTBF divides it by the devices in the gang.
A prior weight of 1 means "the site prior is worth one observed failure": a run that sees
failures much faster than the prior says moves to its own rate within a few failures.

C is the median of the last `window` checkpoint stalls; P (async persist) the median write time.
The interval is max(Daly(C, M), P) clamped to [min_interval_s, max_interval_s]; a new value is
reported only when it differs from the current one by more than `change_threshold` (relative),
so the hooks are not retuned on noise. The returned interval carries ± `jitter_fraction` random
jitter so that many jobs started together do not checkpoint in the same minute.

The memory tier's interval (AdaptiveMemoryInterval) is in steps, as `[memory] every_steps`: every
rank must make the same memory save (a resume needs a step every rank's agent holds), and a step
count needs no agreement. It is two_level.memory_interval — Young's at the memory level's failure
rate, the failures a memory copy survives — from C_m (median `memory_saved.stall_s`), P_m (median
`write_s`, which bounds how often a save can start: one due while the previous is in flight is
skipped), the job MTBF above and the current disk interval; then divided by the median measured
step time (`step_progress.step_time_s`) and held to [ceil(P_m / step), the disk schedule]. The
disk schedule is the job's real one (`disk_cap_steps`): its step count when it saves by steps,
its seconds at the measured step time, whichever comes first; a memory save less often than
the disk saves would never be the newest copy, so a failure would always resume from disk.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError
from ..events import Event, FailureKind
from .interval import daly_interval
from .two_level import Level, memory_interval
from .spans import devices_of, num
from .units import format_duration


@dataclass(frozen=True, kw_only=True)
class Posterior:
    alpha: float        # pseudo + observed failures
    beta_hours: float   # pseudo + observed device-hours

    @property
    def device_mtbf_s(self) -> float:
        return self.beta_hours / self.alpha * 3600.0

    def job_mtbf_s(self, devices: float) -> float:
        return self.device_mtbf_s / max(devices, 1.0)


def posterior(*, gpu_mtbf_hours: float, prior_weight: float, failures: float, device_hours: float) -> Posterior:
    """Gamma–Poisson update of the per-device failure rate (see module doc)."""
    if gpu_mtbf_hours <= 0 or prior_weight <= 0:
        raise ConfigError("cost.gpu_mtbf_hours and the prior weight must be > 0")
    return Posterior(alpha=prior_weight + max(0.0, failures),
                     beta_hours=prior_weight * gpu_mtbf_hours + max(0.0, device_hours))


def record_save_costs(event: dict[str, Any], stalls: deque[float], writes: deque[float], *, with_write: bool = True) -> None:
    """A save event's stall (when > 0) and write time (when >= 0) into the measurement windows."""
    stall = num(event, "stall_s")
    if stall is not None and stall > 0:
        stalls.append(stall)
    write = num(event, "write_s")
    if with_write and write is not None and write >= 0:
        writes.append(write)


MAX_EVERY_STEPS = 10**9   # [memory] every_steps' bound (config.py)


@dataclass(kw_only=True)
class AdaptiveInterval:
    gpu_mtbf_hours: float
    devices: float
    initial_interval_s: float
    prior_weight: float = 1.0
    window: int = 5
    change_threshold: float = 0.10
    jitter_fraction: float = 0.05
    min_interval_s: float = 10.0
    max_interval_s: float = 6 * 3600.0
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    stalls: deque[float] = field(init=False)
    writes: deque[float] = field(init=False)
    failures: int = field(default=0, init=False)
    device_hours: float = field(default=0.0, init=False)
    interval_s: float = field(init=False)  # current target, without jitter
    _since: float = field(init=False)

    def __post_init__(self) -> None:
        if self.devices <= 0 or self.initial_interval_s <= 0:
            raise ConfigError("adaptive interval: devices and the initial interval must be > 0")
        self.stalls = deque(maxlen=self.window)
        self.writes = deque(maxlen=self.window)
        self.interval_s = self.initial_interval_s
        self._since = self.clock()

    def _accrue(self) -> None:
        now = self.clock()
        self.device_hours += max(0.0, now - self._since) * self.devices / 3600.0
        self._since = now

    def observe(self, event: dict[str, Any]) -> tuple[float, str] | None:
        """Feed one event; returns (jittered interval_s, why) when the target moved enough."""
        self._accrue()
        name = Event.parse(event.get("event"))
        if name is Event.CHECKPOINT_COMMITTED:
            record_save_costs(event, self.stalls, self.writes)
        elif name is Event.FAILURE_DETECTED and FailureKind.counts_against_mtbf(event.get("kind")):
            self.failures += 1
        elif name is Event.FAILURE_ATTRIBUTED:
            was, now = (FailureKind.counts_against_mtbf(event.get(k)) for k in ("was_kind", "kind"))
            self.failures = max(0, self.failures + int(now) - int(was))
        elif name is Event.ALLOCATION:
            devices = devices_of(event)
            if devices is not None and devices[0] > 0:
                self.devices = devices[0]  # the active ones: the gang whose failures stop the job
        else:
            return None
        return self._retarget(name.value)

    def seed(self, history: list[dict[str, Any]]) -> None:
        """Start from what earlier attempts of this run saw (events.jsonl after a requeue): their
        failures, exposure and checkpoint costs. Reports nothing; the next observe() may."""
        from .accounting import account

        acc = account(history)
        self.failures += acc.failure_count
        self.device_hours += acc.wall_s * acc.mean_active_devices / 3600.0
        self.stalls.extend(s for s in acc.stalls_s[-self.window:] if s > 0)
        self.writes.extend(acc.writes_s[-self.window:])

    def target(self) -> tuple[float, str] | None:
        """Daly's interval from the current estimates (no jitter), or None before any stall."""
        if not self.stalls:
            return None
        stall = statistics.median(self.stalls)
        post = self.posterior()
        mtbf = post.job_mtbf_s(self.devices)
        daly = daly_interval(stall, mtbf)
        persist = statistics.median(self.writes) if self.writes else 0.0
        value = min(self.max_interval_s, max(self.min_interval_s, daly.interval_s, persist))
        why = (f"C={format_duration(stall)} M={format_duration(mtbf)} "
               f"({self.failures} failures in {self.device_hours:.1f} device-h) -> Daly {format_duration(daly.interval_s)}")
        if persist > daly.interval_s:
            why += f", raised to persist {format_duration(persist)}"
        return value, why

    def posterior(self) -> Posterior:
        return posterior(gpu_mtbf_hours=self.gpu_mtbf_hours, prior_weight=self.prior_weight,
                         failures=self.failures, device_hours=self.device_hours)

    def _retarget(self, cause: str) -> tuple[float, str] | None:
        target = self.target()
        if target is None:
            return None
        value, why = target
        if abs(value - self.interval_s) <= self.change_threshold * self.interval_s:
            return None
        self.interval_s = value
        jittered = value * (1.0 + self.rng.uniform(-self.jitter_fraction, self.jitter_fraction))
        return jittered, f"{cause}: {why}"


def disk_cap_steps(*, disk_every_steps: int, disk_interval_s: float, step_s: float | None) -> int | None:
    """The most steps between two memory saves: the job's disk schedule, in steps — its step
    count (when > 0), its seconds at the measured step time (when measured), whichever is fewer,
    at least 1. None when neither is known (no step count, no step time)."""
    caps = [disk_every_steps] if disk_every_steps > 0 else []
    if step_s is not None and step_s > 0 and math.isfinite(disk_interval_s) and disk_interval_s > 0:
        caps.append(math.floor(disk_interval_s / step_s + 1e-9))   # 6.0 / 0.3 is 19.999...: still 20
    return max(1, min(caps)) if caps else None


@dataclass(kw_only=True)
class AdaptiveMemoryInterval:
    """The memory save interval in steps (see module doc). Pure: observe() records measurements;
    retarget() decides from them and the disk side's MTBF and interval, which it is given."""

    initial_every_steps: int
    nodes: int = 1
    miss: float = 0.0            # failures no memory copy survives, beyond a node lost with its buddy
    window: int = 5
    change_threshold: float = 0.10
    stalls: deque[float] = field(init=False)
    writes: deque[float] = field(init=False)
    step_times: deque[float] = field(init=False)
    every_steps: int = field(init=False)   # the current schedule: the configured one until measured

    def __post_init__(self) -> None:
        if self.initial_every_steps < 1:
            raise ConfigError("adaptive memory interval: the initial every_steps must be >= 1")
        self.stalls = deque(maxlen=self.window)
        self.writes = deque(maxlen=self.window)
        self.step_times = deque(maxlen=2 * self.window + 1)   # odd: the median is a measured step
        self.every_steps = self.initial_every_steps

    def observe(self, event: dict[str, Any]) -> bool:
        """Record what `event` measured; True when it may move the target."""
        name = Event.parse(event.get("event"))
        if name is Event.MEMORY_SAVED:   # a failed save stalled too, but its write time says little
            record_save_costs(event, self.stalls, self.writes, with_write=event.get("ok") is True)
        elif name is Event.STEP_PROGRESS:
            step = num(event, "step_time_s")
            if step is None or step <= 0:
                return False
            self.step_times.append(step)
        elif name is Event.ALLOCATION:
            active = num(event, "active")
            if active is None or active < 1:
                return False
            self.nodes = int(active)
        else:
            return name in (Event.CHECKPOINT_COMMITTED, Event.FAILURE_DETECTED, Event.FAILURE_ATTRIBUTED)
        return True

    def seed(self, history: list[dict[str, Any]]) -> None:
        """After a requeue: the earlier allocations' memory-save costs and step times."""
        from .accounting import account

        acc = account(history)
        self.stalls.extend(s for s in acc.memory_stalls_s[-self.window:] if s > 0)
        self.writes.extend(acc.memory_writes_s[-self.window:])
        for event in history:
            if event.get("event") == Event.STEP_PROGRESS:
                step = num(event, "step_time_s")
                if step is not None and step > 0:
                    self.step_times.append(step)

    def target(self, *, mtbf_s: float, disk_interval_s: float, disk_every_steps: int = 0) -> tuple[int, float, str] | None:
        """(every_steps, the seconds they take, why), or None before a memory stall and a step time
        are measured (the configured every_steps stays)."""
        plan = self._plan(mtbf_s=mtbf_s, disk_interval_s=disk_interval_s, disk_every_steps=disk_every_steps)
        return None if plan is None else (plan.steps, plan.steps * plan.step_s, plan.why)

    def retarget(self, cause: str, *, mtbf_s: float, disk_interval_s: float,
                 disk_every_steps: int = 0) -> tuple[int, float | None, str] | None:
        """A new every_steps (with the seconds they take, None before a step time is measured) when
        the current one is out of bounds, or when the target is closer to the ideal seconds than
        the current one by more than change_threshold of them (whole steps: an ideal between two
        counts must not flip between them on noise). Before a memory stall and a step time are
        measured, only a disk step schedule shorter than the current count moves it."""
        plan = self._plan(mtbf_s=mtbf_s, disk_interval_s=disk_interval_s, disk_every_steps=disk_every_steps)
        if plan is None:   # unmeasured: the configured count, but never past a disk step schedule
            if 0 < disk_every_steps < self.every_steps:
                self.every_steps = disk_every_steps
                step = statistics.median(self.step_times) if self.step_times else None
                return (disk_every_steps, None if step is None else disk_every_steps * step,
                        f"{cause}: held to the disk schedule of every {disk_every_steps} steps")
            return None
        if plan.steps == self.every_steps:
            return None
        error = lambda n: abs(n * plan.step_s - plan.ideal_s) / plan.ideal_s  # noqa: E731
        current = self.every_steps
        if plan.lo <= current <= plan.hi and error(current) - error(plan.steps) <= self.change_threshold:
            return None
        self.every_steps = plan.steps
        return plan.steps, plan.steps * plan.step_s, f"{cause}: {plan.why}"

    def _plan(self, *, mtbf_s: float, disk_interval_s: float, disk_every_steps: int) -> "_MemoryPlan | None":
        if not self.stalls or not self.step_times:
            return None
        stall, step = statistics.median(self.stalls), statistics.median(self.step_times)
        write = statistics.median(self.writes) if self.writes else 0.0
        # Young's alone; the write time is the lower bound below, in whole steps
        young = memory_interval(memory=Level(stall_s=stall, restart_s=0.0), mtbf_s=mtbf_s,
                                nodes=self.nodes, disk_interval_s=disk_interval_s, miss=self.miss)
        # no more often than a save can be written, never less often than the disk saves
        hi = disk_cap_steps(disk_every_steps=disk_every_steps, disk_interval_s=disk_interval_s, step_s=step) \
            or MAX_EVERY_STEPS   # no disk schedule at all (an infinite interval): only the knob's bound
        disk_s = hi * step
        lo = min(hi, max(1, math.ceil(write / step - 1e-9)))
        ideal = min(hi * step, max(lo * step, young))
        steps = min(hi, max(lo, round(ideal / step)))
        why = (f"C_m={format_duration(stall)} P_m={format_duration(write)} M={format_duration(mtbf_s)} "
               f"-> Young {format_duration(young)}")
        if young > hi * step:
            why += f", capped at the disk interval {format_duration(disk_s)}"
        elif young < lo * step:
            why += f", raised to the write time {format_duration(write)}"
        why += f" = {steps} steps of {format_duration(step)}"
        return _MemoryPlan(steps=steps, step_s=step, ideal_s=ideal, lo=lo, hi=hi, why=why)


@dataclass(frozen=True, kw_only=True)
class _MemoryPlan:
    steps: int
    step_s: float
    ideal_s: float
    lo: int
    hi: int
    why: str
