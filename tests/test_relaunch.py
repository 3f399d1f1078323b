"""A launch into a run dir that already holds a run (supervisor/job/relaunch.py): the pure decision,
the facts read from a real run dir, and moving an old run aside."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptsup.config import Config, load_config
from ckptsup.env import ExitStatus
from ckptsup.events import LAST_EVENT_TAIL_BYTES, Event, EventWriter, last_event
from ckptsup.rundir import RunDir, RunState, RunStatus
from ckptsup.supervisor.job import relaunch
from ckptsup.supervisor.job.relaunch import LaunchRefused, New, Previous, Refuse, Resume, decide_relaunch

STALE = 10.0


def decide(status, *, resume=None, age=None, job="local", run_job="local", restarts=0, holder="pid 7 on n1"):
    prev = Previous(path="runs/x", status=status, attempt=2, job_id=run_job, lease_age_s=age, holder=holder)
    return decide_relaunch(prev, job_id=job, restart_count=restarts, lease_stale_s=STALE, resume=resume)


# ---- the decision -------------------------------------------------------------------------------

@pytest.mark.parametrize("resume", [None, False])
def test_an_empty_run_dir_starts_a_new_run_with_nothing_to_move(resume):
    assert decide(None, resume=resume, run_job=None) == New(move_aside=False)


def test_resume_into_an_empty_run_dir_is_refused_so_a_typo_cannot_restart_from_step_zero():
    decision = decide(None, resume=True, run_job=None)
    assert isinstance(decision, Refuse) and "holds no run to resume" in decision.reason
    assert "runs/x" in decision.reason and "--run-dir" in decision.reason


@pytest.mark.parametrize("status, held", [(RunStatus.DONE, "a finished run"), (RunStatus.GAVE_UP, "a run that gave up"),
                                          (RunStatus.STOPPED, "a stopped run")])
def test_an_ended_run_needs_resume_or_new(status, held):
    refused = decide(status, age=1.0)  # a lease just left behind by the supervisor that ended
    assert isinstance(refused, Refuse)
    assert held in refused.reason and "3 attempts" in refused.reason
    assert "--resume" in refused.reason and "--new" in refused.reason and "\n" not in refused.reason
    assert isinstance(decide(status, resume=True), Resume)
    assert decide(status, resume=False) == New(move_aside=True)


@pytest.mark.parametrize("resume", [None, True, False])
@pytest.mark.parametrize("age", [0.0, 3.5, STALE, -2.0])   # a negative age: the writer's clock is ahead
def test_a_live_run_is_refused_whatever_the_flag(resume, age):
    decision = decide(RunStatus.RUNNING, resume=resume, age=age)
    assert isinstance(decision, Refuse), decision
    assert "live run" in decision.reason and "pid 7 on n1" in decision.reason
    assert f"{max(age, 0.0):.1f}s ago" in decision.reason


@pytest.mark.parametrize("age", [STALE + 0.01, 3600.0, None])
def test_a_running_run_whose_supervisor_died_resumes_without_a_flag(age):
    decision = decide(RunStatus.RUNNING, age=age)
    assert isinstance(decision, Resume) and "supervisor died" in decision.why
    assert isinstance(decide(RunStatus.RUNNING, age=age, resume=True), Resume)
    assert decide(RunStatus.RUNNING, age=age, resume=False) == New(move_aside=True)


@pytest.mark.parametrize("status", list(RunStatus))
@pytest.mark.parametrize("resume", [None, True, False])
def test_a_requeue_of_the_same_job_resumes_whatever_the_lease_or_flag_says(status, resume):
    """Slurm runs one instance of a job at a time: a fresh lease is the previous instance's."""
    decision = decide(status, resume=resume, age=0.5, job="42", run_job="42", restarts=1)
    assert isinstance(decision, Resume), decision
    assert "requeue of job 42" in decision.why
    assert ("--new ignored" in decision.why) == (resume is False)


def test_a_requeued_status_of_the_same_job_resumes_even_without_a_restart_count():
    assert isinstance(decide(RunStatus.REQUEUED, job="42", run_job="42", restarts=0), Resume)


@pytest.mark.parametrize("run_job", ["41", None])
def test_a_restart_count_of_another_job_is_not_a_requeue_of_this_run(run_job):
    assert isinstance(decide(RunStatus.DONE, job="42", run_job=run_job, restarts=3), Refuse)
    assert isinstance(decide(RunStatus.RUNNING, age=1.0, job="42", run_job=run_job, restarts=3), Refuse)


