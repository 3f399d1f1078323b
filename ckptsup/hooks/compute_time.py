"""A rank's compute time per step: its step time minus the time it sat blocked in collectives.

Under DDP every rank's step wall time is the same — the gradient all-reduce makes the fast ranks
wait for the slowest — so the supervisor's straggler detection (supervisor/job/stragglers.py)
compares compute times instead. Blocked time, without CUDA-specific hooks:

- DDP's gradient all-reduce, through a comm hook (`allreduce_hook`, DDP's own default arithmetic,
  so the gradients are the same): per step, the time from the last bucket's launch — the end of
  this rank's backward — to the last bucket's completion. Earlier buckets overlap compute.
- ckptsup's own agreement all-reduce at step boundaries (session._sync), timed around the call.

A model that is not DDP, or one whose DDP already has a comm hook (a second registration is
refused), is not measured: its steps carry no `compute_s`, and the supervisor does not compare it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class CommTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.active = False
        self.last_issue: float | None = None
        self.last_done: float | None = None
        self.other_s = 0.0

    def attach(self, model: Any) -> bool:
        """Register the timing comm hook on a DDP model; False when it cannot be measured."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return False
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        timer = self

        def timed(state, bucket):  # noqa: ANN001 - DDP checks a hook's annotations: none is allowed
            with timer.lock:
                timer.last_issue = timer.clock()
            fut = allreduce_hook(state, bucket)

            def done(f: Any) -> Any:
                with timer.lock:
                    timer.last_done = timer.clock()
                return f.value()

            return fut.then(done)

        try:
            model.register_comm_hook(model.process_group, timed)
        except RuntimeError:
            return False   # the script registered its own hook: not ours to replace
        self.active = True
        return True

    def add(self, seconds: float) -> None:
        """Time blocked in a collective of ours (the agreement all-reduce)."""
        with self.lock:
            self.other_s += max(0.0, seconds)

    def take_blocked(self) -> float | None:
        """Seconds blocked since the last call (None when not measured)."""
        if not self.active:
            return None
        with self.lock:
            ddp = 0.0
            if self.last_issue is not None and self.last_done is not None:
                ddp = max(0.0, self.last_done - self.last_issue)
            blocked, self.other_s = ddp + self.other_s, 0.0
            self.last_issue = self.last_done = None
        return blocked
