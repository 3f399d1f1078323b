"""ckptsup as Lightning's checkpointer: `Trainer(callbacks=[CkptsupCallback()])`.

    trainer = lightning.pytorch.Trainer(..., callbacks=[CkptsupCallback()])
    trainer.fit(model, datamodule)      # ckptsup resumes from its newest validated checkpoint

Lightning's own ModelCheckpoint may stay on: its .ckpt files are hashed at write and validated
before Lightning resumes from one (setup(): lightning_ckpt.py); the newest valid of either kind wins.

The callback (docs/integrations.md §Lightning; the hooks' own rules in docs/training.md):
- on_fit_start (the strategy has wrapped the model, the optimizers and schedulers exist): attach
  with the DDP-wrapped model (so the comm-hook timer measures compute time), every optimizer,
  every LR scheduler, Lightning's fit-loop position, the callbacks' and precision plugin's state,
  the DataModule's state and on_save_checkpoint extras (lightning_state.Hooks) and the data
  position; then resume, before `fit_loop.run()` reads the loop state;
- on_train_start (the train loader and its iterator exist; Lightning's signal handlers are in):
  the data position (lightning_data.py), ckptsup's SIGTERM/USR1/HUP handlers back in place of
  Lightning's, and the RNG restored again, undoing what setup_data drew since the resume;
- on_train_batch_end: `step_done(trainer.global_step - 1, loss=)` once per optimizer step (with
  gradient accumulation the accumulated batches' worst loss is checked at the step);
- on_validation_start/_batch_end/_end (and test, predict): an eval phase (hooks/phase.py) with a
  heartbeat per batch, so `[supervisor] eval_timeout_s` applies, not the hang timeout;
- on_fit_end: the final checkpoint and a clean end, or, after a stop signal, a preemption exit;
  on_exception: shut down as failed, no checkpoint of a broken state.
"""

from __future__ import annotations

import logging
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package; its Trainer calls the same hooks
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]  # the same hooks, another package

from ..env import ExitStatus
from ..errors import ConfigError
from ..wire import Phase
from ..hooks.phase import Hold
from ..hooks.rank_link import is_finite
from ..hooks.signals import STOP_SIGNALS
from . import lightning_data as data
from .lightning_state import Callbacks, FitLoop, Hooks, Precision, Schedulers

log = logging.getLogger("ckptsup.integrations.lightning")

# Lightning warns on a mid-epoch resume of a loader without state_dict; ckptsup restores its position
_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