def test_a_run_requeued_by_another_job_names_it_and_needs_a_flag():
    refused = decide(RunStatus.REQUEUED, job="42", run_job="41")
    assert isinstance(refused, Refuse) and "job 41's run, requeued" in refused.reason and "scancel 41" in refused.reason
    assert isinstance(decide(RunStatus.REQUEUED, job="42", run_job="41", resume=True), Resume)
    assert decide(RunStatus.REQUEUED, job="42", run_job="41", resume=False) == New(move_aside=True)


def test_a_requeued_run_of_an_unknown_job_still_reads_well():
    refused = decide(RunStatus.REQUEUED, job="42", run_job=None)
    assert isinstance(refused, Refuse) and "holds a requeued run (3 attempts)" in refused.reason


def test_a_live_refusal_without_a_lease_holder_still_reads_well():
    decision = decide(RunStatus.RUNNING, age=1.0, holder="")
    assert isinstance(decision, Refuse) and "its supervisor renewed its lease 1.0s ago" in decision.reason


# ---- the facts from a real run dir --------------------------------------------------------------

def make_run(path: Path, *, status: RunStatus, attempt: int = 0, job_id: str = "local", lease_age_s: float | None = None,
             now: float = 1_000_000.0) -> RunDir:
    rd = RunDir.create(path)
    rd.save_state(RunState(attempt=attempt, epoch=attempt + 1, status=status))
    writer = EventWriter(run_dir=path, job_id=job_id, attempt=attempt)
    writer.emit(Event.SUPERVISOR_START, script="x.py", resumed=False, in_slurm=False, excluded=[])
    writer.close()
    if lease_age_s is not None:
        (path / "lease").write_text(json.dumps({"pid": 4242, "host": "node7", "epoch": 1, "renewed": now - lease_age_s}))
    return rd


def test_inspect_reads_status_attempt_last_job_and_lease(tmp_path):
    make_run(tmp_path / "run", status=RunStatus.RUNNING, attempt=3, job_id="77", lease_age_s=2.0)
    prev = relaunch.inspect(tmp_path / "run", now=1_000_000.0)
    assert prev == Previous(path=str(tmp_path / "run"), status=RunStatus.RUNNING, attempt=3, job_id="77",
                            lease_age_s=pytest.approx(2.0), holder="pid 4242 on node7")


def test_inspect_of_a_dir_without_state_is_no_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text("")
    assert relaunch.inspect(tmp_path / "run", now=0.0) == Previous(path=str(tmp_path / "run"))
    assert relaunch.inspect(tmp_path / "absent", now=0.0).status is None


def test_last_event_reads_only_the_tail_and_skips_a_torn_last_line(tmp_path):
    writer = EventWriter(run_dir=tmp_path, job_id="1", attempt=0)
    filler = "x" * 1000
    for _ in range(2 * LAST_EVENT_TAIL_BYTES // 1000):
        writer.emit(Event.STEP_PROGRESS, step=1, note=filler)
    writer.close()
    writer = EventWriter(run_dir=tmp_path, job_id="2", attempt=5)
    writer.emit(Event.RUN_COMPLETE, step=9)
    writer.close()
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"event": "launch", "ts": "t", "mo')   # a crash mid-write
    last = last_event(tmp_path)
    assert last is not None and last["event"] == "run_complete" and last["job_id"] == "2"
    assert last_event(tmp_path / "nothing") is None


# ---- prepare: refusing, moving aside, resuming --------------------------------------------------

@pytest.fixture
def config() -> Config:
    return load_config(job_config=None, flags={}).config


def test_prepare_refuses_an_ended_run_with_one_usage_line_and_touches_nothing(tmp_path, config):
    make_run(tmp_path / "run", status=RunStatus.DONE)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(LaunchRefused) as err:
        relaunch.prepare(tmp_path / "run", config, job_id="local", resume=None, environ={}, say=lambda line: None)
    assert err.value.exit_code == ExitStatus.USAGE and "\n" not in str(err.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_prepare_new_moves_the_run_and_an_outside_checkpoint_dir_aside_and_deletes_nothing(tmp_path, config):
    import dataclasses

    ck = tmp_path / "ckpts" / "local"
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path / "ckpts" / "{job_id}")))
    make_run(tmp_path / "run", status=RunStatus.GAVE_UP, attempt=4)
    (ck / "step_10").mkdir(parents=True)
    (ck / "step_10" / "manifest.json").write_text("{}")
    said: list[str] = []
    decision = relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={},
                                now=lambda: 1_700_000_000.0, say=said.append)
    assert decision == New(move_aside=True)
    [old_run] = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    [old_ck] = [p for p in ck.parent.iterdir() if p.name.startswith("local.")]
    assert not (tmp_path / "run").exists() and not ck.exists()
    assert (old_run / "state.json").is_file() and (old_run / "secret").is_file()
    assert (old_ck / "step_10" / "manifest.json").read_text() == "{}"
    assert old_run.name.removeprefix("run.") == old_ck.name.removeprefix("local.")
    assert len(said) == 1 and str(old_run) in said[0] and str(old_ck) in said[0] and "5 attempts" in said[0]


