"""Checkpoints that someone else writes (docs/integrations.md §External checkpoints): DCP step
folders in a framework's own checkpoint folder (torchtitan's `CheckpointManager`, a script's own
`dcp.save`). Torch-free: the folder names, the listing and its order, which node hashes which
file, the manifest ckptsup keeps of each folder (outside the framework's folder), and moving a bad
folder out of the framework's folder.

A folder is complete when DCP's `.metadata` is in it (DCP writes it last, after every rank's
data). Its manifest lists every file with its size and hash; it is written after the save, so it
vouches for the folder staying as it was found (bit rot, truncation, a partial overwrite), not for
the save itself. Names come from the framework's folder: each is one path component, matched with
`re.search` like torchtitan's own `step-(\\d+)`, so that whatever the framework would load, ckptsup
sees; a name the file system cannot encode, or too long, is refused by name.
"""

from __future__ import annotations

import json
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

from ..config import external_pattern_problem as pattern_problem
from ..errors import CheckpointError, ConfigError, ManifestError
from ..safe_io import read_regular
from .durable import rename_noreplace
from .hashing import HASH_ALGORITHMS, hash_file_and_ranges
from .manifest import METADATA_NAME, FileEntry, Manifest
from .trust import TrustError, check_dir_trusted, private_mkdir

DEFAULT_PATTERN = r"step-(\d+)"
MANIFESTS_DIR = "external"                   # <run_dir>/external/<quoted folder name>.json
QUARANTINE_SUFFIX = ".ckptsup-quarantine"    # <external_dir>.ckptsup-quarantine/, a sibling
REASON_SUFFIX = ".reason.json"
MANIFEST_SUFFIX = ".manifest.json"
MAX_ENTRIES = 100_000        # entries of the framework's folder or of one step folder looked at
MAX_NAME_BYTES = 200         # a step folder's or a file's name
MAX_MANIFEST_BYTES = 64 << 20
MAX_STEP = 10 ** 18 - 1
RANK_FILE = re.compile(r"__(\d{1,9})_\d{1,9}\.distcp")   # DCP's FileSystemWriter: __<rank>_<n>.distcp


class ExternalError(CheckpointError):
    """A problem with an external folder or its manifest, in one line."""


# ---- names ----------------------------------------------------------------------------------

def compile_pattern(text: str) -> re.Pattern[str]:
    problem = pattern_problem(text)
    if problem:
        raise ConfigError(f"[checkpoint] external_pattern {text!r} {problem}")
    return re.compile(text)


def step_of(name: str, pattern: re.Pattern[str]) -> int | None:
    """The step a folder name carries (re.search, as torchtitan finds its folders), else None."""
    match = pattern.search(name)
    if match is None or not (match.group(1) or "").isdigit() or len(match.group(1)) > 18:
        return None
    return int(match.group(1))


def name_ok(name: str) -> bool:
    """One path component the file system and JSON can carry: encodable, short, no NUL or slash."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        return False
    try:
        return len(os.fsencode(name)) <= MAX_NAME_BYTES and bool(name.encode("utf-8"))
    except UnicodeError:
        return False


@dataclass(frozen=True, kw_only=True)
class StepFolder:
    name: str
    step: int
    path: Path


def list_folders(external_dir: Path, pattern: re.Pattern[str]) -> list[StepFolder]:
    """The step folders, oldest first (by step, then name: never by mtime). Directories and
    symlinks (the framework follows one) whose name carries a step; a name ckptsup cannot carry
    is left out. A missing or unreadable folder lists nothing."""
    found = []
    try:
        with os.scandir(external_dir) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    break
                if not name_ok(entry.name):
                    continue
                step = step_of(entry.name, pattern)
                if step is None:
                    continue
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
                    found.append(StepFolder(name=entry.name, step=step, path=Path(external_dir) / entry.name))
    except OSError:
        return []
    return sorted(found, key=lambda f: (f.step, f.name))


def is_complete(folder: Path) -> bool:
    """DCP's `.metadata` is there, a regular file (DCP writes it last)."""
    try:
        return stat.S_ISREG(os.lstat(folder / METADATA_NAME).st_mode)
    except OSError:
        return False


