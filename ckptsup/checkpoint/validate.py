"""Validation levels (docs/checkpoint-core.md §Validation), recorded atomically in
<step_dir>/validation.json.

Level 1: every file of the manifest present, regular, right size and hash; no unlisted files.
Level 2: structure, torch-free, never unpickling: every item's file is listed, offset+length lies
         inside it, items of one file do not overlap, item keys are unique, `.metadata` matches
         metadata_hash, the manifest's step matches the directory name, and every item's hash
         matches its bytes (hashed during level 1's read, so no second read).
         A manifest that records replicas in disagreement (silent data corruption) fails here.
Level 3: a test load into fresh CPU state in a separate process
         (`python -m ckptsup.hooks.testload STEP_DIR`, exit 0 = ok) with a timeout.
Each level runs only when the one below passed. Nothing here unpickles anything.
A failing checkpoint is quarantined (moved, never deleted) by `quarantine()`. A checkpoint that
is only untrusted (owner, mode, permissions: `ValidationResult.untrusted`) is not judged: its
outcome is not recorded and it is never quarantined (docs/checkpoint-core.md §Trust is not content).
validation.json is a record, not content: whatever stands at its name (a FIFO, a symlink, a
record of another shape) reads as "not validated" and is replaced by the next record.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import CheckpointError, CkptsupError, ValidationError, one_line
from ..rundir import atomic_write_json
from ..safe_io import read_json
from .commit import parse_step, rename_noreplace
from .hashing import algorithm_of, hash_bytes, hash_file_and_ranges
from .manifest import RESERVED_NAMES, VALIDATION_NAME, FileEntry, ItemEntry, Manifest, load_manifest
from .trust import OwnerModeError, check_dir_trusted, private_mkdir

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
REASON_NAME = "quarantine_reason.json"
TESTLOAD_MODULE = "ckptsup.hooks.testload"
DEFAULT_TESTLOAD_TIMEOUT_S = 600.0
DEFAULT_WORKERS = 4   # files hashed at once by level 1
MAX_PROBLEMS = 50  # a badly broken checkpoint should not produce a megabyte of problems
MAX_RECORD_BYTES = 1 << 20   # validation.json / quarantine_reason.json: a few KB when ckptsup wrote them
RECORD_NAMES = frozenset({VALIDATION_NAME})   # records in a step dir that are not content

Progress = Callable[[int], None]  # called with bytes just hashed


@dataclass(kw_only=True)
class ValidationResult:
    ok: bool
    level: int                  # the level asked for
    problems: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    level_passed: int = 0       # highest level that passed (0 = none)
    checkpoint_id: str = ""
    bytes_checked: int = 0
    untrusted: bool = False     # not judged: owner/mode/permissions are wrong (problems[0] has the fix);
                                # never recorded, never a reason to quarantine

    def summary(self) -> str:
        if self.ok:
            return f"ok (level {self.level_passed}, {self.bytes_checked / 1e6:.1f} MB in {self.duration_s:.2f} s)"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"FAILED level {self.level_passed + 1}: {self.problems[0] if self.problems else '?'}{more}"


# ---- level 1 --------------------------------------------------------------------------------

def _listed_and_extra(step_dir: Path, manifest: Manifest) -> list[str]:
    listed = {f.path for f in manifest.files}
    problems = []

    def walk(top: Path, prefix: str) -> None:
        with os.scandir(top) as it:
            for entry in it:
                rel = f"{prefix}{entry.name}"
                if not prefix and (_is_validation_tmp(rel) or rel in RECORD_NAMES):
                    continue  # a record (or another validator's temporary of one), not content
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    problems.append(f"{rel}: is a symlink (refused)")
                elif stat.S_ISDIR(st.st_mode):
                    walk(Path(entry.path), rel + "/")
                elif not prefix and rel in RESERVED_NAMES:
                    continue
                elif rel not in listed:
                    problems.append(f"{rel}: present but not listed in the manifest")
    walk(step_dir, "")
    return problems


def _is_validation_tmp(name: str) -> bool:
    # atomic_write_json's temporary, present for a moment while another verify records
    return name.startswith(f".{VALIDATION_NAME}.") and name.endswith(".tmp")


def _presence_problem(step_dir: Path, entry: FileEntry) -> str | None:
    """A listed file that is missing, not a regular file, or not its manifest size."""
    try:
        st = os.lstat(step_dir / entry.path)
    except FileNotFoundError:
        return f"{entry.path}: missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{entry.path}: not a regular file (symlink or special file refused)"
    if st.st_size != entry.size:
        return f"{entry.path}: size {st.st_size} != {entry.size} in the manifest (truncated or overwritten)"
    return None


def check_present(step_dir: Path, manifest: Manifest) -> list[str]:
    """Level 1 without the hashes: every listed file present, regular and of its size (what can
    change after an earlier full validation, checked in a stat per file)."""
    return [one_line(problem) for entry in manifest.files if (problem := _presence_problem(step_dir, entry))]


def _check_file(step_dir: Path, entry: FileEntry, items: list[ItemEntry]) -> tuple[list[str], list[str], int]:
    """(file problems, item problems, bytes hashed) for one listed file; the items stored in it
    are hashed in the same read (their mismatches belong to level 2: the index is structure)."""
    full = step_dir / entry.path
    problem = _presence_problem(step_dir, entry)
    if problem is not None:
        return [problem], [], 0
    try:
        actual, _, item_hashes = hash_file_and_ranges(full, algorithm_of(entry.hash),
                                                      [(it.offset, it.length, algorithm_of(it.hash)) for it in items])
    except OSError as err:
        return [f"{entry.path}: cannot read it ({err.strerror}); check its permissions"], [], 0
    if actual != entry.hash:
        return [f"{entry.path}: hash {actual} != {entry.hash} in the manifest (corrupted)"], [], entry.size
    bad = [it for it, h in zip(items, item_hashes) if h != it.hash and it.offset + it.length <= entry.size]
    if bad:   # the file matches its hash but an item does not: the index is wrong
        return [], [f"{entry.path}: {len(bad)} item hash(es) do not match the bytes (first: {bad[0].key!r}); the item index is wrong"], entry.size
    return [], [], entry.size


def check_level1(step_dir: Path, manifest: Manifest, *, progress: Progress | None = None,
                 workers: int = DEFAULT_WORKERS, item_problems: list[str] | None = None) -> tuple[list[str], int]:
    """Sizes and hashes of every listed file, plus no unlisted files. Files are hashed by a few
    threads so reading one overlaps hashing another (reads and the hashes release the GIL).
    Item hashes are checked in the same read; their mismatches go to `item_problems` when given
    (validate() reports them at level 2), else into the returned problems."""
    items_by_file: dict[str, list[ItemEntry]] = {}
    for item in manifest.items:
        items_by_file.setdefault(item.file, []).append(item)

    def one(entry: FileEntry) -> tuple[list[str], list[str], int]:
        found = _check_file(step_dir, entry, items_by_file.get(entry.path, []))
        if progress is not None and found[2]:
            progress(found[2])
        return found

    if workers > 1 and len(manifest.files) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(manifest.files)), thread_name_prefix="ckptsup-verify") as pool:
            outcomes = list(pool.map(one, manifest.files))
    else:
        outcomes = [one(entry) for entry in manifest.files]
    problems = [p for found, _, _ in outcomes for p in found]
    item_found = [p for _, found, _ in outcomes for p in found]
    if item_problems is None:
        problems.extend(item_found)
    else:
        item_problems.extend(item_found)
    problems.extend(_listed_and_extra(step_dir, manifest))
    if item_problems is not None:   # names from the manifest and the directory may hold line breaks
        item_problems[:] = [one_line(p) for p in item_problems]
    return [one_line(p) for p in problems], sum(n for _, _, n in outcomes)


# ---- level 2 --------------------------------------------------------------------------------

REPLICAS_KEY = "replicas"   # manifest extra: {agree, copies, fingerprint, disputed} (docs/sdc.md)


def replica_problem(manifest: Manifest) -> str | None:
    """A checkpoint taken while the replicas disagreed holds a silently corrupted state: never
    validated, never resumed from (docs/sdc.md). A manifest without the record (no replicas to
    compare, or an older writer) is not judged by it."""
    record = manifest.extra.get(REPLICAS_KEY)
    if not isinstance(record, dict) or record.get("agree") is not False:
        return None
    disputed = record.get("disputed")
    who = f" (ranks {', '.join(str(r) for r in disputed)} in dispute)" if isinstance(disputed, list) and disputed else ""
    return (f"replicas disagreed at step {manifest.step}{who}: silent data corruption, this checkpoint is never "
            f"resumed from (docs/sdc.md)")


def check_level2(step_dir: Path, manifest: Manifest) -> list[str]:
    problems: list[str] = []
    sdc = replica_problem(manifest)
    if sdc is not None:
        problems.append(sdc)
    files = manifest.file_map()
    dir_step = parse_step(step_dir.name)
    if dir_step is not None and dir_step != manifest.step:
        problems.append(f"manifest says step {manifest.step} but the directory is {step_dir.name}")
    if manifest.metadata_file:
        meta = files.get(manifest.metadata_file)
        if meta is None:
            problems.append(f"metadata file {manifest.metadata_file!r} is not listed in the manifest")
        elif meta.hash != manifest.metadata_hash:
            problems.append(f"metadata file {manifest.metadata_file!r} hash {meta.hash} != metadata_hash {manifest.metadata_hash}")
    prefix = manifest.hash_algorithm + ":"
    mixed = [f.path for f in manifest.files if not f.hash.startswith(prefix)]
    mixed += [it.key for it in manifest.items if not it.hash.startswith(prefix)]
    if mixed:   # e.g. a "sha256" manifest whose entries are crc32: the weaker one would decide
        problems.append(f"{len(mixed)} entries (first: {mixed[0]!r}) are not hashed with the manifest's {manifest.hash_algorithm}")
    seen_keys: set[str] = set()
    by_file: dict[str, list[ItemEntry]] = {}
    for item in manifest.items:
        if item.key in seen_keys:
            problems.append(f"item {item.key!r} is listed twice")
        seen_keys.add(item.key)
        entry = files.get(item.file)
        if entry is None:
            problems.append(f"item {item.key!r} is in {item.file!r}, which the manifest does not list")
            continue
        if item.offset + item.length > entry.size:
            problems.append(f"item {item.key!r} [{item.offset}, +{item.length}) runs past the end of {item.file!r} ({entry.size} bytes)")
        by_file.setdefault(item.file, []).append(item)
    for name, items in by_file.items():
        items.sort(key=lambda it: (it.offset, it.length))
        for before, after in zip(items, items[1:]):
            if before.offset + before.length > after.offset:
                problems.append(f"items {before.key!r} and {after.key!r} overlap in {name!r}")
    return [one_line(p) for p in problems]


# ---- level 3 --------------------------------------------------------------------------------

def testload_argv(step_dir: Path, command: Sequence[str] | None = None) -> list[str]:
    """The level-3 command: `command` (default: python -m ckptsup.hooks.testload) + STEP_DIR."""
    base = list(command) if command else [sys.executable, "-m", TESTLOAD_MODULE]
    return [*base, str(step_dir)]


def check_level3(step_dir: Path, *, timeout_s: float, command: Sequence[str] | None = None) -> list[str]:
    """Test load in a separate process (ckptsup.hooks.testload); it is the only level that
    touches torch and DCP's pickle, and runs only after levels 1-2 passed."""
    argv = testload_argv(step_dir, command)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [f"test load did not finish within {timeout_s:.0f} s"]
    if proc.returncode == 0:
        return []
    tail = (proc.stderr.strip() or proc.stdout.strip() or "(no output)").splitlines()[-1]
    return [f"test load failed (exit {proc.returncode}): {tail[:300]}"]


