"""Pure parsers on literal Slurm 22.05 output (captured from the dev cluster)."""

from __future__ import annotations

import json

import pytest

from ckptsup.slurm.parsers import (JobState, NodeState, failure_hint, is_permission_denied, is_transient, parse_key_values,
                                   parse_node_state, parse_sbatch_parsable, parse_sinfo_nodes, parse_squeue_json)

SINFO = """\
n1|idle|none
n1|idle|none
n2|down*|Not responding
n2|down*|Not responding
n3|mixed*|none
n4|drained|ckptsup: hang job 12
n5|allocated+drain|maintenance window
"""


def test_sinfo_lines_become_one_info_per_node_with_state_responding_and_reason():
    nodes = parse_sinfo_nodes(SINFO)
    assert sorted(nodes) == ["n1", "n2", "n3", "n4", "n5"]
    assert (nodes["n1"].state, nodes["n1"].responding, nodes["n1"].reason) == (NodeState.IDLE, True, "")
    assert (nodes["n2"].state, nodes["n2"].responding, nodes["n2"].reason) == (NodeState.DOWN, False, "Not responding")
    assert nodes["n3"].state is NodeState.MIXED and not nodes["n3"].responding and not nodes["n3"].healthy
    assert nodes["n4"].state is NodeState.DRAINED and nodes["n4"].reason == "ckptsup: hang job 12"
    assert nodes["n5"].state is NodeState.DRAINING


@pytest.mark.parametrize("raw,expected", [
    ("idle", (NodeState.IDLE, True)), ("idle*", (NodeState.IDLE, False)), ("down*", (NodeState.DOWN, False)),
    ("drained", (NodeState.DRAINED, True)), ("draining", (NodeState.DRAINING, True)),
    ("idle+drain", (NodeState.DRAINED, True)), ("mixed+drain", (NodeState.DRAINING, True)),
    ("completing", (NodeState.COMPLETING, True)), ("unknown*", (NodeState.UNKNOWN, False)),
    ("alloc", (NodeState.ALLOCATED, True)), ("future", (NodeState.OTHER, True)),
])
def test_node_state_words_map_to_states(raw, expected):
    assert parse_node_state(raw) == expected


def test_only_responding_usable_nodes_are_healthy():
    nodes = parse_sinfo_nodes(SINFO)
    assert [n for n, i in nodes.items() if i.healthy] == ["n1"]


SCONTROL_NODE = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.22 "
                 "NodeAddr=127.0.0.1 NodeHostName=localhost Port=17202 Version=22.05.8 "
                 "State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Partitions=main,mainspare,lowprio,highprio "
                 "Reason=Not responding [root@2026-11-29T10:53:27]")


def test_scontrol_show_node_values_may_contain_spaces():
    fields = parse_key_values(SCONTROL_NODE)
    assert fields["NodeAddr"] == "127.0.0.1"
    assert fields["State"] == "DOWN+NOT_RESPONDING"
    assert fields["Reason"] == "Not responding [root@2026-11-29T10:53:27]"
    assert fields["Partitions"] == "main,mainspare,lowprio,highprio"


def _squeue(*jobs):
    return json.dumps({"meta": {"Slurm": {"version": {"major": 22, "minor": 5}}}, "errors": [], "jobs": list(jobs)})


def test_squeue_json_job_fields_are_parsed_and_hostlists_expanded():
    text = _squeue({"job_id": 3, "name": "wrap", "job_state": "PENDING", "nodes": "", "requeue": True,
                    "state_reason": "BeginTime", "restart_cnt": 1, "batch_host": "n1", "partition": "main",
                    "excluded_nodes": "n[2-3]", "exit_code": 0},
                   {"job_id": 7, "name": "train", "job_state": "RUNNING", "nodes": "n[1-2],n5", "requeue": False,
                    "state_reason": "None", "restart_cnt": 0, "batch_host": "n1", "partition": "mainspare",
                    "excluded_nodes": "", "exit_code": 0, "start_time": 1795959520})
    pending, running = parse_squeue_json(text)
    assert pending.state is JobState.PENDING and pending.reason == "BeginTime"
    assert pending.restart_count == 1 and pending.requeue and pending.excluded_nodes == ["n2", "n3"]
    assert running.nodes == ["n1", "n2", "n5"] and running.batch_host == "n1" and not running.requeue
    assert running.start_time == 1795959520 and pending.start_time is None


@pytest.mark.parametrize("raw, expected", [(1795959520, 1795959520), (0, None), (None, None),
                                           ({"set": True, "infinite": False, "number": 17}, 17),
                                           ({"set": False, "number": 0}, None)])
