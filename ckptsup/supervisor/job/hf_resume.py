"""Before each launch: Hugging Face's own `checkpoint-N` folders ([checkpoint] hf_output_dir;
docs/integrations.md §Hugging Face without the callback). An HF Trainer script resumes by itself
from `get_last_checkpoint(output_dir)`, the folder with the highest N, whole or not; HF writes
it in place, so a death mid-save leaves a torn newest folder that every restart picks and dies on.
So before every launch (a new supervisor's first one too) the folders are checked newest first
(checkpoint/hf_folder.py: complete, every file whole; torch-free) and each bad one is moved out
of the folder (checkpoint/external.py `move_aside`: one rename to the sibling
`<output_dir>.ckptsup-quarantine/`, nothing deleted) until the newest is whole: the script then
resumes from it by itself. One `HfCheckpoints` per supervisor, made in its constructor.

`auto` (the default) finds the folder in the script's `--output_dir`. It is safe to have on for
any script: it only looks at folders named `checkpoint-N` in the folder the script named, leaves
alone one that holds nothing HF writes (another tool's folder of that name), and only ever moves
a folder that fails the check; a whole one, or any other file, is never touched."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ... import console
from ...checkpoint import external as ext
from ...checkpoint import hf_folder
from ...config import AUTO, Config
from ...errors import CkptsupError
from ...events import Event

MTIME_SLACK_S = 2.0   # file times come from a coarse kernel clock; a save's folder outlives its launch's start


class Emit(Protocol):
    def __call__(self, name: Event, **fields: Any) -> None: ...


def resolve_dir(config: Config, *, cwd: str, script_args: Sequence[str]) -> tuple[Path | None, bool]:
    """(HF's output folder, whether it was named explicitly); (None, False) when off or, with
    `auto`, when the script's arguments name no --output_dir."""
    configured = config.checkpoint.hf_output_dir
    explicit = configured != AUTO
    directory = hf_folder.output_dir_of(script_args) if not explicit else configured
    if not directory:
        return None, False
    return Path(os.path.abspath(os.path.join(cwd, directory))), explicit


class HfCheckpoints:
    """The pre-launch check of HF's own checkpoint-N folders."""

    def __init__(self, *, directory: Path, explicit: bool, emit: Emit,
                 check: hf_folder.Check | None = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = directory
        self.explicit = explicit           # a folder named in the config: every checkpoint-N in it is HF's
        self.emit = emit
        self.check = check
        self.wall = wall
        self.clock = clock
        self.launched: tuple[float, int] | None = None   # (wall time, world size) of this supervisor's last launch
        self.said: set[str] = set()

    @classmethod
    def from_config(cls, config: Config, *, cwd: str, script_args: Sequence[str], emit: Emit) -> "HfCheckpoints | None":
        directory, explicit = resolve_dir(config, cwd=cwd, script_args=script_args)
        return None if directory is None else cls(directory=directory, explicit=explicit, emit=emit)

    def world_of(self, folder: ext.StepFolder) -> int | None:
        """The world size that wrote `folder` when this supervisor launched it (made since its last
        launch), else None: the folder's own RNG files then tell."""
        if self.launched is None:
            return None
        since, world = self.launched
        try:
            return world if os.stat(folder.path).st_mtime >= since - MTIME_SLACK_S else None
        except OSError:
            return None

    def problems(self, folder: ext.StepFolder) -> list[str] | None:
        """The folder's problems ([] when whole); None when it is not HF's to judge."""
        if not self.explicit:
            files, _ = hf_folder.files_of(folder.path)
            if not hf_folder.looks_like_hf(files):
                self._say(f"{folder.path} holds nothing Hugging Face writes: left alone (set [checkpoint] "
                          "hf_output_dir to check it anyway, or \"\" to stop looking)")
                return None
        kwargs = {"check": self.check} if self.check is not None else {}
        return hf_folder.check_folder(folder.path, folder.step, world_size=self.world_of(folder), **kwargs)

    def before_launch(self, *, world_size: int) -> None:
        """Move every newer folder that fails out of the way of the newest whole one."""
        start = self.clock()
        moved: list[str] = []
        chosen: ext.StepFolder | None = None
        for folder in reversed(hf_folder.list_folders(self.dir)):
            problems = self.problems(folder)
            if problems is None:
                continue
            if not problems:
                chosen = folder
                break
            reason = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            try:
                where = str(ext.move_aside(self.dir, folder.name, reason))
            except CkptsupError as err:
                self.emit(Event.CHECKPOINT_REJECTED, step=folder.step, level=1, external=folder.name,
                          reason=reason[:400], quarantined="")
                raise CkptsupError(f"Hugging Face's {folder.name} is bad ({reason[:200]}) and {err}") from None
            self.emit(Event.CHECKPOINT_REJECTED, step=folder.step, level=1, external=folder.name, reason=reason[:400],
                      quarantined=where)
            console.warning(f"ckptsup: moved {folder.name} out of {self.dir} to {where}: {reason[:300]}")
            moved.append(folder.name)
        self.launched = (self.wall(), world_size)
        if chosen is None and not moved:
            return   # nothing saved yet: a fresh start, nothing to say
        self.emit(Event.HF_RESUME, output_dir=str(self.dir), folder=chosen.name if chosen else None,
                  step=chosen.step if chosen else None, moved_aside=moved, check_s=round(self.clock() - start, 4))
        if chosen is not None:
            console.info(f"ckptsup: Hugging Face resumes from {chosen.name} in {self.dir} (checked whole)")
        else:
            console.warning(f"ckptsup: no checkpoint-N in {self.dir} is whole: the script starts fresh")

    def progressed(self, *, since_wall: float) -> bool:
        """Whether a save finished since `since_wall` (a checkpoint-N whose trainer_state.json,
        written last, is newer): progress for the crash-loop rule, on top of any other sign of it."""
        for folder in hf_folder.list_folders(self.dir):
            try:
                if os.stat(folder.path / hf_folder.STATE_NAME).st_mtime > since_wall - 0.05:
                    return True
            except OSError:
                continue
        return False

    def _say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            console.warning(f"ckptsup: {line}")
