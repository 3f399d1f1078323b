"""What of a Lightning Trainer goes into a ckptsup checkpoint besides model and optimizers: each an
object with state_dict/load_state_dict, passed to attach() as the scheduler or an extra."""

from __future__ import annotations

from typing import Any


class Schedulers:
    """Every LR scheduler of `trainer.lr_scheduler_configs`, in order."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def _schedulers(self) -> list[Any]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self._schedulers()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from ..errors import CheckpointError

        saved, live = state.get("schedulers", []), self._schedulers()
        if len(saved) != len(live):
            raise CheckpointError(f"the checkpoint has {len(saved)} LR scheduler(s), configure_optimizers returns "
                                  f"{len(live)}; resume with the same configure_optimizers")
        for scheduler, scheduler_state in zip(live, saved):
            scheduler.load_state_dict(scheduler_state)


class FitLoop:
    """Lightning's fit-loop position (epoch, batch, optimizer-step and val progress counters,
    `_batches_that_stepped`), loaded the way Lightning's own `restore_loops` does: before
    `fit_loop.run()`, which then restarts mid-epoch, at an epoch's end, or at its start."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class Callbacks:
    """The Trainer's callbacks' own `state_dict`s (EarlyStopping's counters, ...), keyed by their
    `state_key` as in a Lightning checkpoint."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for callback in self.trainer.callbacks:
            state = callback.state_dict()
            if state:
                states[str(callback.state_key)] = state
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for callback in self.trainer.callbacks:
            saved = state.get(str(callback.state_key))
            if saved:
                callback.load_state_dict(dict(saved))


class Precision:
    """The precision plugin's state (a GradScaler's scale with 16-bit mixed precision; empty otherwise)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trainer.precision_plugin.state_dict() or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:   # an empty state (no scaler when saved) would fail a GradScaler's load
            self.trainer.precision_plugin.load_state_dict(state)
