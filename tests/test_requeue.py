"""The requeue path, with a fake of the one Slurm seam: ordering (requeue → wait for PENDING →
ExcNodeList/Partition/StartTime), refusal of --no-requeue jobs, fencing, exactly one event."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptsup.env import ExitStatus
from ckptsup.errors import SlurmCommandError
from ckptsup.events import read_events
from ckptsup.rundir import RunDir
from ckptsup.slurm.client import CommandResult, SlurmClient
from ckptsup.supervisor.job import requeue as rq
from ckptsup.supervisor.job.requeue import RequeueEffects, RequeueRefused, RequeueRequest, requeue_job


@dataclass
class FakeInfo:
    state: str
    requeue: bool = True
    restart_count: int = 0
    excluded_nodes: list = field(default_factory=list)
    partition: str = "main"
    batch_host: str = "n1"


class FakeSlurm:
    """Records calls; after `requeue` the job reports COMPLETING `completing_polls` times, then
    PENDING. update_job refuses a partition named in `refuse_partitions`."""

    def __init__(self, *, requeueable: bool = True, completing_polls: int = 2, excluded=(),
                 refuse_partitions=(), gone_after_requeue: bool = False):
        self.calls: list[tuple] = []
        self.requeued = False
        self.requeueable = requeueable
        self.completing_polls = completing_polls
        self.excluded = list(excluded)
        self.refuse = set(refuse_partitions)
        self.gone = gone_after_requeue

    def job_info(self, job_id):
        self.calls.append(("job_info", job_id))
        if not self.requeued:
            return FakeInfo(state="RUNNING", requeue=self.requeueable, excluded_nodes=self.excluded)
        if self.gone:
            return None
        if self.completing_polls > 0:
            self.completing_polls -= 1
            return FakeInfo(state="COMPLETING", excluded_nodes=self.excluded)
        return FakeInfo(state="PENDING", excluded_nodes=self.excluded)

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        self.requeued = True

    def update_job(self, job_id, *, exc_nodes=None, partition=None, start_time_now=False):
        if not self.requeued or self.completing_polls > 0:
            raise SlurmCommandError(["scontrol", "update"], 1, "Job is no longer pending execution")
        if partition in self.refuse:
            raise SlurmCommandError(["scontrol", "update"], 1, "Invalid partition name specified")
        self.calls.append(("update_job", job_id, tuple(exc_nodes or ()), partition, start_time_now))


def fake_clock(step: float = 0.5):
    counter = itertools.count()
    return lambda: next(counter) * step


def run_dir(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path / "run")
    state = rd.load_state()
    state.epoch, state.attempt = 4, 2
    state.excluded_nodes = {"n7": "nan job 1"}
    rd.save_state(state)
    return rd


def test_requeue_then_wait_for_pending_then_exclude_partition_and_start_now(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(excluded=["n9"])
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    names = [c[0] for c in slurm.calls]
    assert names == ["job_info", "requeue", "job_info", "job_info", "job_info", "update_job"]
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7", "n9"), "spanning", True)
    assert result.requeued and result.finish.ok
    assert set(result.phases) == {"check_s", "fence_s", "requeue_s"}
    assert result.finish.wait_pending_s > 0 and result.finish.total_s >= result.finish.wait_pending_s


def test_requeue_fences_the_epoch_and_records_exclusions(tmp_path) -> None:
    rd = run_dir(tmp_path)
    requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",)),
                RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    state = rd.load_state()
    assert state.epoch == 5 and state.status == "requeued"
    assert state.excluded_nodes == {"n7": "nan job 1", "n2": "node_down"}


def test_exactly_one_fenced_requeue_event_plus_the_update_record(tmp_path) -> None:
    rd = run_dir(tmp_path)
    requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="supervisor_died", by="batch_script"),
                RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    events = read_events(rd.path)
    assert [e["event"] for e in events] == ["requeue", "requeue_updated"]
    event = events[0]
    assert event["epoch"] == 5 and event["attempt"] == 2 and event["job_id"] == "42"
    assert event["reason"] == "supervisor_died" and event["by"] == "batch_script"
    assert event["excluded"] == ["n7"] and set(event["phases"]) == {"check_s", "fence_s", "requeue_s"}
    assert events[1]["ok"] is True


def test_a_second_requeuer_in_the_same_epoch_does_nothing(tmp_path) -> None:
    rd = run_dir(tmp_path)
    first = requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="supervisor_died"),
                        RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    slurm = FakeSlurm()
    second = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",)),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert first.requeued and not second.requeued
    assert "requeued" in second.why_skipped
    assert ("requeue", "42") not in slurm.calls
    assert [e["event"] for e in read_events(rd.path)].count("requeue") == 1


def test_a_racing_requeuer_that_lost_the_claim_does_nothing(tmp_path) -> None:
    rd = run_dir(tmp_path)
    (rd.path / f"{rq.CLAIM_PREFIX}4").write_text("{}")  # the other requeuer won epoch 4
    slurm = FakeSlurm()
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="x"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert not result.requeued and "claimed" in result.why_skipped
    assert rd.load_state().epoch == 4 and not read_events(rd.path)


@pytest.mark.parametrize("status", ["done", "gave_up"])
def test_finished_runs_are_not_requeued(tmp_path, status) -> None:
    rd = run_dir(tmp_path)
    state = rd.load_state()
    state.status = status
    rd.save_state(state)
    slurm = FakeSlurm()
    assert not requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="x"),
                           RequeueEffects(clock=fake_clock(), detach=False)).requeued
    assert ("requeue", "42") not in slurm.calls


def test_no_requeue_job_is_refused_with_one_line_and_give_up_status(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(requeueable=False)
    with pytest.raises(RequeueRefused) as err:
        requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",)),
                    RequeueEffects(clock=fake_clock(), detach=False))
    assert "--no-requeue" in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == ExitStatus.GIVE_UP
    assert [c[0] for c in slurm.calls] == ["job_info"]
    assert rd.load_state().epoch == 4 and not read_events(rd.path)


def test_refused_partition_still_applies_exclusion_and_start_time(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(refuse_partitions={"spanning"})
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7"), None, True)
    assert not result.finish.ok and "Invalid partition" in result.finish.error
    assert read_events(rd.path)[-1]["ok"] is False


def test_job_gone_while_waiting_is_recorded_not_raised(tmp_path) -> None:
    rd = run_dir(tmp_path)
    result = requeue_job(FakeSlurm(gone_after_requeue=True), rd, RequeueRequest(job_id="42", reason="x"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert not result.finish.ok and "gone" in result.finish.error


def test_waiting_for_pending_gives_up_at_the_deadline(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(completing_polls=10**6)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="x"),
                         RequeueEffects(clock=fake_clock(1.0), sleep=lambda s: None, detach=False, finish_deadline_s=5))
    assert not result.finish.ok and "after 5s" in result.finish.error
    assert not any(c[0] == "update_job" for c in slurm.calls)


def test_inside_the_job_the_finish_step_is_detached(tmp_path, monkeypatch) -> None:
    rd = run_dir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    spawned = []
    result = requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",),
                                                         partition="spanning"),
                         RequeueEffects(clock=fake_clock(), spawn=lambda argv, path: spawned.append(argv) or 999))
    assert result.finisher_pid == 999 and result.finish is None
    (argv,) = spawned
    assert argv[1:4] == ["-m", "ckptsup.supervisor.job.requeue", "--finish"]
    assert argv[argv.index("--partition") + 1] == "spanning"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--exclude"] == ["n2", "n7"]


def test_a_requeue_event_that_cannot_be_written_still_starts_the_finisher(tmp_path, monkeypatch, capsys) -> None:
    rd = run_dir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "42")

    def full_disk(self, *a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ckptsup.supervisor.job.requeue.EventWriter.emit", full_disk)
    spawned = []
    result = requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",),
                                                         partition="spanning"),
                         RequeueEffects(clock=fake_clock(), spawn=lambda argv, path: spawned.append(argv) or 999))
    assert result.requeued and result.finisher_pid == 999 and len(spawned) == 1
    assert "could not log it" in capsys.readouterr().err


def test_start_time_waits_for_the_credential_second_to_turn_over(tmp_path) -> None:
    """slurmd refuses a credential issued in the second its predecessor was revoked."""
    rd = run_dir(tmp_path)
    now = [1000.7]
    log = []

    class Slurm(FakeSlurm):
        def update_job(self, job_id, **kw):
            log.append(("update", now[0]))
            super().update_job(job_id, **kw)

    def sleep(s):
        log.append(("sleep", s))
        now[0] += s

    result = requeue_job(Slurm(completing_polls=0), rd, RequeueRequest(job_id="42", reason="x"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: now[0], sleep=sleep, detach=False))
    assert log == [("sleep", pytest.approx(1.3)), ("update", pytest.approx(1002.0))]
    assert result.finish.hold_s > 0


def test_detached_finisher_runs_in_its_own_session_and_ignores_sigterm(tmp_path) -> None:
    import os
    import signal
    import sys
    import time

    out = tmp_path / "out"
    code = ("import os, time, pathlib; p = pathlib.Path(%r); p.write_text(f'{os.getpid()} {os.getsid(0)}\\n');"
            " time.sleep(1.0); p.write_text(p.read_text() + 'done\\n')") % str(out)
    rq.spawn_detached([sys.executable, "-c", code], tmp_path)
    deadline = time.monotonic() + 20
    while not out.exists() or not out.read_text().strip():
        assert time.monotonic() < deadline, "detached process never started"
        time.sleep(0.05)
    pid, sid = map(int, out.read_text().split()[:2])
    assert sid == pid != os.getsid(0)  # a session of its own, not ours
    os.kill(pid, signal.SIGTERM)  # the job's kill wave
    while "done" not in out.read_text():
        assert time.monotonic() < deadline, "SIGTERM killed the detached process"
        time.sleep(0.05)


def test_a_failed_scontrol_requeue_leaves_the_run_requeueable_by_the_next_requeuer(tmp_path) -> None:
    rd = run_dir(tmp_path)

    class Broken(FakeSlurm):
        def requeue(self, job_id):
            raise SlurmCommandError(["scontrol", "requeue"], 1, "Requested operation is presently disabled")

    with pytest.raises(SlurmCommandError):
        requeue_job(Broken(), rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",)),
                    RequeueEffects(clock=fake_clock(), detach=False))
    state = rd.load_state()
    assert state.status == "running" and state.epoch == 5  # fenced, but not marked requeued
    assert not read_events(rd.path)
    retry = requeue_job(FakeSlurm(), rd, RequeueRequest(job_id="42", reason="supervisor_died"),
                        RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert retry.requeued and [e["event"] for e in read_events(rd.path)].count("requeue") == 1


def test_a_scontrol_requeue_killed_by_the_requeue_it_made_counts_as_requeued(tmp_path) -> None:
    """The dev cluster's time-limit test once saw it: the requeue kills the batch step at once,
    the supervisor's scontrol in it (rc=-15) before it returned."""
    rd = run_dir(tmp_path)

    class KilledByItsRequeue(FakeSlurm):
        def requeue(self, job_id):
            self.requeued = True
            raise SlurmCommandError(["scontrol", "requeue"], -15, "")

        def job_info(self, job_id):
            info = super().job_info(job_id)
            if info is not None and self.requeued:
                info.restart_count = 1   # Slurm counted the requeue
            return info

    result = requeue_job(KilledByItsRequeue(), rd, RequeueRequest(job_id="42", reason="time_limit: x"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert result.requeued and rd.load_state().status == "requeued"
    [event] = [e for e in read_events(rd.path) if e["event"] == "requeue"]
    assert event["reason"] == "time_limit: x" and event["by"] == "supervisor"


def test_a_scontrol_requeue_killed_by_a_signal_without_a_requeue_is_still_a_failure(tmp_path) -> None:
    rd = run_dir(tmp_path)

    class Killed(FakeSlurm):
        def requeue(self, job_id):
            raise SlurmCommandError(["scontrol", "requeue"], -9, "")

    naps: list[float] = []
    with pytest.raises(SlurmCommandError):
        requeue_job(Killed(), rd, RequeueRequest(job_id="42", reason="node_down"),
                    RequeueEffects(clock=fake_clock(), sleep=naps.append, detach=False))
    assert rd.load_state().status == "running" and not read_events(rd.path)
    assert len(naps) == 10   # it looked for a requeue for 2 s before saying no


def test_a_job_slurm_already_requeued_still_gets_the_pending_updates(tmp_path) -> None:
    rd = run_dir(tmp_path)

    class Preempted(FakeSlurm):
        def requeue(self, job_id):
            self.requeued = True  # Slurm's preemption requeued it first
            raise SlurmCommandError(["scontrol", "requeue"], 1, "scontrol: error: Job is pending execution for job 42")

    slurm = Preempted(completing_polls=0)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="preempted", partition="spanning"),
                         RequeueEffects(clock=fake_clock(), sleep=lambda s: None, detach=False))
    assert result.requeued and result.finish.ok
    assert slurm.calls[-1] == ("update_job", "42", ("n7",), "spanning", True)
    (event,) = [e for e in read_events(rd.path) if e["event"] == "requeue"]
    assert event["already_pending"] is True