# ---- driver ---------------------------------------------------------------------------------

def validate(step_dir: str | os.PathLike[str], *, level: int = 2, algorithm: str | None = None,
             progress: Progress | None = None, testload_timeout_s: float = DEFAULT_TESTLOAD_TIMEOUT_S,
             record: bool = True, clock: Callable[[], float] = time.monotonic,
             testload_command: Sequence[str] | None = None) -> ValidationResult:
    """Validate up to `level` (1-3) and record the outcome in validation.json (unless
    record=False). `algorithm`, when given, is required to match the manifest's (a site that
    demands sha256 refuses xxh3 manifests)."""
    if level not in (1, 2, 3):
        raise CheckpointError(f"validation level must be 1, 2 or 3, got {level}")
    step_dir = Path(step_dir)
    start = clock()
    result = ValidationResult(ok=False, level=level)
    try:
        check_dir_trusted(step_dir, recursive=True, skip=RECORD_NAMES)
        manifest = load_manifest(step_dir)
    except OwnerModeError as err:   # not a verdict on the content: nothing recorded
        result.problems, result.untrusted = [str(err)], True
        result.duration_s = clock() - start
        return result
    except CkptsupError as err:
        result.problems = [str(err)]
        result.duration_s = clock() - start
        if record and _is_real_dir(step_dir):
            _record_quietly(step_dir, result)
        return result
    result.checkpoint_id = manifest.checkpoint_id
    try:
        _run_levels(step_dir, manifest, result, level=level, algorithm=algorithm, progress=progress,
                    testload_timeout_s=testload_timeout_s, testload_command=testload_command)
    except OSError as err:   # a part became unreadable after the trust check: permissions, not content
        where = f" {err.filename}" if err.filename else ""
        result.problems, result.untrusted = [f"cannot read{where}: {err.strerror or err}; check its permissions"], True
        result.level_passed, result.ok = 0, False
        result.duration_s = clock() - start
        return result
    result.problems = result.problems[:MAX_PROBLEMS]
    result.ok = not result.problems
    result.duration_s = clock() - start
    if record:
        _record_quietly(step_dir, result)
    return result


