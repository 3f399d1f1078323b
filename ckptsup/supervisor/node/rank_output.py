"""The agent's reader of its ranks' output (torchrun runs with `--tee 3` and a `[rankN]: ` line
prefix, its stdout and stderr one pipe to the agent).

Every byte goes to the node's rank log (attempt-N/ranks-<node>.log) as it arrives; each line
(split on \\n and \\r, colour codes stripped) may be a progress line of a rank that did not say
hello, and rank 0's lines (every rank's with `tee`; only some local ranks' with the launch line's
`--local-ranks-filter` or `-r`) go to the supervisor's console, rate-limited:
a flood costs lines on the console, never the log or the agent's loop.

The console relay passes the ranks' bytes through as torchrun would print them: the rank's own
colour codes, its \\r redraws and bytes that are not UTF-8 reach the console unchanged (carried in
the frame as surrogate escapes), never through rich or any markup. That is the rank's own terminal
output, not text ckptsup renders; only the per-line cut (CONSOLE_LINE_CHARS) and the rate limit
apply.
"""

from __future__ import annotations

import os
import selectors
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from ...messages import Output
from ...progress import LineSplitter, ProgressMatcher, Segment, clean, compile_pattern, split_rank

CONSOLE_LINES_PER_S = 200.0   # sustained; a burst of CONSOLE_BURST passes at once
CONSOLE_BURST = 400
CONSOLE_LINE_CHARS = 1000     # a console line is cut here (the log keeps it whole)
FRAME_LINES = 100             # lines per output frame (well inside wire.MAX_FRAME_BYTES)


@dataclass(kw_only=True)
class TokenBucket:
    rate: float
    burst: float
    tokens: float = 0.0
    at: float | None = None

    def take(self, now: float) -> bool:
        if self.at is None:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass(kw_only=True)
class RankOutput:
    """One attempt's output on one node. `feed` takes bytes from the pipe; `take_progress` and
    `take_console` hand over what is due (the agent turns them into frames)."""

    log_fd: int
    pattern: str
    tee: bool = False
    nproc_per_node: int = 1
    console_local_ranks: list[int] | None = None   # --local-ranks-filter / -r: only these local ranks on the console
    hooked: Callable[[int], bool] = lambda rank: False
    clock: Callable[[], float] = lambda: 0.0
    splitter: LineSplitter = field(default_factory=LineSplitter)
    matcher: ProgressMatcher = field(init=False)
    progress: dict[int, int] = field(default_factory=dict)   # rank -> newest step not yet sent
    console: list[str] = field(default_factory=list)
    dropped: int = 0
    line_rank: int | None = None    # the rank of the \n-line being redrawn with \r
    bucket: TokenBucket = field(default_factory=lambda: TokenBucket(rate=CONSOLE_LINES_PER_S, burst=CONSOLE_BURST))

    def __post_init__(self) -> None:
        self.matcher = ProgressMatcher(patterns=compile_pattern(self.pattern))

    @classmethod
    def open(cls, log_path: str, **kw) -> "RankOutput":
        return cls(log_fd=os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), **kw)

    def feed(self, data: bytes) -> None:
        try:
            os.write(self.log_fd, data)
        except OSError:
            pass  # a full disk loses log lines, never the agent
        self._lines(self.splitter.segments(data))

    def finish(self) -> None:
        self._lines(self.splitter.flush_segments())

    def _lines(self, segments: list[Segment]) -> None:
        now = self.clock()
        for seg in segments:
            line = clean(seg.raw.decode("utf-8", "replace"))   # for the prefix and the step only
            rank, text = split_rank(line)
            if rank is None and seg.continued:
                rank = self.line_rank   # a \r redraw of a rank's line carries no prefix of its own
            self.line_rank = rank
            if rank is not None and text and not self.hooked(rank):
                step = self.matcher.match(rank, text)
                if step is not None:
                    self.progress[rank] = step
            if self._on_console(rank):
                if self.bucket.take(now):
                    raw = seg.raw.decode("utf-8", "surrogateescape")   # bytes that are not UTF-8 survive the frame
                    self.console.append(raw[:CONSOLE_LINE_CHARS] + seg.end.decode("ascii"))
                else:
                    self.dropped += 1

    def _on_console(self, rank: int | None) -> bool:
        """Rank 0's lines (every rank's with tee), less the local ranks the launch line keeps off
        the console (a global rank's local rank: rank % ranks per node)."""
        if rank is None:
            return self.tee   # torchrun's own lines (no rank prefix)
        if not (rank == 0 or self.tee):
            return False
        return self.console_local_ranks is None or rank % max(1, self.nproc_per_node) in self.console_local_ranks

    def take_progress(self) -> dict[int, int]:
        out, self.progress = self.progress, {}
        return out

    def take_console(self) -> tuple[list[str], int] | None:
        """Up to FRAME_LINES lines and the count dropped since the last frame; None when nothing."""
        if not self.console and not self.dropped:
            return None
        lines, self.console = self.console[:FRAME_LINES], self.console[FRAME_LINES:]
        dropped, self.dropped = self.dropped, 0
        return lines, dropped

    def close(self) -> None:
        self.finish()
        try:
            os.close(self.log_fd)
        except OSError:
            pass


