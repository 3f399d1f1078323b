"""The run directory's files as inputs: state.json of the wrong shape or types, the per-job secret
and the lease. Each bad one is one ConfigError line naming the file, the problem and the fix (or,
for the lease, "no lease"), never a traceback, a hang or an empty HMAC key."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from ckptsup.errors import ConfigError
from ckptsup.rundir import FAILURE_OUTCOMES, SUPERVISION_LEVELS, RunDir, RunState, RunStatus, read_epoch, read_secret


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir.create(tmp_path / "run")


@pytest.mark.parametrize(("text", "problem"), [
    ("[]", "not a JSON object but a list"),
    ('"running"', "not a JSON object but a string"),
    ("", "is not valid JSON"),
    ('{"epoch": "x"}', "epoch must be an integer >= 0, not 'x'"),
    ('{"epoch": -1}', "epoch must be an integer >= 0, not -1"),
    ('{"epoch": 1.5}', "epoch must be an integer >= 0, not 1.5"),
    ('{"epoch": NaN}', "epoch must be an integer >= 0, not nan"),
    ('{"epoch": 99999999999999999999999}', "epoch must be an integer >= 0"),
    ('{"attempt": true}', "attempt must be an integer >= 0, not True"),
    ('{"restarts": null}', "restarts must be an integer >= 0, not None"),
    ('{"excluded_nodes": ["n1"]}', "excluded_nodes must be an object of node -> reason"),
    ('{"excluded_nodes": {"n1": 3}}', "excluded_nodes must be an object of node -> reason"),
    ('{"measured": []}', "measured must be an object"),
    ('{"measured": {"stall_s": "fast"}}', "measured.stall_s must be a number or a list of numbers"),
    ('{"measured": {"step_times": [0.1, "x"]}}', "measured.step_times must be a number or a list of numbers"),
    ('{"status": 3}', "unknown run status 3"),
    ('{"status": "exploded"}', "unknown run status 'exploded'"),
    ('{"failures": {}}', "failures must be a list"),
    ('{"failures": [1]}', "failures[0] must be an object"),
    ('{"failures": [{"kind": "meteor"}]}', "failures[0].kind must be one of"),
    ('{"failures": [{}, {"outcome": "exploded"}]}', "failures[1].outcome must be one of"),
    ('{"failures": [{"attempt": "x"}]}', "failures[0].attempt must be"),
    ('{"failures": [{"start_step": -3}]}', "failures[0].start_step must be"),
    ('{"failures": [{"last_step": "9"}]}', "failures[0].last_step must be"),
    ('{"failures": [{"step": 1.5}]}', "failures[0].step must be"),
    ('{"failures": [{"rank": true}]}', "failures[0].rank must be"),
    ('{"failures": [{"node": 7}]}', "failures[0].node must be"),
    ('{"failures": [{"detect_s": "x"}]}', "failures[0].detect_s must be"),
    ('{"failures": [{"detail": []}]}', "failures[0].detail must be"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
])
def test_a_state_json_of_the_wrong_shape_or_types_is_one_line(run: RunDir, text: str, problem: str) -> None:
    run.state_path.write_text(text)
    with pytest.raises(ConfigError) as err:
        run.load_state()
    message = str(err.value)
    assert problem in message, message
    assert str(run.state_path) in message and "is corrupt" in message and "move it aside" in message
    assert "\n" not in message and len(message) < 400
    with pytest.raises(ConfigError):
        read_epoch(run.path)  # the commit's fencing check reads it too


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["directory", "fifo"])
def test_a_state_json_that_is_not_a_file_is_one_line_without_blocking(run: RunDir, make) -> None:
    make(run.state_path)
    with pytest.raises(ConfigError, match="not a regular file.*move it aside"):
        run.load_state()


def test_a_huge_state_json_is_refused(run: RunDir) -> None:
    with open(run.state_path, "wb") as fh:
        fh.truncate(64 << 20)
    with pytest.raises(ConfigError, match="bytes; at most"):
        run.load_state()


def test_every_field_round_trips_and_unknown_keys_are_ignored(run: RunDir) -> None:
    state = RunState(attempt=3, epoch=7, excluded_nodes={"n2": "node_down"}, restarts=2,
                     measured={"stall_s": 0.5, "step_times": [0.1, 0.2]}, status=RunStatus.STOPPED,
                     failures=[{"attempt": 1, "outcome": "failed", "start_step": 0, "last_step": 9, "kind": "crash",
                                "node": "n2", "rank": 1, "step": 9, "detect_s": 0.4, "detail": "rc=1"},
                               {"attempt": 2, "outcome": "preempted", "start_step": 9, "last_step": None}])
    run.save_state(state)
    assert run.load_state() == state
    data = json.loads(run.state_path.read_text())
    run.state_path.write_text(json.dumps({**data, "from_a_newer_version": 1}))
    assert run.load_state() == state


def test_a_non_finite_measurement_is_forgotten_not_fatal(run: RunDir) -> None:
    """Measured costs are estimates the next attempt can measure again: a NaN one must not end the run."""
    run.state_path.write_text('{"epoch": 2, "measured": {"stall_s": NaN, "write_s": 1.0, "step_times": [0.1, Infinity, 0.2]}}')
    state = run.load_state()
    assert state.epoch == 2 and state.measured == {"write_s": 1.0, "step_times": [0.1, 0.2]}


def test_the_failure_outcomes_are_the_supervisors() -> None:
    from ckptsup.supervisor.job.observations import Outcome, SupervisionLevel

    assert set(FAILURE_OUTCOMES) == {o.value for o in Outcome}
    assert set(SUPERVISION_LEVELS) == {level.value for level in SupervisionLevel}


# ---- the secret -------------------------------------------------------------------------------

def put_secret(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.close(fd)
    return path


@pytest.mark.parametrize(("data", "problem"), [
    (b"", "is empty"),
    (b"\n", "is empty"),
    (b"s3cret", "holds 6 bytes, not all hex"),
    (b"ab" * 31, "holds 62 characters"),
    (b"z" * 64, "not all hex"),
    ("é".encode() * 40, "not all hex"),
])
def test_a_secret_that_is_not_a_ckptsup_key_is_refused(tmp_path: Path, data: bytes, problem: str) -> None:
    path = put_secret(tmp_path / "secret", data)
    with pytest.raises(ConfigError) as err:
        read_secret(path)
    message = str(err.value)
    assert problem in message and str(path) in message and "at least 64 hex characters" in message
    assert "\n" not in message


def test_a_ckptsup_secret_is_read_as_its_hex_text(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    assert read_secret(put_secret(tmp_path / "secret", token.encode() + b"\n")) == token.encode()


@pytest.mark.parametrize(("make", "problem"), [
    (lambda p: None, "does not exist"),
    (os.mkdir, "is a directory"),
    (os.mkfifo, "is a FIFO"),
])
def test_a_secret_path_that_is_not_a_file_is_one_line(tmp_path: Path, make, problem: str) -> None:
    path = tmp_path / "secret"
    make(path)
    if path.exists():
        os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=problem):
        read_secret(path)


def test_the_variable_that_named_the_secret_is_in_the_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secret file \(CKPTSUP_SECRET_FILE\) .*nope does not exist"):
        read_secret(tmp_path / "nope", named_by="CKPTSUP_SECRET_FILE")


def test_create_replaces_an_empty_secret_left_by_a_crash_and_keeps_a_good_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    put_secret(run_dir / "secret", b"")     # an older ckptsup died between creating and writing it
    run = RunDir.create(run_dir)
    key = run.read_secret()
    assert len(key) == 64
    assert RunDir.create(run_dir).read_secret() == key  # a good secret is never replaced
    assert sorted(p.name for p in run_dir.iterdir()) == ["secret"]  # no temporary left behind


# ---- the lease ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[]", "{}", '{"renewed": "x"}', '{"renewed": NaN}', '{"renewed": true}', "{oops",
                                  "[" * 100_000])
def test_an_unreadable_lease_reads_as_no_lease(run: RunDir, text: str) -> None:
    run.lease_path.write_text(text)
    assert run.lease_age_s() is None


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["directory", "fifo"])
def test_a_lease_that_is_not_a_file_reads_as_no_lease(run: RunDir, make) -> None:
    make(run.lease_path)
    assert run.lease_age_s() is None
