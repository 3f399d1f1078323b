"""What of a Lightning Trainer goes into a ckptsup checkpoint besides model and optimizers: each an
object with state_dict/load_state_dict, passed to attach() as the scheduler or an extra."""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("ckptsup.integrations.lightning")


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
            if getattr(callback, "ckptsup_own", False):
                continue   # ckptsup's callback: its state is the data position, saved as an extra of its own
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


# what a Lightning checkpoint holds besides the hooks' own keys: given to the hooks, never saved twice
BASE_KEYS = ("epoch", "global_step", "pytorch-lightning_version")


class Hooks:
    """What Lightning's own checkpoint gets from hooks, as `dump_checkpoint` / `restore_*` do it:
    the DataModule's `state_dict` (under its class's `__qualname__`) and every key that
    `LightningModule.on_save_checkpoint` and the callbacks' `on_save_checkpoint` add to the
    checkpoint dict; on load the same dict goes to `on_load_checkpoint` (the module's first, as
    Lightning's restore_model), the DataModule's `load_state_dict`, the callbacks' `on_load_checkpoint`.
    The hooks see `epoch`, `global_step` and the Lightning version, not the weights or optimizer
    states (ckptsup keeps those as DCP shards): a hook that raises (reading `checkpoint["state_dict"]`)
    is warned about once and its keys are missing, the rest is saved. Optional: a checkpoint written
    before this extra existed still loads."""

    optional_extra = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.warned: set[str] = set()

    def _base(self) -> dict[str, Any]:
        import lightning.pytorch as pl

        return {"epoch": self.trainer.current_epoch, "global_step": self.trainer.global_step,
                "pytorch-lightning_version": pl.__version__}

    def _call(self, what: str, hook: Callable[..., Any], *args: Any) -> None:
        try:
            hook(*args)
        except Exception as err:  # noqa: BLE001 - a user hook: its keys are missing, the save/resume goes on
            if what not in self.warned:
                self.warned.add(what)
                log.warning("ckptsup: %s raised %s: %s; what it saves or restores is not in ckptsup's checkpoint "
                            "(its hooks see epoch, global_step and the version, not the weights)",
                            what, type(err).__name__, str(err)[:200])

    def state_dict(self) -> dict[str, Any]:
        trainer, module = self.trainer, self.trainer.lightning_module
        checkpoint = self._base()
        datamodule = trainer.datamodule
        if datamodule is not None:
            state = datamodule.state_dict()
            if state:
                checkpoint[type(datamodule).__qualname__] = state
        for callback in trainer.callbacks:
            self._call(f"{type(callback).__name__}.on_save_checkpoint", callback.on_save_checkpoint, trainer, module,
                       checkpoint)
        self._call(f"{type(module).__name__}.on_save_checkpoint", module.on_save_checkpoint, checkpoint)
        return {key: value for key, value in checkpoint.items() if key not in BASE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer, module = self.trainer, self.trainer.lightning_module
        checkpoint = {**self._base(), **state}
        self._call(f"{type(module).__name__}.on_load_checkpoint", module.on_load_checkpoint, checkpoint)
        datamodule = trainer.datamodule
        if datamodule is not None and type(datamodule).__qualname__ in checkpoint:
            datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])
        for callback in trainer.callbacks:
            self._call(f"{type(callback).__name__}.on_load_checkpoint", callback.on_load_checkpoint, trainer, module,
                       checkpoint)
