"""Fuzz tier: ckptsup/config.py — site and job TOML (`read_toml`, `load_config`), every layer's
values (`apply_layer`, the rules between knobs) and the supervisor's effective config.json
(`read_config_json`).

Allowed exception: ConfigError, one short line, for every input (bytes, TOML documents of the
schema's shape with any value of any TOML type, JSON payloads). A layer of valid values
round-trips: TOML → load_config → the same values with their provenance, and
write_config_json → read_config_json → the same config."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from ckptsup.config import (AUTO, SECTIONS, Config, apply_layer, check_rules, load_config, read_config_json,
                            read_toml, write_config_json)
from ckptsup.env import SITE_CONFIG
from ckptsup.errors import ConfigError
from fuzz_helpers import (FILE_KINDS, assert_one_line, fresh_dir, json_bytes, json_values, keys, mutated, plain_text,
                          plant, scalars, strings, write_private)

FIELDS = {section: {f.name: f for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()}

# ---- TOML text -------------------------------------------------------------------------------

RAW_TOML_VALUES = ["1979-05-27T07:32:00Z", "1979-05-27T07:32:00", "1979-05-27", "07:32:00", "0x7fffffffffffffffff",
                   "0o777", "0b1", "1_000", "+inf", "-nan", "'literal'", '"""multi\nline"""', "1e400", "-1e400",
                   "9" * 30, "true", "[]", "{}", "[[1], ['a']]"]


def toml_str(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, everything else
    as itself (a lone surrogate becomes a \\ud800 escape, which TOML refuses: a hostile input)."""
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, _Raw):
        return value.text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_str(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    return '""'   # None: TOML has no null


@dataclasses.dataclass(frozen=True)
class _Raw:
    text: str


def render_toml(doc: Any) -> str:
    if not isinstance(doc, dict):
        return f"x = {toml_value(doc)}\n"
    out = []
    for section, values in doc.items():
        if isinstance(values, dict):
            out.append(f"[{toml_str(section)}]")
            out.extend(f"{toml_str(k)} = {toml_value(v)}" for k, v in values.items() if v is not None)
        elif values is not None:
            out.append(f"{toml_str(section)} = {toml_value(values)}")
    return "\n".join(out) + "\n"


def toml_field_values() -> st.SearchStrategy[Any]:
    return st.one_of(scalars(), st.lists(scalars(), max_size=3), st.sampled_from(RAW_TOML_VALUES).map(_Raw),
                     st.dictionaries(keys(), scalars(), max_size=2))


@st.composite
def config_docs(draw: st.DrawFn) -> Any:
    """A config document: sections of the schema (some unknown), fields of each (some unknown),
    values of the right shape or of any other."""
    if draw(st.integers(0, 15)) == 0:
        return draw(json_values())
    doc: dict[str, Any] = {}
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS)), max_size=3, unique=True)):
        valid = {name: draw(field_value(FIELDS[section][name])) for name in
                 draw(st.lists(st.sampled_from(sorted(FIELDS[section])), min_size=1, max_size=4, unique=True))}
        doc[section] = draw(mutated(valid, field_values=toml_field_values()))
    if draw(st.integers(0, 5)) == 0:
        doc[draw(keys())] = draw(st.one_of(json_values(), st.dictionaries(keys(), scalars(), max_size=2)))
    return doc


def toml_documents() -> st.SearchStrategy[bytes]:
    return st.one_of(config_docs().map(lambda d: render_toml(d).encode("utf-8", "surrogatepass")),
                     json_bytes(), st.binary(max_size=100),
                     st.builds(lambda n: ("a = " + "[" * n).encode(), st.integers(100, 50_000)),
                     st.builds(lambda n: ("a = " + "{b = " * n).encode(), st.integers(100, 5_000)))


# ---- valid values ----------------------------------------------------------------------------

STRING_CHOICES = ["", AUTO, "static", "c10d", "xxh3-128", "crc32", "sha256", "require", "off", "s3://bucket/p",
                  "file:///n/{node}", "/scratch/{job_id}", "24:00:00", "train.sbatch"]


