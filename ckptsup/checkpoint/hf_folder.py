"""Hugging Face's own `checkpoint-N` folders, checked torch-free (docs/integrations.md §Hugging
Face without the callback). HF's Trainer writes a folder in place (`Trainer._save_checkpoint`,
transformers 5.25): the model (`model.safetensors` or shards with their index, `config.json`,
`generation_config.json`, the tokenizer's files, `training_args.bin`), then `optimizer.pt`,
`scheduler.pt`, `scaler.pt` (with a grad scaler), each rank's RNG state (`rng_state.pth` alone,
`rng_state_<rank>.pth` for every rank of a larger world), and `trainer_state.json` last, by rank 0.
A death mid-save leaves a torn newest folder that `get_last_checkpoint` picks on every restart.

A folder is whole when: `trainer_state.json` is there and parses, with `global_step` == N; the
weights are there (every shard an index names); with a training state (`save_only_model` off: any
of optimizer.pt, scheduler.pt, an RNG state present) optimizer.pt, scheduler.pt and the RNG state
of every rank of the world the folder shows — `rng_state_<k>.pth` means a world of more than k
ranks (world size 1 writes `rng_state.pth`), and a caller that knows the world that wrote it
passes `world_size`; and every file checks whole (checkpoint/script_file.py `check`: torch.save
zips by their CRC-32s, safetensors by header and length; JSON files parsed). No byte is unpickled.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Callable, Sequence

from ..errors import CheckpointError
from ..safe_io import read_json
from . import script_file
from .external import StepFolder, name_ok

HF_FOLDER = re.compile(r"checkpoint-(\d{1,18})")   # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR, fullmatch
STATE_NAME = "trainer_state.json"
OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"
RNG_ONE = "rng_state.pth"
RNG_RANK = re.compile(r"rng_state_(\d{1,9})\.pth")
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# names only HF's save writes: a checkpoint-N folder holding none of them (and not empty) is not HF's
HF_NAMES = frozenset({STATE_NAME, OPTIMIZER, SCHEDULER, RNG_ONE, "training_args.bin", "config.json", "scaler.pt",
                      *WEIGHTS, *INDEXES})
MAX_FILES = 10_000          # files of one folder looked at (subfolders included)
MAX_DEPTH = 4               # DeepSpeed's global_stepN/, FSDP's pytorch_model_fsdp_0/ ...
MAX_JSON_BYTES = 256 << 20
OUTPUT_DIR_FLAGS = ("--output_dir", "--output-dir")

Check = Callable[[Path], script_file.Verdict]


class HfFolderError(CheckpointError):
    """A JSON file of a checkpoint-N folder that does not parse, in one line."""


def output_dir_of(args: Sequence[str]) -> str | None:
    """The `--output_dir D` (`--output-dir D`, `--output_dir=D`) of a script's arguments, as
    HfArgumentParser (argparse) reads them: the last one wins; none after a bare `--`."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg in OUTPUT_DIR_FLAGS and i + 1 < len(args):
            found = args[i + 1]
        else:
            flag, eq, value = arg.partition("=")
            if eq and flag in OUTPUT_DIR_FLAGS:
                found = value
    return found or None


def step_of(name: str) -> int | None:
    match = HF_FOLDER.fullmatch(name)
    return int(match.group(1)) if match else None


def list_folders(output_dir: Path) -> list[StepFolder]:
    """The `checkpoint-N` folders (directories, or symlinks to one: get_last_checkpoint follows
    them), oldest first by step. A missing or unreadable folder lists nothing."""
    found = []
    try:
        with os.scandir(output_dir) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_FILES:
                    break
                step = step_of(entry.name)
                if step is None or not name_ok(entry.name):
                    continue
                try:
                    if entry.is_dir(follow_symlinks=True):
                        found.append(StepFolder(name=entry.name, step=step, path=Path(output_dir) / entry.name))
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(found, key=lambda f: (f.step, f.name))