def listing(folder: Path) -> tuple[dict[str, int], list[str]]:
    """({file name: size} of the folder's regular files, problems): a subdirectory, a symlink, a
    special file or a name ckptsup cannot carry is a problem (DCP writes flat folders of files)."""
    files: dict[str, int] = {}
    problems: list[str] = []
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            return {}, [f"{folder.name} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                        "a step folder must be a real directory"]
        with os.scandir(folder) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    problems.append(f"{folder.name} holds more than {MAX_ENTRIES} entries")
                    break
                if not name_ok(entry.name):
                    problems.append(f"{folder.name} holds an entry whose name ckptsup cannot carry ({entry.name[:40]!r})")
                    continue
                est = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(est.st_mode):
                    files[entry.name] = est.st_size
                else:
                    kind = "directory" if stat.S_ISDIR(est.st_mode) else "symlink" if stat.S_ISLNK(est.st_mode) else "special file"
                    problems.append(f"{folder.name}/{entry.name} is a {kind}, not a regular file")
    except FileNotFoundError:
        return {}, [f"{folder.name} is gone"]
    except OSError as err:
        return {}, [f"cannot list {folder.name}: {err.strerror or err}"]
    return files, problems


def rank_of(name: str) -> int | None:
    match = RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def assign_files(names: Iterable[str], nodes: Sequence[str], nproc_per_node: int) -> dict[str, list[str]]:
    """Which node's agent hashes which file: rank r's `__<r>_*.distcp` on the node of global rank
    r (nodes in launch order: node i runs ranks i*nproc .. i*nproc+nproc-1 with the static
    rendezvous); `.metadata` and every other file on the first node (global rank 0's)."""
    out: dict[str, list[str]] = {node: [] for node in nodes}
    for name in sorted(names):
        rank = rank_of(name)
        index = rank // nproc_per_node if rank is not None and nproc_per_node > 0 else 0
        out[nodes[index if index < len(nodes) else 0]].append(name)
    return {node: files for node, files in out.items() if files}


def hash_files(folder: Path, names: Iterable[str], algorithm: str) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """({name: (size, hash)}, problems): each file read once, never through a symlink, a special
    file refused (hashing.open_regular)."""
    if algorithm not in HASH_ALGORITHMS:
        raise ExternalError(f"unknown hash algorithm {algorithm!r}; valid: {', '.join(HASH_ALGORITHMS)}")
    out: dict[str, tuple[int, str]] = {}
    problems: list[str] = []
    for name in names:
        if not name_ok(name):
            problems.append(f"refused file name {name[:40]!r}")
            continue
        try:
            digest, size, _ = hash_file_and_ranges(folder / name, algorithm, [])
        except FileNotFoundError:
            problems.append(f"{folder.name}/{name}: missing")
            continue
        except OSError as err:
            problems.append(f"{folder.name}/{name}: cannot read it ({err.strerror or err})")
            continue
        out[name] = (size, digest)
    return out, problems


# ---- the manifest ckptsup keeps of a folder (outside the framework's folder) ----------------

def manifests_dir(run_dir: Path) -> Path:
    return Path(run_dir) / MANIFESTS_DIR


def manifest_path(run_dir: Path, name: str) -> Path:
    """<run_dir>/external/<name, percent-quoted>.json: one confined file per folder name."""
    if not name_ok(name):
        raise ExternalError(f"refused step folder name {name[:40]!r}")
    return manifests_dir(run_dir) / (urllib.parse.quote(name, safe="") + ".json")


def build_manifest(folder: StepFolder, hashed: dict[str, tuple[int, str]], *, algorithm: str, job_id: str,
                   attempt: int, epoch: int, world_size: int, external_dir: Path) -> Manifest:
    files = [FileEntry(path=name, size=size, hash=digest) for name, (size, digest) in sorted(hashed.items())]
    meta = hashed.get(METADATA_NAME)
    return Manifest(step=min(folder.step, MAX_STEP), job_id=job_id, attempt=attempt, epoch=epoch,
                    world_size=max(1, world_size), files=files, items=[],
                    metadata_file=METADATA_NAME if meta else "", metadata_hash=meta[1] if meta else "",
                    hash_algorithm=algorithm,
                    extra={"external": True, "folder": folder.name, "external_dir": str(external_dir)})


def write_manifest(run_dir: Path, name: str, manifest: Manifest) -> Path:
    from ..rundir import atomic_write_json

    private_mkdir(manifests_dir(run_dir))
    path = manifest_path(run_dir, name)
    atomic_write_json(path, json.loads(manifest.to_json()), mode=0o600)
    return path


def load_manifest(run_dir: Path, name: str) -> Manifest | None:
    """The manifest of folder `name`, None when there is none. One that is not ours (wrong shape,
    wrong folder, a symlink, a FIFO, too large) raises ExternalError."""
    path = manifest_path(run_dir, name)
    try:
        data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES, what="external manifest", error=ExternalError,
                            follow_symlinks=False)
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_json(data, source=str(path))
    except ManifestError as err:
        raise ExternalError(str(err)) from None
    if manifest.extra.get("folder") != name or manifest.extra.get("external") is not True:
        raise ExternalError(f"{path} is not ckptsup's manifest of {name}")
    return manifest