def field_value(fld: dataclasses.Field) -> st.SearchStrategy[Any]:
    """A value the knob accepts (drawn broadly, kept when the project's own check passes)."""
    default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()  # type: ignore[misc]
    high = fld.metadata.get("max")
    if isinstance(default, bool):
        candidates: st.SearchStrategy[Any] = st.booleans()
    elif isinstance(default, int):
        candidates = st.integers(-1, int(high) if high is not None else 2 ** 63 - 1)
    elif isinstance(default, float):
        candidates = st.one_of(st.floats(0, high, allow_nan=False), st.integers(0, int(high)))
    elif isinstance(default, list) and default and isinstance(default[0], int):
        candidates = st.lists(st.integers(0, 2**31 - 1), max_size=3)
    elif isinstance(default, list):
        candidates = st.lists(plain_text(max_size=10), max_size=3)
    elif default == AUTO and high is not None:   # a number of seconds or "auto"
        candidates = st.one_of(st.just(AUTO), st.floats(0, high, allow_nan=False), st.integers(0, int(high)))
    else:
        candidates = st.one_of(st.sampled_from(STRING_CHOICES), plain_text(max_size=15))
    check = fld.metadata.get("check")
    return candidates.filter(lambda v: check is None or check(v) is None)


@st.composite
def valid_layers(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    layer: dict[str, dict[str, Any]] = {}
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS)), min_size=1, max_size=4, unique=True)):
        names = draw(st.lists(st.sampled_from(sorted(FIELDS[section])), min_size=1, max_size=5, unique=True))
        layer[section] = {name: draw(field_value(FIELDS[section][name])) for name in names}
    config = Config()
    apply_layer(config, {}, layer, "job:x")
    try:
        check_rules(config, {})
    except ConfigError:
        assume(False)
    return layer


# ---- properties ------------------------------------------------------------------------------

@given(toml_documents(), st.sampled_from(FILE_KINDS))
def test_a_job_toml_of_anything_is_a_dict_or_one_line(data: bytes, kind: str) -> None:
    with fresh_dir() as d:
        path = d / "job.toml"
        plant(path, kind, data)
        try:
            assert isinstance(read_toml(path, "job"), dict)
        except ConfigError as err:
            assert_one_line(err)


@given(config_docs())
def test_apply_layer_of_any_document_is_a_config_or_one_line(doc: Any) -> None:
    """Values of every TOML type (and a JSON config's), straight into a layer."""
    data = unraw(doc if isinstance(doc, dict) else {"x": doc})
    try:
        apply_layer(Config(), {}, data, "job:/x.toml")
    except ConfigError as err:
        assert_one_line(err)


@given(toml_documents(), toml_documents(), st.sampled_from(FILE_KINDS))
def test_load_config_with_any_site_and_job_file_is_resolved_or_one_line(site: bytes, job: bytes, kind: str) -> None:
    with fresh_dir() as d:
        write_private(d / "site.toml", site)
        plant(d / "job.toml", kind, job)
        try:
            resolved = load_config(job_config=d / "job.toml", env={SITE_CONFIG: str(d / "site.toml")})
        except ConfigError as err:
            assert_one_line(err)
        else:
            check_rules(resolved.config, resolved.provenance)   # what loaded obeys the rules
            for row in resolved.rows(redact=False):
                value = row["value"]
                assert not isinstance(value, float) or math.isfinite(value), row


@given(valid_layers())
def test_a_valid_job_layer_round_trips_through_toml_and_config_json(layer: dict[str, dict[str, Any]]) -> None:
    with fresh_dir() as d:
        write_private(d / "site.toml", b"")
        write_private(d / "job.toml", render_toml(layer).encode())
        resolved = load_config(job_config=d / "job.toml", env={SITE_CONFIG: str(d / "site.toml")})
        rows = {row["key"]: row for row in resolved.rows(redact=False)}
        for section, values in layer.items():
            for key, value in values.items():
                row = rows[f"{section}.{key}"]
                assert row["source"] == f"job:{d / 'job.toml'}"
                expected = float(value) if isinstance(FIELDS[section][key].default, float) else value
                assert row["value"] == expected and type(row["value"]) is type(expected), (row, value)
        write_config_json(resolved, d / "config.json")
        again = read_config_json(d / "config.json")
        assert again.config == resolved.config and again.provenance == resolved.provenance


