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
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError
from ..events import Event, FailureKind
from .interval import daly_interval
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
            stall = num(event, "stall_s")
            if stall is not None and stall > 0:
                self.stalls.append(stall)
            write = num(event, "write_s")
            if write is not None and write >= 0:
                self.writes.append(write)
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