def _run_levels(step_dir: Path, manifest: Manifest, result: ValidationResult, *, level: int, algorithm: str | None,
                progress: Progress | None, testload_timeout_s: float, testload_command: Sequence[str] | None) -> None:
    if algorithm is not None and manifest.hash_algorithm != algorithm:
        result.problems = [f"manifest uses {manifest.hash_algorithm}, but {algorithm} was required"]
        return
    sdc = replica_problem(manifest)
    if sdc is not None:   # at every level: its bytes may all be intact, its state is not
        result.problems = [sdc]
        return
    item_problems: list[str] = []
    result.problems, result.bytes_checked = check_level1(step_dir, manifest, progress=progress, item_problems=item_problems)
    if not result.problems:
        result.level_passed = 1
        if level >= 2:
            result.problems = check_level2(step_dir, manifest) + item_problems
            result.level_passed = 2 if not result.problems else 1
        if level >= 3 and not result.problems:
            result.problems = check_level3(step_dir, timeout_s=testload_timeout_s, command=testload_command)
            result.level_passed = 3 if not result.problems else 2


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def _record_quietly(step_dir: Path, result: ValidationResult) -> None:
    """Record the outcome; a record that cannot be written (a read-only or foreign dir, a
    directory standing at validation.json) costs a later re-check, never the result itself."""
    try:
        _record(step_dir, result)
    except OSError as err:
        log.warning("ckptsup: could not record the validation of %s (%s); it will be checked again next time",
                    step_dir, err.strerror or err)