def test_the_finisher_reports_each_job_state_change_once_for_the_post_mortem_log(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(completing_polls=3)
    slurm.requeue("42")
    seen: list[str] = []
    result = rq.finish_requeue(slurm, rd, "42", exclude=["n2"], partition=None, restart_count=0,
                               requeued_mono=0.0, clock=fake_clock(), sleep=lambda s: None,
                               on_state=lambda state, waited_s: seen.append(state))
    assert result.ok and seen == ["COMPLETING", "PENDING"]


class RestartedAtOnce(FakeSlurm):
    """After the requeue: COMPLETING, then the job shows `after` — the dead batch host's case,
    where Slurm skips the BeginTime hold and runs the job again in the same scheduling pass."""

    def __init__(self, after: list[FakeInfo], **kw):
        super().__init__(**kw)
        self.after = after

    def job_info(self, job_id):
        info = super().job_info(job_id)
        if info is not None and info.state == "PENDING" and self.after:
            return self.after.pop(0)
        return info


def test_a_job_slurm_restarted_at_once_is_recorded_without_waiting_for_the_deadline(tmp_path) -> None:
    rd = run_dir(tmp_path)
    rerun = FakeInfo(state="COMPLETED", restart_count=1)
    rerun.nodes, rerun.start_time = ["n2", "n3"], 1010
    slurm = RestartedAtOnce([rerun] * 10**6, completing_polls=2)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False,
                                        finish_deadline_s=60))
    assert not result.finish.ok and "restarted at once" in result.finish.error
    assert "partition main on n2,n3" in result.finish.error and "none of the excluded" in result.finish.error
    assert result.finish.total_s < 60 and not any(c[0] == "update_job" for c in slurm.calls)
    assert read_events(rd.path)[-1]["event"] == "requeue_updated"