def _raw_bytes(line: str) -> bytes:
    try:
        return line.encode("utf-8", "surrogateescape")   # the rank's own bytes, as the agent read them
    except UnicodeEncodeError:   # a surrogate no byte decodes to: shown as its escape
        return line.encode("utf-8", "backslashreplace")


def print_console(body: Output, out: Any = None) -> None:
    """The supervisor's side: an `output` frame's lines on its console (the job's output file),
    byte for byte, each with the separator it had (a line without one, cut or the last, gets \\n)."""
    import sys

    out = out or sys.stdout
    lines = body.lines
    if lines:
        data = b"".join(_raw_bytes(line if line.endswith(("\n", "\r")) else line + "\n") for line in lines)
        buffer = getattr(out, "buffer", None)
        if buffer is not None:
            out.flush()   # what went through the text layer first stays first
            buffer.write(data)
            buffer.flush()
        else:   # a text-only stream (no bytes layer): the same text, undecodable bytes replaced
            out.write(data.decode("utf-8", "replace"))
    dropped = body.dropped
    if dropped > 0:
        out.write(f"ckptsup: ({dropped} rank output line(s) not shown: more than {CONSOLE_LINES_PER_S:g}/s; "
                  f"the rank log has them)\n")
    out.flush()


OUTPUT_READ_BYTES = 1 << 16  # per wake-up: a flooding rank cannot starve the rank sockets


class OutputPipe:
    """torchrun's stdout (every rank's lines, `--tee 3`), read without blocking in the agent's
    selector into a RankOutput, until EOF: torchrun and every worker holding the pipe are gone."""

    def __init__(self, pipe: IO[bytes], output: RankOutput, sel: selectors.BaseSelector) -> None:
        self.pipe: IO[bytes] | None = pipe
        self.output = output
        self.sel = sel
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ, self.read)

    def read(self) -> int:
        """Read what the ranks wrote (bounded): bytes read, 0 when nothing is waiting, -1 at EOF."""
        if self.pipe is None:
            return -1
        try:
            data = os.read(self.pipe.fileno(), OUTPUT_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            data = b""
        if not data:
            self._unregister()
            self.output.finish()
            return -1
        self.output.feed(data)
        return len(data)

    def drain(self) -> None:
        """Everything torchrun wrote before it exited (bounded): its last lines are often the error."""
        for _ in range(64):
            if self.read() <= 0:
                break

    def close(self) -> None:
        """Stop reading; the caller takes what is left (take_progress, take_console), then closes
        the RankOutput."""
        self._unregister()

    def _unregister(self) -> None:
        if self.pipe is None:
            return
        try:
            self.sel.unregister(self.pipe)
        except (KeyError, ValueError):
            pass
        self.pipe.close()
        self.pipe = None
