"""ckptsup for the Hugging Face Trainer (transformers + accelerate): ckptsup keeps the checkpoints.

    from ckptsup.integrations.hf import CkptsupCallback, resume_path

    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"),
                      train_dataset=data, callbacks=[CkptsupCallback()])
    trainer.train(resume_from_checkpoint=resume_path(trainer))   # None on a fresh start

How it fits HF (transformers 5.24, accelerate 1.15; docs/integrations.md):
- `resume_path(trainer)`, evaluated before `train()` starts: rank 0 picks the checkpoint the
  resume will load (the memory tier's newest copy every rank holds when no usable disk checkpoint
  is newer, as Run.resume decides; else CKPTSUP_RESUME_FROM, then the newest committed; a corrupt
  one is quarantined and the previous tried), reads the TrainerState saved in it (verified: hf_state.py)
  and broadcasts the choice; every rank writes `<checkpoint_dir>/hf_resume/rank<r>/
  trainer_state.json` and gets that folder. HF derives its data skip from it (accelerate's
  `skip_first_batches` on its DataLoaderShard). Its own loading from the folder is made harmless:
  optimizer, scheduler, scaler and RNG files are absent, and HF only loads what exists; the model
  weights loader (`Trainer._load_from_checkpoint`, which raises on a folder without weights) is
  skipped for that one folder on this trainer instance.
- `on_train_begin` (HF has created optimizer and scheduler, no batch drawn yet): attach with the
  model HF trains (DDP-wrapped), the optimizer inside accelerate's wrapper, the scheduler and the
  TrainerState as an extra; the loader is not attached (HF's skip is the data position); then the
  resume, pinned to the checkpoint `resume_path` chose, restores model, optimizer, scheduler,
  TrainerState and every rank's RNG. The RNG goes back where HF's own resume puts it: at an epoch
  boundary before the epoch's loader iterator, mid-epoch after the first batch past the skip
  (on_step_begin), so a resumed run draws what the uninterrupted one drew.
- every optimizer step, `on_step_end`: `run.step_done(global_step - 1, loss=...)`: heartbeat,
  NaN check, saves, preemption stops. The loss is the sum of the step's micro-batch losses as
  `Trainer.training_step` returned them (resume_path wraps it on the instance; HF itself gives
  callbacks no per-step loss, and its logged loss filters NaN out with logging_nan_inf_filter).
- `evaluate()` and `predict()`: an eval phase (hooks/phase.py) from the step whose `should_evaluate`
  is set (`on_step_end`, `on_epoch_end`; else the first `on_prediction_step`) to `on_evaluate` /
  `on_predict`, with a heartbeat per batch: `[supervisor] eval_timeout_s` applies, not the hang timeout.
- `on_train_end`: close (final checkpoint). An exception out of train(): the run says bye as a
  failure at interpreter exit. A preemption: the ranks stop at an agreed step and exit PREEMPTED
  (SystemExit, which neither HF nor accelerate catches).
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from ..env import ExitStatus, RankEnv
from ..errors import CheckpointError, ConfigError
from ..hooks.memory_tier import newest_common
from ..hooks.phase import Hold
from ..wire import Phase
from .hf_state import (STATE_EXTRA, Choice, TrainerStateExtra, choose_checkpoint, held_steps, hf_folders, memory_client,
                       prefer_hf_folder, prefer_memory, read_memory_trainer_state, write_state_folder)

log = logging.getLogger("ckptsup.integrations.hf")

_NOT_CALLED = object()

try:
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover - the module is importable without the extra, useless without it
    _Base = object   # type: ignore[assignment,misc]


class CkptsupCallback(_Base):
    """ckptsup as the Trainer's checkpointer. Options (keyword-only) are attach()'s:
    checkpoint_dir, save_every_steps, save_every_s and any [checkpoint] key."""

    def __init__(self, *, checkpoint_dir: str | None = None, save_every_steps: int | None = None,
                 save_every_s: float | None = None, **overrides: Any) -> None:
        if _Base is object:
            raise ConfigError("ckptsup.integrations.hf needs transformers: pip install 'ckptsup[hf]'")
        self.options = {"checkpoint_dir": checkpoint_dir, "save_every_steps": save_every_steps,
                        "save_every_s": save_every_s, **overrides}
        self.run: Any = None
        self.trainer: Any = None          # set by resume_path
        self.choice: Any = _NOT_CALLED    # resume_path's Choice
        self.rng: Any = None              # loaded RNG, re-applied where HF's own resume applies it
        self.rng_mid_epoch = False
        self.loss: Any = None             # this step's micro-batch losses, summed (resume_path's tap)
        self.logged_loss: Any = None      # without the tap: the last logged loss
        self.recorder: Any = None          # HF's checkpoint-N folders' manifests (framework_ckpt.py)
        self.eval = Hold(Phase.EVAL)      # evaluate() and predict()

    # ---- lifecycle ----------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **_: Any) -> None:
        from ..hooks.session import attach

        self._check_args(args)
        wrapped = getattr(self.trainer, "model_wrapped", None) or model
        self.run = attach(model=wrapped, optimizer=_inner_optimizer(optimizer), lr_scheduler=lr_scheduler,
                                  dataloader=None, extra={STATE_EXTRA: TrainerStateExtra(state)},
                                  **{k: v for k, v in self.options.items() if v is not None})
        atexit.register(self._fail_if_open)
        choice = self._agreed_choice()
        if self.run.rank == 0:
            for path, reason in choice.rejected:
                self.run._reject(Path(path), CheckpointError(reason))   # quarantined already: reported here
            self._report_hf_folders(choice)
        if choice.framework:
            self.run.resume(candidates=[])   # HF loaded its own newer checkpoint-N: nothing of ckptsup's to load
            return
        if choice.memory_step is not None:   # the memory copy resume_path read HF's TrainerState from
            step = self.run.resume(candidates=[], memory_step=choice.memory_step)
        else:
            step = self.run.resume(candidates=[choice.path] if choice.path else [])
        if step != choice.step:
            # HF has positioned its data for choice.step; a checkpoint rejected only now (a shard
            # whose hash fails while loading) is quarantined, and the next attempt resumes from
            # the one before it
            self.run._shutdown(status=int(ExitStatus.FAILURE))
            raise CheckpointError(f"{Path(choice.path or '').name} was rejected while loading, after HF had positioned "
                                  "its data for it; it is quarantined and the restart resumes from the previous one")
        if step > 0:
            from ..hooks.state import capture_rng

            self.rng = capture_rng()
            self.rng_mid_epoch = _resumes_mid_epoch(args, state, train_dataloader)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.rng is not None and not self.rng_mid_epoch:
            self._restore_rng()   # HF: at a boundary, before the epoch's iterator

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.rng is not None:
            self._restore_rng()   # HF: mid-epoch, after the first batch past the skip

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.run is None:
            return
        loss, self.loss = self.loss, None
        if loss is None:
            loss, self.logged_loss = self.logged_loss, None
        self.run.step_done(state.global_step - 1, loss=loss)
        if getattr(control, "should_evaluate", False):
            self.eval.enter()   # HF evaluates right after this hook: the phase from its first batch on

    # ---- evaluate() / predict(): an eval phase with a heartbeat per batch (hooks/phase.py) ------
    def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if getattr(control, "should_evaluate", False):
            self.eval.enter()   # eval_strategy="epoch"

    def on_prediction_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.eval.beat()        # entered here when no hook above saw it coming (evaluate() called directly)

    def on_evaluate(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.eval.leave()

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **_: Any) -> None:
        self.eval.leave()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if self.trainer is None and logs and "loss" in logs:
            self.logged_loss = logs["loss"]   # no tap (resume_path not called): per logging_steps only

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.run is not None:
            self.run.close()

    # ---- HF's own checkpoint-N folders (save_strategy other than "no") --------------------------
    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        """HF wrote output_dir/checkpoint-<global_step> (every rank its part): once every rank is
        past its save, rank 0 records the folder's hashes and forgets the folders HF rotated away."""
        if self.run is None:
            return
        self.run.all_ok(True)   # a barrier: each rank writes its own rng_state file
        if self.run.rank != 0:
            return
        recorder = self.recorder_for(self.run.settings)
        output_dir = Path(args.output_dir)
        folder = output_dir / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            recorder.record_quietly(folder, int(state.global_step))
        recorder.forget_missing(output_dir, [f.name for _, f in hf_folders(output_dir)])

    def recorder_for(self, settings: Any) -> Any:
        from .framework_ckpt import FrameworkCheckpoints

        if self.recorder is None:
            self.recorder = FrameworkCheckpoints(settings.checkpoint_dir, settings.hash_algorithm)
        return self.recorder

    def _report_hf_folders(self, choice: Choice) -> None:
        from ..events import Event

        for name, step, reason, where in choice.external:
            self.run.reporter.emit(Event.CHECKPOINT_REJECTED, step=step, level=1, external=name, reason=reason[:400],
                                   quarantined=where)
        if choice.framework and choice.path:
            name = Path(choice.path).name
            self.run.reporter.emit(Event.CHECKPOINT_VALIDATED, step=choice.step, level=1, external=name,
                                   checked=choice.framework)
            self.run.reporter.emit(Event.CHECKPOINT_LOADED, step=choice.step, path=choice.path, load_s=0.0,
                                   source="shared", files_by_source={"shared": 1}, external=name)

    # ---- helpers ------------------------------------------------------------------------------
    def _agreed_choice(self) -> Choice:
        if self.choice is not _NOT_CALLED:
            return self.choice
        # resume_path was not called: fine on a fresh start, wrong when there is something to resume
        found = self.run._broadcast(self.run._candidates() if self.run.rank == 0 else None)
        if found:
            self.run._shutdown(status=int(ExitStatus.USAGE))
            raise ConfigError(f"there is a ckptsup checkpoint to resume ({found[0].path}) but train() was not given it: call "
                              "trainer.train(resume_from_checkpoint=ckptsup.integrations.hf.resume_path(trainer))")
        return Choice()

    def _restore_rng(self) -> None:
        from ..hooks.state import restore_rng

        restore_rng(*self.rng)
        self.rng = None

    def _check_args(self, args: Any) -> None:
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            raise ConfigError("CkptsupCallback does not support DeepSpeed (its engine loads its own checkpoints); "
                              "use DDP or FSDP, or drop the callback")
        if getattr(args, "ignore_data_skip", False):
            log.warning("ckptsup: TrainingArguments(ignore_data_skip=True): a resumed run restarts its epoch's data")

    def _fail_if_open(self) -> None:
        if self.run is not None and not self.run.closed:
            self.run._shutdown(status=int(ExitStatus.FAILURE))

    def tap_loss(self, loss: Any) -> None:
        if loss is not None:
            loss = loss.detach() if hasattr(loss, "detach") else loss
            self.loss = loss if self.loss is None else self.loss + loss


