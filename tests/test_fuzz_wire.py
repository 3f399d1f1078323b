"""Fuzz tier: wire frames (ckptsup/wire.py) — `decode` (every hop: rank socket, agent stdout,
supervisor stdin) and `FrameReader` (a byte stream split into frames, forgeries and replays dropped).

Allowed exceptions: `decode` raises FrameError only; `FrameReader.feed` raises FrameError only (an
unterminated flood); `FrameReader.accept` raises nothing. Messages are one short line. A frame
round-trips through encode → decode, and a stream of good frames cut at any points comes out whole,
in order, once."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptsup import wire
from ckptsup.wire import MAX_FRAME_BYTES, FrameError, FrameReader, MessageKind, decode, encode
from fuzz_helpers import (ANY_CHAR, assert_one_line, json_text, deep_text, finite_json, json_bytes, json_values, mutated, scalars,
                          strings)

SECRET = b"0123456789abcdef" * 4
kinds = st.sampled_from(list(MessageKind))
seqs = st.integers(0, 2 ** 63)
bodies = st.dictionaries(json_text(max_size=8), finite_json(max_leaves=12), max_size=6)


def signed(m: object, seq: object, body: object, secret: bytes = SECRET) -> dict:
    """A frame whose MAC is right for whatever m, seq and body are (a sender holding the secret
    but sending nonsense), so decode gets past the MAC to the type checks."""
    try:
        body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
        mac = wire._mac(secret, m, seq, body_json)   # type: ignore[arg-type]
    except (TypeError, ValueError, UnicodeEncodeError):
        mac = "0" * 64
    return {"m": m, "seq": seq, "body": body, "mac": mac}


def frame_values() -> st.SearchStrategy[object]:
    fields = st.one_of(scalars(), json_values(max_leaves=5), strings())
    good = st.builds(lambda m, s, b: json.loads(encode(m, b, seq=s, secret=SECRET)), kinds, seqs, bodies)
    return st.one_of(
        good.flatmap(lambda f: mutated(f, field_values=fields)),                   # tampered: the MAC fails
        st.builds(signed, st.one_of(kinds, strings()), st.one_of(seqs, scalars()), st.one_of(bodies, fields)),
        st.builds(signed, kinds, seqs, st.one_of(bodies, fields), st.sampled_from([b"", b"x", SECRET[:-1]])),
        json_values())


@given(kinds, seqs, bodies)
def test_a_frame_round_trips(m: MessageKind, seq: int, body: dict) -> None:
    try:
        data = encode(m, body, seq=seq, secret=SECRET)
    except FrameError as err:   # a body too large for one frame
        assert "limit" in assert_one_line(err)
        return
    assert data.endswith(b"\n") and data.count(b"\n") == 1 and len(data) <= MAX_FRAME_BYTES
    assert decode(data, secret=SECRET) == (m, seq, body)
    assert decode(data.decode(), secret=SECRET) == (m, seq, body)


@given(json_bytes(frame_values()), st.booleans())
def test_decode_of_anything_is_a_frame_or_one_frame_error(data: bytes, as_text: bool) -> None:
    line: bytes | str = data
    if as_text:   # a str line, lone surrogates included
        line = data.decode("utf-8", "surrogateescape")
    try:
        m, seq, body = decode(line, secret=SECRET)
    except FrameError as err:
        assert_one_line(err)
    else:
        assert isinstance(m, MessageKind) and isinstance(seq, int) and isinstance(body, dict)


@given(st.lists(st.tuples(kinds, bodies), max_size=6), st.lists(st.sampled_from([
    b"garbage", b"{}", b'{"m":"hb","seq":1,"body":{},"mac":"00"}', b"[" * 200, b"\xff\xfe", b"   "]), max_size=4),
    st.lists(st.integers(1, 50), max_size=20), st.data())
def test_a_stream_cut_anywhere_gives_each_good_frame_once_in_order(frames: list, junk: list[bytes], cuts: list[int],
                                                                    data: st.DataObject) -> None:
    good = [encode(m, body, seq=i, secret=SECRET) for i, (m, body) in enumerate(frames)]
    good = [g for g in good if len(g) <= MAX_FRAME_BYTES]
    lines = [*good, *(j + b"\n" for j in junk)]
    lines = data.draw(st.permutations(lines)) if lines else lines
    replays = [g for g in good if data.draw(st.booleans())]   # sent again after everything: dropped
    stream = b"".join(lines + replays)
    drops = []
    reader = FrameReader(secret=SECRET, sender="n1", on_drop=lambda: drops.append(1))
    out, at = [], 0
    for cut in cuts + [len(stream)]:
        out += reader.feed(stream[at:at + cut])
        at += cut
    out += reader.feed(stream[at:])
    order = [g for g in lines if g in good]
    expected, last = [], -1
    for g in order:   # the replay guard keeps a frame only if its seq is above every earlier one
        m, seq, body = decode(g, secret=SECRET)
        if seq > last:
            expected.append((m, body))
            last = seq
    assert out == expected
    assert len(drops) == len(lines) + len(replays) - len(expected) - sum(1 for j in junk if not j.strip())


@given(st.integers(4 * MAX_FRAME_BYTES + 1, 8 * MAX_FRAME_BYTES), st.sampled_from([b"x", b"[", b"\xff"]))
def test_an_unterminated_flood_is_one_frame_error(size: int, unit: bytes) -> None:
    reader = FrameReader(secret=SECRET, sender="n1")
    with pytest.raises(FrameError) as err:
        for at in range(0, size, MAX_FRAME_BYTES):
            reader.feed(unit * min(MAX_FRAME_BYTES, size - at))
    assert "flood" in assert_one_line(err.value)


@given(st.lists(st.binary(max_size=300), max_size=8))
def test_accept_of_any_line_never_raises(lines: list[bytes]) -> None:
    reader = FrameReader(secret=SECRET, sender="n1")
    for line in lines:
        assert reader.accept(line) is None


NON_ASCII_MACS = st.text(ANY_CHAR, min_size=1, max_size=8).filter(lambda t: not t.isascii()).map(
    lambda mac: json.dumps({"m": "hello", "seq": 1, "body": {}, "mac": mac}))


@given(st.one_of(deep_text(), st.text(ANY_CHAR, max_size=20).map(lambda t: t + "\ud800"), NON_ASCII_MACS))
def test_deep_nesting_surrogate_strs_and_non_hex_macs_are_frame_errors(line: str) -> None:
    with pytest.raises(FrameError) as err:
        decode(line, secret=SECRET)
    assert_one_line(err.value)


def test_a_kind_holding_a_lone_surrogate_is_a_frame_error_not_a_unicode_error() -> None:
    """Regression (found by this tier): `{"m": "\\ud800", ...}` passed json.loads and the type
    checks, then raised UnicodeEncodeError while its MAC was computed: out of decode, which
    promises FrameError and nothing else (the agent reading a rank's socket died of it)."""
    for m in ("\ud800", "hb\udfff"):
        line = json.dumps({"m": m, "seq": 1, "body": {}, "mac": "0" * 64}).encode()
        with pytest.raises(FrameError) as err:
            decode(line, secret=SECRET)
        assert "bad MAC" in assert_one_line(err.value)


@given(st.sampled_from(list(MessageKind)), st.integers(0, 2**62), finite_json())
def test_our_own_frames_take_the_fast_path_and_decode_the_same(m: MessageKind, seq: int, body) -> None:
    # the fast path checks the MAC on the body's own bytes and parses them once (a heartbeat of 8
    # ranks: 80 -> 25 us); it must give exactly what the general path gives
    body = {"v": body}
    frame = encode(m, body, seq=seq, secret=SECRET)
    assert wire._decode_ours(frame, SECRET) == (m, seq, body) == decode(frame, secret=SECRET)


def test_a_body_that_ends_like_a_frame_or_a_tampered_one_is_not_believed() -> None:
    sneaky = {"x": ',"m":"hb","mac":"' + "0" * 64 + '","seq":1}'}
    frame = encode(MessageKind.HB, sneaky, seq=3, secret=SECRET)
    assert decode(frame, secret=SECRET) == (MessageKind.HB, 3, sneaky)
    tampered = frame.replace(b'"x"', b'"y"')
    with pytest.raises(FrameError, match="bad MAC"):
        decode(tampered, secret=SECRET)
    forged = encode(MessageKind.HB, {"a": 1}, seq=3, secret=b"other" * 8)
    with pytest.raises(FrameError, match="bad MAC"):
        decode(forged, secret=SECRET)