def test_the_first_runs_end_shown_briefly_as_completed_is_not_mistaken_for_a_restart(tmp_path) -> None:
    rd = run_dir(tmp_path)
    first_run_end = FakeInfo(state="COMPLETED", restart_count=1)
    first_run_end.nodes, first_run_end.start_time = ["n1", "n2"], 900  # started before the requeue
    slurm = RestartedAtOnce([first_run_end, first_run_end], completing_polls=1)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
    assert result.finish.ok, result.finish.error
    assert slurm.calls[-1] == ("update_job", "42", ("n1", "n7"), "spanning", True)


class StartedBeforeUpdate(FakeSlurm):
    """The race seen in CI after a dead batch host: the job is seen PENDING, then Slurm starts it
    before the finisher's `scontrol update` arrives, which the real client (its runner faked)
    turns into SlurmCommandError "Job is no longer pending execution". After each of the
    `len(after_refusal)` refusals squeue shows the next of `after_refusal` (None: the job is gone;
    PENDING: refused in a moment it was not pending, the next update applies)."""

    def __init__(self, after_refusal: list, *, squeue_fails: bool = False, **kw):
        super().__init__(**kw)
        self.after_refusal = list(after_refusal)
        self.answers: list = []
        self.squeue_fails = squeue_fails

    def job_info(self, job_id):
        if not self.answers:
            return super().job_info(job_id)
        self.calls.append(("job_info", job_id))
        if self.squeue_fails:
            raise SlurmCommandError(["squeue", "--json", "--jobs"], 1, "slurm_load_jobs error: Unexpected message received")
        return self.answers.pop(0)

    def update_job(self, job_id, *, exc_nodes=None, partition=None, start_time_now=False):
        if self.requeued and self.completing_polls == 0 and self.after_refusal:
            self.answers.append(self.after_refusal.pop(0))
            self.calls.append(("update_job refused", job_id))
            client = SlurmClient(env={}, runner=lambda argv, timeout_s, env: CommandResult(
                argv=argv, returncode=1, stdout="", stderr="slurm_update error: Job is no longer pending execution"))
            client.update_job(job_id, exc_nodes=exc_nodes, partition=partition, start_time_now=start_time_now)
        super().update_job(job_id, exc_nodes=exc_nodes, partition=partition, start_time_now=start_time_now)


