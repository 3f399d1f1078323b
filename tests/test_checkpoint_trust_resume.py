"""Quarantine is for content only (docs/checkpoint-core.md §Trust is not content). A trust problem
of one checkpoint (owner, mode) skips it without quarantine, with one warning naming the fix, and
an older one is used; a trust problem of the checkpoint directory itself stops the resume choice
with one line naming the fix, as a usage problem (never requeued), and quarantines nothing.
Real files: chmod, and chown to nobody (the tests run as root)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.checkpoint.catalog import Status, list_checkpoints
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.trust import CheckpointDirUntrusted, OwnerModeError
from ckptsup.checkpoint.validate import read_validation, validate
from ckptsup.env import ExitStatus, should_requeue
from ckptsup.errors import TrustError
from ckptsup.supervisor.job.recovery import pick_resume

CKPTSUP = str(Path(sys.executable).with_name("ckptsup"))
ROOT = Path(__file__).resolve().parent.parent
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    for step in (100, 200, 300):
        write_synthetic(d, step=step, item_bytes=1000)
    return d


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.warnings: list[str] = []

    def emit(self, name, **fields) -> None:
        self.events.append((name.value, fields))

    def warn(self, line: str) -> None:
        self.warnings.append(line)

    def pick(self, ckdir: Path) -> str:
        return pick_resume(ckdir, self.emit, warn=self.warn)


def quarantined(ckdir: Path) -> list[str]:
    q = ckdir / "quarantine"
    return sorted(os.listdir(q)) if q.is_dir() else []


def chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, -1, follow_symlinks=False)


# ---- one untrusted checkpoint: skipped, never quarantined ---------------------------------------

@pytest.mark.parametrize("validated_first", [False, True], ids=["fresh", "validated-earlier"])
def test_a_group_writable_file_in_the_newest_skips_it_without_quarantine(ckdir: Path, validated_first: bool) -> None:
    if validated_first:   # the supervisor's cheap re-check of a recorded validation takes this path
        for step in (100, 200, 300):
            assert validate(ckdir / f"step_{step}", level=2).ok
    os.chmod(ckdir / "step_300" / "__0_0.distcp", 0o664)
    rec = Recorder()
    assert rec.pick(ckdir) == str(ckdir / "step_200")
    assert quarantined(ckdir) == [] and (ckdir / "step_300").is_dir()
    assert len(rec.warnings) == 1 and "step_300" in rec.warnings[0] and "chmod -R go-w" in rec.warnings[0]
    assert "\n" not in rec.warnings[0]
    rejected = [f for name, f in rec.events if name == "checkpoint_rejected"]
    assert len(rejected) == 1 and rejected[0]["step"] == 300 and rejected[0]["quarantined"] == ""
    # the fix the warning names makes it the resume point again, without any re-commit
    subprocess.run(["chmod", "-R", "go-w", str(ckdir / "step_300")], check=True)
    assert Recorder().pick(ckdir) == str(ckdir / "step_300")


@as_root
def test_a_newest_checkpoint_owned_by_another_user_is_skipped_without_quarantine(ckdir: Path) -> None:
    chown_tree(ckdir / "step_300", nobody())
    rec = Recorder()
    assert rec.pick(ckdir) == str(ckdir / "step_200")
    assert quarantined(ckdir) == [] and (ckdir / "step_300").is_dir()
    assert len(rec.warnings) == 1 and f"owned by uid {nobody()}" in rec.warnings[0] and "chown" in rec.warnings[0]


def test_an_untrusted_checkpoint_is_not_judged_so_nothing_is_recorded(ckdir: Path) -> None:
    assert validate(ckdir / "step_300", level=2).ok
    before = read_validation(ckdir / "step_300")
    os.chmod(ckdir / "step_300", 0o770)
    result = validate(ckdir / "step_300", level=2)
    assert not result.ok and result.untrusted and "chmod -R go-w" in result.problems[0]
    assert read_validation(ckdir / "step_300") == before   # still the earlier pass: not REJECTED
    os.chmod(ckdir / "step_300", 0o700)
    assert {i.step: i.status for i in list_checkpoints(ckdir)}[300] is Status.VALIDATED


def test_verify_quarantine_leaves_an_untrusted_checkpoint_in_place(ckdir: Path) -> None:
    os.chmod(ckdir / "step_300" / "__1_0.distcp", 0o666)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([CKPTSUP, "ckpt", "verify", str(ckdir), "--quarantine"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "step_300: FAILED" in proc.stdout and "chmod -R go-w" in proc.stdout and "never quarantined" in proc.stdout
    assert quarantined(ckdir) == [] and (ckdir / "step_300").is_dir()


# ---- content problems still quarantine -----------------------------------------------------------

@pytest.mark.parametrize("spoil", ["bitflip", "symlink", "fifo", "hardlink"])
def test_content_and_structure_problems_still_quarantine_the_newest(ckdir: Path, tmp_path: Path, spoil: str) -> None:
    shard = ckdir / "step_300" / "__0_0.distcp"
    if spoil == "bitflip":
        data = bytearray(shard.read_bytes())
        data[10] ^= 1
        shard.write_bytes(bytes(data))
    elif spoil == "symlink":   # (a listed file that is a symlink makes the manifest unusable: INCOMPLETE, skipped)
        (tmp_path / "outside").write_bytes(b"x")
        (ckdir / "step_300" / "stray").symlink_to(tmp_path / "outside")
    elif spoil == "fifo":
        os.mkfifo(ckdir / "step_300" / "stray", 0o600)
    else:
        os.link(shard, tmp_path / "second-name")
    rec = Recorder()
    assert rec.pick(ckdir) == str(ckdir / "step_200")
    assert len(quarantined(ckdir)) == 1 and not (ckdir / "step_300").exists()
    rejected = [f for name, f in rec.events if name == "checkpoint_rejected"]
    assert len(rejected) == 1 and "quarantine" in rejected[0]["quarantined"]


# ---- the checkpoint directory itself: stop, one line, a usage problem, nothing quarantined ---------

def _assert_stops_with_one_line(ckdir: Path, needle: str) -> None:
    statuses = {i.step: i.status for i in list_checkpoints(ckdir)}
    with pytest.raises(CheckpointDirUntrusted) as err:
        Recorder().pick(ckdir)
    line = str(err.value)
    assert "\n" not in line and needle in line, line
    assert isinstance(err.value, TrustError)
    assert err.value.exit_code == ExitStatus.USAGE and not should_requeue(err.value.exit_code)
    assert quarantined(ckdir) == [] and {i.step: i.status for i in list_checkpoints(ckdir)} == statuses


@as_root
def test_a_checkpoint_dir_owned_by_another_user_stops_with_the_fix(ckdir: Path) -> None:
    os.chown(ckdir, nobody(), -1)
    _assert_stops_with_one_line(ckdir, "chown")


@as_root
def test_a_checkpoint_dir_chowned_recursively_quarantines_nothing(ckdir: Path) -> None:
    """Today's worst case: every good checkpoint was quarantined and the run started from step 0."""
    chown_tree(ckdir, nobody())
    _assert_stops_with_one_line(ckdir, f"owned by uid {nobody()}")
    assert sorted(p.name for p in ckdir.iterdir()) == ["step_100", "step_200", "step_300"]


