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
from ckptsup.supervisor import requeue as rq
from ckptsup.supervisor.requeue import RequeueRefused, requeue_job


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
    result = requeue_job(slurm, rd, "42", "node_down", ["n2"], fake_clock(), partition="spanning",
                         detach=False, sleep=lambda s: None)
    names = [c[0] for c in slurm.calls]
    assert names == ["job_info", "requeue", "job_info", "job_info", "job_info", "update_job"]
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7", "n9"), "spanning", True)
    assert result.requeued and result.finish.ok
    assert set(result.phases) == {"check_s", "fence_s", "requeue_s"}
    assert result.finish.wait_pending_s > 0 and result.finish.total_s >= result.finish.wait_pending_s


def test_requeue_fences_the_epoch_and_records_exclusions(tmp_path) -> None:
    rd = run_dir(tmp_path)
    requeue_job(FakeSlurm(), rd, "42", "node_down", ["n2"], fake_clock(), detach=False, sleep=lambda s: None)
    state = rd.load_state()
    assert state.epoch == 5 and state.status == "requeued"
    assert state.excluded_nodes == {"n7": "nan job 1", "n2": "node_down"}


def test_exactly_one_fenced_requeue_event_plus_the_update_record(tmp_path) -> None:
    rd = run_dir(tmp_path)
    requeue_job(FakeSlurm(), rd, "42", "supervisor_died", [], fake_clock(), by="batch_script",
                detach=False, sleep=lambda s: None)
    events = read_events(rd.path)
    assert [e["event"] for e in events] == ["requeue", "requeue_updated"]
    event = events[0]
    assert event["epoch"] == 5 and event["attempt"] == 2 and event["job_id"] == "42"
    assert event["reason"] == "supervisor_died" and event["by"] == "batch_script"
    assert event["excluded"] == ["n7"] and set(event["phases"]) == {"check_s", "fence_s", "requeue_s"}
    assert events[1]["ok"] is True


def test_a_second_requeuer_in_the_same_epoch_does_nothing(tmp_path) -> None:
    rd = run_dir(tmp_path)
    first = requeue_job(FakeSlurm(), rd, "42", "supervisor_died", [], fake_clock(), detach=False, sleep=lambda s: None)
    slurm = FakeSlurm()
    second = requeue_job(slurm, rd, "42", "batch_host_lost", ["n1"], fake_clock(), detach=False, sleep=lambda s: None)
    assert first.requeued and not second.requeued
    assert "requeued" in second.why_skipped
    assert ("requeue", "42") not in slurm.calls
    assert [e["event"] for e in read_events(rd.path)].count("requeue") == 1


def test_a_racing_requeuer_that_lost_the_claim_does_nothing(tmp_path) -> None:
    rd = run_dir(tmp_path)
    (rd.path / f"{rq.CLAIM_PREFIX}4").write_text("{}")  # the other requeuer won epoch 4
    slurm = FakeSlurm()
    result = requeue_job(slurm, rd, "42", "x", [], fake_clock(), detach=False, sleep=lambda s: None)
    assert not result.requeued and "claimed" in result.why_skipped
    assert rd.load_state().epoch == 4 and not read_events(rd.path)


@pytest.mark.parametrize("status", ["done", "gave_up"])
def test_finished_runs_are_not_requeued(tmp_path, status) -> None:
    rd = run_dir(tmp_path)
    state = rd.load_state()
    state.status = status
    rd.save_state(state)
    slurm = FakeSlurm()
    assert not requeue_job(slurm, rd, "42", "x", [], fake_clock(), detach=False).requeued
    assert ("requeue", "42") not in slurm.calls