def _record(step_dir: Path, result: ValidationResult) -> None:
    previous = read_validation(step_dir)
    level = result.level_passed
    # A passing level-1 re-check must not erase an earlier level-3 pass of the same checkpoint.
    if result.ok and previous and previous.get("ok") and previous.get("checkpoint_id") == result.checkpoint_id:
        level = max(level, int(previous.get("level", 0)))
    atomic_write_json(step_dir / VALIDATION_NAME, {
        "ok": result.ok, "level": level, "requested": result.level, "problems": result.problems,
        "checkpoint_id": result.checkpoint_id, "duration_s": round(result.duration_s, 6),
        "ts": datetime.now(timezone.utc).isoformat(),
    })


def read_validation(step_dir: Path) -> dict[str, Any] | None:
    """The recorded validation, or None when absent, unreadable, not a regular file (a FIFO, a
    symlink: never followed, never blocks) or not of the shape ckptsup writes (then: not validated)."""
    try:
        data = read_json(Path(step_dir) / VALIDATION_NAME, max_bytes=MAX_RECORD_BYTES, what="validation record",
                         error=ValidationError, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError, CkptsupError, OSError):
        return None
    return data if _is_record(data) else None


def _is_record(data: Any) -> bool:
    """The fields readers act on, with their types: ok (bool), level (0-3), checkpoint_id (str),
    problems (a list of strings)."""
    if not isinstance(data, dict):
        return False
    level, problems = data.get("level", 0), data.get("problems", [])
    return (type(data.get("ok")) is bool and type(level) is int and 0 <= level <= 3
            and isinstance(data.get("checkpoint_id", ""), str)
            and isinstance(problems, list) and all(isinstance(p, str) for p in problems))


# ---- reader-side item check -----------------------------------------------------------------

def verify_item(data: bytes | bytearray | memoryview, item: ItemEntry) -> None:
    """The reader's per-item check: one read, hashed as loaded. Raises ValidationError."""
    if len(data) != item.length:
        raise ValidationError(f"item {item.key!r} in {item.file}: read {len(data)} bytes, manifest says {item.length}; checkpoint is corrupt")
    actual = hash_bytes(data, algorithm_of(item.hash))
    if actual != item.hash:
        raise ValidationError(f"item {item.key!r} in {item.file} at offset {item.offset}: hash {actual} != {item.hash}; checkpoint is corrupt")


# ---- quarantine -----------------------------------------------------------------------------

def quarantine(step_dir: str | os.PathLike[str], reason: str, *, now: datetime | None = None) -> Path:
    """Move a bad checkpoint to <checkpoint_dir>/quarantine/<name>-<ts>/ with a reason file.
    Never deletes anything."""
    step_dir = Path(step_dir)
    when = now or datetime.now(timezone.utc)
    qdir = private_mkdir(step_dir.parent / QUARANTINE_DIR)
    stamp = when.strftime("%Y%m%dT%H%M%S%fZ")
    dest = qdir / f"{step_dir.name}-{stamp}"
    rename_noreplace(step_dir, dest)
    atomic_write_json(dest / REASON_NAME, {"reason": reason, "ts": when.isoformat(), "from": step_dir.name})
    return dest
