"""What happens to a checkpoint after its commit, off the training thread
(docs/training.md §Saving): promotion to slower tiers, retention on every tier, and level-3 test
loads (every Nth commit and before a checkpoint becomes a daily keeper). One object, one call per
commit:

    keeper = Housekeeper.from_config(config, checkpoint_dir=..., job_id=..., emit=send_event)
    keeper.after_commit(step_dir)     # from the writer's background thread, after commit()
    keeper.close(timeout_s=...)       # at run.close(): drain promotions and test loads

Events go out through `emit(Event, fields)` (the hooks or agent forward them to the supervisor):
checkpoint_promoted, checkpoint_validated, checkpoint_rejected. A checkpoint that fails its
test load is quarantined (moved, never deleted), so resume falls back to the previous one.
Retention never deletes what is queued for promotion or being test-loaded.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import CkptsupError
from ..events import Event
from .catalog import list_checkpoints
from .commit import parse_step
from .promote import Promoter, PromotionResult
from .retention import apply_retention, apply_tier_retention
from .tiers import Tier, TierKind, tiers_from_config
from .validate import DEFAULT_TESTLOAD_TIMEOUT_S, quarantine, validate

Emit = Callable[[Event, dict[str, Any]], None]
log = logging.getLogger(__name__)


class Housekeeper:
    def __init__(self, *, checkpoint_dir: str | Path, slower_tiers: Sequence[Tier] = (), keep_last: int = 3,
                 keep_daily_days: int = 14, test_load_every: int = 5, promote_queue_size: int = 4,
                 promote_retries: int = 5, emit: Emit | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 testload_command: Sequence[str] | None = None,
                 testload_timeout_s: float = DEFAULT_TESTLOAD_TIMEOUT_S, promote_wait_initial_s: float = 1.0) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.slower_tiers = list(slower_tiers)
        self.keep_last = keep_last
        self.keep_daily_days = keep_daily_days
        self.test_load_every = test_load_every
        self.emit = emit or (lambda event, fields: None)
        self.clock = clock
        self.testload_command = testload_command
        self.testload_timeout_s = testload_timeout_s
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()   # the writer's and the promoter's threads both prune
        self._commits = 0
        self._testing: set[int] = set()
        self._tested: set[int] = set()
        self._rejected: set[int] = set()
        self._tests: queue.Queue[Path | None] = queue.Queue()
        self.promoter: Promoter | None = None
        if self.slower_tiers:
            self.promoter = Promoter(destinations=self.slower_tiers, queue_size=promote_queue_size, retries=promote_retries,
                                     on_result=self._promoted, wait_initial_s=promote_wait_initial_s).start()
        # started last: the thread sees a fully built object
        self._tester = threading.Thread(target=self._test_loop, name="ckptsup-testload", daemon=True)
        self._tester.start()

    @classmethod
    def from_config(cls, config: Any, *, checkpoint_dir: str | Path, node: str = "", job_id: str = "",
                    emit: Emit | None = None) -> "Housekeeper":
        """From a config.Config: slower tiers are those after the shared one (S3 when set)."""
        tiers = tiers_from_config(config.storage, shared_dir=checkpoint_dir, node=node, job_id=job_id)
        slower = [t for t in tiers if t.kind is TierKind.OBJECT]
        ck = config.checkpoint
        return cls(checkpoint_dir=checkpoint_dir, slower_tiers=slower, keep_last=ck.keep_last,
                   keep_daily_days=ck.keep_daily_days, test_load_every=ck.test_load_every,
                   promote_queue_size=config.storage.promote_queue_size, promote_retries=config.storage.promote_retries,
                   emit=emit)

    # ---- the one call per commit ----------------------------------------------------------

    def after_commit(self, step_dir: str | Path) -> None:
        step_dir = Path(step_dir)
        step = parse_step(step_dir.name)
        with self._lock:
            self._commits += 1
            due = self.test_load_every > 0 and self._commits % self.test_load_every == 0
        if self.promoter is not None:
            self.promoter.submit(step_dir, step=step)
        if due and step is not None:
            self._queue_test(step_dir, step)
        self.run_retention()

    def protected(self) -> set[int]:
        with self._lock:
            busy = set(self._testing)
        return busy | (self.promoter.in_flight() if self.promoter is not None else set())

    def run_retention(self) -> list[int]:
        """Retention on the shared tier; daily keepers without a level-3 pass get one queued.
        Returns the steps deleted."""
        with self._retention_lock:
            result = apply_retention(self.checkpoint_dir, keep_last=self.keep_last, keep_daily_days=self.keep_daily_days,
                                     clock=self.clock, protected=self.protected())
        with self._lock:
            busy = bool(self._testing)
        # one test load at a time is enough: a burst of commits would queue one each (and
        # close() waits for the queue); what is still due is found again by the next pass
        for step in [] if busy else result.needs_test_load[:1]:
            self._queue_test(self.checkpoint_dir / f"step_{step}", step)
        return result.deleted

    # ---- promotion results -> events, slower-tier retention ---------------------------------

    def _promoted(self, result: PromotionResult) -> None:
        self.emit(Event.CHECKPOINT_PROMOTED, result.event_fields())
        if not result.ok:
            return
        tier = next((t for t in self.slower_tiers if t.name == result.tier), None)
        if tier is None:
            return
        with self._lock:
            rejected = result.step in self._rejected
        if rejected:   # its test load failed while it was being copied: the copy must not stay
            self._drop_copies(result.step)
            return
        validated = {i.step for i in list_checkpoints(self.checkpoint_dir) if i.validated_level >= 2}
        try:
            with self._retention_lock:
                apply_tier_retention(tier, keep_last=self.keep_last, keep_daily_days=self.keep_daily_days, clock=self.clock,
                                     validated=validated, protected=self.protected())
            self.run_retention()   # what waited for this promotion may go from the shared tier now
        except (CkptsupError, OSError) as err:
            # retention is housekeeping: a failure costs space, never data; say so and go on
            log.warning("ckptsup: retention on tier %s failed: %s", tier.name, str(err).splitlines()[0][:300])

    # ---- level-3 test loads, one at a time --------------------------------------------------

    def _queue_test(self, step_dir: Path, step: int) -> None:
        with self._lock:
            if step in self._testing or step in self._tested:
                return
            self._testing.add(step)
        self._tests.put(step_dir)

    def _test_loop(self) -> None:
        while True:
            step_dir = self._tests.get()
            if step_dir is None:
                return
            step = parse_step(step_dir.name)
            try:
                if step_dir.is_dir():
                    self._test_one(step_dir, step)
            finally:
                with self._lock:
                    if step is not None:   # only step_<N> dirs are queued
                        self._testing.discard(step)
                        self._tested.add(step)
                self._tests.task_done()

    def _test_one(self, step_dir: Path, step: int | None) -> None:
        result = validate(step_dir, level=3, testload_command=self.testload_command, testload_timeout_s=self.testload_timeout_s)
        if result.ok:
            self.emit(Event.CHECKPOINT_VALIDATED, {"step": step, "level": 3, "duration_s": round(result.duration_s, 3)})
            return
        reason = result.problems[0] if result.problems else "test load failed"
        if result.untrusted:   # owner/mode: not a verdict on the content, never quarantined
            log.warning("ckptsup: step %s was not test-loaded (not quarantined): %s", step, reason)
            return
        if step is not None:
            with self._lock:
                self._rejected.add(step)
            self._drop_copies(step)
        try:
            moved = str(quarantine(step_dir, reason))
        except (CkptsupError, OSError) as err:
            log.warning("ckptsup: could not quarantine %s (%s); it failed: %s", step_dir, err, reason)
            moved = ""
        self.emit(Event.CHECKPOINT_REJECTED, {"step": step, "level": result.level_passed + 1, "reason": reason,
                                              "quarantined_to": moved})

    def _drop_copies(self, step: int) -> None:
        """Remove a rejected checkpoint's copies from the slower tiers; the original stays in
        quarantine, so nothing is lost, and no tier offers it for a restore."""
        for tier in self.slower_tiers:
            try:
                if step in tier.list_steps():
                    tier.delete(step)
            except (CkptsupError, OSError) as err:
                log.warning("ckptsup: could not remove rejected step %d from tier %s: %s", step, tier.name, err)

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain promotions (up to timeout_s) and pending test loads; True when all finished."""
        drained = self.promoter.close(timeout_s) if self.promoter is not None else True
        self._tests.put(None)
        self._tester.join(timeout=timeout_s)
        self.run_retention()
        return drained and not self._tester.is_alive()
