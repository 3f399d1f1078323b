"""Hostile files in a checkpoint directory (a FIFO or a /dev/zero link where a record should be, a
record of the wrong type, a lone surrogate, numbers past any real size, timestamps at the ends of
the calendar, a manifest in a directory not named step_<N>): every `ckptsup ckpt` command answers
with at most one error line and never hangs; retention and the supervisor's resume choice skip or
reject the bad newest checkpoint and use the older good one, without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

import pytest

from ckptsup.checkpoint.retention import apply_retention, daily_keepers, Candidate
from ckptsup.checkpoint.synthetic import write_synthetic

CKPTSUP = str(Path(sys.executable).with_name("ckptsup"))
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20   # far beyond any of these commands; a FIFO read blocks forever


def _manifest(step_dir: Path, mutate: Callable[[dict], None]) -> None:
    path = step_dir / "manifest.json"
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))   # json.dumps writes a lone surrogate as the \ud800 escape


def fifo_manifest(step: Path) -> None:
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json", 0o600)


def fifo_validation(step: Path) -> None:
    os.mkfifo(step / "validation.json", 0o600)


def validation_to_dev_zero(step: Path) -> None:
    os.symlink("/dev/zero", step / "validation.json")


def validation_level_x(step: Path) -> None:
    (step / "validation.json").write_text(json.dumps({"ok": True, "level": "x", "problems": [], "checkpoint_id": ""}))


def surrogate_file_name(step: Path) -> None:
    _manifest(step, lambda m: m["files"][0].update(path="__0_0.distcp\ud800"))


def size_10e400(step: Path) -> None:
    _manifest(step, lambda m: m["files"][0].update(size=10 ** 400))


def item_offset_10e400(step: Path) -> None:
    _manifest(step, lambda m: m["items"][0].update(offset=10 ** 400))


def created_year_1(step: Path) -> None:
    _manifest(step, lambda m: m.update(created_at="0001-01-01T00:00:00+01:00"))


def created_year_9999(step: Path) -> None:
    _manifest(step, lambda m: m.update(created_at="9999-12-31T23:00:00-05:00"))


HOSTILE = [fifo_manifest, fifo_validation, validation_to_dev_zero, validation_level_x, surrogate_file_name,
           size_10e400, item_offset_10e400, created_year_1, created_year_9999]
# a bad record is not a bad checkpoint: re-validated, it is the one resumed from
CONTENT_OK = {fifo_validation, validation_to_dev_zero, validation_level_x}


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    now = datetime.now(timezone.utc)
    for step in (100, 200, 300):
        write_synthetic(d, step=step, item_bytes=1000, created_at=now - timedelta(hours=3 - step // 100))
    return d


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([CKPTSUP, "ckpt", *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`ckptsup ckpt {' '.join(args)}` hung for {TIMEOUT_S} s")


def assert_at_most_one_error_line(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 1, proc.stderr
    if lines:
        assert lines[0].startswith("ckptsup: error: "), proc.stderr
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr)


COMMANDS = [("list", "dir"), ("list", "step"), ("inspect", "dir"), ("inspect", "step"), ("verify", "dir"),
            ("verify", "step"), ("prune", "dir")]


@pytest.mark.parametrize("command, target", COMMANDS, ids=[f"{c}-{t}" for c, t in COMMANDS])
@pytest.mark.parametrize("make_bad", HOSTILE, ids=[f.__name__ for f in HOSTILE])
def test_every_ckpt_command_answers_a_hostile_newest_checkpoint_in_one_line(ckdir: Path, make_bad, command: str,
                                                                           target: str) -> None:
    make_bad(ckdir / "step_300")
    path = ckdir if target == "dir" else ckdir / "step_300"
    extra = ["--dry-run", "--keep-last", "1", "--keep-daily-days", "3"] if command == "prune" else []
    proc = run_cli(command, str(path), *extra)
    assert_at_most_one_error_line(proc)
    if command == "list" and target == "dir":
        rows = {int(line.split()[0]): line for line in proc.stdout.splitlines()[1:]}
        assert rows.keys() == {100, 200, 300} and "committed" in rows[200], proc.stdout
    if command == "verify" and target == "dir":
        assert "step_200: ok" in proc.stdout, proc.stdout
    if command == "prune":
        assert "keep" in proc.stdout and "200" in proc.stdout, proc.stdout


@pytest.mark.parametrize("make_bad", HOSTILE, ids=[f.__name__ for f in HOSTILE])
def test_retention_skips_a_hostile_newest_checkpoint(ckdir: Path, make_bad) -> None:
    make_bad(ckdir / "step_300")
    result = apply_retention(ckdir, keep_last=1, keep_daily_days=0, dry_run=True)
    if make_bad in CONTENT_OK:
        assert result.keep == [300] and result.delete == [100, 200]
    else:
        assert 300 in result.skipped and result.keep == [200] and result.delete == [100]


PICK = """
import json, sys
from pathlib import Path
from ckptsup.supervisor.job.recovery import pick_resume
events = []
chosen = pick_resume(Path(sys.argv[1]), lambda name, **fields: events.append([str(name.value), fields.get("step")]))
print(json.dumps({"chosen": chosen, "events": events}))
"""


def pick_resume_in_a_child(ckdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-c", PICK, str(ckdir)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pick_resume hung for {TIMEOUT_S} s (the supervisor would hang before every launch)")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("make_bad", HOSTILE, ids=[f.__name__ for f in HOSTILE])
def test_the_supervisor_resumes_from_the_older_good_checkpoint_past_a_hostile_newest(ckdir: Path, make_bad) -> None:
    make_bad(ckdir / "step_300")
    outcome = pick_resume_in_a_child(ckdir)
    expected = "step_300" if make_bad in CONTENT_OK else "step_200"
    assert outcome["chosen"] == str(ckdir / expected), outcome


def test_a_fifo_manifest_does_not_block_the_resume_choice_of_an_already_validated_run(ckdir: Path) -> None:
    """The recorded-validation path (recheck) reads the manifest too."""
    from ckptsup.checkpoint.validate import validate

    for step in (100, 200, 300):
        assert validate(ckdir / f"step_{step}", level=2).ok
    fifo_manifest(ckdir / "step_300")
    assert pick_resume_in_a_child(ckdir)["chosen"] == str(ckdir / "step_200")


@pytest.mark.parametrize("command", ["list", "inspect", "verify", "prune"])
def test_a_directory_not_named_step_n_holding_a_manifest_is_one_line(ckdir: Path, command: str) -> None:
    (ckdir / "step_300").rename(ckdir / "mine")
    proc = run_cli(command, str(ckdir / "mine"))
    assert_at_most_one_error_line(proc)
    assert proc.returncode == 1 and "step_<N>" in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["list", "inspect", "verify", "prune"])
def test_a_path_with_a_lone_surrogate_is_one_line(ckdir: Path, command: str, capsys) -> None:
    from ckptsup.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["ckpt", command, str(ckdir / "step_5\ud800")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ckptsup: error: ") and "cannot be encoded" in err[0], err


def test_an_undecodable_file_name_in_a_step_dir_is_reported_not_a_crash(ckdir: Path) -> None:
    """os.listdir hands such a name back with surrogate escapes; printing it must not raise."""
    with open(os.path.join(os.fsencode(ckdir / "step_300"), b"stray\xff"), "wb") as fh:
        fh.write(b"x")
    proc = run_cli("verify", str(ckdir))
    assert_at_most_one_error_line(proc)
    assert proc.returncode == 1 and "step_300: FAILED" in proc.stdout and "stray" in proc.stdout, proc.stdout


@pytest.mark.parametrize("days", ["100000000000000000000", "1e20"])
def test_prune_with_an_absurd_number_of_daily_days_is_an_answer_or_one_line(ckdir: Path, days: str) -> None:
    _manifest(ckdir / "step_100", lambda m: m.update(created_at="0001-01-01T00:00:00+00:00"))   # valid, and ancient
    proc = run_cli("prune", str(ckdir), "--dry-run", "--keep-last", "1", "--keep-daily-days", days)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 1, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr   # an answer, or click's one-line usage error
    if proc.returncode == 0:
        assert "keep" in proc.stdout and "100" in proc.stdout.splitlines()[0], proc.stdout


def test_daily_keepers_take_any_number_of_days_and_any_representable_date() -> None:
    now = datetime(2026, 1, 2, 12, tzinfo=timezone.utc)
    cands = [Candidate(step=1, created_at=datetime(1, 1, 1, tzinfo=timezone.utc)),
             Candidate(step=2, created_at=datetime(9999, 12, 31, 23, tzinfo=timezone.utc)),
             Candidate(step=3, created_at=now - timedelta(hours=1))]
    assert daily_keepers(cands, keep_daily_days=10 ** 20, now=now) == {1, 3}
    assert daily_keepers(cands, keep_daily_days=1, now=now) == {3}
