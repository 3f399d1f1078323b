"""After a restore, is the loss where it was? (docs/sdc.md §After a restore). Pure.

A resume from a checkpoint replays steps the job already ran: with the whole training state
restored (ckptsup saves model, optimizer, data position, RNG and scheduler), rank 0's loss at a
replayed step is the one it had before the failure, to the last bit on a deterministic run and
within a few per cent otherwise. A wrong restore — another run's weights, a layer re-initialised
after loading, the optimizer left behind — shows as a jump. It is a warning, never a kill: the
supervisor cannot know better than the script which loss is right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

CHECK_STEPS = 5          # the first replayed steps compared after a restore
SAME_STEP_RATIO = 0.10   # |after - before| / |before| at the same step: beyond it, a jump
WINDOW_FACTOR = 2.0      # a step not seen before: beyond 2 x the window's largest (per-batch losses are
                         # noisy: a mean would warn on a healthy resume). Never below: training lowers the
                         # loss, and a wrong restore (fresh weights, a lost optimizer) raises it; a low side
                         # warned on a correct resume on the dev cluster (0.107 after a window down to 0.335)
KEEP_STEPS = 256         # rank 0's losses kept across attempts


@dataclass(frozen=True, kw_only=True)
class LossJump:
    step: int
    loss: float
    before: float
    basis: str          # "same step" | "window"

    @property
    def detail(self) -> str:
        what = f"step {self.step} had loss {self.before:.6g} before the failure" if self.basis == "same step" else \
            f"the last 20 losses before the failure reached {self.before:.6g}"
        return (f"after the restore rank 0's loss at step {self.step} is {self.loss:.6g}; {what}: was the whole "
                "training state restored? (a warning: training goes on)")


def loss_jump(before: Mapping[int, float], step: int, loss: float) -> LossJump | None:
    """`before`: rank 0's losses by step from earlier attempts; `loss`: at `step` after a restore."""
    if not math.isfinite(loss) or not before:
        return None
    if step in before:
        then = before[step]
        if abs(loss - then) > SAME_STEP_RATIO * max(abs(then), 1e-12):
            return LossJump(step=step, loss=loss, before=then, basis="same step")
        return None
    high = max(before[s] for s in sorted(before)[-20:])
    if high > 0 and loss > WINDOW_FACTOR * high:
        return LossJump(step=step, loss=loss, before=high, basis="window")
    return None


def keep(losses: Mapping[int, float], newer: Mapping[int, float]) -> dict[int, float]:
    """The earlier attempts' losses with an attempt's own on top, the newest KEEP_STEPS steps."""
    merged = {**losses, **newer}
    return {s: merged[s] for s in sorted(merged)[-KEEP_STEPS:]}
