"""Progress lines: a regex on the ranks' own output turns any script's log lines into step
progress (docs/drop-in.md §Progress lines). Pure: the agent feeds it chunks of output; the
config validates a pattern with `compile_pattern` at the edge.

A chunk is split on `\\r` as well as `\\n` (progress bars redraw with `\\r`) and ANSI colour
codes are stripped before matching (torchtitan prints `\\033[31mstep: 10`). A line longer than
MAX_LINE is cut: the step is near its start in every log format we know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OFF = "off"
AUTO = "auto"

# name -> pattern with one capture group: the step. "plain" is anchored at the start of the line
# (after torchrun's rank prefix): a number in the middle of a sentence is not a step.
PRESETS: dict[str, str] = {
    "torchtitan": r"\bstep:\s*(\d+)\b",                    # "[titan] ... - INFO - step:  10  loss: 7.2"
    "megatron": r"\biteration\s+(\d+)\s*/\s*\d+",         # " [2024-..] iteration       10/    100 | ..."
    "plain": r"(?i)^\s*step[\s:=#]*(\d+)\b",                # print(f"step {i}"), "Step 10/100"
}
MAX_LINE = 4096
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")   # torchrun's --tee prefix (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)


class PatternError(ValueError):
    """A progress pattern that cannot be used (the message says why, in a few words)."""


def compile_pattern(value: str) -> list[re.Pattern[str]]:
    """The regexes a `[supervisor] progress_pattern` value means: none for "off", every preset for
    "auto", one preset by name, else the value itself, which must have exactly one capture group."""
    if value == OFF or value == "":
        return []
    if value == AUTO:
        return [re.compile(p) for p in PRESETS.values()]
    if value in PRESETS:
        return [re.compile(PRESETS[value])]
    try:
        pattern = re.compile(value)
    except re.error as err:
        raise PatternError(f"is not a valid regular expression ({err})") from None
    if pattern.groups != 1:
        raise PatternError(f"must have exactly one capture group (the step), has {pattern.groups}")
    return [pattern]


def pattern_problem(value: str) -> str | None:
    """For the config: what is wrong with a pattern, or None."""
    try:
        compile_pattern(value)
    except PatternError as err:
        return f"{err}; use {AUTO}, {OFF}, one of {', '.join(PRESETS)}, or a regex like 'step (\\d+)'"
    return None


def clean(line: str) -> str:
    return ANSI.sub("", line[:MAX_LINE]).rstrip()


def split_rank(line: str) -> tuple[int | None, str]:
    """(global rank, the line without torchrun's prefix); rank None for torchrun's own lines."""
    match = RANK_PREFIX.match(line)
    if match is None:
        return None, line
    return int(match.group(1)), line[match.end():]


def step_of(patterns: list[re.Pattern[str]], text: str) -> int | None:
    for pattern in patterns:
        match = pattern.search(text)
        if match is not None:
            try:
                step = int(match.group(1))
            except (TypeError, ValueError):
                continue   # the group matched something that is not a number
            if 0 <= step < 2**63:
                return step
    return None


@dataclass(frozen=True)
class Segment:
    """One piece of output as it came: its bytes, whether it continues a \r-redrawn line, and the
    separator that ended it (b"" for a partial line cut at MAX_LINE or flushed at the end)."""

    raw: bytes
    continued: bool
    end: bytes


@dataclass(kw_only=True)
class LineSplitter:
    """Bytes in, whole lines out: splits on \n and \r, keeps a partial line for the next chunk
    (bounded: a line longer than MAX_LINE is emitted cut). Each line comes with whether it
    continues a \r-redrawn one (torchrun prefixes a line with its rank once, before the \n-line's
    first segment, so a redraw inherits the rank). `segments` gives every piece with its
    separator, blank ones too (the console relay passes them through); `feed` the non-blank
    lines as text (progress matching)."""

    partial: bytes = b""
    continued: bool = False     # the partial line follows a \r
    lines_cut: int = 0

    def segments(self, data: bytes) -> list[Segment]:
        buf = self.partial + data
        out: list[Segment] = []
        start = 0
        for sep in re.finditer(rb"\r\n|\r|\n", buf):
            out.append(Segment(buf[start:sep.start()], self.continued, sep.group()))
            self.continued = sep.group() == b"\r"
            start = sep.end()
        self.partial = buf[start:]
        if len(self.partial) > MAX_LINE:
            out.append(Segment(self.partial[:MAX_LINE], self.continued, b""))
            self.partial = b""
            self.lines_cut += 1
        return out

    def flush_segments(self) -> list[Segment]:
        out = [Segment(self.partial, self.continued, b"")] if self.partial else []
        self.partial, self.continued = b"", False
        return out

    def feed(self, data: bytes) -> list[tuple[str, bool]]:
        return _text_lines(self.segments(data))

    def flush(self) -> list[tuple[str, bool]]:
        return _text_lines(self.flush_segments())


def _text_lines(segments: list[Segment]) -> list[tuple[str, bool]]:
    return [(s.raw.decode("utf-8", "replace"), s.continued) for s in segments if s.raw.strip()]


@dataclass(kw_only=True)
class ProgressMatcher:
    """Turns cleaned output lines into (rank, step) progress. Only an increase of a rank's step is
    reported (a redrawn bar repeats its step)."""

    patterns: list[re.Pattern[str]]
    last: dict[int | None, int] = field(default_factory=dict)

    def match(self, rank: int | None, text: str) -> int | None:
        if not self.patterns:
            return None
        step = step_of(self.patterns, text)
        if step is None:
            return None
        if rank in self.last and step <= self.last[rank]:
            return None
        self.last[rank] = step
        return step
