"""Fuzz tier: the agent's launch spec (ckptsup/supervisor/spec.py) — `LaunchSpec.read` (the
spec file of `ckptsup agent --spec`) and `LaunchSpec.from_json` (the spec in a `restart` frame).

Allowed exception: ConfigError, one short line. A spec round-trips through write → read and
to_json → from_json."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from ckptsup.errors import ConfigError
from ckptsup.supervisor.spec import LaunchSpec
from fuzz_helpers import (FILE_KINDS, json_text, assert_one_line, fresh_dir, json_bytes, json_values, mutated, plant,
                          scalars, strings)

text = json_text(max_size=12)
seconds = st.one_of(st.floats(0, 7 * 86400), st.integers(0, 7 * 86400))


def launch_specs() -> st.SearchStrategy[LaunchSpec]:
    host = json_text(min_size=1, max_size=12)
    return st.builds(
        LaunchSpec, script=text, script_args=st.lists(text, max_size=4),
        nproc_per_node=st.integers(1, 2 ** 31 - 1), nnodes=st.integers(1, 2 ** 31 - 1),
        rdzv_endpoint=st.builds(lambda h, p: f"{h}:{p}", host, st.integers(1, 65535)),
        rdzv_id=text, node_addrs=st.dictionaries(text, text, max_size=4), env=st.dictionaries(text, text, max_size=4),
        log_dir=text, heartbeat_interval_s=seconds.filter(lambda v: v > 0), shutdown_timeout_s=seconds,
        kill_grace_s=seconds, cwd=text, rdzv_backend=st.sampled_from(["static", "c10d"]))


ENDPOINTS = st.one_of(strings(), st.sampled_from([
    "h:0", "h:65536", "h:99999999", ":1", "h:", "h:-1", "h:+1", "h: 1", "h:1 ", "h:\u00b2", "h:\u0661\u0662",
    "h:\uff11", "h:" + "1" * 5000, "[::1]:29500", "h:1:2", "h:0x10", "h:1_0",
]))


def spec_values() -> st.SearchStrategy[object]:
    fields = st.one_of(json_values(max_leaves=6), ENDPOINTS, scalars(),
                       st.dictionaries(text, st.one_of(text, scalars()), max_size=3))
    return st.one_of(launch_specs().flatmap(lambda s: mutated(s.to_json(), field_values=fields)),
                     launch_specs().flatmap(lambda s: ENDPOINTS.map(lambda e: {**s.to_json(), "rdzv_endpoint": e})),
                     json_values())


@given(launch_specs())
def test_a_spec_round_trips_through_its_file_and_its_json(spec: LaunchSpec) -> None:
    with fresh_dir() as d:
        spec.write(d / "spec.json")
        assert LaunchSpec.read(d / "spec.json") == spec
    assert LaunchSpec.from_json(spec.to_json()) == spec


@given(json_bytes(spec_values()), st.sampled_from(FILE_KINDS))
def test_a_spec_file_of_anything_is_a_spec_or_one_line(data: bytes, kind: str) -> None:
    with fresh_dir() as d:
        plant(d / "spec.json", kind, data)
        try:
            spec = LaunchSpec.read(d / "spec.json")
        except ConfigError as err:
            assert "launch spec" in assert_one_line(err)
        else:
            check_usable(spec)


@given(spec_values())
def test_a_restart_frames_spec_of_anything_is_a_spec_or_one_line(value: object) -> None:
    """from_json also takes what JSON decoding of a frame gives: NaN and infinities included."""
    try:
        spec = LaunchSpec.from_json(value, source="restart frame")
    except ConfigError as err:
        assert "restart frame" in assert_one_line(err)
    else:
        check_usable(spec)


def check_usable(spec: LaunchSpec) -> None:
    """What the agent does with a spec it accepted cannot raise: the endpoint splits into a host
    and a port, the timeouts are finite seconds, the counts are small integers."""
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    assert host and 0 < int(port) < 65536
    for name in ("heartbeat_interval_s", "shutdown_timeout_s", "kill_grace_s"):
        assert math.isfinite(getattr(spec, name)) and 0 <= getattr(spec, name) <= 7 * 86400
    assert 1 <= spec.nproc_per_node < 2 ** 31 and 1 <= spec.nnodes < 2 ** 31


def test_an_endpoint_with_a_non_ascii_digit_port_is_one_line_not_a_value_error() -> None:
    """Regression (found by this tier): `str.isdigit` is true for '²' and '١', and int('²')
    raised ValueError out of from_json; a 5,000-digit port raised it too (int's digit limit)."""
    good = LaunchSpec(script="t.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="h:1", rdzv_id="1",
                      node_addrs={}, env={}, log_dir="/tmp").to_json()
    for endpoint in ("h:\u00b2", "h:\u0661\u0662", "h:" + "1" * 5000, "h:\uff11"):
        try:
            LaunchSpec.from_json({**good, "rdzv_endpoint": endpoint})
        except ConfigError as err:
            assert "rdzv_endpoint must be ADDR:PORT" in assert_one_line(err)
        else:
            raise AssertionError(endpoint)


def test_an_unknown_field_of_any_name_is_named_on_one_line() -> None:
    """Regression (found by this tier): an unknown field's name was printed raw (a line break in
    it split the error over two lines; a 100,000-character name made a 100,000-character line)."""
    for name, shown in (("line\nbreak", "unknown field 'line\\nbreak'"), ("x" * 100_000, "unknown field 'xxx"),
                        ("bogus", "unknown field bogus;")):
        try:
            LaunchSpec.from_json({name: 1})
        except ConfigError as err:
            assert shown in assert_one_line(err)
        else:
            raise AssertionError(name)


def test_a_number_of_seconds_past_any_float_is_one_line_not_an_overflow() -> None:
    """Regression (found by `make fuzz`): kill_grace_s = 10**400 (a JSON integer) made
    math.isfinite() raise OverflowError out of the spec check."""
    good = LaunchSpec(script="t.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="h:1", rdzv_id="1",
                      node_addrs={}, env={}, log_dir="/tmp").to_json()
    for name in ("kill_grace_s", "heartbeat_interval_s", "shutdown_timeout_s"):
        try:
            LaunchSpec.from_json({**good, name: 10 ** 400})
        except ConfigError as err:
            assert f"{name} must be a number of seconds" in assert_one_line(err)
        else:
            raise AssertionError(name)
