"""The parsers and the client on literal `squeue --json` answers captured from each Slurm version
the matrix runs (tests/golden/slurm/<version>/, written by tests/golden/slurm/capture.py against
that version's dev cluster): 22.05 (Debian 12), 24.11 (trixie), 26.05 (sid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptsup.errors import SlurmCommandError
from ckptsup.slurm.client import CommandResult, SlurmClient
from ckptsup.slurm.parsers import JobState, job_state_of, json_errors, parse_squeue_json

GOLDEN = Path(__file__).parent / "golden" / "slurm"
VERSIONS = ["22.05", "24.11", "26.05"]   # every version of the matrix has its captures


def _read(version: str, name: str) -> str:
    return (GOLDEN / version / name).read_text()


def _job(version: str, name: str, which: str):
    ids = json.loads(_read(version, "ids.json"))
    (job,) = [j for j in parse_squeue_json(_read(version, name)) if j.job_id == ids[which]]
    return job


@pytest.mark.parametrize("version", VERSIONS)
def test_a_finished_job_shows_failed_with_its_exit_code_under_states_all(version):
    job = _job(version, "finished_exit3.json", "finished")
    assert job.state is JobState.FAILED and job.state.finished
    assert (job.exit_code, job.exit_signal) == (3, None)


@pytest.mark.parametrize("version", VERSIONS)
def test_without_states_all_a_finished_job_is_missing_on_newer_slurm(version):
    ids = json.loads(_read(version, "ids.json"))
    listed = [j.job_id for j in parse_squeue_json(_read(version, "finished_default.json"))]
    # why job_info asks with --states=all: 23.02+ answer "jobs": [] for a job that ended
    assert (ids["finished"] in listed) is (version == "22.05")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_requeued_job_still_completing_reads_completing_not_pending(version):
    job = _job(version, "requeued_completing.json", "requeued")
    assert job.state is JobState.COMPLETING      # what squeue %T prints: not yet schedulable
    raw = job.raw["job_state"]
    assert raw == "COMPLETING" if version == "22.05" else (isinstance(raw, list) and "COMPLETING" in raw)


@pytest.mark.parametrize("flags, expected", [
    (["PENDING"], JobState.PENDING), ("PENDING", JobState.PENDING),
    (["PENDING", "COMPLETING"], JobState.COMPLETING), (["RUNNING", "CONFIGURING"], JobState.CONFIGURING),
    (["COMPLETED", "STAGE_OUT"], JobState.STAGE_OUT), (["PENDING", "REQUEUED"], JobState.REQUEUED),
    (["PENDING", "REQUEUE_HOLD"], JobState.REQUEUE_HOLD), (["PENDING", "REQUEUE_FED"], JobState.REQUEUE_FED),
    (["RUNNING", "SIGNALING", "COMPLETING"], JobState.COMPLETING),  # %T's order, not the list's
    (["RUNNING", "POWER_UP_NODE"], JobState.RUNNING),                # a flag %T does not name
    (["PENDING", "RESV_DEL_HOLD"], JobState.RESV_DEL_HOLD), ([], JobState.OTHER), ("weird", JobState.OTHER),
])
def test_state_flags_name_the_state_as_squeue_percent_t_does(flags, expected):
    assert job_state_of(flags) is expected


def test_22_05_reports_an_unreachable_controller_as_exit_0_with_errors():
    answer = json.loads(_read("22.05", "unreachable.json"))
    assert answer["returncode"] == 0 and json.loads(answer["stdout"])["jobs"] == []
    assert json_errors(answer["stdout"]) == ["slurm_load_jobs: Failed while looking for jobs: Unspecified error"]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unreachable_controller_is_retried_and_never_reads_as_a_vanished_job(version):
    answer = json.loads(_read(version, "unreachable.json"))
    calls = []

    def runner(argv, timeout_s, env):
        calls.append(argv)
        return CommandResult(argv=argv, **answer)

    client = SlurmClient(runner=runner, sleep=lambda s: None, max_attempts=4)
    with pytest.raises(SlurmCommandError) as err:
        client.job_info("5")
    assert len(calls) == 4                                   # transient: retried within the bound
    assert "--states=all" in calls[0]
    assert "controller" in str(err.value).lower() or "failed while looking for jobs" in str(err.value).lower()


def test_a_json_answer_that_recovers_within_the_bound_is_used():
    answer = json.loads(_read("22.05", "unreachable.json"))
    good = _read("22.05", "finished_exit3.json")
    ids = json.loads(_read("22.05", "ids.json"))
    answers = [CommandResult(argv=[], **answer), CommandResult(argv=[], returncode=0, stdout=good, stderr="")]
    client = SlurmClient(runner=lambda argv, t, env: answers.pop(0), sleep=lambda s: None)
    job = client.job_info(ids["finished"])
    assert job is not None and job.state is JobState.FAILED and job.exit_code == 3


def test_an_unknown_job_in_a_clean_answer_is_none():
    text = _read("26.05", "finished_default.json")   # "jobs": [], no errors
    client = SlurmClient(runner=lambda argv, t, env: CommandResult(argv=argv, returncode=0, stdout=text, stderr=""))
    assert client.job_info("424242") is None


def test_a_refusal_in_the_errors_array_is_not_retried():
    text = json.dumps({"errors": [{"description": "Invalid job id specified", "error_number": 2017}], "jobs": []})
    calls = []

    def runner(argv, t, env):
        calls.append(argv)
        return CommandResult(argv=argv, returncode=0, stdout=text, stderr="")

    assert SlurmClient(runner=runner, sleep=lambda s: None).job_info("7") is None
    assert len(calls) == 1
