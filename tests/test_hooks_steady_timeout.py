"""The rank side of `set_timeout`: the command the agent forwards reaches the session, which
moves the default group to that steady collective timeout at its next step (through the step
link it shares with heartbeat(), hooks/rank_link.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.wire import MessageKind


@pytest.mark.torch
def test_set_timeout_is_applied_at_the_next_step(tmp_path: Path, monkeypatch) -> None:
    import os

    torch = pytest.importorskip("torch")
    from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir

    from ckptsup.hooks import rank_link

    for name in list(os.environ):
        if name.startswith(("CKPTSUP_", "SLURM_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())
    applied: list = []
    monkeypatch.setattr(rank_link, "set_steady_timeout", lambda seconds=None: applied.append(seconds))
    run = attach_parts(make_parts(), private_dir(tmp_path / "ck"), save_every_s=3600)
    try:
        run.step_done(0, loss=torch.tensor(1.0))
        assert applied == [None]  # the first step: the environment's steady value
        run.channel.handle(MessageKind.SET_TIMEOUT, {"collective_s": 42.5})
        run.channel.handle(MessageKind.SET_TIMEOUT, {"collective_s": "soon"})  # not a number: ignored
        run.step_done(1, loss=torch.tensor(1.0))
        run.step_done(2, loss=torch.tensor(1.0))
        assert applied == [None, 42.5]
    finally:
        run.close(final_save=False)
