"""Fuzz tier: the run directory's files (ckptsup/rundir.py) — state.json (`RunDir.load_state`,
`read_epoch`), the per-job secret (`read_secret`) and the lease (`RunDir.lease_age_s`).

Allowed exceptions: ConfigError, one short line, from load_state / read_epoch / read_secret;
none from lease_age_s (an unreadable lease reads as no lease: None). A RunState round-trips
through save_state → load_state; a secret that read_secret returns is the file's hex text."""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ckptsup.errors import ConfigError
from ckptsup.events import FailureKind
from ckptsup.rundir import (FAILURE_OUTCOMES, SECRET_HEX_CHARS, RunDir, RunState, RunStatus, read_epoch,
                            read_secret)
from fuzz_helpers import (ANY_CHAR, FILE_KINDS, assert_one_line, fresh_dir, json_bytes, json_text, json_values, mutated,
                          plant, write_private)

text = json_text(max_size=12)
counts = st.integers(0, 2 ** 63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
optional_int = st.one_of(st.none(), st.integers(-(2 ** 70), 2 ** 70))


def failure_records() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={
        "attempt": counts, "outcome": st.sampled_from(FAILURE_OUTCOMES), "start_step": counts,
        "last_step": optional_int, "kind": st.one_of(st.none(), st.sampled_from([k.value for k in FailureKind])),
        "node": st.one_of(st.none(), text), "rank": optional_int, "step": optional_int,
        "detect_s": st.one_of(st.none(), finite), "detail": st.one_of(st.none(), text),
        "extra_from_a_newer_ckptsup": st.integers(),
    })


def run_states() -> st.SearchStrategy[RunState]:
    return st.builds(
        RunState, attempt=counts, epoch=counts, restarts=counts,
        excluded_nodes=st.dictionaries(text, text, max_size=4),
        measured=st.dictionaries(text, st.one_of(finite, st.integers(-(2 ** 70), 2 ** 70),
                                                 st.lists(finite, max_size=5)), max_size=4),
        status=st.sampled_from(list(RunStatus)), failures=st.lists(failure_records(), max_size=4))


def state_json_values() -> st.SearchStrategy[object]:
    """A state.json's value: a RunState's fields, some replaced by anything, or no object at all."""
    records = st.lists(st.one_of(failure_records(), mutated({"kind": "crash", "step": 1, "outcome": "failed"})),
                       max_size=3)
    return st.one_of(run_states().flatmap(lambda s: mutated(asdict(s))),
                     st.builds(lambda f: {"failures": f}, records),
                     st.builds(lambda m: {"measured": m}, st.dictionaries(text, json_values(), max_size=3)),
                     json_values())


@given(run_states())
def test_a_run_state_round_trips(state: RunState) -> None:
    with fresh_dir() as d:
        run = RunDir(path=d)
        run.save_state(state)
        assert run.load_state() == state
        assert read_epoch(d) == state.epoch


@given(json_bytes(state_json_values()), st.sampled_from(FILE_KINDS))
def test_a_state_json_of_anything_is_a_state_or_one_line(data: bytes, kind: str) -> None:
    with fresh_dir() as d:
        run = RunDir(path=d)
        plant(run.state_path, kind, data)
        try:
            state = run.load_state()
        except ConfigError as err:
            assert "state.json" in assert_one_line(err)
        else:
            assert kind in ("regular", "symlink-to-regular", "missing", "dangling-symlink")
            assert isinstance(state.status, RunStatus)
            for name in ("attempt", "epoch", "restarts"):
                value = getattr(state, name)
                assert type(value) is int and 0 <= value < 2 ** 63, (name, value)
            for value in state.measured.values():   # what the policy and the planner compute with
                assert all(math.isfinite(v) for v in (value if isinstance(value, list) else [value]))


SECRET_TEXT = st.one_of(
    st.binary(max_size=100),
    st.builds(lambda n, pad: os.urandom(n).hex().encode() + pad, st.integers(0, 100),
              st.sampled_from([b"", b"\n", b" \n", b"\r\n", b"\x00", b"g", "é".encode()])),
    st.text(ANY_CHAR, max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"\n", b"0" * 64, b"0" * 63, b"A" * 64 + b"\n", b"f" * 4097]),
)


@given(SECRET_TEXT, st.sampled_from(FILE_KINDS), st.sampled_from([0o600, 0o400, 0o640, 0o604, 0o000]))
def test_a_secret_file_of_anything_is_a_ckptsup_key_or_one_line(data: bytes, kind: str, mode: int) -> None:
    with fresh_dir() as d:
        path = d / "secret"
        plant(path, kind, data)
        if kind in ("regular", "symlink-to-regular"):
            os.chmod(path, mode)
        try:
            key = read_secret(path, named_by="CKPTSUP_SECRET_FILE")
        except ConfigError as err:
            assert "CKPTSUP_SECRET_FILE" in assert_one_line(err)
        else:   # what becomes the HMAC key: the file's own hex text, never short, never empty
            assert len(key) >= SECRET_HEX_CHARS and re.fullmatch(rb"[0-9a-fA-F]+", key)
            assert key == data.strip() and mode & 0o077 == 0


def test_a_created_run_dir_holds_a_secret_read_secret_accepts() -> None:
    with fresh_dir() as d:
        run = RunDir.create(d / "run")
        key = run.read_secret()
        assert len(key) == SECRET_HEX_CHARS and os.stat(run.secret_path).st_mode & 0o777 == 0o600


def lease_values() -> st.SearchStrategy[object]:
    return st.one_of(mutated({"pid": 1, "host": "n1", "epoch": 0, "renewed": 1.0e9}), json_values())


@given(json_bytes(lease_values()), st.sampled_from(FILE_KINDS), st.floats(allow_nan=False, allow_infinity=False))
def test_a_lease_of_anything_is_an_age_or_none(data: bytes, kind: str, now: float) -> None:
    with fresh_dir() as d:
        run = RunDir(path=d)
        plant(run.lease_path, kind, data)
        age = run.lease_age_s(now=now)
        assert age is None or isinstance(age, float)


@given(st.integers(0, 2 ** 63 - 1), st.text(ANY_CHAR, max_size=20))
def test_a_renewed_lease_reads_back(epoch: int, host: str) -> None:
    with fresh_dir() as d:
        run = RunDir(path=Path(d))
        run.renew_lease(epoch=epoch, host=host)
        age = run.lease_age_s()
        assert age is not None and -1.0 < age < 60.0


# ---- regressions `make fuzz` found -------------------------------------------------------------

def test_integers_past_any_float_in_state_json_and_the_lease_are_no_overflow() -> None:
    """JSON integers have any size and math.isfinite() of 10**400 raises OverflowError: a state.json
    with such a measurement or detect_s was a traceback of every command reading the run, and such
    a lease's `renewed` one of the watchdog. A measurement is dropped like any non-finite one, a
    detect_s refused, the lease unreadable (no lease)."""
    with fresh_dir() as d:
        run = RunDir(path=d)
        write_private(run.state_path, b'{"measured": {"save_s": 1%s, "step_times": [2, 1%s]}}' % (b"0" * 400, b"0" * 400))
        assert run.load_state().measured == {"step_times": [2]}
        write_private(run.state_path, b'{"failures": [{"detect_s": 1%s}]}' % (b"0" * 400))
        try:
            run.load_state()
        except ConfigError as err:
            assert "failures[0].detect_s must be a number" in assert_one_line(err)
        else:
            raise AssertionError("accepted")
        write_private(run.lease_path, b'{"renewed": -1%s}' % (b"0" * 400))
        assert run.lease_age_s() is None
