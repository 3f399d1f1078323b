"""`ckptsup ckpt list|verify|inspect|prune DIR` through the real console script: one-line errors
for bad DIRs, non-zero exit on a failed verify, --json everywhere, prune --dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptsup.checkpoint.synthetic import write_synthetic

CKPTSUP = str(Path(sys.executable).with_name("ckptsup"))


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([CKPTSUP, "ckpt", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    old = datetime.now(timezone.utc) - timedelta(days=40)
    for step in (100, 200, 300, 400):
        write_synthetic(d, step=step, item_bytes=10_000, created_at=old + timedelta(hours=step))
    return d


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("make_bad, expected", [
    (lambda tmp: tmp / "missing", "does not exist"),
    (lambda tmp: (tmp / "f").write_text("x") and tmp / "f", "is not a directory"),
    (lambda tmp: (tmp / "link").symlink_to(tmp) or tmp / "link", "is a symlink"),
    (lambda tmp: (tmp / "open").mkdir(mode=0o777) or os.chmod(tmp / "open", 0o777) or tmp / "open", "chmod -R go-w"),
])
@pytest.mark.parametrize("command", ["list", "verify", "inspect", "prune"])
def test_a_bad_dir_is_one_line_with_the_fix_and_a_nonzero_exit(tmp_path: Path, make_bad, expected: str, command: str) -> None:
    bad = make_bad(tmp_path)
    proc = run(command, str(bad))
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptsup: error:") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_passes_a_clean_dir_and_records_levels(ckdir: Path) -> None:
    proc = run("verify", str(ckdir), "--level", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(": ok (level 2") == 4
    listed = json.loads(run("list", str(ckdir), "--json").stdout)
    assert [(r["step"], r["status"], r["validated_level"]) for r in listed] == [(s, "validated", 2) for s in (100, 200, 300, 400)]


def test_verify_exits_nonzero_naming_the_corrupt_file_and_can_quarantine(ckdir: Path) -> None:
    _flip(ckdir / "step_300" / "__1_0.distcp")
    proc = run("verify", str(ckdir), "--json", "--quarantine")
    assert proc.returncode == 1
    rows = json.loads(proc.stdout)
    bad = [r for r in rows if not r["ok"]]
    assert len(bad) == 1 and "__1_0.distcp" in bad[0]["problems"][0] and "quarantine" in bad[0]["quarantined_to"]
    assert "1 of 4 checkpoint(s) failed" in proc.stderr
    summary = json.loads(run("inspect", str(ckdir), "--json").stdout)
    assert summary["latest_validated"] == 400 and summary["counts"]["quarantined"] == 1


def test_verify_of_one_step_dir_and_a_missing_manifest(ckdir: Path) -> None:
    (ckdir / "step_400" / "manifest.json").unlink()
    proc = run("verify", str(ckdir / "step_400"))
    assert proc.returncode == 1 and "never committed" in proc.stdout
    assert run("verify", str(ckdir / "step_200")).returncode == 0


def test_inspect_shows_the_manifest_without_reading_the_pickle(ckdir: Path) -> None:
    (ckdir / "step_200" / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")   # would run code if unpickled
    payload = json.loads(run("inspect", str(ckdir / "step_200"), "--json").stdout)
    assert payload["step"] == 200 and payload["world_size"] == 2 and payload["items"] == 8
    assert {f["path"] for f in payload["file_list"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    human = run("inspect", str(ckdir / "step_200"))
    assert human.returncode == 0 and "checkpoint_id" in human.stdout


def test_prune_dry_run_plans_and_prune_deletes(ckdir: Path) -> None:
    plan = json.loads(run("prune", str(ckdir), "--keep-last", "2", "--keep-daily-days", "0", "--dry-run", "--json").stdout)
    assert plan["delete"] == [100, 200] and plan["deleted"] == [] and plan["keep"] == [300, 400]
    assert len(list(ckdir.glob("step_*"))) == 4
    proc = run("prune", str(ckdir), "--keep-last", "2", "--keep-daily-days", "0")
    assert proc.returncode == 0 and "deleted 2: 100, 200" in proc.stdout
    assert sorted(p.name for p in ckdir.glob("step_*")) == ["step_300", "step_400"]


def test_prune_refuses_while_a_live_writer_holds_the_dir(ckdir: Path) -> None:
    from ckptsup.checkpoint.commit import WriterLock

    with WriterLock(ckdir, epoch=0):
        proc = run("prune", str(ckdir), "--keep-last", "1", "--keep-daily-days", "0")
        assert proc.returncode != 0 and "is being written by pid" in proc.stderr
        assert len(list(ckdir.glob("step_*"))) == 4


def test_verify_shows_a_progress_bar_on_request(ckdir: Path, monkeypatch) -> None:
    from click.testing import CliRunner

    from ckptsup.checkpoint import cli

    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    result = CliRunner().invoke(cli.ckpt, ["verify", str(ckdir), "--progress"])
    assert result.exit_code == 0, result.output
    assert result.output.count(": ok (level 2") == 4
