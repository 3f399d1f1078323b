"""The jitter on time-based saves (hooks/session.py SaveTimer): a save is due `save_every_s` plus
a draw in [0, jitter_s] after the last one, the same on every rank of a job (they save together)
and different between jobs, so jobs started together do not all write in the same second."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.hooks.session import SaveTimer


def test_the_due_time_lies_between_the_interval_and_the_interval_plus_jitter() -> None:
    delays = []
    for job in range(200):
        timer = SaveTimer(jitter_s=30.0, seed=f"J{job}:0", now=1000.0, step=0)
        assert 1600.0 <= timer.due_at(600.0) <= 1630.0
        delays.append(timer.delay_s)
    assert max(delays) - min(delays) > 25.0  # spread over the whole window, not bunched


def test_one_seed_gives_the_same_due_times_and_another_seed_different_ones() -> None:
    rank0, rank1 = (SaveTimer(jitter_s=30.0, seed="J1:0", now=0.0, step=0) for _ in range(2))
    other_job = SaveTimer(jitter_s=30.0, seed="J2:0", now=0.0, step=0)
    assert rank0.due_at(600.0) == rank1.due_at(600.0)
    assert rank0.due_at(600.0) != other_job.due_at(600.0)
    for timer in (rank0, rank1, other_job):
        timer.restart(700.0, step=40)
    assert rank0.due_at(600.0) == rank1.due_at(600.0) != other_job.due_at(600.0)


def test_each_period_draws_afresh_and_starts_at_the_restart() -> None:
    timer = SaveTimer(jitter_s=30.0, seed="J1:0", now=0.0, step=0)
    delays = set()
    for step in range(1, 20):
        timer.restart(step * 1000.0, step=step)
        assert step * 1000.0 + 600.0 <= timer.due_at(600.0) <= step * 1000.0 + 630.0
        delays.add(timer.delay_s)
    assert len(delays) == 19


def test_due_is_false_until_the_jittered_time_and_never_without_an_interval() -> None:
    timer = SaveTimer(jitter_s=30.0, seed="J1:0", now=0.0, step=0)
    at = timer.due_at(600.0)
    assert not timer.due(at - 0.01, 600.0)
    assert timer.due(at, 600.0)
    assert not timer.due(1e9, 0.0)  # save_every_s = 0: time-based saves are off
    assert timer.due_at(300.0) == at - 300.0  # a new interval applies to the running period


def test_no_jitter_means_exactly_the_interval() -> None:
    timer = SaveTimer(jitter_s=0.0, seed="J1:0", now=5.0, step=0)
    assert timer.due_at(600.0) == 605.0


# ---- through a real Run (single rank, in process) -----------------------------------------------

@pytest.fixture()
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from hooks_helpers import fast_site_config

    for name in list(os.environ):
        if name.startswith(("CKPTSUP_", "SLURM_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


def attach_as(job: str, ckdir: Path, monkeypatch: pytest.MonkeyPatch, **kw):
    from hooks_helpers import attach_parts, make_parts, private_dir

    monkeypatch.setenv("CKPTSUP_JOB_ID", job)
    return attach_parts(make_parts(), private_dir(ckdir), **kw)


@pytest.mark.torch
def test_ranks_of_one_job_share_the_jitter_and_two_jobs_differ(tmp_path: Path, monkeypatch, no_supervisor) -> None:
    pytest.importorskip("torch")
    delays = []
    for n, job in enumerate(("J1", "J1", "J2")):  # the first two stand for two ranks of job J1
        run = attach_as(job, tmp_path / f"ck{n}", monkeypatch, save_every_s=600, jitter_s=30)
        try:
            assert 600 <= run.save_timer.due_at(600) - run.save_timer.start <= 630
            delays.append(run.save_timer.delay_s)
        finally:
            run.close(final_save=False)
    assert delays[0] == delays[1] != delays[2]


@pytest.mark.torch
def test_a_run_saves_on_time_only_once_its_jittered_interval_is_up(tmp_path: Path, monkeypatch, no_supervisor) -> None:
    torch = pytest.importorskip("torch")
    run = attach_as("J1", tmp_path / "ck", monkeypatch, save_every_s=100, jitter_s=30, async_save=False)
    try:
        due = run.save_timer.due_at(100)
        assert due - run.save_timer.start > 100  # this job's draw is not zero, so the jitter is visible
        run.clock = lambda: due - 0.01
        run.step_done(0, loss=torch.tensor(1.0))
        assert run.last_saved_step is None
        run.clock = lambda: due
        run.step_done(1, loss=torch.tensor(1.0))
        assert run.last_saved_step == 2
    finally:
        run.close(final_save=False)
    assert (tmp_path / "ck" / "step_2").is_dir()
