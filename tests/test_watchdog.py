"""The watchdog loop with injected clocks: requeues exactly once on a stale lease, never on a
fresh one, a finished run or a lease left over from a previous batch run within the grace."""

from __future__ import annotations

from pathlib import Path

from ckptsup.config import Config
from ckptsup.events import read_events
from ckptsup.rundir import RunDir, atomic_write_json
from ckptsup.supervisor.job.requeue import RequeueRefused, RequeueResult
from ckptsup.supervisor.job.watchdog import WatchOutcome, watch

from test_requeue import FakeSlurm, fake_clock


class World:
    """A wall clock that `sleep` advances; `on_sleep` lets a test act between polls."""

    def __init__(self, start: float = 1_000_000.0):
        self.now = start
        self.sleeps = 0
        self.on_sleep = lambda world: None

    def wall(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        self.on_sleep(self)
        if self.sleeps > 10_000:
            raise AssertionError("watchdog never returned")


def lease(rd: RunDir, renewed: float, host: str = "n1") -> None:
    atomic_write_json(rd.lease_path, {"pid": 1, "host": host, "epoch": 0, "renewed": renewed})


def make(tmp_path: Path) -> tuple[RunDir, Config, World]:
    rd = RunDir.create(tmp_path / "run")
    config = Config()
    config.supervisor.lease_stale_s = 10.0
    config.slurm.spare_partition = "spanning"
    return rd, config, World()


def recording_requeue(calls):
    def requeue(client, rd, request, effects):
        calls.append((request.job_id, request.reason, list(request.exclude), request.by))
        assert request.partition == "spanning"
        return RequeueResult(job_id=request.job_id, requeued=True, epoch=1)
    return requeue


def test_stale_lease_of_a_running_run_requeues_once_excluding_the_lease_host(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now, host="n1")  # renewed at our start, then never again
    calls = []
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.REQUEUED
    assert calls == [("42", "batch_host_lost", ["n1"], "watchdog")]
    assert 10.0 < result.lease_age_s <= 11.0  # noticed within one poll of going stale


def test_fresh_lease_never_triggers(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now)
    calls = []

    def renew_then_finish(w):
        lease(rd, w.now)
        if w.sleeps == 40:  # 40 s (4x lease_stale_s) of healthy renewals, then the run completes
            state = rd.load_state()
            state.status = "done"
            rd.save_state(state)

    world.on_sleep = renew_then_finish
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.FINISHED and calls == []


def test_finished_or_given_up_run_exits_quietly_even_with_a_stale_lease(tmp_path) -> None:
    for status in ("done", "gave_up"):
        rd, config, world = make(tmp_path / status)
        lease(rd, world.now - 1000)
        state = rd.load_state()
        state.status = status
        rd.save_state(state)
        calls = []
        result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                       sleep=world.sleep, requeue=recording_requeue(calls))
        assert result.outcome is WatchOutcome.FINISHED and calls == []


def test_lease_from_a_previous_batch_run_gets_the_startup_grace(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now - 500)  # the previous run's supervisor
    calls = []

    def new_supervisor_comes_up(w):
        if w.sleeps >= 20:
            lease(rd, w.now, host="n3")
        if w.sleeps == 100:
            state = rd.load_state()
            state.status = "done"
            rd.save_state(state)

    world.on_sleep = new_supervisor_comes_up
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.FINISHED and calls == []


