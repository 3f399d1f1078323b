"""Retention (docs/checkpoint-core.md §Retention): keep the last K checkpoints plus the newest one
of each of the last D days, per tier. Never delete the newest validated checkpoint, nor one being
validated or promoted (`protected`). The decision is a pure function; `apply_retention` is the
effect, with the clock injected. Deletion renames to `.del-*` first, so a half-deleted directory is
never mistaken for a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import CheckpointError
from .catalog import Status, list_checkpoints
from .commit import fsync_dir

DELETING_PREFIX = ".del-"
VALIDATED = "validated"     # flag: validation passed (levels 1-2 or more)
VALIDATING = "validating"   # flag: a validation is running on it
PROMOTING = "promoting"     # flag: queued for or being promoted to a slower tier


@dataclass(frozen=True, kw_only=True)
class Candidate:
    step: int
    created_at: datetime
    flags: frozenset[str] = field(default_factory=frozenset)


def _as_candidate(entry: Candidate | tuple) -> Candidate:
    if isinstance(entry, Candidate):
        return entry
    step, created_at, flags = entry
    return Candidate(step=step, created_at=created_at, flags=frozenset(flags))


def daily_keepers(candidates: Iterable[Candidate], *, keep_daily_days: int, now: datetime) -> set[int]:
    """The newest checkpoint (by step) of each UTC calendar day among the last D days, today
    included. Level 3 should pass before one of these becomes a long-lived keeper."""
    if keep_daily_days <= 0:
        return set()
    today = now.astimezone(timezone.utc).date()
    # any number of days: more than the calendar holds means every day since year 1
    first_day = today - timedelta(days=min(keep_daily_days - 1, (today - date.min).days))
    newest: dict[object, Candidate] = {}
    for c in candidates:
        day = _utc_day(c)
        if day is None or day < first_day or day > today:
            continue
        if day not in newest or c.step > newest[day].step:
            newest[day] = c
    return {c.step for c in newest.values()}


def _utc_day(c: Candidate) -> date | None:
    """The candidate's UTC day; None when its time has none (year 1 east of UTC, year 9999 west of
    it: parse_created_at refuses such manifests, a Candidate built elsewhere may still hold one)."""
    try:
        return c.created_at.astimezone(timezone.utc).date()
    except OverflowError:
        return None


def plan_retention(checkpoints: Sequence[Candidate | tuple], *, keep_last: int, keep_daily_days: int,
                   now: datetime, protected: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """Pure: (keep, delete) lists of steps, ascending. `checkpoints` are (step, created_at,
    flags) tuples or Candidates of usable (committed) checkpoints on one tier."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 (got {keep_last}): deleting every checkpoint is never a plan")
    cands = sorted((_as_candidate(c) for c in checkpoints), key=lambda c: c.step)
    keep = {c.step for c in cands[-keep_last:]}
    keep |= daily_keepers(cands, keep_daily_days=keep_daily_days, now=now)
    validated = [c.step for c in cands if VALIDATED in c.flags]
    if validated:
        keep.add(validated[-1])
    keep |= {c.step for c in cands if c.flags & {VALIDATING, PROMOTING}}
    keep |= set(protected) & {c.step for c in cands}
    delete = [c.step for c in cands if c.step not in keep]
    return sorted(keep), delete


@dataclass(kw_only=True)
class RetentionResult:
    keep: list[int]
    delete: list[int]
    deleted: list[int]
    skipped: list[int]   # not usable (incomplete/rejected): left for a human or quarantine
    needs_test_load: list[int] = field(default_factory=list)  # daily keepers due a level-3 test load


def apply_retention(checkpoint_dir: str | os.PathLike[str], *, keep_last: int, keep_daily_days: int,
                    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                    protected: Iterable[int] = (), dry_run: bool = False) -> RetentionResult:
    """Plan on the committed checkpoints of one local tier and delete what the plan says.
    Incomplete and rejected directories are never deleted here (quarantine handles those)."""
    checkpoint_dir = Path(checkpoint_dir)
    infos = list_checkpoints(checkpoint_dir)
    usable = [i for i in infos if i.status in (Status.COMMITTED, Status.VALIDATED) and i.manifest is not None]
    cands = [Candidate(step=i.step, created_at=i.manifest.created_datetime,
                       flags=frozenset({VALIDATED} if i.validated_level >= 2 else set()))
             for i in usable if i.manifest is not None]   # (usable ones have one; said again for the checker)
    keep, delete = plan_retention(cands, keep_last=keep_last, keep_daily_days=keep_daily_days, now=clock(), protected=protected)
    deleted: list[int] = []
    if not dry_run:
        by_step = {i.step: i.path for i in usable}
        for step in delete:
            delete_step_dir(by_step[step])
            deleted.append(step)
    skipped = sorted(i.step for i in infos if i not in usable)
    levels = {i.step: i.validated_level for i in usable}
    daily = daily_keepers(cands, keep_daily_days=keep_daily_days, now=clock())
    return RetentionResult(keep=keep, delete=delete, deleted=deleted, skipped=skipped,
                           needs_test_load=due_test_loads(cands, daily=daily, levels=levels, keep_last=keep_last))


def due_test_loads(cands: Sequence[Candidate], *, daily: set[int], levels: dict[int, int], keep_last: int) -> list[int]:
    """Pure: the daily keepers that need a level-3 test load now. Today's newest is a daily keeper
    at every commit, so testing each would run one per commit: a keeper still among the last K is
    tested only while no checkpoint of its day has passed level 3; it becomes a long-lived keeper
    when it leaves the last K, and is tested then unless it already passed."""
    day = {c.step: _utc_day(c) for c in cands}
    last_k = {c.step for c in sorted(cands, key=lambda c: c.step)[-keep_last:]}
    tested_days = {day[s] for s, level in levels.items() if level >= 3 and s in day}
    return sorted(s for s in daily if levels.get(s, 0) < 3 and (s not in last_k or day[s] not in tested_days))


def delete_step_dir(step_dir: Path) -> None:
    """Rename to .del-<name>-<uuid> (atomic: from here on it is not a checkpoint), fsync the
    parent, then remove."""
    doomed = step_dir.parent / f"{DELETING_PREFIX}{step_dir.name}-{uuid.uuid4().hex[:8]}"
    os.rename(step_dir, doomed)
    fsync_dir(step_dir.parent)
    shutil.rmtree(doomed)


def apply_tier_retention(tier, *, keep_last: int, keep_daily_days: int,
                         clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                         protected: Iterable[int] = (), validated: Iterable[int] = (),
                         dry_run: bool = False) -> RetentionResult:
    """Retention on any Tier (e.g. the S3 tier): same plan, using the tier's own manifests for
    creation times. `validated` are the steps whose validation passed (recorded on the shared
    tier), so the newest validated one survives on every tier."""
    validated = set(validated)
    cands = []
    skipped = []
    for step in tier.list_steps():
        manifest = tier.get_manifest(step)
        if manifest is None:
            skipped.append(step)
            continue
        cands.append(Candidate(step=step, created_at=manifest.created_datetime,
                               flags=frozenset({VALIDATED} if step in validated else set())))
    keep, delete = plan_retention(cands, keep_last=keep_last, keep_daily_days=keep_daily_days, now=clock(), protected=protected)
    deleted = []
    if not dry_run:
        for step in delete:
            tier.delete(step)
            deleted.append(step)
    return RetentionResult(keep=keep, delete=delete, deleted=deleted, skipped=sorted(skipped))
