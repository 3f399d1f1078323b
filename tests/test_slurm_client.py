"""SlurmClient logic with a fake runner (retries, errors, argv); the same behaviours run on the
real cluster in test_slurm_cluster.py."""

from __future__ import annotations

import pytest

from ckptsup.errors import NotInAllocationError, SlurmCommandError
from ckptsup.slurm.allocation import allocation_from_env
from ckptsup.slurm.client import CommandResult, SlurmClient


class FakeRunner:
    def __init__(self, *results: tuple[int, str, str]):
        self.results = list(results)
        self.calls: list[list[str]] = []

    def __call__(self, argv, timeout_s, env):
        self.calls.append(argv)
        rc, out, err = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        return CommandResult(argv=argv, returncode=rc, stdout=out, stderr=err)


def client(runner, **kw):
    sleeps: list[float] = []
    c = SlurmClient(env={"SLURM_CONF": "/x/slurm.conf"}, runner=runner, sleep=sleeps.append, **kw)
    return c, sleeps


def test_transient_failures_are_retried_then_succeed():
    runner = FakeRunner((1, "", "Socket timed out on send/recv operation"),
                        (1, "", "Unable to contact slurm controller"), (0, "42\n", ""))
    c, sleeps = client(runner)
    assert c.submit("/tmp/job.sbatch") == "42"
    assert len(runner.calls) == 3 and len(sleeps) == 2


def test_transient_failure_past_the_attempt_bound_raises_slurm_command_error():
    runner = FakeRunner((1, "", "Socket timed out on send/recv operation"))
    c, _ = client(runner, max_attempts=4)
    with pytest.raises(SlurmCommandError, match=r"squeue --json --states=all failed \(rc=1\): Socket timed out") as err:
        c.job_info("5")
    assert err.value.rc == 1 and len(runner.calls) == 4


def test_permanent_failure_raises_at_once_with_cmd_rc_and_stderr():
    runner = FakeRunner((1, "", "sbatch: error: Invalid partition name specified"))
    c, sleeps = client(runner)
    with pytest.raises(SlurmCommandError) as err:
        c.submit("/tmp/job.sbatch", ["-p", "nope"])
    assert err.value.cmd[:4] == ["sbatch", "--parsable", "-p", "nope"]
    assert "Invalid partition" in err.value.stderr and sleeps == [] and len(runner.calls) == 1


def test_drain_denied_returns_false_instead_of_raising():
    c, _ = client(FakeRunner((1, "", "slurm_update error: Access/permission denied")))
    assert c.drain("n2", "hang") is False


def test_drain_sends_state_and_reason_as_one_argument():
    runner = FakeRunner((0, "", ""))
    c, _ = client(runner)
    assert c.drain("n2", "ckptsup: hang job 7") is True
    assert runner.calls[0] == ["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=ckptsup: hang job 7"]


def test_resume_of_a_node_already_in_service_is_not_an_error():
    c, _ = client(FakeRunner((1, "", "slurm_update error: Invalid node state specified")))
    assert c.resume("n1") is True


def test_update_job_puts_every_field_in_one_scontrol_update():
    runner = FakeRunner((0, "", ""))
    c, _ = client(runner)
    c.update_job("7", exc_nodes=["n2", "n3", "n1"], partition="mainspare", start_time_now=True)
    assert runner.calls == [["scontrol", "update", "JobId=7", "ExcNodeList=n[1-3]", "Partition=mainspare", "StartTime=now"]]


def test_update_job_with_nothing_to_change_runs_nothing():
    runner = FakeRunner((0, "", ""))
    c, _ = client(runner)
    c.update_job("7")
    assert runner.calls == []


def test_job_info_of_a_purged_job_is_none():
    c, _ = client(FakeRunner((1, "", "slurm_load_jobs error: Invalid job id specified")))
    assert c.job_info("99") is None


def test_cancel_with_signal_to_the_batch_shell_only():
    runner = FakeRunner((0, "", ""))
    c, _ = client(runner)
    c.cancel("7", signal="USR1", batch=True)
    assert runner.calls == [["scancel", "--signal=USR1", "--batch", "7"]]


def test_srun_argv_is_one_task_per_node_overlapping_with_stdin_to_all():
    argv = SlurmClient.srun_argv(nodes=["n1", "n3", "n4"], command=["ckptsup", "agent", "--attempt", "2"], job_id="7")
    assert argv == ["srun", "--overlap", "--input=all", "--jobid=7", "--nodes=3", "--ntasks=3",
                    "--ntasks-per-node=1", "--nodelist=n[1,3-4]", "ckptsup", "agent", "--attempt", "2"]


def test_commands_run_with_the_clients_environment():
    seen = {}

    def runner(argv, timeout_s, env):
        seen.update(env)
        return CommandResult(argv=argv, returncode=0, stdout="Slurmctld(primary) at vm is UP\n", stderr="")

    assert SlurmClient(env={"SLURM_CONF": "/dev/cluster/slurm.conf"}, runner=runner).ping()
    assert seen["SLURM_CONF"] == "/dev/cluster/slurm.conf"


def test_a_slurm_conf_that_does_not_exist_fails_at_once_with_the_fix(tmp_path):
    """Slurm itself would hang ~30 s on a DNS lookup per try (and we would retry it)."""
    sleeps: list[float] = []
    c = SlurmClient(env={"SLURM_CONF": str(tmp_path / "missing.conf"), "PATH": "/usr/bin:/bin"}, sleep=sleeps.append)
    with pytest.raises(SlurmCommandError, match="does not exist; point it at") as err:
        c.run(["sinfo"])
    assert sleeps == [] and "\n" not in str(err.value)


def test_no_cluster_answers_get_the_set_slurm_conf_hint():
    c, _ = client(FakeRunner((1, "", "sbatch: fatal: Could not establish a configuration source")))
    with pytest.raises(SlurmCommandError, match="Could not establish a configuration source; no Slurm cluster"):
        c.run(["sbatch", "x"])


def test_missing_slurm_command_is_one_line_naming_the_package():
    c = SlurmClient(env={"PATH": "/nonexistent"})
    with pytest.raises(SlurmCommandError, match="command not found; install"):
        c.run(["sinfo-does-not-exist"])


# ---- the allocation ---------------------------------------------------------------------------

def test_allocation_is_read_from_slurms_environment():
    alloc = allocation_from_env({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-3],n5",
                                 "SLURMD_NODENAME": "n1", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_NUM_NODES": "4",
                                 "SLURM_CPUS_ON_NODE": "4", "SLURM_JOB_PARTITION": "mainspare"})
    assert alloc.nodes == ["n1", "n2", "n3", "n5"] and alloc.batch_host == "n1"
    assert (alloc.restart_count, alloc.num_nodes, alloc.cpus_on_node, alloc.partition) == (2, 4, 4, "mainspare")
    assert alloc.others() == ["n2", "n3", "n5"]


def test_first_attempt_has_restart_count_zero():
    alloc = allocation_from_env({"SLURM_JOB_ID": "12", "SLURM_NODELIST": "n4"})
    assert alloc.restart_count == 0 and alloc.nodes == ["n4"] and alloc.num_nodes == 1 and alloc.batch_host == "n4"


def test_outside_an_allocation_is_one_clear_error():
    with pytest.raises(NotInAllocationError, match="SLURM_JOB_ID is unset"):
        allocation_from_env({})


def test_a_malformed_nodelist_is_a_config_error_not_a_traceback():
    from ckptsup.errors import ConfigError

    with pytest.raises(ConfigError, match="not a Slurm hostlist"):
        allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-"})
