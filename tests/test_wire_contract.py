"""docs/contracts.md's wire table and ckptsup.wire's enums say the same thing; unknown kinds never
reach a handler."""

import json
import re
from pathlib import Path

import pytest

from ckptsup import wire
from ckptsup.wire import HOPS, FrameError, FrameReader, MessageKind, Phase

DOC = Path(__file__).resolve().parent.parent / "docs" / "contracts.md"


def documented_kinds() -> dict[str, str]:
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", DOC.read_text(), flags=re.M)
    return {kind: hop.replace(" (forwarded to the ranks)", "").strip() for kind, hop in rows
            if hop.strip().split(" (")[0] in {h.value for h in wire.Hop}}


def test_every_message_kind_is_documented_with_its_hop_and_nothing_else_is() -> None:
    assert documented_kinds() == {k.value: HOPS[k].value for k in MessageKind}


def test_every_kind_has_a_hop_and_forwarded_commands_are_commands() -> None:
    assert set(HOPS) == set(MessageKind)
    assert all(HOPS[k] is wire.Hop.COMMAND for k in wire.FORWARDED_COMMANDS)
    text = DOC.read_text()
    for kind in wire.FORWARDED_COMMANDS:
        assert f"| `{kind.value}` | supervisor → agent (forwarded to the ranks) |" in text


def test_every_phase_is_documented() -> None:
    line = next(x for x in DOC.read_text().splitlines() if "ckptsup.wire.Phase" in x)
    assert re.findall(r"`(\w+)`", line.split("is one of", 1)[1]) == [p.value for p in Phase]


def test_decode_returns_the_member_and_a_member_formats_as_its_value() -> None:
    frame = wire.encode(MessageKind.HELLO, {"rank": 0}, seq=1, secret=b"k")
    m, _, _ = wire.decode(frame, secret=b"k")
    assert m is MessageKind.HELLO
    assert f"{m}" == "hello" and json.loads(frame)["m"] == "hello"


def test_a_well_signed_frame_of_an_unknown_kind_is_dropped_and_counted() -> None:
    drops = []
    reader = FrameReader(secret=b"k", sender="x", on_drop=lambda: drops.append(1))
    forged = wire.encode("format_disk", {}, seq=1, secret=b"k")  # type: ignore[arg-type]
    with pytest.raises(FrameError, match="unknown message kind"):
        wire.decode(forged, secret=b"k")
    good = wire.encode(MessageKind.BYE, {"rank": 0, "status": 0}, seq=2, secret=b"k")
    assert reader.feed(forged + good) == [(MessageKind.BYE, {"rank": 0, "status": 0})]
    assert drops == [1]


def test_phase_parse_is_lenient() -> None:
    assert Phase.parse("load") is Phase.LOAD
    assert Phase.parse("compiling") is Phase.TRAIN and Phase.parse(None) is Phase.TRAIN
    assert Phase.parse(["train"]) is Phase.TRAIN   # unhashable: still a phase, never a TypeError


def test_a_nan_in_a_body_travels_as_null_instead_of_losing_the_frame() -> None:
    frame = wire.encode(MessageKind.STEP, {"rank": 0, "step": 3, "step_time_s": float("nan"),
                                           "extra": [float("inf"), 1.5]}, seq=1, secret=b"k")
    m, _, body = wire.decode(frame, secret=b"k")
    assert m is MessageKind.STEP and body == {"rank": 0, "step": 3, "step_time_s": None, "extra": [None, 1.5]}
