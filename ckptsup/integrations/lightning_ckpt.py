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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # the standalone package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment]  # the same class, another package

from ..errors import CheckpointError
from .framework_ckpt import FrameworkCheckpoints

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


@dataclass
class Pick:
    """Rank 0's choice, broadcast: the `.ckpt` Lightning loads (None: none), its step, what was
    refused on the way ((name, step, reason, where it went)) and how the winner was checked."""

    path: str | None = None
    step: int = 0
    rejected: list[tuple[str, int | None, str, str]] = field(default_factory=list)
    checked: str = ""
    error: str | None = None


def pick(requested: str, recorder: FrameworkCheckpoints, ckptsup_step: int,
         test_load: Callable[[Path], int]) -> Pick:
    """Rank 0: the `.ckpt` to load in place of `requested` (Lightning's resolved ckpt_path), or
    None when ckptsup's own checkpoint of `ckptsup_step` is at least as new. `test_load` returns
    the loaded file's global_step or raises."""
    first = Path(requested)
    out = Pick()
    known = recorder.step_of(first)
    if known is not None and known <= ckptsup_step:
        return out   # ckptsup's own is as new: no need to read the file
    candidates = [first] + [p for s, p in recorder.recorded_beside(first) if p != first and (known is None or s <= known)]
    for path in candidates:
        verdict = recorder.verify(path)
        if verdict.step is not None and verdict.step <= ckptsup_step:
            return out
        problems = list(verdict.problems)
        step = verdict.step
        if not problems:
            try:
                step = test_load(path)
            except Exception as err:  # noqa: BLE001 - any failure to load is a bad checkpoint
                lines = [line for line in str(err).splitlines() if line.strip()]
                problems = [f"{path.name}: test load failed: {type(err).__name__}: {(lines[-1] if lines else '')[:200]}"]
        if problems:
            reason = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            out.rejected.append((path.name, step, reason, recorder.reject(path, reason)))
            continue
        assert step is not None
        recorder.set_step(path, step)
        if step <= ckptsup_step:
            return out
        out.path, out.step, out.checked = str(path), step, verdict.how
        return out
    if ckptsup_step <= 0:
        out.error = (f"ckpt_path {requested} failed validation and no older .ckpt of its folder passed (see above); "
                     "the bad files were moved aside: rerun to start fresh, or pass another ckpt_path")
    return out


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