def files_of(folder: Path) -> tuple[list[str], list[str]]:
    """(relative paths of the folder's regular files, subfolders included, sorted; problems: a
    special file, a symlink inside, too many entries or too deep)."""
    files: list[str] = []
    problems: list[str] = []

    def walk(path: Path, prefix: str, depth: int) -> None:
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if len(files) >= MAX_FILES:
                        problems.append(f"{folder.name} holds more than {MAX_FILES} files")
                        return
                    rel = prefix + entry.name
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISREG(mode):
                        files.append(rel)
                    elif stat.S_ISDIR(mode) and depth < MAX_DEPTH:
                        walk(Path(entry.path), rel + "/", depth + 1)
                    else:
                        kind = "a symlink" if stat.S_ISLNK(mode) else "too deep" if stat.S_ISDIR(mode) else "a special file"
                        problems.append(f"{folder.name}/{rel} is {kind}")
        except FileNotFoundError:
            problems.append(f"{folder.name}/{prefix or ''} is gone")
        except OSError as err:
            problems.append(f"cannot list {folder.name}/{prefix}: {err.strerror or err}")

    walk(folder, "", 0)
    return sorted(files), problems


def looks_like_hf(files: Sequence[str]) -> bool:
    """Empty (a save that wrote nothing yet) or holding a name only HF's save writes."""
    return not files or any(name in HF_NAMES or RNG_RANK.fullmatch(name) for name in files)


def _json(folder: Path, name: str) -> object:
    return read_json(folder / name, max_bytes=MAX_JSON_BYTES, what=f"{folder.name}/{name}", error=HfFolderError,
                     follow_symlinks=False, allow_nonfinite=True)   # HF writes NaN/Infinity in log_history


def rng_names(files: Sequence[str], world_size: int | None) -> tuple[list[str], int]:
    """(the RNG files the folder must hold, the world size it implies); ([], 0) when it shows none."""
    top = set(files)
    ranks = [int(m.group(1)) for name in top if (m := RNG_RANK.fullmatch(name))]
    if not ranks:
        return ([RNG_ONE], 1) if RNG_ONE in top else ([], 0)
    world = max(max(ranks) + 1, 2, world_size or 0)   # rng_state_<k>: a world of more than one rank
    return [f"rng_state_{k}.pth" for k in range(world)], world


def missing_files(folder: Path, step: int, files: Sequence[str], *, world_size: int | None = None) -> list[str]:
    """What a whole save of HF's would hold that this one lacks (or says wrong), from the names
    and trainer_state.json alone: no other byte read."""
    top = set(files)
    name = folder.name
    if not files:
        return [f"{name} is empty: a save that never wrote"]
    if STATE_NAME not in top:
        return [f"{name} has no {STATE_NAME} (HF writes it last): a save that did not finish"]
    problems: list[str] = []
    try:
        state = _json(folder, STATE_NAME)
    except (HfFolderError, FileNotFoundError) as err:
        return [f"{name}/{STATE_NAME}: {err}"]
    global_step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(global_step, int) or isinstance(global_step, bool) or global_step != step:
        problems.append(f"{name}/{STATE_NAME} says global_step {global_step!r}, not {step}")
    nested = any("/" in f for f in files)   # DeepSpeed / FSDP keep weights and optimizer in subfolders
    index = next((i for i in INDEXES if i in top), None)
    if index is not None:
        try:
            parsed = _json(folder, index)
        except (HfFolderError, FileNotFoundError) as err:
            return problems + [f"{name}/{index}: {err}"]
        weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
        shards = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
        problems += [f"{name}/{shard}: missing (named by {index})" for shard in shards if shard not in top]
    elif not nested and not top.intersection(WEIGHTS):
        problems.append(f"{name} has no model weights ({', '.join(WEIGHTS[:2])})")
    rngs, _ = rng_names(files, world_size)
    training = bool(rngs) or OPTIMIZER in top or SCHEDULER in top   # else save_only_model
    if training:
        needed = ([] if nested else [OPTIMIZER, SCHEDULER]) + (rngs or [RNG_ONE])
        problems += [f"{name}/{f}: missing" for f in needed if f not in top]
    return problems


def check_folder(folder: Path, step: int, *, world_size: int | None = None,
                 check: Check = script_file.check) -> list[str]:
    """The problems of HF's checkpoint folder `folder` (step N from its name); [] when whole.
    Names first (nothing read but trainer_state.json), then every file read whole, stopping at
    the first bad one."""
    files, problems = files_of(folder)
    if problems:
        return problems
    problems = missing_files(folder, step, files, world_size=world_size)
    if problems:
        return problems
    for rel in files:
        path = folder / rel
        if rel.endswith(".json"):
            try:
                _json(folder, rel)
            except (HfFolderError, FileNotFoundError) as err:
                return [f"{folder.name}/{rel}: {err}"]
            continue
        verdict = check(path)
        if not verdict.ok:
            return [verdict.line(f"{folder.name}/{rel}")]
    return []
