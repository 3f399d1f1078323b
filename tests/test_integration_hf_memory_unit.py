"""hf_state.prefer_memory: which copy resume_path hands HF (pure; the real runs are in
test_integration_hf_memory.py)."""
from __future__ import annotations

from ckptsup.errors import CheckpointError
from ckptsup.integrations.hf_state import Choice, prefer_memory


def state(step: int) -> dict:
    return {"global_step": step, "epoch": 1.0}


def test_a_memory_copy_wins_over_no_disk_checkpoint_and_over_an_older_one():
    got = prefer_memory(Choice(), (20, "cid"), state)
    assert (got.path, got.step, got.memory_step, got.state) == ("memory:step_20", 20, 20, state(20))
    disk = Choice(path="/ck/step_10", step=10, state=state(10), rejected=[("/ck/step_15", "bad")])
    got = prefer_memory(disk, (20, "cid"), state)
    assert got.memory_step == 20 and got.rejected == disk.rejected
    assert prefer_memory(Choice(path="/ck/step_20", step=20, state=state(20)), (20, "c"), state).memory_step == 20


def test_the_disk_choice_stands_when_newer_absent_from_memory_or_unreadable():
    disk = Choice(path="/ck/step_30", step=30, state=state(30))
    assert prefer_memory(disk, (20, "cid"), state) is disk
    assert prefer_memory(disk, None, state) is disk
    fresh = Choice()

    def corrupt(step):
        raise CheckpointError(f"memory checkpoint of step {step}: hash mismatch")

    assert prefer_memory(fresh, (20, "cid"), corrupt) is fresh
    assert prefer_memory(fresh, (20, "cid"), lambda s: state(s + 1)) is fresh   # mislabelled copy
    failed = Choice(error="untrusted")
    assert prefer_memory(failed, (20, "cid"), state) is failed
