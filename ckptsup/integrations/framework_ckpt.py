"""A framework's own checkpoints beside ckptsup's, validated in place (docs/integrations.md):
Lightning's `.ckpt` files (ModelCheckpoint, trainer.save_checkpoint) and HF's `checkpoint-N`
folders (save_strategy other than "no"). Torch-free.

The same treatment as external DCP step folders (checkpoint/external.py), done in the rank that
saved instead of by the supervisor, since the callback sees each save: right after the framework
wrote one, rank 0 hashes its files and keeps a manifest outside the framework's folder
(`<checkpoint_dir>/framework/external/<name>.json`, 0600; the manifest records the step). Before
the framework loads one, its names and sizes and every file's hash are checked against the
manifest (one without a manifest, a save the crash came before hashing, is hashed then and
adopted), and then it is test-loaded by the integration. A bad one is moved out of the framework's
folder to the sibling `<folder>.ckptsup-quarantine/<name>-<UTC stamp>` (one rename, nothing
deleted), its reason and manifest beside it, so that the framework's own "latest" cannot pick it.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checkpoint import external as ext
from ..checkpoint.manifest import FileEntry, Manifest
from ..checkpoint.trust import private_mkdir
from ..errors import CkptsupError

log = logging.getLogger("ckptsup.integrations")

MANIFESTS = "framework"   # <checkpoint_dir>/framework/external/<name>.json


@dataclass(frozen=True)
class Verdict:
    """One framework checkpoint checked against its manifest: `problems` empty when it passed."""

    problems: list[str]
    step: int | None = None     # the step its manifest records
    how: str = ""               # "hashes", or "hashes (adopted at resume)": no manifest, hashed now


def _files(path: Path) -> tuple[Path, list[str], list[str]]:
    """(the folder the names are in, the names, problems): a file is its own one name; a folder
    lists its regular files (flat: a subdirectory, a symlink or a special file is a problem)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path.parent, [], [f"{path.name} is gone"]
    if stat.S_ISREG(mode):
        return path.parent, [path.name], []
    if stat.S_ISDIR(mode):
        listed, problems = ext.listing(path)
        return path, sorted(listed), problems
    return path.parent, [], [f"{path.name} is {'a symlink' if stat.S_ISLNK(mode) else 'a special file'}, "
                             "not a regular file or folder"]