def landed_on(nodes, state="RUNNING", partition="main"):
    info = FakeInfo(state=state, restart_count=1, partition=partition)
    info.nodes, info.start_time = list(nodes), 1002
    return info


def test_a_job_slurm_started_between_the_pending_seen_and_the_update_is_recorded_as_restarted_at_once(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = StartedBeforeUpdate([landed_on(["n2", "n3"])], completing_polls=2)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
    finish = result.finish
    assert result.requeued and not finish.ok and "restarted at once" in finish.error, finish.error
    assert "(running, partition main on n2,n3)" in finish.error and "none of the excluded" in finish.error
    assert "no longer pending" in finish.error  # the refusal is kept, for the post-mortem
    assert finish.restarted and finish.nodes == ("n2", "n3") and finish.on_excluded == ()
    assert finish.job_partition == "main"
    # one refused update, then one look where it landed: no fallback updates against a running job
    assert [c[0] for c in slurm.calls[-2:]] == ["update_job refused", "job_info"]
    assert not any(c[0] == "update_job" for c in slurm.calls)
    event = read_events(rd.path)[-1]
    assert event["event"] == "requeue_updated" and event["ok"] is False
    assert event["restarted"] is True and event["nodes"] == ["n2", "n3"] and event["on_excluded"] == []
    assert event["job_partition"] == "main" and event["error"] == finish.error
    assert rd.load_state().status == "requeued"  # the requeue stands


def test_a_start_between_pending_and_update_onto_an_excluded_node_says_so(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = StartedBeforeUpdate([landed_on(["n1", "n7"])], completing_polls=1)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
    assert not result.finish.ok and "restarted at once" in result.finish.error
    assert "holds excluded node(s) n1,n7, which the next supervisor refuses" in result.finish.error
    assert result.finish.on_excluded == ("n1", "n7")
    assert read_events(rd.path)[-1]["on_excluded"] == ["n1", "n7"]


def test_a_refused_update_whose_job_shows_pending_again_is_retried_and_applied(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = StartedBeforeUpdate([FakeInfo(state="PENDING")], completing_polls=1)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",),
                                                   partition="spanning"),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
    assert result.finish.ok and not result.finish.restarted, result.finish.error
    assert [c[0] for c in slurm.calls[-3:]] == ["update_job refused", "job_info", "update_job"]
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7"), "spanning", True)


@pytest.mark.parametrize("squeue_fails", [False, True])
def test_a_job_gone_or_unreadable_after_the_refused_update_is_recorded_not_raised(tmp_path, squeue_fails) -> None:
    rd = run_dir(tmp_path)
    slurm = StartedBeforeUpdate([None], squeue_fails=squeue_fails, completing_polls=1)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",)),
                         RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
    assert not result.finish.ok and "no longer pending" in result.finish.error
    assert ("squeue failed" if squeue_fails else "gone after it was seen pending") in result.finish.error
    assert read_events(rd.path)[-1]["event"] == "requeue_updated"


def test_the_cluster_tests_outcome_check_accepts_a_start_before_the_update_only_where_it_is_safe(tmp_path) -> None:
    from test_requeue_cluster import check_finisher_outcomes

    def record(landed):
        rd = RunDir.create(tmp_path / f"run-{len(list(tmp_path.iterdir()))}")
        slurm = StartedBeforeUpdate([landed], completing_polls=1)
        requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="batch_host_lost", exclude=("n1",), partition="spanning"),
                    RequeueEffects(clock=fake_clock(), wall=lambda: 1000.5, sleep=lambda s: None, detach=False))
        return read_events(rd.path)

    # landed away from the excluded node: accepted; the job stays in its own partition
    events = record(landed_on(["n2", "n3"]))
    check_finisher_outcomes([events[-1]], "main")
    with pytest.raises(AssertionError):
        check_finisher_outcomes([events[-1]], "mainspare")
    # the CI failure's record: every update refused, nothing said about where the job landed
    refused = dict(events[-1], restarted=False, nodes=[], on_excluded=[],
                   error="update ['exc_nodes', 'partition', 'start_time_now'] refused: ... no longer pending execution")
    with pytest.raises(AssertionError):
        check_finisher_outcomes([refused], "main")
    # landed on an excluded node: accepted only when the next supervisor refused it
    events = record(landed_on(["n1", "n2"]))
    (requeue,) = [e for e in events if e["event"] == "requeue"]
    with pytest.raises(AssertionError, match="no supervisor ran"):
        check_finisher_outcomes([events[-1]], "main")
    nxt = requeue["epoch"] + 1
    refusing = [{"event": "supervisor_start", "epoch": nxt, "excluded": ["n1"]},
                {"event": "launch", "epoch": nxt, "nodes": ["n2", "n3"]}]
    check_finisher_outcomes([events[-1]], "main", events + refusing)
    using = [refusing[0], {"event": "launch", "epoch": nxt, "nodes": ["n1", "n2"]}]
    with pytest.raises(AssertionError):
        check_finisher_outcomes([events[-1]], "main", events + using)