def resume_path(trainer: Any) -> str | None:
    """The folder to pass as train(resume_from_checkpoint=...): None on a fresh start. Collective:
    every rank calls it (rank 0 decides, every rank gets the same choice)."""
    callback = _find_callback(trainer)
    callback.trainer = trainer
    _tap_training_step(trainer, callback)
    settings, env = _settings(callback)
    # the memory tier first, as Run.resume: the newest copy every rank's agent (or its peers) holds
    client = memory_client(settings, env, _rank())
    common = newest_common(_all_gather(held_steps(client)))
    recorder = callback.recorder_for(settings)

    def decide() -> Choice:
        choice = prefer_memory(choose_checkpoint(settings.checkpoint_dir, env.resume_from), common,
                               lambda step: read_memory_trainer_state(client, step))
        if hf_saves(trainer.args):   # HF's own checkpoint-N folders too: the newest valid of either kind
            choice = prefer_hf_folder(choice, Path(trainer.args.output_dir), recorder)
        return choice

    choice = _broadcast(decide)
    if choice.error:
        raise CheckpointError(choice.error)
    callback.choice = choice
    if choice.path is None:
        return None
    if choice.framework:   # HF's own folder, newer than ckptsup's: HF loads all of it itself
        log.info("ckptsup: resuming HF from its own %s (global_step %d, validated: %s)", choice.path, choice.step,
                 choice.framework)
        return choice.path
    if choice.state is None:   # choose_checkpoint reads the state of what it picks
        raise CheckpointError(f"{choice.path}: chosen without its TrainerState; move it aside or report a bug")
    folder = write_state_folder(settings.checkpoint_dir, _rank(), choice.state)
    _skip_weights_load(trainer, folder)
    log.info("ckptsup: resuming HF from %s (global_step %d) through %s", choice.path, choice.step, folder)
    return str(folder)