def test_supervisor_that_never_writes_a_lease_is_requeued_after_the_grace(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    calls = []
    start = world.now
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, startup_grace_s=60.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.REQUEUED and 60.0 < world.now - start <= 61.0
    assert calls == [("42", "batch_host_lost", ["n1"], "watchdog")]  # batch host from squeue


def test_real_requeue_path_appends_exactly_one_fenced_event(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now, host="n1")
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, clock=fake_clock(), poll_s=1.0)
    assert result.outcome is WatchOutcome.REQUEUED
    requeues = [e for e in read_events(rd.path) if e["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["by"] == "watchdog" and requeues[0]["epoch"] == 1
    assert rd.load_state().excluded_nodes == {"n1": "batch_host_lost"}


def test_run_requeued_by_someone_else_while_watching_is_left_alone(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now)

    def batch_script_requeues(w):
        lease(rd, w.now)
        if w.sleeps == 5:
            state = rd.load_state()
            state.status, state.epoch = "requeued", state.epoch + 1
            rd.save_state(state)

    world.on_sleep = batch_script_requeues
    calls = []
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.ALREADY_REQUEUED and calls == []


def test_unrequeueable_job_records_give_up_then_frees_the_allocation(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now)
    order = []

    class Slurm(FakeSlurm):
        def cancel(self, job_id):
            order.append(("cancel", [e["event"] for e in read_events(rd.path)]))

    def refuse(*a, **kw):
        raise RequeueRefused("job 42 was submitted with --no-requeue")

    result = watch(run_dir=rd, job_id="42", config=config, client=Slurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=refuse)
    assert result.outcome is WatchOutcome.REFUSED
    assert order == [("cancel", ["give_up"])]
    assert rd.load_state().status == "gave_up"


def test_stop_request_ends_the_loop(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, stop=lambda: True)
    assert result.outcome is WatchOutcome.STOPPED


def test_watchdog_command_without_a_run_dir_config_exits_quietly(tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner

    from ckptsup.cli import cli
    from ckptsup.supervisor.ops import cli_ops

    monkeypatch.setattr(cli_ops, "STARTUP_WAIT_S", 0.6)
    result = CliRunner().invoke(cli, ["watchdog", "--run-dir", str(tmp_path / "never"), "--job-id", "42"])
    assert result.exit_code == 0, result.output
    assert "never appeared; nothing to watch" in result.output


def test_a_lease_host_slurm_does_not_know_is_replaced_by_slurms_batch_host(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    lease(rd, world.now, host="n1.cluster.example.org")  # FQDN, not the Slurm node name
    calls = []
    watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
          sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert calls == [("42", "batch_host_lost", ["n1"], "watchdog")]


def test_requeued_status_left_by_the_previous_run_does_not_stop_the_new_watchdog(tmp_path) -> None:
    rd, config, world = make(tmp_path)
    state = rd.load_state()
    state.status, state.epoch = "requeued", 2  # what the previous batch run left
    rd.save_state(state)
    lease(rd, world.now - 300)
    calls = []

    def new_supervisor(w):
        if w.sleeps == 3:  # takes over: epoch 3, running, fresh lease
            s = rd.load_state()
            s.status, s.epoch = "running", 3
            rd.save_state(s)
        if 3 <= w.sleeps <= 8:
            lease(rd, w.now, host="n1")
        # then it dies: the lease goes stale

    world.on_sleep = new_supervisor
    result = watch(run_dir=rd, job_id="42", config=config, client=FakeSlurm(), wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=recording_requeue(calls))
    assert result.outcome is WatchOutcome.REQUEUED
    assert calls == [("42", "batch_host_lost", ["n1"], "watchdog")]


def test_slurm_not_answering_when_the_lease_goes_stale_keeps_watching_and_never_cancels(tmp_path) -> None:
    """22.05 reports an unreachable controller as an `errors` array at exit 0; past the seam's
    retries that is a SlurmCommandError: the watchdog asks again later, never cancels on it."""
    from ckptsup.errors import SlurmCommandError

    rd, config, world = make(tmp_path)
    lease(rd, world.now, host="n1")
    answers = []

    def requeue(client, rd, request, effects):
        answers.append(world.now)
        if len(answers) < 3:   # the controller is back at the third try
            raise SlurmCommandError(["squeue", "--json"], 1, "slurm_load_jobs: Failed while looking for jobs")
        return RequeueResult(job_id=request.job_id, requeued=True, epoch=1)

    slurm = FakeSlurm()
    result = watch(run_dir=rd, job_id="42", config=config, client=slurm, wall=world.wall,
                   sleep=world.sleep, poll_s=1.0, requeue=requeue)
    assert result.outcome is WatchOutcome.REQUEUED and len(answers) == 3
    assert answers[1] - answers[0] == 1.0            # one poll later, not a give-up
    assert rd.load_state().status != "gave_up"
