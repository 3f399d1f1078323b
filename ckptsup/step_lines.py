"""Lines through one srun step: every task's stdout merged into one pipe (docs/contracts.md
§Step output).

Measured on the dev cluster (tests/test_step_lines.py, Slurm 22.05, 24.11 and 26.05): srun hands
on whole lines of up to IO_MESSAGE_BYTES from each task; a longer line is forwarded in pieces of
that size, and the pieces of two tasks writing at once interleave, so both lines are lost. With
`-u` it is worse: a line of any length is cut wherever one of slurmstepd's reads ends. So the
agents' and the health checks' steps run without `-u`, and every task writes lines of at most
PIECE_BYTES: a longer one goes as numbered pieces that name their writer, and the reader puts
them back together (`Joiner`). Pure; no Slurm, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IO_MESSAGE_BYTES = 1024   # Slurm's step I/O message (MAX_MSG_LEN): the longest line srun keeps whole
PIECE_BYTES = 960         # a written line at most this long, head included (margin for a \r)
MARK = b"~"               # a piece: ~WRITER INDEX COUNT DATA (a whole line never starts with it)
MAX_WRITER_BYTES = 200    # a writer's name (an agent's node/instance); every piece then carries >= MIN_PIECE_DATA
MIN_PIECE_DATA = 256
MAX_OPEN = 4096           # writers with a line half put together (one per agent; beyond: the oldest dropped)


def pieces(line: bytes, writer: bytes) -> bytes:
    """`line` (one line, ending in a newline) as written to a step's shared stdout: itself when
    short, else its pieces, in one buffer so that one write() keeps them together. `writer`:
    this task's name, unique in the step (cut to MAX_WRITER_BYTES printable bytes)."""
    if len(line) <= PIECE_BYTES and not line.startswith(MARK):
        return line
    writer = bytes(b if 0x21 <= b <= 0x7e else 0x5f for b in writer[:MAX_WRITER_BYTES]) or b"_"
    body = line[:-1] if line.endswith(b"\n") else line
    size = PIECE_BYTES - len(writer) - 2 * len(str(len(body))) - 5   # ~, three spaces, newline
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    count = len(parts)
    return b"".join(b"%s%s %d %d %s\n" % (MARK, writer, i, count, part) for i, part in enumerate(parts))


@dataclass
class Joiner:
    """The reader's side: whole lines from a merged stdout where pieces of several writers'
    lines interleave. A piece out of order, a line past `max_bytes` or one that a new line of
    the same writer interrupts is dropped and counted, never raised."""

    max_bytes: int
    dropped: int = 0
    _open: dict[bytes, tuple[int, list[bytes], int]] = field(default_factory=dict)   # writer → (count, pieces, bytes)
    _skipping: set[bytes] = field(default_factory=set)   # writers whose line in progress was dropped

    def feed(self, line: bytes) -> bytes | None:
        """The whole line that `line` completes (`line` itself when it is no piece), else None."""
        if not line.startswith(MARK):
            return line
        end = -2 if line.endswith(b"\r\n") else -1 if line.endswith(b"\n") else len(line)
        fields = line[len(MARK):end].split(b" ", 3)
        try:
            writer, index, count, part = fields[0], int(fields[1]), int(fields[2]), fields[3]
        except (IndexError, ValueError):
            self.dropped += 1
            return None
        if not 0 <= index < count or count > self.max_bytes // MIN_PIECE_DATA + 1:
            self._drop(writer)
            return None
        if index == 0:
            self._skipping.discard(writer)
            if self._open.pop(writer, None) is not None:
                self.dropped += 1   # that writer's last line never ended
            if len(self._open) >= MAX_OPEN:
                self._open.pop(next(iter(self._open)))
                self.dropped += 1
            self._open[writer] = (count, [], 0)
        elif writer in self._skipping:
            return None   # the rest of a line already dropped
        held = self._open.get(writer)
        if held is None or held[0] != count or len(held[1]) != index:
            self._drop(writer)
            return None
        parts, size = held[1], held[2] + len(part)
        if size > self.max_bytes:
            self._drop(writer)
            return None
        parts.append(part)
        self._open[writer] = (count, parts, size)
        if len(parts) < count:
            return None
        del self._open[writer]
        return b"".join(parts) + b"\n"

    def _drop(self, writer: bytes) -> None:
        """`writer`'s line is lost: counted once, its later pieces ignored until its next line."""
        self._open.pop(writer, None)
        self.dropped += 1
        self._skipping.add(writer)
        if len(self._skipping) > MAX_OPEN:
            self._skipping.clear()
