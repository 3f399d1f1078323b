"""Lightning's own `.ckpt` files beside ckptsup's callback (docs/integrations.md §Lightning):
ModelCheckpoint may stay on. Its files are validated in place (framework_ckpt.py):

- at write: the strategy's CheckpointIO is wrapped (`RecordingIO`); after each `.ckpt` save
  (ModelCheckpoint, `trainer.save_checkpoint`: rank 0) its hash and step are recorded, and a
  `.ckpt` Lightning removes (save_top_k) loses its manifest;
- at resume: `trainer.fit(ckpt_path=...)` ("last", "best" or a path) goes through
  `_CheckpointConnector.resume_start`, which is wrapped on this trainer (`guard_resume`): rank 0
  checks the file Lightning picked against its manifest (hashes; none yet: hashed and adopted),
  test-loads it with the strategy's own loader, and moves a bad one out of the folder, then tries
  the older recorded `.ckpt` files of that folder, newest first. The newest valid one of either
  kind wins: when ckptsup's own newest checkpoint (disk or memory) is as new, Lightning loads
  nothing and ckptsup resumes in on_fit_start; else Lightning loads that `.ckpt` and ckptsup does
  not resume. The choice is broadcast; every rank then does what Lightning does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # the standalone package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment]  # the same class, another package

from ..errors import CheckpointError
from .framework_ckpt import FrameworkCheckpoints, Pick, pick

__all__ = ["RecordingIO", "Pick", "pick", "guard_resume"]

log = logging.getLogger("ckptsup.integrations.lightning")


def _local(path: Any) -> bool:
    return path is not None and "://" not in str(path)


class RecordingIO(CheckpointIO):
    """The strategy's CheckpointIO, with each local save's hashes recorded once it is written."""

    def __init__(self, inner: Any, recorder: FrameworkCheckpoints) -> None:
        self.inner = inner
        self.recorder = recorder
        # an async save returns before the file is written: its hashes are taken at resume instead
        self.hash_at_write = not type(inner).__name__.startswith("Async")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        if self.hash_at_write and _local(path):
            self.recorder.record_quietly(Path(path), int(checkpoint.get("global_step", 0)))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        if _local(path):
            self.recorder.forget(Path(path))

    def teardown(self) -> None:
        self.inner.teardown()


def guard_resume(trainer: Any, decide: Callable[[str, Any], Pick], done: Callable[[Pick], None]) -> None:
    """Wrap this trainer's `resume_start` (fit only): `decide` (collective) gives the path to load."""
    connector = trainer._checkpoint_connector
    if getattr(connector, "_ckptsup_guarded", False):
        return
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.FITTING and _local(checkpoint_path):
            choice = decide(str(checkpoint_path), weights_only)
            done(choice)
            if choice.error:
                raise CheckpointError(choice.error)
            checkpoint_path = choice.path
        return original(checkpoint_path, weights_only=weights_only)

    connector.resume_start = resume_start
    connector._ckptsup_guarded = True
