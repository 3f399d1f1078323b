"""The node-local cache tier with 2 ranks under torchrun (gloo, examples/train.py): each rank
writes its shards on the node-local tier first, the commit happens on the shared tier, and a
restart reads the local copies only when they are copies of exactly that checkpoint — falling
back to the shared copy file by file, never quarantining a good checkpoint. Every resume must
restore the saved state bit for bit (2 ranks: gloo's all-reduce sum is order-free)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hooks_helpers import assert_states_equal, load_final, private_dir, run_train

from ckptsup.checkpoint.local_cache import MARKER_NAME, LocalCopy
from ckptsup.checkpoint.manifest import load_manifest
from ckptsup.checkpoint.validate import validate
from ckptsup.events import read_events

pytestmark = pytest.mark.torch

ARGS = ["--steps", "6", "--save-every-steps", "2"]


def site_config(base: Path) -> str:
    """keep_last 2 (on the shared tier and in the cache), no dailies, no level-3 test loads."""
    path = base / "site.toml"
    path.write_text("[checkpoint]\nkeep_last = 2\nkeep_daily_days = 0\ntest_load_every = 0\n")
    return str(path)


def train(base: Path, *, ck: Path, local: Path, out: str = "out", run: str = "run"):
    proc = run_train(2, [*ARGS, "--checkpoint-dir", str(ck), "--out", str(base / out)],
                     env={"CKPTSUP_NODE_LOCAL_DIR": str(local), "CKPTSUP_RUN_DIR": str(private_dir(base / run)),
                          "CKPTSUP_SITE_CONFIG": site_config(base)})
    (base / f"{run}-{out}.stderr").write_text(proc.stderr)  # whole, for a post-mortem
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def loaded_event(base: Path, run: str = "run") -> dict:
    [event] = [e for e in read_events(base / run) if e["event"] == "checkpoint_loaded"]
    return event


def assert_resumed_state(out: Path, saved_out: Path) -> None:
    for rank in (0, 1):
        assert_states_equal(load_final(out, rank), load_final(saved_out, rank))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank run of 6 steps, saving every 2, through the node-local dir base/local."""
    base = private_dir(tmp_path_factory.mktemp("saved"))
    train(base, ck=base / "ck", local=base / "local")
    return base


def copy_of(saved: Path, tmp_path: Path) -> Path:
    base = private_dir(tmp_path / "copy")
    for name in ("ck", "local", "out"):
        shutil.copytree(saved / name, base / name)
    return base


def test_two_ranks_commit_on_the_shared_tier_and_keep_the_last_k_local_copies(saved: Path) -> None:
    ck = saved / "ck"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_4", "step_6"]
    committed = [e["step"] for e in read_events(saved / "run") if e["event"] == "checkpoint_committed"]
    assert committed == [2, 4, 6]
    for step in (4, 6):
        assert validate(ck / f"step_{step}", level=2, record=False).ok      # what `ckptsup ckpt verify` checks
        manifest = load_manifest(ck / f"step_{step}")
        held = {}
        for local_rank in (0, 1):
            copy = saved / "local" / f"local_rank_{local_rank}" / f"step_{step}"
            marker = LocalCopy.from_json((copy / MARKER_NAME).read_text(), source="marker")
            assert marker.checkpoint_id == manifest.checkpoint_id
            assert [f.path for f in marker.files] == [f"__{local_rank}_0.distcp"]   # each rank its own shard
            held.update({f.path: f for f in marker.files})
        shards = {f.path: (f.size, f.hash) for f in manifest.files if f.path != manifest.metadata_file}
        assert {p: (f.size, f.hash) for p, f in held.items()} == shards
    for local_rank in (0, 1):   # the cache keeps the last K (2) too
        assert sorted(p.name for p in (saved / "local" / f"local_rank_{local_rank}").iterdir()) == ["step_4", "step_6"]


def test_a_restart_reads_the_local_copies_and_restores_the_state_bit_for_bit(saved: Path, tmp_path: Path) -> None:
    base = copy_of(saved, tmp_path)
    train(base, ck=base / "ck", local=base / "local", out="resumed", run="run2")
    event = loaded_event(base, "run2")
    assert event["step"] == 6
    # both ranks read items of both shards (DDP: the whole model on every rank)
    assert (event["read_local_files"], event["read_shared_files"], event["local_fallback_files"]) == (4, 0, 0)
    assert_resumed_state(base / "resumed", saved / "out")


def test_a_flipped_bit_in_a_local_copy_is_read_from_the_shared_tier_instead(saved: Path, tmp_path: Path) -> None:
    base = copy_of(saved, tmp_path)
    manifest = load_manifest(base / "ck" / "step_6")
    # a model weight in rank 0's shard: both ranks load the whole (DDP) model, so both read it
    item = next(it for it in manifest.items if it.file == "__0_0.distcp" and it.key.startswith("model."))
    path = base / "local" / "local_rank_0" / "step_6" / item.file
    data = bytearray(path.read_bytes())
    data[item.offset + item.length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    proc = train(base, ck=base / "ck", local=base / "local", out="resumed", run="run2")
    event = loaded_event(base, "run2")
    assert event["step"] == 6
    # each rank: __0_0 from the shared tier (after the local item failed its hash), __1_0 from its
    # local copy; the first rank to find the bad copy deletes it, so the other rank may fall back
    # too or never see it
    assert (event["read_local_files"], event["read_shared_files"]) == (2, 2)
    assert event["local_fallback_files"] in (1, 2), event
    assert "reading __0_0.distcp from the shared tier" in proc.stderr
    assert not path.exists()
    assert_resumed_state(base / "resumed", saved / "out")
    assert (base / "ck" / "step_6").is_dir() and not (base / "ck" / "quarantine").exists()
    assert not [e for e in read_events(base / "run2") if e["event"] == "checkpoint_rejected"]


def test_an_unusable_local_dir_warns_once_and_another_runs_copy_is_never_read(saved: Path, tmp_path: Path) -> None:
    base = private_dir(tmp_path / "other")
    (base / "not-a-dir").write_text("")
    proc = train(base, ck=base / "ck", local=base / "not-a-dir" / "local")
    # three saves, each rank warned once, every save committed on the shared tier
    assert proc.stderr.count("node-local checkpoint dir unusable") == 2
    assert [e["step"] for e in read_events(base / "run") if e["event"] == "checkpoint_committed"] == [2, 4, 6]
    assert validate(base / "ck" / "step_6", level=2, record=False).ok
    # restart this run next to the first run's node-local copies: same step, same training, other checkpoint
    local = base / "saved-local"
    shutil.copytree(saved / "local", local)
    train(base, ck=base / "ck", local=local, out="resumed", run="run2")
    event = loaded_event(base, "run2")
    assert event["step"] == 6
    assert (event["read_local_files"], event["read_shared_files"], event["local_fallback_files"]) == (0, 4, 0)
    assert_resumed_state(base / "resumed", base / "out")