@pytest.mark.parametrize("needed", [2, 3])
def test_the_next_supervisor_refuses_an_allocation_s_excluded_nodes(tmp_path, monkeypatch, needed) -> None:
    """What the finisher's "holds excluded node(s) …, which the next supervisor refuses" rests on:
    a supervisor started in an allocation that holds a node excluded in state.json never launches
    there — it runs on the others, or requeues (excluding it again) when too few are left."""
    import signal

    from ckptsup.config import Config, Resolved
    from ckptsup.env import ExitStatus
    from ckptsup.supervisor.job.loop import Job, Supervisor
    from ckptsup.supervisor.job.placement import Placement
    from ckptsup.supervisor.job.policy import Requeue

    rd = RunDir.create(tmp_path / "run")
    state = rd.load_state()
    state.epoch, state.status = 3, "requeued"
    state.excluded_nodes = {"n1": "batch_host_lost"}
    rd.save_state(state)
    config = Config()
    config.health.enabled = False
    sv = Supervisor(resolved=Resolved(config=config, provenance={}),
                    job=Job(script="train.py", script_args=[], cwd=str(tmp_path), nodes_needed=needed),
                    run_dir=rd, placement=Placement(job_id="42", nodes=("n1", "n2", "n3"), in_slurm=True))
    launched, carried = [], []

    class Stop(Exception):
        pass

    def launch(nodes, **kw):
        launched.append(nodes)
        raise Stop

    def requeue(action):
        carried.append(action)
        return ExitStatus.REQUEUE

    monkeypatch.setattr(sv, "_launch", launch)
    monkeypatch.setattr(sv, "_requeue", requeue)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        if needed == 2:
            with pytest.raises(Stop):
                sv.run()
        else:
            assert sv.run() == ExitStatus.REQUEUE
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    start = [e for e in read_events(rd.path) if e["event"] == "supervisor_start"][0]
    assert start["excluded"] == ["n1"] and start["epoch"] == 4
    if needed == 2:
        assert launched == [("n2", "n3")] and not carried
    else:
        assert not launched and isinstance(carried[0], Requeue) and "n1" in carried[0].exclude


