"""External checkpoints under the real `ckptsup launch` (local mode, real torchrun, 2 gloo ranks):
torchtitan's real `CheckpointManager` writes `step-N` folders (tests/helpers/titan_train.py), the
agents hash them, the supervisor keeps their manifests in the run dir, and a bad folder is moved out
of the framework's folder so that torchtitan's own "load latest" resumes from a good one."""
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ckptsup.checkpoint import external as ext
from ckptsup.events import read_events

from drop_in_helpers import rank_process
from run_helpers import CKPTSUP, named, wait_for

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent / "helpers" / "titan_train.py"
STEPS, EVERY, KEEP = 30, 5, 3


def launch(tmp: Path, *extra: str, plain: bool = False) -> tuple[subprocess.Popen, Path, Path]:
    run, ckpt = tmp / "run", tmp / "ckpt"
    cfg = tmp / "job.toml"
    cfg.write_text('[checkpoint]\nexternal_dir = "ckpt"\n[supervisor]\nheartbeat_interval_s = 0.5\n'
                   'init_timeout_s = 2.0\n')
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run), str(SCRIPT),
            "--steps", str(STEPS), "--every", str(EVERY), "--keep", str(KEEP), "--folder", str(ckpt),
            "--out", str(tmp / "final.pt"), "--step-s", "0.1", *(["--plain-dcp"] if plain else []), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp)
    return proc, run, ckpt


def finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return out.decode(errors="replace")


def committed(run: Path) -> list[dict]:
    return [e for e in named(read_events(run), "checkpoint_committed") if e.get("external")]


def manifests(run: Path) -> set[str]:
    return set(ext.known_names(run))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted supervised run: its final parameters, events and folders. The script holds after
    step 5 until step-5's manifest exists, so that a folder torchtitan purges later was surely hashed
    first (on a loaded box the watch, newest first, could otherwise skip every purged one)."""
    tmp = tmp_path_factory.mktemp("titan-ref")
    proc, run, ckpt = launch(tmp, "--hold-after", str(EVERY), "--release",
                             str(ext.manifest_path(tmp / "run", f"step-{EVERY}")))
    console = finish(proc)
    assert proc.returncode == 0, console[-3000:]
    return {"model": torch.load(tmp / "final.pt"), "run": run, "ckpt": ckpt}


def test_an_uninterrupted_run_gets_manifests_that_vanish_with_purged_folders(reference):
    run, ckpt = reference["run"], reference["ckpt"]
    present = {f.name for f in ext.list_folders(ckpt, ext.compile_pattern(ext.DEFAULT_PATTERN))}
    assert present == {f"step-{s}" for s in range(STEPS - (KEEP - 1) * EVERY, STEPS + 1, EVERY)}   # keep_latest_k
    seen = {e["external"] for e in committed(run)}
    assert f"step-{EVERY}" in seen - present              # hashed while the run went on...
    assert manifests(run) <= present                       # ...and forgotten once torchtitan purged them
    for name in manifests(run):
        path = ext.manifest_path(run, name)
        assert path.stat().st_mode & 0o777 == 0o600
        manifest = ext.load_manifest(run, name)
        assert {f.path for f in manifest.files} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert manifest.metadata_hash and manifest.step == int(name.split("-")[1])
    assert not ext.quarantine_dir(ckpt).exists()


def test_a_corrupted_newest_folder_and_an_unfinished_one_are_moved_aside_and_the_run_ends_bit_identical(
        tmp_path, reference):
    """The script holds after saving step 15 until released: the test waits for step-10's and step-15's manifests,
    flips bytes in rank 1's file (same size), leaves an unfinished step-999 (no .metadata), then
    SIGKILLs rank 1. The next attempt finds both bad, moves them out of the framework's folder,
    torchtitan loads step-10, and the final parameters equal the uninterrupted run's."""
    release = tmp_path / "release"
    proc, run, ckpt = launch(tmp_path, "--hold-after", "15", "--release", str(release))
    try:
        # The watch hashes the newest unhashed folder first: step-15's manifest can come before
        # step-10's, and this test is about a resume from a step-10 hashed while the run went on.
        wait_for(lambda: {"step-10", "step-15"} <= {e["external"] for e in committed(run)}, 120,
                 "step-10's and step-15's manifests")
        victim = ckpt / "step-15" / "__1_0.distcp"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        (ckpt / "step-999").mkdir()
        (ckpt / "step-999" / "__0_0.distcp").write_bytes(b"half a save")
        release.touch()
        rank_process(SCRIPT, ckpt, 1).send_signal(signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    console = finish(proc)
    assert proc.returncode == 0, console[-3000:]
    events = read_events(run)
    rejected = [e for e in named(events, "checkpoint_rejected") if e.get("external")]
    assert [e["external"] for e in rejected] == ["step-999", "step-15"], rejected
    assert "no .metadata" in rejected[0]["reason"] and "corrupted" in rejected[1]["reason"]
    resumed = named(events, "external_resume")
    assert resumed[0]["folder"] == "step-10" and resumed[0]["checked"] == "hashes"
    assert resumed[0]["moved_aside"] == ["step-999", "step-15"]
    qdir = ext.quarantine_dir(ckpt)
    assert qdir.stat().st_mode & 0o777 == 0o700
    moved = sorted(p.name for p in qdir.iterdir() if p.is_dir())
    assert [m.rsplit("-", 1)[0] for m in moved] == ["step-15", "step-999"]
    for name in moved:
        reason = json.loads((qdir / (name + ext.REASON_SUFFIX)).read_text())
        assert reason["from"] in ("step-15", "step-999")
    assert not (ckpt / "step-999").exists()
    assert b"resumed from step 10" in console.encode()
    assert "moved step-15 out of" in console
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == reference["model"].keys()
    assert all(torch.equal(final[k], reference["model"][k]) for k in final)
    assert manifests(run) <= {f.name for f in ext.list_folders(ckpt, ext.compile_pattern(ext.DEFAULT_PATTERN))}


def test_a_plain_dcp_script_gets_manifests_too(tmp_path):
    """A script that calls dcp.save itself (no torchtitan): the same folders, the same manifests."""
    proc, run, ckpt = launch(tmp_path, plain=True)
    console = finish(proc)
    assert proc.returncode == 0, console[-3000:]
    seen = {e["external"] for e in committed(run)}
    assert seen and manifests(run) == seen, seen   # nothing purged: every manifest stays
    manifest = ext.load_manifest(run, sorted(seen)[0])
    assert {f.path for f in manifest.files} >= {".metadata", "__0_0.distcp"}
