"""Fuzz tier: the restart log (ckptsup/events.py) — `parse_line` (one line of events.jsonl, and
the records ranks forward), `read_events` (the whole file) and `parse_ts` (an event's time).

Allowed exceptions: none from parse_line (a line that is not an event is None; an accepted one has
every required field and a string `event`) or parse_ts (None); read_events raises only
EventsFileError (one line) for a file that is not a restart log at all. An event round-trips:
make_event → the line EventWriter writes → parse_line, and through the file."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptsup.events import (REQUIRED_FIELDS, Event, EventsFileError, EventWriter, make_event, parse_line, parse_ts,
                            read_events)
from fuzz_helpers import (FILE_KINDS, json_text, assert_one_line, deep_text, finite_json, fresh_dir, json_bytes,
                          json_values, mutated, number_texts, plant, scalars, strings)

names = st.sampled_from(list(Event))
field_names = json_text(max_size=10).filter(lambda k: k not in ("name", "job_id", "attempt", "mono", "ts"))
fields = st.dictionaries(field_names, finite_json(max_leaves=8), max_size=5)
timestamps = st.one_of(st.none(), st.datetimes().map(lambda d: d.isoformat()), strings())
round_trip_timestamps = st.one_of(st.none(), st.datetimes().map(lambda d: d.isoformat()), json_text())


def line_of(record: dict) -> str:
    """The line EventWriter.write_record writes."""
    return json.dumps(record, separators=(",", ":"), default=str)


@given(names, json_text(max_size=10), st.integers(0, 2 ** 63), st.floats(allow_nan=False, allow_infinity=False),
       round_trip_timestamps, fields)
def test_an_event_round_trips_through_its_line(name: Event, job_id: str, attempt: int, mono: float, ts: str | None,
                                               extra: dict) -> None:
    record = make_event(name, job_id=job_id, attempt=attempt, mono=mono, ts=ts, **extra)
    assert parse_line(line_of(record)) == record
    assert parse_line(line_of(record).encode("utf-8", "surrogatepass").decode("utf-8", "replace")) is not None


@given(st.lists(st.tuples(names, fields), max_size=6))
def test_events_round_trip_through_the_file(emitted: list) -> None:
    with fresh_dir() as d:
        writer = EventWriter(run_dir=d, job_id="7", attempt=1, epoch=2)
        records = [writer.emit(name, **extra) for name, extra in emitted]
        writer.close()
        assert read_events(d) == records


def record_values() -> st.SearchStrategy[object]:
    valid = {"event": "restart_done", "ts": "2026-01-01T00:00:00.000+00:00", "mono": 1.0, "job_id": "1",
             "attempt": 0, "restart_s": 3.5, "phases": {"kill_s": 1.0}}
    return st.one_of(mutated(valid, field_values=st.one_of(scalars(), json_values(max_leaves=5), strings())),
                     json_values())


def lines() -> st.SearchStrategy[str]:
    """A line of a restart log (read_events decodes with errors="replace")."""
    return json_bytes(record_values()).map(lambda b: b.decode("utf-8", "replace"))


@given(lines())
def test_parse_line_of_anything_is_an_event_or_none(line: str) -> None:
    record = parse_line(line)
    if record is not None:
        assert isinstance(record, dict) and all(k in record for k in REQUIRED_FIELDS)
        assert isinstance(record["event"], str)   # what log, report and the ops commands format and compare


@given(st.lists(lines(), max_size=8), st.sampled_from(FILE_KINDS))
def test_read_events_of_any_file_is_its_events_or_one_line(content: list[str], kind: str) -> None:
    with fresh_dir() as d:
        data = "\n".join(content).encode("utf-8", "surrogatepass")
        plant(d / "events.jsonl", kind, data)
        try:
            got = read_events(d)
        except EventsFileError as err:   # not a restart log at all (a directory, a FIFO, a device)
            assert kind not in ("regular", "symlink-to-regular", "missing", "dangling-symlink")
            assert_one_line(err)
        else:
            if kind in ("missing", "dangling-symlink"):
                assert got == []
            else:   # exactly the lines that are events, in order
                text = data.decode("utf-8", "replace")
                assert got == [r for r in map(parse_line, text.split("\n")) if r is not None]


@given(st.one_of(timestamps, scalars()))
def test_parse_ts_of_anything_is_seconds_or_none(value: object) -> None:
    seconds = parse_ts(value)
    assert seconds is None or (isinstance(seconds, float) and math.isfinite(seconds))


@given(st.one_of(deep_text(), number_texts().filter(lambda t: t[:1].isdigit() and len(t) > 4300)))
def test_parse_line_bounds_nesting_and_numbers(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("kind", ["directory", "fifo", "dev-zero"])
def test_read_events_of_what_is_no_file_is_one_line(kind: str) -> None:
    with fresh_dir() as d:
        plant(d / "events.jsonl", kind)
        with pytest.raises(EventsFileError) as err:
            read_events(d)
        assert_one_line(err.value)
