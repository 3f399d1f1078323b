"""The launch spec an agent reads (supervisor/spec.py): the supervisor's own file round-trips;
anything else — not JSON, not an object, missing/unknown fields, wrong types, a FIFO — is one
ConfigError line naming the file and the field (the agent command turns it into exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptsup.errors import ConfigError
from ckptsup.supervisor.spec import LaunchSpec

GOOD = {"script": "/w/train.py", "script_args": ["--lr", "1"], "nproc_per_node": 2, "nnodes": 2,
        "rdzv_endpoint": "10.0.0.1:29511", "rdzv_id": "42-3", "node_addrs": {"n1": "10.0.0.1", "n2": "10.0.0.2"},
        "env": {"CKPTSUP_ATTEMPT": "3"}, "log_dir": "/runs/42/attempt-3"}


def test_the_supervisors_spec_round_trips(tmp_path: Path) -> None:
    spec = LaunchSpec(**GOOD, kill_grace_s=5.0)
    spec.write(tmp_path / "launch.json")
    assert LaunchSpec.read(tmp_path / "launch.json") == spec


@pytest.mark.parametrize(("text", "problem"), [
    ("{oops", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
    (json.dumps({"script": "x.py"}), "lacks script_args, nproc_per_node"),
    (json.dumps({**GOOD, "bogus": 1}), "unknown field bogus"),
    (json.dumps({**GOOD, "nproc_per_node": "eight"}), "nproc_per_node must be an integer >= 1, not 'eight'"),
    (json.dumps({**GOOD, "nnodes": True}), "nnodes must be an integer >= 1, not True"),
    (json.dumps({**GOOD, "nnodes": 0}), "nnodes must be an integer >= 1, not 0"),
    (json.dumps({**GOOD, "script_args": "--lr 1"}), "script_args must be a list of strings"),
    (json.dumps({**GOOD, "env": {"A": 1}}), "env must be an object of variable -> string value"),
    (json.dumps({**GOOD, "node_addrs": ["n1"]}), "node_addrs must be an object of node -> address"),
    (json.dumps({**GOOD, "rdzv_endpoint": "10.0.0.1"}), "rdzv_endpoint must be ADDR:PORT"),
    (json.dumps({**GOOD, "rdzv_endpoint": "h:99999"}), "rdzv_endpoint must be ADDR:PORT"),
    (json.dumps({**GOOD, "kill_grace_s": 1e300}), "kill_grace_s must be a number of seconds >= 0"),
    (json.dumps({**GOOD, "heartbeat_interval_s": 0}), "heartbeat_interval_s must be a number of seconds > 0"),
    (json.dumps({**GOOD, "kill_grace_s": float("nan")}), "is not valid JSON"),
    (json.dumps({**GOOD, "rdzv_backend": "etcd"}), "rdzv_backend must be static or c10d"),
    ("[" * 100_000, "nests deeper"),
])
def test_a_bad_spec_is_one_line_naming_the_field(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "launch.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        LaunchSpec.read(path)
    message = str(err.value)
    assert problem in message and str(path) in message and "\n" not in message


@pytest.mark.parametrize(("make", "problem"), [(lambda p: None, "does not exist"), (os.mkfifo, "is a FIFO"),
                                                (os.mkdir, "is a directory")])
def test_a_spec_path_that_is_not_a_file_is_one_line(tmp_path: Path, make, problem: str) -> None:
    path = tmp_path / "launch.json"
    make(path)
    with pytest.raises(ConfigError, match=problem):
        LaunchSpec.read(path)


def test_a_spec_from_a_restart_frame_is_checked_the_same_way() -> None:
    assert LaunchSpec.from_json(dict(GOOD)) == LaunchSpec(**GOOD)
    with pytest.raises(ConfigError, match="restart frame: nnodes must be"):
        LaunchSpec.from_json({**GOOD, "nnodes": "2"}, source="restart frame")
