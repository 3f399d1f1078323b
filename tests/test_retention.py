"""Retention with an injected clock: keep the last 3 + one a day for 14 days; never delete the
newest validated checkpoint or anything protected (being validated or promoted)."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import list_checkpoints
from ckptsup.checkpoint.retention import (
    PROMOTING, VALIDATED, VALIDATING, Candidate, apply_retention, daily_keepers, plan_retention,
)
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.validate import validate
from ckptsup.errors import CheckpointError

NOW = datetime(2026, 3, 31, 12, 0, tzinfo=timezone.utc)


def _history(days: int = 30, per_day: int = 4) -> list[Candidate]:
    """A save every 6 hours for `days` days up to NOW; step = 100 per save."""
    out = []
    start = NOW - timedelta(days=days)
    for i in range(days * per_day + 1):
        out.append(Candidate(step=100 * (i + 1), created_at=start + timedelta(hours=24 / per_day * i)))
    return out


def test_keeps_the_last_three_and_the_newest_of_each_of_the_last_14_days() -> None:
    cands = _history()
    keep, delete = plan_retention(cands, keep_last=3, keep_daily_days=14, now=NOW)
    newest_three = [c.step for c in cands[-3:]]
    assert set(newest_three) <= set(keep)
    days = {}
    for c in cands:
        days.setdefault(c.created_at.date(), []).append(c.step)
    recent_days = [d for d in days if d > (NOW - timedelta(days=14)).date()]
    assert len(recent_days) == 14
    for day in recent_days:
        assert max(days[day]) in keep                    # one a day, the newest of the day
        assert sum(s in keep for s in days[day]) <= 1 + 3  # not more (the last 3 may share today)
    old_days = [d for d in days if d <= (NOW - timedelta(days=14)).date()]
    assert not any(s in keep for d in old_days for s in days[d])
    assert sorted(keep + delete) == [c.step for c in cands] and not set(keep) & set(delete)
    assert len(keep) == 14 + 3 - 1   # today's newest is both a daily keeper and among the last 3


def test_the_newest_validated_and_protected_checkpoints_are_never_deleted() -> None:
    cands = _history()
    old_validated = cands[5]
    cands[5] = Candidate(step=old_validated.step, created_at=old_validated.created_at, flags=frozenset({VALIDATED}))
    cands[6] = Candidate(step=cands[6].step, created_at=cands[6].created_at, flags=frozenset({VALIDATING}))
    cands[7] = Candidate(step=cands[7].step, created_at=cands[7].created_at, flags=frozenset({PROMOTING}))
    keep, delete = plan_retention(cands, keep_last=3, keep_daily_days=14, now=NOW, protected={cands[8].step})
    for c in cands[5:9]:
        assert c.step in keep and c.step not in delete
    # an older validated one is not protected once a newer one is validated
    cands[50] = Candidate(step=cands[50].step, created_at=cands[50].created_at, flags=frozenset({VALIDATED}))
    keep, delete = plan_retention(cands, keep_last=3, keep_daily_days=14, now=NOW)
    assert cands[50].step in keep and cands[5].step in delete


def test_plain_tuples_are_accepted_and_keep_last_zero_is_refused() -> None:
    tuples = [(c.step, c.created_at, set()) for c in _history(days=2)]
    keep, _ = plan_retention(tuples, keep_last=2, keep_daily_days=0, now=NOW)
    assert keep == [t[0] for t in tuples[-2:]]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        plan_retention(tuples, keep_last=0, keep_daily_days=14, now=NOW)


def test_daily_keepers_use_utc_days_and_ignore_the_future() -> None:
    cands = [Candidate(step=1, created_at=datetime(2026, 3, 30, 23, 30, tzinfo=timezone(timedelta(hours=-5)))),  # 31st UTC
             Candidate(step=2, created_at=datetime(2026, 3, 31, 1, 0, tzinfo=timezone.utc)),
             Candidate(step=3, created_at=NOW + timedelta(days=3))]  # a skewed clock on the writer
    assert daily_keepers(cands, keep_daily_days=1, now=NOW) == {2}


def test_apply_retention_deletes_on_disk_with_an_injected_clock(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    for i, step in enumerate(range(1, 9)):
        write_synthetic(ckdir, step=step, created_at=NOW - timedelta(days=8 - i))
    assert validate(ckdir / "step_2", level=2).ok
    result = apply_retention(ckdir, keep_last=3, keep_daily_days=2, clock=lambda: NOW, protected={4})
    # last 3 = 6,7,8; daily for 2 days (Mar 30-31) = 8; newest validated = 2; protected = 4
    remaining = [i.step for i in list_checkpoints(ckdir)]
    assert remaining == sorted(result.keep)
    assert {2, 4, 6, 7, 8} <= set(remaining)
    assert result.deleted == [1, 3, 5]
    assert not any(p.name.startswith(".del-") for p in ckdir.iterdir())


def test_dry_run_deletes_nothing_and_incomplete_dirs_are_left_alone(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    for step in range(1, 6):
        write_synthetic(ckdir, step=step, created_at=NOW - timedelta(days=30))
    (ckdir / "step_1" / "manifest.json").unlink()
    result = apply_retention(ckdir, keep_last=1, keep_daily_days=0, clock=lambda: NOW, dry_run=True)
    assert result.delete == [2, 3, 4] and result.deleted == [] and result.skipped == [1]
    assert len(list_checkpoints(ckdir)) == 5
    apply_retention(ckdir, keep_last=1, keep_daily_days=0, clock=lambda: NOW)
    assert [i.step for i in list_checkpoints(ckdir)] == [1, 5]


def _pass_level3(step_dir: Path) -> None:
    assert validate(step_dir, level=3, testload_command=[sys.executable, "-c", "pass"]).ok


def test_a_daily_keeper_is_test_loaded_once_its_day_has_none_and_when_it_leaves_the_last_k(tmp_path: Path) -> None:
    """Today's newest is a daily keeper at every commit: testing each would mean a test load per
    commit. Due: a day's keeper while that day has no level-3 pass, and a keeper leaving the last K."""
    ckdir = tmp_path / "ck"
    yesterday, today = NOW - timedelta(days=1), NOW - timedelta(hours=1)
    for step, created in ((1, yesterday), (2, yesterday), (3, today)):
        write_synthetic(ckdir, step=step, created_at=created)

    def due() -> list[int]:
        return apply_retention(ckdir, keep_last=3, keep_daily_days=2, clock=lambda: NOW, dry_run=True).needs_test_load

    assert due() == [2, 3]                      # neither day has a level-3 pass yet
    _pass_level3(ckdir / "step_1")
    _pass_level3(ckdir / "step_3")
    assert due() == []                          # each day has one; keepers 2 and 3 are among the last 3
    for step in (4, 5):
        write_synthetic(ckdir, step=step, created_at=today)
    assert due() == [2]                         # yesterday's keeper left the last 3 untested; 5 needs none
