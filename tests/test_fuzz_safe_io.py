"""Fuzz tier: ckptsup/safe_io.py, the bounded reader under every file boundary.

Allowed exceptions: `read_regular` and `read_json` raise the caller's error class (here
ConfigError) or let FileNotFoundError through (documented: callers decide what a missing file
means); `loads_json` and `encodable` raise only the caller's error class; `json_depth_ok` never
raises. Every message is one short line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st

from ckptsup.errors import ConfigError
from ckptsup.safe_io import MAX_JSON_DEPTH, encodable, json_depth_ok, loads_json, read_json, read_regular
from fuzz_helpers import (ANY_CHAR, FILE_KINDS, assert_one_line, finite_json, fresh_dir, json_bytes, plain_text,
                          plant)


class _Err(ConfigError):
    pass


def depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@given(json_bytes(), st.sampled_from(FILE_KINDS), st.integers(0, 300), st.booleans(), st.booleans())
def test_read_json_of_anything_is_a_value_or_one_line(data: bytes, kind: str, max_bytes: int, follow: bool,
                                                     nonfinite: bool) -> None:
    with fresh_dir() as d:
        path = d / "state.json"
        plant(path, kind, data)
        try:
            read_json(path, max_bytes=max_bytes, what="state", error=_Err, follow_symlinks=follow,
                      allow_nonfinite=nonfinite)
        except FileNotFoundError:
            assert kind in ("missing", "dangling-symlink")
        except _Err as err:
            assert_one_line(err)
        else:
            assert kind == "regular" or (kind == "symlink-to-regular" and follow)
            assert len(data) <= max_bytes


@given(st.binary(max_size=400), st.integers(0, 500))
def test_read_regular_returns_the_bytes_of_a_file_within_its_cap(data: bytes, max_bytes: int) -> None:
    with fresh_dir() as d:
        path = d / "f"
        plant(path, "regular", data)
        try:
            assert read_regular(path, max_bytes=max_bytes, what="file", error=_Err) == data
        except _Err as err:
            assert len(data) > max_bytes and str(max_bytes) in assert_one_line(err)


@given(plain_text(min_size=1, max_size=30).filter(lambda s: "/" not in s and s not in (".", "..")))
def test_any_file_name_is_read_or_refused_in_one_line(name: str) -> None:
    with fresh_dir() as d:
        try:
            (d / name).write_bytes(b"{}")
        except OSError:   # a name the file system itself refuses (too long)
            assume(False)
        assert read_json(d / name, max_bytes=10, what="config", error=_Err) == {}


@given(st.text(ANY_CHAR, max_size=40))
def test_encodable_refuses_only_what_the_file_system_cannot_be_given(name: str) -> None:
    try:
        os.fsencode(name)
        ok = True
    except UnicodeEncodeError:
        ok = False
    try:
        assert encodable(name, what="path", error=_Err) == Path(name) and ok
    except _Err as err:
        assert not ok
        assert_one_line(err)


@given(st.text(ANY_CHAR, max_size=40))
def test_read_regular_of_a_surrogate_name_is_one_line(suffix: str) -> None:
    with fresh_dir() as d:
        path = str(d / "x") + suffix.replace("/", "").replace("\x00", "")
        try:
            read_regular(path, max_bytes=10, what="file", error=_Err)
        except (FileNotFoundError, _Err) as err:
            if isinstance(err, _Err):
                assert_one_line(err)


@given(json_bytes(), st.integers(1, 100), st.booleans())
def test_loads_json_of_anything_is_a_value_or_one_line(data: bytes, max_depth: int, as_text: bool) -> None:
    text: str | bytes = data.decode("utf-8", "surrogateescape") if as_text else data
    try:
        value = loads_json(text, what="frame", error=_Err, max_depth=max_depth)
    except _Err as err:
        assert_one_line(err)
    else:
        assert depth(value) <= max_depth


@given(finite_json(max_leaves=30), st.integers(0, 12), st.booleans())
def test_json_depth_ok_is_exactly_the_nesting_of_valid_json(value: object, max_depth: int, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth_ok(text, max_depth) == (depth(value) <= max_depth)
    assert json_depth_ok(text.encode("utf-8", "surrogatepass"), max_depth) == (depth(value) <= max_depth)


@given(st.builds(lambda n: "[" * n + "]" * n, st.integers(MAX_JSON_DEPTH + 1, 200_000)))
def test_nesting_past_the_bound_never_reaches_the_parser(text: str) -> None:
    assert not json_depth_ok(text)
    try:
        loads_json(text, what="frame", error=_Err)
    except _Err as err:
        assert "nests deeper" in assert_one_line(err)
    else:
        raise AssertionError("a nesting past the bound was parsed")


@given(finite_json(max_leaves=20))
def test_a_finite_json_value_round_trips(value: object) -> None:
    assume(depth(value) <= MAX_JSON_DEPTH)
    assert loads_json(json.dumps(value), what="state", error=_Err) == value


def _walk_depth_ok(data: bytes, max_depth: int) -> bool:
    """The byte-by-byte walk json_depth_ok falls back to: the reference its fast path must equal."""
    depth_now, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth_now += 1
            if depth_now > max_depth:
                return False
        elif byte in (0x5D, 0x7D):
            depth_now -= 1
    return True


@given(st.one_of(json_bytes(), st.text(alphabet='[]{}"a,:\\', max_size=200).map(str.encode)), st.integers(0, 20))
def test_the_depth_check_in_c_says_what_the_walk_says(data: bytes, max_depth: int) -> None:
    # the fast path (no escapes: strings stripped by a regex, innermost pairs peeled a level a
    # pass) must agree with the exact walk on anything, balanced or not
    assert json_depth_ok(data, max_depth) == _walk_depth_ok(data, max_depth)