def hf_saves(args: Any) -> bool:
    """HF writes checkpoint-N folders of its own (save_strategy "steps", "epoch", "best")."""
    return str(getattr(args, "save_strategy", "no")).lower() not in ("no", "savestrategy.no")


def _find_callback(trainer: Any) -> CkptsupCallback:
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", []):
        if isinstance(callback, CkptsupCallback):
            return callback
    raise ConfigError("resume_path(trainer): the trainer has no CkptsupCallback; pass "
                      "callbacks=[ckptsup.integrations.hf.CkptsupCallback()] to Trainer(...)")


def _settings(callback: CkptsupCallback) -> tuple[Any, RankEnv]:
    from ..hooks.settings import resolve_settings

    env = RankEnv.from_environ()
    o = dict(callback.options)
    settings = resolve_settings(env=env, checkpoint_dir=o.pop("checkpoint_dir"), save_every_steps=o.pop("save_every_steps"),
                                save_every_s=o.pop("save_every_s"), overrides={k: v for k, v in o.items() if v is not None})
    return settings, env


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(decide: Any) -> Choice:
    """Rank 0 decides; the others receive (the Trainer has initialised torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _skip_weights_load(trainer: Any, folder: Path) -> None:
    """HF's weights loader raises on a folder without weights; ckptsup restores them itself in
    on_train_begin. Only this folder is skipped, only on this trainer (an instance attribute)."""
    original = trainer._load_from_checkpoint
    ours = str(folder.resolve())

    def load_unless_ours(resume_from_checkpoint: str, model: Any = None) -> None:
        if str(Path(resume_from_checkpoint).resolve()) == ours:
            return
        original(resume_from_checkpoint, model)

    trainer._load_from_checkpoint = load_unless_ours


def _tap_training_step(trainer: Any, callback: CkptsupCallback) -> None:
    """Every micro-batch loss that Trainer.training_step returns (the public override point) goes
    to the callback; once per trainer instance."""
    if getattr(trainer, "_ckptsup_tapped", False):
        return
    step = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        loss = step(*args, **kwargs)
        callback.tap_loss(loss)
        return loss

    trainer.training_step = training_step
    trainer._ckptsup_tapped = True


def _inner_optimizer(optimizer: Any) -> Any:
    """accelerate's AcceleratedOptimizer wraps the torch optimizer; DCP's state-dict helpers want
    the torch one (their first-load initialisation steps it, which the wrapper would gate)."""
    return getattr(optimizer, "optimizer", optimizer) if type(optimizer).__name__ == "AcceleratedOptimizer" else optimizer


def _resumes_mid_epoch(args: Any, state: Any, loader: Any) -> bool:
    """Whether HF's resume skips batches into an epoch (as Trainer._init_training_state decides)."""
    if getattr(args, "ignore_data_skip", False):
        return False
    gas = max(1, int(getattr(args, "gradient_accumulation_steps", 1)))
    try:
        batches = len(loader)
    except TypeError:
        batches = 0
    per_epoch = max(batches // gas + int(batches % gas > 0), 1) if batches else max(1, int(state.max_steps))
    return state.global_step % per_epoch != 0