def test_prepare_new_twice_in_one_second_never_replaces_the_first_copy(tmp_path, config):
    for _ in range(3):
        make_run(tmp_path / "run", status=RunStatus.DONE)
        relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={},
                         now=lambda: 1_700_000_000.0, say=lambda line: None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and all(n.startswith("run.") for n in names), names


def test_prepare_new_leaves_an_empty_outside_checkpoint_dir_alone_and_keeps_the_inside_one_with_the_run(tmp_path, config):
    import dataclasses

    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path / "ck")))
    (tmp_path / "ck").mkdir()
    make_run(tmp_path / "run", status=RunStatus.DONE)
    relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={}, say=lambda line: None)
    assert (tmp_path / "ck").is_dir() and not [p for p in tmp_path.iterdir() if p.name.startswith("ck.")]


def test_prepare_new_refuses_a_checkpoint_dir_that_contains_the_run_dir(tmp_path, config):
    import dataclasses

    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path)))
    make_run(tmp_path / "run", status=RunStatus.DONE)
    with pytest.raises(LaunchRefused, match="contains the run directory"):
        relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={}, say=lambda line: None)
    assert (tmp_path / "run" / "state.json").is_file()


def test_a_failed_move_puts_back_what_it_moved(tmp_path, config, monkeypatch):
    import dataclasses

    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path / "ck")))
    (tmp_path / "ck" / "step_1").mkdir(parents=True)
    make_run(tmp_path / "run", status=RunStatus.DONE)
    real = relaunch.rename_noreplace

    def flaky(src, dst):
        if Path(src).name == "run":
            raise PermissionError(13, "Permission denied")
        real(src, dst)

    monkeypatch.setattr(relaunch, "rename_noreplace", flaky)
    with pytest.raises(LaunchRefused, match="cannot move .*run aside: Permission denied"):
        relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={}, say=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "run"]
    assert (tmp_path / "ck" / "step_1").is_dir()


def test_prepare_resumes_a_requeue_from_the_slurm_environment(tmp_path, config):
    make_run(tmp_path / "run", status=RunStatus.RUNNING, job_id="42", lease_age_s=0.5, now=1_000_000.0)
    said: list[str] = []
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}
    decision = relaunch.prepare(tmp_path / "run", config, job_id="42", resume=None, environ=env,
                                now=lambda: 1_000_000.0, say=said.append)
    assert isinstance(decision, Resume) and "requeue of job 42 (restart 2)" in said[0]
    # the same run dir outside the allocation: the restart count is not read, the lease is live
    with pytest.raises(LaunchRefused, match="live run"):
        relaunch.prepare(tmp_path / "run", config, job_id="42", resume=None, environ={"SLURM_RESTART_COUNT": "2"},
                         now=lambda: 1_000_000.0, say=said.append)


def test_a_restart_count_that_is_not_a_number_is_one_line(tmp_path, config):
    make_run(tmp_path / "run", status=RunStatus.RUNNING, job_id="42")
    with pytest.raises(Exception, match="SLURM_RESTART_COUNT='x' is not an integer") as err:
        relaunch.prepare(tmp_path / "run", config, job_id="42", resume=None,
                         environ={"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "x"}, say=lambda line: None)
    assert "\n" not in str(err.value)


def test_prepare_new_warns_when_the_object_store_cannot_be_listed(tmp_path, config, monkeypatch):
    import dataclasses
    import socket

    with socket.socket() as s:   # a closed loopback port: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    config = dataclasses.replace(config, storage=dataclasses.replace(
        config.storage, object_store="s3://b/ck/{job_id}", s3_endpoint_url=f"http://127.0.0.1:{port}"))
    make_run(tmp_path / "run", status=RunStatus.DONE)
    said: list[str] = []
    relaunch.prepare(tmp_path / "run", config, job_id="local", resume=False, environ={}, say=said.append)
    assert len(said) == 2 and said[0].startswith("warning: cannot list the object store s3://b/ck/{job_id}"), said
    assert said[1].startswith("moved the previous run")


def test_the_lease_reader_takes_an_unreadable_lease_as_none(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    assert rd.read_lease() is None and rd.lease_age_s() is None
    rd.lease_path.write_text("[1, 2]")
    assert rd.read_lease() is None and rd.lease_age_s() is None
    os.unlink(rd.lease_path)
    rd.renew_lease(epoch=3, host="h")
    assert rd.read_lease()["host"] == "h" and 0 <= rd.lease_age_s() < 5