class CkptsupCallback(Callback):
    """No required arguments. Keyword options go to ckptsup.attach: checkpoint_dir,
    save_every_steps, save_every_s and any other [checkpoint] key."""

    ckptsup_own = True   # lightning_state.Callbacks leaves this one out

    def __init__(self, *, checkpoint_dir: str | None = None, save_every_steps: int | None = None,
                 save_every_s: float | None = None, **attach_options: Any) -> None:
        super().__init__()
        self.attach_options = {"checkpoint_dir": checkpoint_dir, "save_every_steps": save_every_steps,
                               "save_every_s": save_every_s, **attach_options}
        self.run: Any = None
        self.resumed_step = 0
        self.data = data.DataPosition()
        self._rng_after_resume: Any = None
        self._stop_handlers: dict[int, Any] = {}
        self._last_global_step = 0
        self._loss: Any = None
        self._eval = Hold(Phase.EVAL)      # validation, test and predict loops
        self._pick: Any = None             # lightning_ckpt.Pick: the .ckpt Lightning loaded instead, if any
        self._recorder: Any = None         # the .ckpt files' manifests (framework_ckpt.py)

    # ---- Lightning's own .ckpt files (lightning_ckpt.py) ----------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before Lightning restores a ckpt_path: hashes of each .ckpt recorded at write, and the
        resume's choice between a validated .ckpt and ckptsup's own checkpoint."""
        from . import lightning_ckpt
        from .framework_ckpt import FrameworkCheckpoints

        if stage != "fit" or self._recorder is not None:
            return
        settings, env = self._settings()
        self._recorder = FrameworkCheckpoints(settings.checkpoint_dir, settings.hash_algorithm)
        if not isinstance(trainer.strategy.checkpoint_io, lightning_ckpt.RecordingIO):
            trainer.strategy.checkpoint_io = lightning_ckpt.RecordingIO(trainer.strategy.checkpoint_io, self._recorder)

        def decide(requested: str, weights_only: Any) -> Any:
            from .resume_choice import broadcast, ckptsup_newest_step, rank

            newest = ckptsup_newest_step(settings, env)   # collective (the memory tier's held steps)

            def test_load(path: Any) -> int:
                return int(trainer.strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only)["global_step"])

            return broadcast(lambda: lightning_ckpt.pick(requested, self._recorder, newest, test_load)
                             if rank() == 0 else None)

        lightning_ckpt.guard_resume(trainer, decide, lambda choice: setattr(self, "_pick", choice))

    def _settings(self) -> tuple[Any, Any]:
        from ..env import RankEnv
        from ..hooks.settings import resolve_settings

        env = RankEnv.from_environ()
        o = dict(self.attach_options)
        settings = resolve_settings(env=env, checkpoint_dir=o.pop("checkpoint_dir"),
                                    save_every_steps=o.pop("save_every_steps"), save_every_s=o.pop("save_every_s"),
                                    overrides={k: v for k, v in o.items() if v is not None})
        return settings, env

    def state_dict(self) -> dict[str, Any]:
        """In Lightning's own .ckpt: the data position, so a resume from a .ckpt continues the epoch."""
        return {"data": self.data.state_dict()} if self.data.samplers else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data"):
            self.data.load_state_dict(state["data"])

    # ---- fit start: attach and resume ---------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from ..hooks.session import attach
        from ..hooks.state import capture_rng

        if trainer.checkpoint_callbacks and trainer.is_global_zero:
            log.info("ckptsup: Lightning's ModelCheckpoint writes .ckpt files beside ckptsup's checkpoints; ckptsup "
                     "records their hashes and validates one before Lightning resumes from it")
        optimizers = list(trainer.optimizers)
        optimizer = None if not optimizers else optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
        self.data.batches_done = lambda: int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        extra = {"lightning_fit_loop": FitLoop(trainer), "lightning_data": self.data,
                 "lightning_callbacks": Callbacks(trainer), "lightning_precision": Precision(trainer),
                 "lightning_hooks": Hooks(trainer)}
        self.run = attach(model=trainer.strategy.model, optimizer=optimizer, lr_scheduler=Schedulers(trainer),
                          extra=extra, **{k: v for k, v in self.attach_options.items() if v is not None})
        if threading.current_thread() is threading.main_thread():
            self._stop_handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        pick = self._pick
        if pick is not None and trainer.is_global_zero:
            self._report(pick)
        if pick is not None and pick.path:
            self.resumed_step = self.run.resume(candidates=[])   # Lightning loaded a newer .ckpt
        else:
            self.resumed_step = self.run.resume()
        if self.resumed_step > 0:
            if trainer.ckpt_path and pick is None:   # a ckpt_path ckptsup could not weigh (not a local file)
                raise ConfigError(f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) and ckptsup's checkpoint of step "
                                  f"{self.resumed_step} both want to restore the run; drop ckpt_path (ckptsup resumes)")
            if trainer.global_step != self.resumed_step:
                log.warning("ckptsup: resumed step %d but Lightning's global_step is %d (optimizer steps per "
                            "batch other than one?)", self.resumed_step, trainer.global_step)
            self._rng_after_resume = capture_rng()
        self._last_global_step = trainer.global_step

    def _report(self, pick: Any) -> None:
        from ..events import Event

        for name, step, reason, where in pick.rejected:
            self.run.reporter.emit(Event.CHECKPOINT_REJECTED, step=step, level=1, external=name, reason=reason[:400],
                                   quarantined=where)
        if pick.path:
            name = Path(pick.path).name
            self.run.reporter.emit(Event.CHECKPOINT_VALIDATED, step=pick.step, level=1, external=name,
                                   checked=pick.checked)
            self.run.reporter.emit(Event.CHECKPOINT_LOADED, step=pick.step, path=pick.path, load_s=0.0,
                                   source="shared", files_by_source={"shared": 1}, external=name)
            log.warning("ckptsup: Lightning resumes from %s (step %d, validated: %s), newer than ckptsup's own "
                        "checkpoints", name, pick.step, pick.checked)

    # ---- train start: data position, signals, RNG ---------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from ..hooks.state import restore_rng

        for signum, handler in self._stop_handlers.items():
            signal.signal(signum, handler)   # Lightning's SIGTERM handler runs a collective in the handler
        self._install_samplers(trainer)
        if self._rng_after_resume is not None:
            restore_rng(*self._rng_after_resume)
            self._rng_after_resume = None

    def _install_samplers(self, trainer: Any) -> None:
        from ..hooks.state import isolate_loader_rng

        combined = trainer.fit_loop._combined_loader
        loaders = list(combined.flattened) if combined is not None else []
        samplers: list[data.LoaderSampler | None] = []
        batch_sizes: list[int] = []
        workers = False
        for loader in loaders:
            plan = data.plan_loader(loader) if len(loaders) == 1 else data.SamplerPlan(
                reason=f"the fit has {len(loaders)} train loaders; ckptsup restores the position of one")
            if not plan.ok:
                if trainer.is_global_zero:
                    warnings.warn(f"ckptsup: the train loader's data position is not restored after a restart: "
                                  f"{plan.reason}", stacklevel=2)
                samplers.append(None)
                batch_sizes.append(0)
                continue
            samplers.append(data.install_sampler(loader, plan))
            batch_sizes.append(int(loader.batch_sampler.batch_size))
            isolate_loader_rng(loader)   # later iterators must not draw from the global RNG
            workers = workers or loader.num_workers > 0
        self.data.track(samplers, batch_sizes)
        self.data.apply()
        if samplers and all(s is not None for s in samplers):
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)
        if workers:
            # worker processes pulled indices from the old sampler when setup_data created the iterator
            iter(trainer.fit_loop._data_fetcher)

    # ---- every batch ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = _loss_of(outputs)
        if self._loss is None or is_finite(self._loss):
            self._loss = loss   # the accumulation window's first non-finite loss is kept
        global_step = trainer.global_step
        if global_step == self._last_global_step:
            return   # accumulating: no optimizer step yet
        self._last_global_step = global_step
        handler = self._stop_handlers.get(signal.SIGTERM)
        if trainer.received_sigterm and callable(handler):
            handler(signal.SIGTERM, None)   # Lightning saw one (ckptsup's flag only): the ranks agree on a stop
        loss, self._loss = self._loss, None
        self.run.step_done(global_step - 1, loss=loss)

    # ---- validation, test, predict: an eval phase with a heartbeat per batch --------------------
    # (hooks/phase.py; a quiet validation pass is not a hang, [supervisor] eval_timeout_s applies)
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval.enter()

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *_: Any, **__: Any) -> None:
        self._eval.beat()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval.leave()

    on_test_start, on_test_batch_end, on_test_end = on_validation_start, on_validation_batch_end, on_validation_end
    on_predict_start, on_predict_batch_end, on_predict_end = (on_validation_start, on_validation_batch_end,
                                                              on_validation_end)

    # ---- the end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        run = self.run
        if run is None or run.closed:
            return
        # a stop signal that came after the last agreement: a preemption, never "done"
        if not run.all_ok(not (run.stop.set or trainer.received_sigterm)):
            run.stop_now(preempted=True)   # emergency save when it fits; SystemExit(PREEMPTED)
        run.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        run = self.run
        if run is None or run.closed:
            return   # ckptsup's own exit (a stop, a NaN) already closed it
        if isinstance(exception, SystemExit) and trainer.received_sigterm:
            # Lightning's SIGTERMException (exit code None, i.e. 0): each rank at its own point, no save
            run.abandon(preempted=True)
            exception.code = int(ExitStatus.PREEMPTED)
            return
        run.__exit__(type(exception), exception, None)


def _loss_of(outputs: Any) -> Any:
    """The loss in what training_step returned (a tensor, or a dict with "loss"); None otherwise."""
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    return outputs if hasattr(outputs, "detach") or isinstance(outputs, (int, float)) else None