def test_a_group_writable_checkpoint_dir_stops_with_the_fix(ckdir: Path) -> None:
    os.chmod(ckdir, 0o770)
    _assert_stops_with_one_line(ckdir, "chmod -R go-w")


def test_when_every_checkpoint_is_untrusted_the_run_stops_instead_of_starting_over(ckdir: Path) -> None:
    for step in (100, 200, 300):
        os.chmod(ckdir / f"step_{step}" / ".metadata", 0o662)
    _assert_stops_with_one_line(ckdir, "chmod -R go-w")


def test_a_missing_checkpoint_dir_is_a_fresh_start(tmp_path: Path) -> None:
    assert Recorder().pick(tmp_path / "never-made") == ""


def test_owner_and_mode_refusals_are_owner_mode_errors_and_links_are_not(tmp_path: Path) -> None:
    from ckptsup.checkpoint.trust import check_dir_trusted

    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "f").write_bytes(b"x")
    os.chmod(d / "f", 0o620)
    with pytest.raises(OwnerModeError):
        check_dir_trusted(d, recursive=True)
    os.chmod(d / "f", 0o600)
    (d / "l").symlink_to(d / "f")
    with pytest.raises(TrustError) as err:
        check_dir_trusted(d, recursive=True)
    assert not isinstance(err.value, OwnerModeError)


@as_root
def test_ckptsup_launch_with_an_untrusted_checkpoint_dir_exits_usage_with_one_line(tmp_path: Path) -> None:
    """The supervisor reports it as a usage problem (exit 2, never requeued) before any launch."""
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    write_synthetic(ck, step=5, item_bytes=100)
    os.chmod(run_dir, 0o700)
    os.chown(ck, nobody(), -1)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTSUP_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([CKPTSUP, "launch", "--run-dir", str(run_dir), str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == ExitStatus.USAGE, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptsup: error:")]
    assert len(errors) == 1 and "chown" in errors[0], proc.stderr
    assert (ck / "step_5").is_dir() and not (ck / "quarantine").exists()
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "checkpoint_rejected" not in events


@as_root
def test_a_shard_its_owner_cannot_read_is_a_permission_problem_not_content(tmp_path: Path) -> None:
    """Run as nobody (a user without root's way past modes): a 0000 file in the newest checkpoint
    used to fail level 1 as content and be quarantined by `verify --quarantine`."""
    import shutil
    import tempfile

    from test_cli_bad_inputs import AS_NOBODY, nobody_ckptsup, nobody_env

    if not AS_NOBODY:
        pytest.skip("setpriv/runuser not available")
    root = Path(tempfile.mkdtemp(prefix="ckptsup-unreadable-"))
    try:
        os.chmod(root, 0o755)
        ck = root / "ck"
        for step in (1, 2):
            write_synthetic(ck, step=step, item_bytes=100)
        chown_tree(ck, nobody())
        os.chmod(ck / "step_2" / "__0_0.distcp", 0o000)
        proc = subprocess.run([*AS_NOBODY, nobody_ckptsup(), "ckpt", "verify", str(ck), "--quarantine"],
                              capture_output=True, text=True, timeout=120, cwd=root, env=nobody_env(dict(os.environ)))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "step_1: ok" in proc.stdout and "step_2: FAILED" in proc.stdout and "chmod u+r" in proc.stdout, proc.stdout
        assert (ck / "step_2").is_dir() and not (ck / "quarantine").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
