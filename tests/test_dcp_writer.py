"""DCP's writer on the torch of the GPU machines (issue 25's device run, torch 2.11): there
`FileSystemWriter.finish` fills `storage_data` on a `dataclasses.replace` copy, so the metadata
`dcp.save` returns had none, and every disk and memory save failed ('NoneType' object has no
attribute 'items'). Here torch 2.13's finish is swapped for that behaviour."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir, train_steps
from test_memory_tier import load, same, state

from ckptsup.hooks.memory_tier import serialize

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def finish_on_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's finish: the caller's metadata is left without storage_data."""
    import os

    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.finish

    def finish(self, metadata, results):
        copy = dataclasses.replace(metadata)
        original(self, copy, results)
        assert metadata.storage_data is None  # the behaviour this test stands in for

    monkeypatch.setattr(FileSystemWriter, "finish", finish)
    for name in list(os.environ):
        if name.startswith("CKPTSUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


def test_a_disk_save_hashes_every_item_and_resumes_when_finish_fills_a_copy(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, async_save=False)
    train_steps(run, *parts, 0, 3)
    run.save(reason="test", blocking=True)
    run.close(final_save=False)
    parts2 = make_parts(seed=5)
    run2 = attach_parts(parts2, ck, async_save=False)
    assert run2.resume() == 3
    run2.close(final_save=False)
    for a, b in zip(parts[0].parameters(), parts2[0].parameters()):
        assert torch.equal(a, b)


def test_a_memory_bundle_lists_every_item_when_finish_fills_a_copy() -> None:
    saved = state(0)
    bundle = serialize(saved, step=7, checkpoint_id="c" * 32, algorithm="xxh3-128", extra={})
    assert len(bundle.manifest.items) > 0
    assert same(load(bundle, state(1)), saved)