class FrameworkCheckpoints:
    """The manifests of one framework's checkpoints (rank 0's; every path absolute and local)."""

    def __init__(self, checkpoint_dir: Path, algorithm: str) -> None:
        self.root = Path(checkpoint_dir) / MANIFESTS
        self.algorithm = algorithm

    def record(self, path: Path, step: int) -> Manifest:
        """Hash what the framework just wrote and keep its manifest. Raises CkptsupError."""
        path = Path(os.path.abspath(path))
        folder, names, problems = _files(path)
        if problems:
            raise ext.ExternalError(problems[0])
        hashed, problems = ext.hash_files(folder, names, self.algorithm)
        if problems:
            raise ext.ExternalError(problems[0])
        files = [FileEntry(path=name, size=size, hash=digest) for name, (size, digest) in sorted(hashed.items())]
        manifest = Manifest(step=max(0, min(int(step), ext.MAX_STEP)), job_id=os.environ.get("SLURM_JOB_ID", ""),
                            attempt=0, epoch=0, world_size=1, files=files, items=[], metadata_file="",
                            metadata_hash="", hash_algorithm=self.algorithm,
                            extra={"external": True, "folder": path.name, "external_dir": str(path.parent),
                                   "kind": "file" if folder != path else "folder"})
        private_mkdir(self.root)   # 0700 (write_manifest's parents= would take the umask)
        ext.write_manifest(self.root, path.name, manifest)
        return manifest

    def record_quietly(self, path: Path, step: int) -> None:
        """record(), a failure logged: a save without a manifest is adopted (hashed) at resume."""
        try:
            self.record(path, step)
        except (CkptsupError, OSError) as err:
            log.warning("ckptsup: could not record the hashes of %s (%s); it is hashed when a resume reaches it",
                        path, err)

    def manifest(self, path: Path) -> Manifest | None:
        """Its manifest; None when there is none or it is of a file of the same name elsewhere."""
        path = Path(os.path.abspath(path))
        try:
            manifest = ext.load_manifest(self.root, path.name)
        except ext.ExternalError as err:
            log.warning("ckptsup: %s", err)
            return None
        if manifest is None or manifest.extra.get("external_dir") != str(path.parent):
            return None
        return manifest

    def step_of(self, path: Path) -> int | None:
        manifest = self.manifest(path)
        return None if manifest is None else manifest.step

    def verify(self, path: Path) -> Verdict:
        """Names, sizes and every file's hash against its manifest; none yet: hashed now, adopted."""
        path = Path(os.path.abspath(path))
        manifest = self.manifest(path)
        if manifest is None:
            try:
                self.record(path, 0)
            except (CkptsupError, OSError) as err:
                return Verdict([str(err)])
            return Verdict([], None, "hashes (adopted at resume)")
        folder, names, problems = _files(path)
        if problems:
            return Verdict(problems, manifest.step)
        listed = manifest.file_map()
        problems = [f"{path.name}: {name} is not in its manifest" for name in names if name not in listed]
        problems += [f"{path.name}: {name} is missing" for name in sorted(set(listed) - set(names))]
        if problems:
            return Verdict(problems, manifest.step)
        for name in names:
            size = os.lstat(folder / name).st_size
            if size != listed[name].size:
                problems.append(f"{path.name}: {name} has {size} bytes, {listed[name].size} when it was saved "
                                "(truncated or overwritten)")
        if problems:
            return Verdict(problems, manifest.step)
        hashed, problems = ext.hash_files(folder, names, manifest.hash_algorithm)
        problems += ext.compare_hashes(folder.name, manifest, hashed)
        return Verdict(problems, manifest.step, "hashes")

    def set_step(self, path: Path, step: int) -> None:
        """An adopted checkpoint's step, once its test load has read it."""
        manifest = self.manifest(path)
        if manifest is not None and manifest.step != step:
            manifest.step = max(0, min(int(step), ext.MAX_STEP))
            try:
                ext.write_manifest(self.root, Path(path).name, manifest)
            except (CkptsupError, OSError):
                pass   # only its order among fallbacks depends on it

    def reject(self, path: Path, reason: str) -> str:
        """Move it out of the framework's folder (its manifest beside it); where it went ("" when
        it could not be moved: logged)."""
        path = Path(os.path.abspath(path))
        try:
            where = str(ext.move_aside(path.parent, path.name, reason, run_dir=self.root))
        except CkptsupError as err:
            log.error("ckptsup: %s", err)
            return ""
        log.error("ckptsup: moved %s out of %s to %s: %s", path.name, path.parent, where, reason[:300])
        return where

    def forget(self, path: Path) -> None:
        """The framework deleted it (save_top_k, save_total_limit): its manifest goes too."""
        ext.forget(self.root, Path(path).name)

    def recorded_beside(self, path: Path) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint with a manifest in `path`'s folder that still exists,
        newest first (by step, then name): the fallbacks when `path` fails."""
        parent = Path(os.path.abspath(path)).parent
        out = []
        for name in ext.known_names(self.root):
            other = parent / name
            manifest = self.manifest(other) if os.path.lexists(other) else None
            if manifest is not None:
                out.append((manifest.step, other))
        return sorted(out, key=lambda pair: (pair[0], pair[1].name), reverse=True)

    def forget_missing(self, directory: Path, present: list[str]) -> None:
        """Forget the manifests of `directory`'s checkpoints that are gone (HF's save_total_limit)."""
        here = set(present)
        for name in ext.known_names(self.root):
            if name not in here and not os.path.lexists(Path(directory) / name) and \
                    self.manifest(Path(directory) / name) is not None:
                self.forget(Path(directory) / name)


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