def test_no_requeue_job_is_refused_with_one_line_and_give_up_status(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(requeueable=False)
    with pytest.raises(RequeueRefused) as err:
        requeue_job(slurm, rd, "42", "node_down", ["n2"], fake_clock(), detach=False)
    assert "--no-requeue" in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == ExitStatus.GIVE_UP
    assert [c[0] for c in slurm.calls] == ["job_info"]
    assert rd.load_state().epoch == 4 and not read_events(rd.path)


def test_refused_partition_still_applies_exclusion_and_start_time(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(refuse_partitions={"spanning"})
    result = requeue_job(slurm, rd, "42", "node_down", ["n2"], fake_clock(), partition="spanning",
                         detach=False, sleep=lambda s: None)
    assert slurm.calls[-1] == ("update_job", "42", ("n2", "n7"), None, True)
    assert not result.finish.ok and "Invalid partition" in result.finish.error
    assert read_events(rd.path)[-1]["ok"] is False


def test_job_gone_while_waiting_is_recorded_not_raised(tmp_path) -> None:
    rd = run_dir(tmp_path)
    result = requeue_job(FakeSlurm(gone_after_requeue=True), rd, "42", "x", [], fake_clock(),
                         detach=False, sleep=lambda s: None)
    assert not result.finish.ok and "gone" in result.finish.error


def test_waiting_for_pending_gives_up_at_the_deadline(tmp_path) -> None:
    rd = run_dir(tmp_path)
    slurm = FakeSlurm(completing_polls=10**6)
    result = requeue_job(slurm, rd, "42", "x", [], fake_clock(1.0), detach=False, sleep=lambda s: None,
                         finish_deadline_s=5)
    assert not result.finish.ok and "after 5s" in result.finish.error
    assert not any(c[0] == "update_job" for c in slurm.calls)


def test_inside_the_job_the_finish_step_is_detached(tmp_path, monkeypatch) -> None:
    rd = run_dir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    spawned = []
    result = requeue_job(FakeSlurm(), rd, "42", "node_down", ["n2"], fake_clock(), partition="spanning",
                         spawn=lambda argv, path: spawned.append(argv) or 999)
    assert result.finisher_pid == 999 and result.finish is None
    (argv,) = spawned
    assert argv[1:4] == ["-m", "ckptsup.supervisor.requeue", "--finish"]
    assert argv[argv.index("--partition") + 1] == "spanning"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--exclude"] == ["n2", "n7"]


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

    result = requeue_job(Slurm(completing_polls=0), rd, "42", "x", [], fake_clock(), detach=False,
                         sleep=sleep, wall=lambda: now[0])
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
        requeue_job(Broken(), rd, "42", "node_down", ["n2"], fake_clock(), detach=False)
    state = rd.load_state()
    assert state.status == "running" and state.epoch == 5  # fenced, but not marked requeued
    assert not read_events(rd.path)
    retry = requeue_job(FakeSlurm(), rd, "42", "supervisor_died", [], fake_clock(), detach=False,
                        sleep=lambda s: None)
    assert retry.requeued and [e["event"] for e in read_events(rd.path)].count("requeue") == 1


def test_a_job_slurm_already_requeued_still_gets_the_pending_updates(tmp_path) -> None:
    rd = run_dir(tmp_path)

    class Preempted(FakeSlurm):
        def requeue(self, job_id):
            self.requeued = True  # Slurm's preemption requeued it first
            raise SlurmCommandError(["scontrol", "requeue"], 1, "scontrol: error: Job is pending execution for job 42")

    slurm = Preempted(completing_polls=0)
    result = requeue_job(slurm, rd, "42", "preempted", [], fake_clock(), partition="spanning", detach=False,
                         sleep=lambda s: None)
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
    result = requeue_job(slurm, rd, "42", "batch_host_lost", ["n1"], fake_clock(), partition="spanning",
                         detach=False, sleep=lambda s: None, wall=lambda: 1000.5, finish_deadline_s=60)
    assert not result.finish.ok and "restarted at once" in result.finish.error
    assert "partition main on n2,n3" in result.finish.error and "none of the excluded" in result.finish.error
    assert result.finish.total_s < 60 and not any(c[0] == "update_job" for c in slurm.calls)
    assert read_events(rd.path)[-1]["event"] == "requeue_updated"


def test_the_first_runs_end_shown_briefly_as_completed_is_not_mistaken_for_a_restart(tmp_path) -> None:
    rd = run_dir(tmp_path)
    first_run_end = FakeInfo(state="COMPLETED", restart_count=1)
    first_run_end.nodes, first_run_end.start_time = ["n1", "n2"], 900  # started before the requeue
    slurm = RestartedAtOnce([first_run_end, first_run_end], completing_polls=1)
    result = requeue_job(slurm, rd, "42", "batch_host_lost", ["n1"], fake_clock(), partition="spanning",
                         detach=False, sleep=lambda s: None, wall=lambda: 1000.5)
    assert result.finish.ok, result.finish.error
    assert slurm.calls[-1] == ("update_job", "42", ("n1", "n7"), "spanning", True)
