"""After-commit housekeeping on real files: promotion to a slower tier, retention on both tiers,
level-3 test loads every Nth commit (a failing one is quarantined), events for each."""

from __future__ import annotations

import sys
from pathlib import Path

from ckptsup.checkpoint.catalog import Status, latest_validated, list_checkpoints
from ckptsup.checkpoint.housekeeping import Housekeeper
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.tiers import LocalTier, TierKind
from ckptsup.checkpoint.validate import validate
from ckptsup.config import Config
from ckptsup.events import Event


def _testload_script(tmp_path: Path) -> list[str]:
    script = tmp_path / "testload.py"
    script.write_text("import sys\nsys.exit(1 if sys.argv[1].endswith('step_4') else 0)\n")
    return [sys.executable, str(script)]


def test_after_commit_promotes_prunes_every_tier_and_test_loads_every_nth(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    slow = LocalTier(name="archive", root=tmp_path / "archive", kind=TierKind.OBJECT)
    events: list[tuple[Event, dict]] = []
    keeper = Housekeeper(checkpoint_dir=shared, slower_tiers=[slow], keep_last=2, keep_daily_days=0, test_load_every=2,
                         emit=lambda e, f: events.append((e, f)), testload_command=_testload_script(tmp_path),
                         promote_retries=2, promote_wait_initial_s=0.01)
    for step in range(1, 7):
        path = write_synthetic(shared, step=step)
        assert validate(path, level=2).ok
        keeper.after_commit(path)
    assert keeper.close(timeout_s=60)
    keeper.run_retention()

    validated3 = sorted(f["step"] for e, f in events if e is Event.CHECKPOINT_VALIDATED)
    rejected = [f for e, f in events if e is Event.CHECKPOINT_REJECTED]
    assert validated3 == [2, 6]
    assert [r["step"] for r in rejected] == [4] and "quarantine" in rejected[0]["quarantined_to"]
    quarantined = [i.step for i in list_checkpoints(shared, include_quarantined=True) if i.status is Status.QUARANTINED]
    assert quarantined == [4]
    # shared: the last 2 usable, plus nothing else (the newest validated is among them)
    assert [i.step for i in list_checkpoints(shared)] == [5, 6]
    assert latest_validated(shared, min_level=3).step == 6
    promoted_ok = sorted(f["step"] for e, f in events if e is Event.CHECKPOINT_PROMOTED and f["ok"])
    assert {1, 2, 3, 5, 6} <= set(promoted_ok)
    assert slow.list_steps()[-2:] == [5, 6] and 4 not in slow.list_steps()


def test_from_config_uses_the_config_knobs_and_no_slower_tier_without_object_store(tmp_path: Path) -> None:
    cfg = Config()
    cfg.checkpoint.keep_last = 4
    keeper = Housekeeper.from_config(cfg, checkpoint_dir=tmp_path / "ck", job_id="7")
    try:
        assert keeper.keep_last == 4 and keeper.promoter is None and keeper.slower_tiers == []
    finally:
        assert keeper.close(timeout_s=5)
