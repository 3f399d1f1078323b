"""Parsing of durations and sizes, and every refused unit/value."""

import pytest

from ckptsup.errors import ConfigError
from ckptsup.planning.units import (MONTH_S, format_duration, format_size, parse_duration, parse_size)


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30), ("10m", 600), ("44h", 44 * 3600), ("54d", 54 * 86400), ("1.5h", 5400),
    ("2w", 14 * 86400), ("1mo", 730 * 3600), ("250ms", 0.25), ("90", 90), (" 5 min ", 300),
    ("1e3s", 1000), ("3 hours", 3 * 3600),
])
def test_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_a_month_is_730_hours():
    assert MONTH_S == 730 * 3600
    assert parse_duration("1month") == 730 * 3600


@pytest.mark.parametrize("text, n_bytes", [
    ("140GB", 140e9), ("1TB", 1e12), ("512MB", 512e6), ("2KiB", 2048), ("1GiB", 2**30),
    ("1.5tb", 1.5e12), ("100", 100), ("3 bytes", 3), ("7B", 7),
])
def test_sizes_are_decimal_unless_binary_unit(text, n_bytes):
    assert parse_size(text) == pytest.approx(n_bytes)


@pytest.mark.parametrize("text, fragment", [
    ("3x", "unknown unit 'x'"), ("ten minutes", "not a number"), ("", "not a number"),
    ("-5s", "negative"), ("0s", "greater than zero"), ("5 fortnights", "unknown unit"),
    ("nan", "not a number"), ("inf", "not a number"), ("1e308y", "not a finite value"),
])
def test_bad_durations_are_refused_with_one_line(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_duration(text, what="--stall")
    message = str(info.value)
    assert fragment in message and "--stall" in message and "\n" not in message


@pytest.mark.parametrize("text, fragment", [
    ("140GX", "unknown unit 'gx'"), ("-1TB", "negative"), ("0GB", "greater than zero"), ("lots", "not a number"),
    ("1e400GB", "not finite"), ("1e307PB", "not a finite value"),
])
def test_bad_sizes_are_refused_with_one_line(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_size(text, what="--ckpt-size")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_zero_is_accepted_where_allowed():
    assert parse_duration("0", allow_zero=True) == 0
    assert parse_size("0B", allow_zero=True) == 0


def test_formatting_picks_a_readable_unit():
    assert format_duration(0.25) == "250ms"
    assert format_duration(42) == "42.0s"
    assert format_duration(750) == "12.5min"
    assert format_duration(3 * 3600 + 720) == "3.20h"
    assert format_duration(54 * 86400) == "54.0d"
    assert format_size(140e9) == "140GB"
    assert format_size(2.38e12) == "2.38TB"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_numbers_given_as_numbers_are_refused(value):
    for parse in (parse_duration, parse_size):
        with pytest.raises(ConfigError, match="finite|negative"):
            parse(value, what="--x")