def unraw(value: Any) -> Any:
    """A document for JSON: raw TOML fragments become the strings they are."""
    if isinstance(value, _Raw):
        return value.text
    if isinstance(value, dict):
        return {k: unraw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unraw(v) for v in value]
    return value


def config_payloads() -> st.SearchStrategy[bytes]:
    wrapped = st.tuples(config_docs().map(unraw), st.booleans()).map(
        lambda pair: {"config": pair[0], "provenance": {}} if pair[1] else pair[0])
    return json_bytes(st.one_of(wrapped, mutated({"config": {}, "provenance": {}})))


@given(config_payloads(), st.sampled_from(FILE_KINDS))
def test_an_effective_config_json_of_anything_is_a_config_or_one_line(data: bytes, kind: str) -> None:
    with fresh_dir() as d:
        plant(d / "config.json", kind, data)
        try:
            read_config_json(d / "config.json")
        except ConfigError as err:
            assert_one_line(err)


@given(strings(), strings())
def test_names_of_unknown_sections_and_keys_stay_on_one_line(section: str, key: str) -> None:
    for data in ({section: {}}, {"supervisor": {key: 1}}, {section: 3}):
        try:
            apply_layer(Config(), {}, data, "job:/x.toml")
        except ConfigError as err:
            assert_one_line(err)


def test_toml_datetimes_are_refused_as_the_wrong_type() -> None:
    """TOML has date and time values that JSON has not; a knob refuses them like any wrong type."""
    for value in (dt.datetime(1979, 5, 27), dt.date(1979, 5, 27), dt.time(7, 32)):
        try:
            apply_layer(Config(), {}, {"supervisor": {"kill_grace_s": value}}, "job:x")
        except ConfigError as err:
            assert "must be a number" in assert_one_line(err)
        else:
            raise AssertionError(value)


# ---- regressions the fuzz tier found -----------------------------------------------------------

def test_an_integer_choice_out_of_range_is_one_line_not_a_type_error() -> None:
    """`[nccl] async_error_handling = 5` was a TypeError traceback (the message joined the integer
    choices as strings)."""
    try:
        apply_layer(Config(), {}, {"nccl": {"async_error_handling": 5}}, "job:x")
    except ConfigError as err:
        assert "async_error_handling = 5 must be one of: 0, 1, 2, 3" in assert_one_line(err)
    else:
        raise AssertionError("accepted")


def test_a_quoted_section_or_key_with_a_line_break_is_named_on_one_line() -> None:
    """`["a\\nb"]` and `"x\\ny" = 1` are TOML; their names were printed raw, over two lines."""
    for data, shown in (({"a\nb": {}}, "unknown section ['a\\nb']"), ({"a\x1eb": 1}, "unknown section ['a\\x1eb']"),
                        ({"run": {"x\ny": 1}}, "unknown key run.'x\\ny'"),
                        ({"r" * 5000: {}}, "unknown section ['rrrr"), ({"nope": {}}, "unknown section [nope]")):
        try:
            apply_layer(Config(), {}, data, "job:x")
        except ConfigError as err:
            assert shown in assert_one_line(err), err
        else:
            raise AssertionError(data)


def test_an_integer_past_a_float_for_a_seconds_knob_is_one_line_not_an_overflow() -> None:
    """Regression (found by `make fuzz`): `save_every_s = 999...9` (400 digits) is a TOML integer;
    math.isfinite() of it raised OverflowError out of config loading (a traceback of every command)."""
    for value in (10 ** 400, -(10 ** 309), 2 ** 63):
        try:
            apply_layer(Config(), {}, {"checkpoint": {"save_every_s": value}}, "job:x")
        except ConfigError as err:
            assert "save_every_s" in assert_one_line(err) and "too large" in str(err)
        else:
            raise AssertionError(value)