def test_squeue_json_start_time_in_old_and_new_formats(raw, expected):
    (job,) = parse_squeue_json(_squeue({"job_id": 5, "job_state": "RUNNING", "start_time": raw}))
    assert job.start_time == expected


@pytest.mark.parametrize("raw, expected", [(1795959520, 1795959520), (0, None), (None, None),
                                           ({"set": True, "infinite": False, "number": 17}, 17),
                                           ({"set": True, "infinite": True, "number": 0}, None)])
def test_squeue_json_end_time_prices_fewer_nodes_and_no_limit_is_none(raw, expected):
    (job,) = parse_squeue_json(_squeue({"job_id": 5, "job_state": "RUNNING", "end_time": raw}))
    assert job.end_time == expected


def test_squeue_json_raw_wait_status_splits_into_exit_code_and_signal():
    failed, killed = parse_squeue_json(_squeue({"job_id": 4, "job_state": "FAILED", "exit_code": 768},
                                               {"job_id": 5, "job_state": "FAILED", "exit_code": 9}))
    assert (failed.exit_code, failed.exit_signal) == (3, None)
    assert (killed.exit_code, killed.exit_signal) == (0, 9)


def test_squeue_json_newer_exit_code_objects_are_understood():
    (job,) = parse_squeue_json(_squeue({"job_id": 9, "job_state": ["COMPLETED"],
                                        "exit_code": {"status": ["EXITED"], "return_code": {"number": 4}}}))
    assert job.state is JobState.COMPLETED and job.exit_code == 4


def test_squeue_invalid_json_is_a_value_error():
    with pytest.raises(ValueError, match="invalid JSON"):
        parse_squeue_json("slurm_load_jobs error")


def test_finished_states_are_terminal_and_pending_is_not():
    assert JobState.COMPLETED.finished and JobState.PREEMPTED.finished and JobState.NODE_FAIL.finished
    assert not JobState.PENDING.finished and not JobState.RUNNING.finished and not JobState.REQUEUED.finished


@pytest.mark.parametrize("text,job_id", [("42\n", "42"), ("42;cluster\n", "42")])
def test_sbatch_parsable_output_gives_the_job_id(text, job_id):
    assert parse_sbatch_parsable(text) == job_id


def test_sbatch_output_without_job_id_is_refused():
    with pytest.raises(ValueError):
        parse_sbatch_parsable("sbatch: error: Batch job submission failed")


@pytest.mark.parametrize("stderr", [
    "squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation",
    "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
    "scontrol: error: slurm_load_partitions: Zero Bytes were transmitted or received",
    "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying",
    "error: Connection refused",
])
def test_controller_unreachable_or_busy_is_transient(stderr):
    assert is_transient(stderr)


@pytest.mark.parametrize("stderr", [
    "scontrol: error: Invalid job id specified",
    "sbatch: error: Invalid partition name specified",
    "slurm_update error: Job is no longer pending execution",
    "slurm_update error: Access/permission denied",
])
def test_refusals_are_permanent(stderr):
    assert not is_transient(stderr)


def test_permission_denied_is_recognised():
    assert is_permission_denied("slurm_update error: Access/permission denied")
    assert is_permission_denied("scontrol: error: Invalid user for this operation")
    assert is_permission_denied("slurm_update error: Invalid user id")  # 22.05, non-admin node update
    assert not is_permission_denied("slurm_update error: Invalid node name specified")


def test_sacct_parsable_rows_become_dicts():
    from ckptsup.slurm.parsers import parse_sacct

    rows = parse_sacct("2|COMPLETED|0:0|n[1-2]\n3|FAILED|3:0|n1\n", ["JobID", "State", "ExitCode", "NodeList"])
    assert rows == [{"JobID": "2", "State": "COMPLETED", "ExitCode": "0:0", "NodeList": "n[1-2]"},
                    {"JobID": "3", "State": "FAILED", "ExitCode": "3:0", "NodeList": "n1"}]


@pytest.mark.parametrize("stderr", [
    "sbatch: fatal: Could not establish a configuration source",
    "sinfo: error: Unable to contact slurm controller (connect failure)",
])
def test_no_cluster_failures_get_a_hint_naming_slurm_conf(stderr):
    assert "SLURM_CONF" in failure_hint(stderr)


def test_other_failures_get_no_hint():
    assert failure_hint("sbatch: error: Batch job submission failed: Invalid account") == ""
