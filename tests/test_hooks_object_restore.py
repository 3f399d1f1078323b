"""A resume fetches a checkpoint back from the object store (a real moto_server) when its shared
copy is gone or corrupt, validates it as it downloads and loads it through the verifying reader;
checkpoint_loaded says where the files came from (files_by_source). One process, real torch, real
DCP, real S3 client; the commits reach the store through the housekeeper's promotion."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hooks_helpers import attach_parts, make_parts, private_dir, train_steps
from run_helpers import named
from s3_helpers import BUCKET, free_port, make_bucket, moto  # noqa: F401 - moto is a fixture

from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.checkpoint.validate import QUARANTINE_DIR
from ckptsup.env import RUN_DIR
from ckptsup.events import read_events
from ckptsup.hooks.resume_sources import FILES_BY_SOURCE_KEYS

pytestmark = [pytest.mark.torch, pytest.mark.s3]


def site_config(tmp_path: Path, endpoint: str, prefix: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text("[checkpoint]\nkeep_daily_days = 0\ntest_load_every = 0\n"
                    f'[storage]\nobject_store = "s3://{BUCKET}/{prefix}"\ns3_endpoint_url = "{endpoint}"\n')
    return path


@pytest.fixture(autouse=True)
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Without a supervisor the hooks write their events to <run_dir>/events.jsonl."""
    path = private_dir(tmp_path / "run")
    monkeypatch.setenv(RUN_DIR, str(path))
    return path


def resume(ck: Path) -> tuple[int, tuple]:
    parts = make_parts(seed=99)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    try:
        return run.resume(), parts
    finally:
        run.close(final_save=False)


def same_model(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0].parameters(), b[0].parameters(), strict=True))


def flip_a_byte(step_dir: Path) -> None:
    entry = max(load_manifest(step_dir).files, key=lambda f: f.size)
    path = step_dir / entry.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_lost_or_corrupt_shared_copy_is_fetched_back_from_the_object_store(tmp_path: Path, moto,  # noqa: F811
                                                                             run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_bucket(moto)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site_config(tmp_path, moto.url, "restore")))
    ck = tmp_path / "ck"
    parts = make_parts(seed=0)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    assert run.resume() == 0
    train_steps(run, *parts, 0, 6)
    run.close()   # drains the promotions: steps 2, 4, 6 are in the object store
    promoted = {e["step"] for e in named(read_events(run_dir), "checkpoint_promoted") if e.get("ok")}
    assert promoted == {2, 4, 6}, read_events(run_dir)

    # 1. the shared copy of the newest is gone: fetched back, verified, loaded
    shutil.rmtree(ck / "step_6")
    mark = len(read_events(run_dir))
    step, restored = resume(ck)
    loaded = named(read_events(run_dir)[mark:], "checkpoint_loaded")
    assert step == 6 and loaded[-1]["source"] == "object", loaded
    by_source = loaded[-1]["files_by_source"]
    assert set(by_source) == set(FILES_BY_SOURCE_KEYS)
    assert by_source["object"] > 0 and by_source["shared"] == by_source["node_local"] == 0, by_source
    assert same_model(restored, parts)
    assert (ck / "step_6" / "manifest.json").is_file()   # committed on the shared tier again

    # 2. the shared copy is corrupt: quarantined (not the previous checkpoint used), the object copy loaded
    flip_a_byte(ck / "step_6")
    mark = len(read_events(run_dir))
    step, restored = resume(ck)
    rejected = named(read_events(run_dir)[mark:], "checkpoint_rejected")
    loaded = named(read_events(run_dir)[mark:], "checkpoint_loaded")
    assert step == 6 and [e["step"] for e in rejected] == [6] and loaded[-1]["source"] == "object"
    assert same_model(restored, parts)
    assert [p.name.split("-")[0] for p in (ck / QUARANTINE_DIR).iterdir()] == ["step_6"]

    # 3. an intact shared copy is read from the shared tier, never downloaded
    mark = len(read_events(run_dir))
    step, restored = resume(ck)
    loaded = named(read_events(run_dir)[mark:], "checkpoint_loaded")
    assert step == 6 and loaded[-1]["source"] == "shared" and loaded[-1]["files_by_source"]["object"] == 0
    assert loaded[-1]["files_by_source"]["shared"] > 0


def test_an_unreachable_object_store_leaves_the_shared_tier_to_resume_from(tmp_path: Path, run_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    ck = tmp_path / "ck"
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(tmp_path / "plain.toml"))
    (tmp_path / "plain.toml").write_text("[checkpoint]\nkeep_daily_days = 0\ntest_load_every = 0\n")
    parts = make_parts(seed=0)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    run.resume()
    train_steps(run, *parts, 0, 4)
    run.close()
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG",
                       str(site_config(tmp_path, f"http://127.0.0.1:{free_port()}", "dead")))
    mark = len(read_events(run_dir))
    step, restored = resume(ck)
    loaded = named(read_events(run_dir)[mark:], "checkpoint_loaded")
    assert step == 4 and loaded[-1]["source"] == "shared" and same_model(restored, parts)


def test_new_refuses_while_the_object_store_holds_the_old_runs_checkpoints(tmp_path: Path, moto,  # noqa: F811
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume would fetch them back, so `--new` would continue the old run; S3 has no rename."""
    from ckptsup.checkpoint.s3tier import S3Tier
    from ckptsup.checkpoint.synthetic import write_synthetic
    from ckptsup.config import load_config
    from ckptsup.events import EventWriter
    from ckptsup.rundir import RunDir, RunState, RunStatus
    from ckptsup.supervisor.job import relaunch

    make_bucket(moto)
    for prefix, holds in (("new-empty", False), ("new-held", True)):
        monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site_config(tmp_path, moto.url, prefix + "/{job_id}")))
        config = load_config(job_config=None, flags={}).config
        if holds:
            S3Tier(url=f"s3://{BUCKET}/{prefix}/local", endpoint_url=moto.url).put(write_synthetic(tmp_path / "src", step=7))
        run = tmp_path / prefix
        RunDir.create(run).save_state(RunState(attempt=1, epoch=2, status=RunStatus.DONE))
        EventWriter(run_dir=run, job_id="local", attempt=1).close()
        said: list[str] = []
        if not holds:
            relaunch.prepare(run, config, job_id="local", resume=False, environ={}, say=said.append)
            assert len(said) == 1 and said[0].startswith("moved the previous run"), said
            continue
        with pytest.raises(relaunch.LaunchRefused, match=r"holds 1 checkpoint\(s\) of the previous run \(newest step_7\)"):
            relaunch.prepare(run, config, job_id="local", resume=False, environ={}, say=said.append)
        assert run.is_dir() and said == []   # nothing moved