class BusyController(FakeSlurm):
    """Slurm 26.05 seen on the version matrix: right after the requeue, slurmctld answers the
    pending job's `scontrol update` with "Resource temporarily unavailable" for longer than the
    client's own retries (11 s there); `busy` updates are answered so, then they apply."""

    def __init__(self, busy: int, **kw):
        super().__init__(**kw)
        self.busy = busy

    def update_job(self, job_id, *, exc_nodes=None, partition=None, start_time_now=False):
        if self.requeued and self.completing_polls == 0 and self.busy > 0:
            self.busy -= 1
            self.calls.append(("busy", job_id))
            raise SlurmCommandError(["scontrol", "update"], 1, f"Resource temporarily unavailable for job {job_id}")
        super().update_job(job_id, exc_nodes=exc_nodes, partition=partition, start_time_now=start_time_now)


def test_a_controller_busy_past_the_clients_retries_gets_the_updates_once_it_answers(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = BusyController(busy=3, completing_polls=1)   # the whole update answered busy three times
    naps: list[float] = []
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",), partition="spanning"),
                         RequeueEffects(clock=fake_clock(), sleep=naps.append, detach=False))
    assert result.finish.ok and result.finish.error == "", result.finish
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7"), "spanning", True)   # all three, as one update
    assert [c[0] for c in slurm.calls].count("busy") == 3 and naps.count(rq.BUSY_RETRY_S) == 3
    [updated] = [e for e in read_events(rd.path) if e["event"] == "requeue_updated"]
    assert updated["ok"] is True


def test_a_controller_busy_until_the_finish_deadline_is_one_recorded_error(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = BusyController(busy=10**6, completing_polls=1)
    result = requeue_job(slurm, rd, RequeueRequest(job_id="42", reason="node_down", exclude=("n2",), partition="spanning"),
                         RequeueEffects(clock=fake_clock(1.0), sleep=lambda s: None, detach=False, finish_deadline_s=30))
    assert not result.finish.ok and "still busy at the finish deadline" in result.finish.error
    assert "Resource temporarily unavailable" in result.finish.error
    assert [c[0] for c in slurm.calls].count("busy") < 100   # bounded by the deadline, not by luck