def known_names(run_dir: Path) -> list[str]:
    """The folder names that have a manifest."""
    out = []
    try:
        with os.scandir(manifests_dir(run_dir)) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    break
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    name = urllib.parse.unquote(entry.name[:-5])
                    if name_ok(name):
                        out.append(name)
    except OSError:
        return []
    return sorted(out)


def forget(run_dir: Path, name: str) -> None:
    try:
        os.unlink(manifest_path(run_dir, name))
    except (FileNotFoundError, ExternalError):
        pass


def forget_vanished(run_dir: Path, present: Iterable[str]) -> list[str]:
    """Drop the manifests of folders that are gone (the framework purged them: keep_latest_k)."""
    here = set(present)
    gone = [name for name in known_names(run_dir) if name not in here]
    for name in gone:
        forget(run_dir, name)
    return gone


# ---- checks ---------------------------------------------------------------------------------

def check_against(folder: Path, manifest: Manifest) -> list[str]:
    """The cheap check (a listing and a stat per file, nothing read): trust (owner, mode, no
    links), `.metadata` present, the same file names as the manifest, each of its size."""
    try:
        check_dir_trusted(folder, recursive=True)
    except TrustError as err:
        return [str(err)]
    files, problems = listing(folder)
    if problems:
        return problems
    if METADATA_NAME not in files:
        return [f"{folder.name} has no {METADATA_NAME} (an unfinished save)"]
    listed = manifest.file_map()
    for name, size in sorted(files.items()):
        entry = listed.get(name)
        if entry is None:
            problems.append(f"{folder.name}/{name}: present but not in its manifest")
        elif entry.size != size:
            problems.append(f"{folder.name}/{name}: size {size} != {entry.size} in its manifest (truncated or overwritten)")
    problems += [f"{folder.name}/{name}: missing" for name in sorted(set(listed) - set(files))]
    return problems


def compare_hashes(folder_name: str, manifest: Manifest, hashed: dict[str, tuple[int, str]]) -> list[str]:
    listed = manifest.file_map()
    problems = []
    for name, (size, digest) in sorted(hashed.items()):
        entry = listed.get(name)
        if entry is None:
            problems.append(f"{folder_name}/{name}: not in its manifest")
        elif (size, digest) != (entry.size, entry.hash):
            problems.append(f"{folder_name}/{name}: hash {digest} != {entry.hash} in its manifest (corrupted)")
    return problems


# ---- moving a folder out of the framework's folder ------------------------------------------

def quarantine_dir(external_dir: Path) -> Path:
    external_dir = Path(os.path.abspath(external_dir))
    return external_dir.parent / (external_dir.name + QUARANTINE_SUFFIX)


def move_aside(external_dir: Path, name: str, reason: str, *, run_dir: Path | None = None,
               now: datetime | None = None) -> Path:
    """Move step folder `name` out of the framework's folder to the sibling
    <external_dir>.ckptsup-quarantine/<name>-<UTC stamp> (0700, same file system: one rename,
    never a copy, nothing deleted), so that the framework's "load latest" cannot pick it. The
    reason lands beside it (<dest>.reason.json), and so does its manifest, if any. Raises
    ExternalError with the fix when it cannot be moved."""
    if not name_ok(name):
        raise ExternalError(f"refused step folder name {name[:40]!r}")
    when = now or datetime.now(timezone.utc)
    try:
        qdir = private_mkdir(quarantine_dir(external_dir))
    except TrustError as err:
        raise ExternalError(f"cannot move {name} aside: {err}") from None
    dest = qdir / f"{name}-{when.strftime('%Y%m%dT%H%M%S%fZ')}"
    try:
        rename_noreplace(Path(external_dir) / name, dest)
    except OSError as err:
        raise ExternalError(f"cannot move {name} out of {external_dir} to {qdir}: {err.strerror or err}; "
                            "move it away by hand (the framework would load it next)") from None
    from ..rundir import atomic_write_json

    try:
        atomic_write_json(qdir / (dest.name + REASON_SUFFIX), {"reason": reason, "ts": when.isoformat(), "from": name})
        if run_dir is not None:
            source = manifest_path(run_dir, name)
            if os.path.lexists(source):
                os.replace(source, qdir / (dest.name + MANIFEST_SUFFIX))
    except OSError:
        pass   # the folder is out of the framework's reach: what matters is done
    return dest
