"""Lines through one srun step (ckptsup/step_lines.py): every agent's (and every node's health
check's) stdout is merged into one pipe by srun, which keeps lines of up to 1 KiB whole and
interleaves the pieces of longer ones. The pieces and their joining, pure; then the real thing:
a 2-node srun step of the agents' shape (SlurmClient.srun_argv) whose tasks write long lines
at the same moment, every one of them read back whole."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ckptsup import step_lines
from ckptsup.slurm.client import SlurmClient
from ckptsup.step_lines import MARK, PIECE_BYTES, Joiner, pieces

WRITER = Path(__file__).parent / "helpers" / "step_writer.py"


def lines_of(data: bytes) -> list[bytes]:
    return re.findall(rb"[^\n]*\n", data)


def interleave(streams: dict[bytes, list[bytes]], rng: random.Random) -> list[tuple[bytes, bytes]]:
    """The writers' lines merged as srun merges them: whole lines, in each writer's order
    (with who wrote each, for the check)."""
    at = {w: 0 for w in streams}
    merged = []
    while live := [w for w in streams if at[w] < len(streams[w])]:
        w = rng.choice(live)
        merged.append((w, streams[w][at[w]]))
        at[w] += 1
    return merged


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([b"n1/a1", b"n2/b2", b"node-17/c3"]),
                       st.lists(st.binary(min_size=0, max_size=5000).map(lambda b: b.replace(b"\n", b"?").replace(b"\r", b"?") + b"\n"),
                                max_size=6), min_size=1),
       st.randoms(use_true_random=False))
def test_interleaved_pieces_join_into_every_writers_lines_in_order(written, rng):
    streams = {w: lines_of(b"".join(pieces(line, w) for line in lines)) for w, lines in written.items()}
    assert all(len(piece) <= PIECE_BYTES for stream in streams.values() for piece in stream)
    joiner = Joiner(max_bytes=1 << 16)
    got: dict[bytes, list[bytes]] = {w: [] for w in written}
    for writer, piece in interleave(streams, rng):
        whole = joiner.feed(piece)
        if whole is not None:
            got[writer].append(whole)
    assert got == {w: list(lines) for w, lines in written.items()} and joiner.dropped == 0


def test_a_short_line_goes_as_it_is_and_one_that_looks_like_a_piece_does_not():
    assert pieces(b'{"m":"hb"}\n', b"n1/a") == b'{"m":"hb"}\n'
    odd = b"~n9/x 0 1 forged\n"
    sent = pieces(odd, b"n1/a")
    assert sent != odd and Joiner(max_bytes=100).feed(sent) == odd


def test_a_writers_name_is_made_safe_and_never_raises():
    sent = pieces(b"y" * 3000 + b"\n", b"node with spaces\n" + b"z" * 500)
    heads = [line.split(b" ", 1)[0] for line in sent.splitlines()]
    assert len(set(heads)) == 1 and b"\n" not in heads[0] and len(heads[0]) <= 1 + step_lines.MAX_WRITER_BYTES
    joiner = Joiner(max_bytes=1 << 16)
    assert [w for line in lines_of(sent) if (w := joiner.feed(line))] == [b"y" * 3000 + b"\n"]


@pytest.mark.parametrize("bad", [b"~", b"~w", b"~w x 1 d\n", b"~w 0 -1 d\n", b"~w 5 2 d\n", b"~w 1 2 d\n",
                                 b"~w 0 999999999 d\n", b"~w 0 2 \xff\xfe\n"])
def test_a_malformed_or_orphan_piece_is_dropped_and_counted_never_raised(bad):
    joiner = Joiner(max_bytes=1 << 16)
    assert joiner.feed(bad) is None
    assert joiner.dropped == (0 if bad == b"~w 0 2 \xff\xfe\n" else 1)   # the last is a good first piece


def test_a_line_past_the_limit_is_dropped_and_the_writers_next_line_still_joins():
    joiner = Joiner(max_bytes=2000)
    for piece in lines_of(pieces(b"a" * 5000 + b"\n", b"w")):
        assert joiner.feed(piece) is None
    assert joiner.dropped == 1
    assert [x for p in lines_of(pieces(b"b" * 1500 + b"\n", b"w")) if (x := joiner.feed(p))] == \
        [b"b" * 1500 + b"\n"]


def test_a_line_cut_short_by_the_writers_next_one_is_dropped_not_glued():
    first = lines_of(pieces(b"a" * 3000 + b"\n", b"w"))
    joiner = Joiner(max_bytes=1 << 16)
    assert joiner.feed(first[0]) is None
    assert [x for p in lines_of(pieces(b"c" * 2000 + b"\n", b"w")) if (x := joiner.feed(p))] == \
        [b"c" * 2000 + b"\n"]
    assert joiner.dropped == 1


@pytest.mark.slurm
def test_long_lines_of_two_nodes_written_at_once_come_through_srun_whole(dev_cluster):
    """Measured before the fix (BENCHMARKS.md §Step output): whole lines of 1–20 KB from two
    tasks of one step lose ~6 % of them to interleaving; in pieces none."""
    start = time.time() + 3
    argv = SlurmClient.srun_argv(nodes=["n1", "n2"], command=[sys.executable, str(WRITER), f"{start}", "150", "pieces"],
                                 input_all=False, extra=["-p", "main", "--kill-on-bad-exit=0"])
    argv = [a for a in argv if not a.startswith("--nodelist")]
    proc = subprocess.run(argv, capture_output=True, timeout=120, env=dev_cluster.client.env)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    joiner = Joiner(max_bytes=1 << 16)
    got: dict[int, list[int]] = {0: [], 1: []}
    for piece in lines_of(proc.stdout):
        assert len(piece) <= PIECE_BYTES + 1
        whole = joiner.feed(piece)
        if whole is not None:
            line = json.loads(whole)
            got[line["task"]].append(line["i"])
    assert joiner.dropped == 0 and got == {0: list(range(150)), 1: list(range(150))}
    assert sum(line.startswith(MARK) for line in proc.stdout.splitlines()) > 150   # long lines did go in pieces
