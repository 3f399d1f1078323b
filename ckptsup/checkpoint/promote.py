"""Background promotion of committed checkpoints to slower tiers (docs/checkpoint-core.md §Tiers).

One worker thread, a bounded queue (storage.promote_queue_size: when full, the oldest waiting
checkpoint is skipped, since a newer one supersedes it), retries with tenacity
(storage.promote_retries, exponential backoff, injected sleep). A copy counts only once the
destination's has_copy() matches the manifest; the source is never deleted here, so a slow or
dead tier costs lag, never the only durable copy, and never stalls training (submit() does not
block). Every outcome is reported through `on_result` (the hooks/agent turn it into a
`checkpoint_promoted` event).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..errors import CheckpointError, CkptsupError
from .manifest import load_manifest
from .tier_base import Tier, TierError


@dataclass(kw_only=True)
class PromotionResult:
    step: int
    tier: str
    ok: bool
    attempts: int = 0
    duration_s: float = 0.0
    bytes: int = 0
    error: str = ""
    skipped: bool = False   # dropped from a full queue, never tried

    def event_fields(self) -> dict[str, object]:
        """Fields of the `checkpoint_promoted` event (events.Event.CHECKPOINT_PROMOTED)."""
        return {"step": self.step, "tier": self.tier, "ok": self.ok, "attempts": self.attempts,
                "duration_s": round(self.duration_s, 3), "bytes": self.bytes, "error": self.error, "skipped": self.skipped}


class Promoter:
    def __init__(self, *, destinations: Sequence[Tier], queue_size: int = 4, retries: int = 5,
                 on_result: Callable[[PromotionResult], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 wait_initial_s: float = 1.0, wait_max_s: float = 60.0) -> None:
        if queue_size < 1 or retries < 1:
            raise CheckpointError(f"promote_queue_size and promote_retries must be >= 1 (got {queue_size}, {retries})")
        self.destinations = list(destinations)
        self.queue_size = queue_size
        self.retries = retries
        self.on_result = on_result
        self.sleep = sleep
        self.clock = clock
        self.wait_initial_s = wait_initial_s
        self.wait_max_s = wait_max_s
        self._queue: collections.deque[tuple[int, Path]] = collections.deque()
        self._current: int | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.results: list[PromotionResult] = []

    # ---- control (called from the training/agent thread; never blocks on I/O) --------------

    def start(self) -> "Promoter":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptsup-promoter", daemon=True)
            self._thread.start()
        return self

    def submit(self, step_dir: str | Path, *, step: int | None = None) -> None:
        step_dir = Path(step_dir)
        step = step if step is not None else load_manifest(step_dir).step
        dropped: list[int] = []
        with self._cond:
            if self._closing:
                raise CheckpointError("promoter is closed; no new promotions")
            while len(self._queue) >= self.queue_size:
                dropped.append(self._queue.popleft()[0])
            self._queue.append((step, step_dir))
            self._cond.notify_all()
        for old in dropped:
            self._report(PromotionResult(step=old, tier="*", ok=False, skipped=True,
                                         error=f"queue full ({self.queue_size}); superseded by step {step}"))

    def in_flight(self) -> set[int]:
        """Steps queued or being promoted: retention must not delete them."""
        with self._cond:
            steps = {s for s, _ in self._queue}
            if self._current is not None:
                steps.add(self._current)
            return steps

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is empty and nothing is in progress; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish what is queued (up to timeout_s), then stop the worker."""
        drained = self.drain(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0 if not drained else None)
        return drained

    # ---- worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                step, step_dir = self._queue.popleft()
                self._current = step
            try:
                for tier in self.destinations:
                    result = self.promote_one(step_dir, tier)
                    self._report(result)
                    if not result.ok:
                        break  # a later tier copies from the same source, but keep order: stop here
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def promote_one(self, step_dir: Path, tier: Tier) -> PromotionResult:
        """Copy one committed step dir to one tier with retries, verified; never raises."""
        start = self.clock()
        attempts = 0
        try:
            manifest = load_manifest(step_dir)
        except CkptsupError as err:
            return PromotionResult(step=-1, tier=tier.name, ok=False, error=str(err))
        retrying = Retrying(stop=stop_after_attempt(self.retries),
                            wait=wait_exponential(multiplier=self.wait_initial_s, max=self.wait_max_s),
                            retry=retry_if_exception(_worth_retrying),
                            sleep=self.sleep, reraise=False)
        try:
            for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    tier.put(step_dir)
                    if not tier.has_copy(manifest.step, manifest):
                        raise OSError(f"{tier.name}: copy of step {manifest.step} does not match its manifest after put")
        except RetryError as err:
            last = err.last_attempt.exception()
            return PromotionResult(step=manifest.step, tier=tier.name, ok=False, attempts=attempts,
                                   duration_s=self.clock() - start, error=_one_line(last))
        except CkptsupError as err:
            return PromotionResult(step=manifest.step, tier=tier.name, ok=False, attempts=attempts,
                                   duration_s=self.clock() - start, error=str(err))
        return PromotionResult(step=manifest.step, tier=tier.name, ok=True, attempts=attempts,
                               duration_s=self.clock() - start, bytes=manifest.total_bytes)

    def _report(self, result: PromotionResult) -> None:
        with self._cond:
            self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)


def _worth_retrying(err: BaseException) -> bool:
    """A tier that is down or flaky may come back; a damaged source or a refusal will not."""
    return isinstance(err, TierError) or not isinstance(err, CkptsupError)


def _one_line(err: BaseException | None) -> str:
    if err is None:
        return "unknown error"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
