"""Progress lines: the ranks' own output turned into step progress (docs/drop-in.md §Progress
lines). Pure: the agent feeds it chunks of output; the config validates a pattern with
`compile_pattern` at the edge.

A chunk is split on `\\r` as well as `\\n` (progress bars redraw with `\\r`) and ANSI colour
codes are stripped before matching (torchtitan prints `\\033[31mstep: 10`). A line longer than
MAX_LINE is cut: the step is near its start in every log format we know.

A preset reads one kind of line into a Reading: a step (torchtitan, megatron, nanoGPT, `step N`,
a log dict with 'step'), a progress bar's count (tqdm: HF's and Lightning's bars; Lightning's rich
bar), or a tick (HF's log dict without 'step'). ProgressMatcher turns each rank's readings into a
step that only goes up (RankSteps): a bar's count within an epoch becomes E*M+N, a bar that
restarts continues where it ended, evaluation bars do not count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

OFF = "off"
AUTO = "auto"
MAX_LINE = 4096
MAX_STEP = 2**63
MAX_OTHER_BARS = 8    # bars beside the training bar a rank remembers
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")   # torchrun's --tee prefix (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)


@dataclass(frozen=True)
class Reading:
    """What one progress line says: a step, a bar's count (with the bar's identity, total and
    epoch), or a tick (progress without a number of its own)."""

    count: int
    bar: str | None = None       # the bar's identity: its description without digits, and its total
    total: int | None = None     # the bar's total; None: unknown (`N/?`, `Nit`)
    epoch: int | None = None     # "Epoch E" in the bar's description
    tick: bool = False


@dataclass(frozen=True)
class Preset:
    """A kind of progress line: the regex that finds it and what a match says."""

    name: str
    pattern: re.Pattern[str]
    read: Callable[[re.Match[str]], Reading | None]


def _step_group(match: re.Match[str]) -> Reading | None:
    try:
        step = int(match.group(1))
    except (TypeError, ValueError):
        return None   # the group matched something that is not a number
    return Reading(count=step) if 0 <= step < MAX_STEP else None


# A bar whose description says it evaluates is evidence of life, not training progress: it does not
# count (a stuck or endless evaluation is then found like any silence: docs/drop-in.md). Bars of data
# preparation and loading run before training and are no training step either.
EVAL_BAR = re.compile(r"(?i)\b(val\b|valid|eval|test|predict|sanity)")
PREP_BAR = re.compile(r"(?i)\b(map|filter|download|upload|fetching|loading|generating|extracting|tokeniz|shards?\b|"
                      r"resolving|preprocess)")
EPOCH = re.compile(r"(?i)\bepoch\s*(\d+)")


def _bar(match: re.Match[str]) -> Reading | None:
    desc = (match.group("desc") or "").strip()
    if EVAL_BAR.search(desc) or PREP_BAR.search(desc):
        return None
    count = int(match.group("count") or match.group("its"))
    total_text = match.groupdict().get("total")
    total = int(total_text) if total_text and total_text != "?" else None
    if count >= MAX_STEP or (total is not None and total >= MAX_STEP):
        return None
    epoch_match = EPOCH.search(desc)
    epoch = int(epoch_match.group(1)) if epoch_match and len(epoch_match.group(1)) < 10 else None
    identity = " ".join(re.sub(r"\d+", "#", desc).lower().split()) + f" /{total if total is not None else '?'}"
    return Reading(count=count, bar=identity, total=total, epoch=epoch)


HF_ITEM = re.compile(r"'(\w+)': '?([^,'}]*)'?")
HF_EVAL_KEY = ("eval_", "test_", "predict_")


def _hf_log(match: re.Match[str]) -> Reading | None:
    """HF Trainer's log dict (its ProgressCallback / PrinterCallback print `str(logs)`; transformers 5
    formats floats as '%.4g' strings). 'step' is the step; a training log with only 'epoch' is a
    tick: '%.4g' can print the same epoch twice, and an epoch gives no step count."""
    items = dict(HF_ITEM.findall(match.string))
    if "step" in items:
        try:
            step = int(items["step"])
        except ValueError:
            return None
        return Reading(count=step) if 0 <= step < MAX_STEP else None
    if "epoch" in items and not any(key.startswith(HF_EVAL_KEY) for key in items):
        return Reading(count=0, tick=True)
    return None   # an evaluation's metrics, or a dict that is no HF log


def _preset(name: str, pattern: str, read: Callable[[re.Match[str]], Reading | None] = _step_group) -> Preset:
    return Preset(name=name, pattern=re.compile(pattern), read=read)


# Explicit steps first: a line that has one says it outright. "plain" and "nanogpt" are anchored at
# the start of the line (after torchrun's rank prefix): a number in the middle of a sentence is not a step.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("torchtitan", r"\bstep:\s*(\d+)\b"),                  # "[titan] ... - INFO - step:  10  loss: 7.2"
    _preset("megatron", r"\biteration\s+(\d+)\s*/\s*\d+"),       # " [2024-..] iteration       10/    100 | ..."
    _preset("nanogpt", r"^\s*iter\s+(\d+):\s*loss\b"),            # "iter 10: loss 2.3101, time 41.20ms, mfu 1.20%"
    _preset("plain", r"(?i)^\s*step[\s:=#]*(\d+)\b"),              # print(f"step {i}"), "Step 10/100"
    _preset("hf_log", r"^\{'\w+': ", _hf_log),                      # "{'loss': '2.31', ..., 'epoch': '0.5'}"
    # tqdm: "Epoch 0:  40%|████      | 4/10 [00:01<...", "  5%|▌     | 10/200 [...", "Epoch 2: 3it [..."
    _preset("tqdm", r"^\s*(?:(?P<desc>[^|]*?):\s*)?(?:(?:\d{1,3}%)?\|[^|]*\|\s*(?P<count>\d+)/(?P<total>\d+|\?)"
                    r"|(?P<its>\d+)it)\s+\[", _bar),
    # Lightning's RichProgressBar, where it draws: "Epoch 1/1  ━━━━━━╸━━━ 4/6 0:00:01 • 0:00:01 ..."
    _preset("rich", r"^(?P<desc>[^━╸╺|]*)[━╸╺]+\s+(?P<count>\d+)/(?P<total>\d+|\?)\s", _bar),
)}


class PatternError(ValueError):
    """A progress pattern that cannot be used (the message says why, in a few words)."""


def compile_pattern(value: str) -> list[Preset]:
    """The presets a `[supervisor] progress_pattern` value means: none for "off", every preset for
    "auto", one preset by name, else the value itself, a regex that must have exactly one capture
    group (the step)."""
    if value == OFF or value == "":
        return []
    if value == AUTO:
        return list(PRESETS.values())
    if value in PRESETS:
        return [PRESETS[value]]
    try:
        pattern = re.compile(value)
    except re.error as err:
        raise PatternError(f"is not a valid regular expression ({err})") from None
    if pattern.groups != 1:
        raise PatternError(f"must have exactly one capture group (the step), has {pattern.groups}")
    return [Preset(name="custom", pattern=pattern, read=_step_group)]


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


def read(presets: list[Preset], text: str) -> Reading | None:
    """What the first preset that reads `text` says it is."""
    for preset in presets:
        match = preset.pattern.search(text)
        if match is not None:
            reading = preset.read(match)
            if reading is not None:
                return reading
    return None


def step_of(presets: list[Preset], text: str) -> int | None:
    """The number a line gives (a step, or a bar's count), None for a line without one."""
    reading = read(presets, text)
    return None if reading is None or reading.tick else reading.count


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
class RankSteps:
    """One rank's readings as one step that only goes up.

    A step line gives its step. A bar's count is a step of the rank's training bar: the first bar
    seen counting up (HF's training bar is drawn before its eval bars; Lightning's `Epoch E` bar
    after its `Training: 0/?` placeholder). On an `Epoch E: N/M` bar the step is E*M+N; on a bar
    without an epoch, a restart (its count went back: a new epoch's bar) continues from where it
    ended. Once the training bar reached its total, a bar counting up that was never drawn beside
    it while it ran takes over (a second phase) and continues from the rank's last step: HF's eval
    bars, drawn beside its training bar, never count, nor the finished training bar redrawn after
    the final evaluation (its count does not go up). A tick (HF's log dict without 'step') is the
    rank's last step + 1, only while the rank has shown no step line and no bar (with HF's bar, the
    bar's count is the global step). Sources mix by the rule every step obeys: only an increase is
    reported."""

    last: int | None = None
    counted: bool = False         # a step line or a bar seen: ticks add nothing
    bar: str | None = None        # the training bar's identity
    bar_done: bool = False        # it reached its total
    bar_count: int = 0            # its newest count
    bar_position: int = 0         # its newest position (E*M+N on an epoch bar)
    bar_base: int = 0             # added to its position: where its earlier runs (or the bar before it) ended
    others: dict[str, int] = field(default_factory=dict)   # other bars' newest counts (a few)
    beside: dict[str, None] = field(default_factory=dict)   # bars drawn while the training bar ran (a few)

    def step(self, reading: Reading) -> int | None:
        if reading.tick:
            return None if self.counted else (self.last or 0) + 1
        self.counted = True
        if reading.bar is None:
            return reading.count
        position, absolute = reading.count, False
        if reading.epoch is not None and reading.total is not None:
            position, absolute = reading.epoch * reading.total + reading.count, True
        if reading.bar != self.bar:
            before = self.others.pop(reading.bar, 0)
            _remember(self.others, reading.bar, reading.count)
            if self.bar is not None and not self.bar_done:
                _remember(self.beside, reading.bar, None)
                return None   # a bar beside the running training bar (an evaluation)
            if reading.count <= before or reading.bar in self.beside:
                return None   # not counting up, or a bar that ran beside the training bar
            if self.bar is not None:
                _remember(self.others, self.bar, self.bar_count)
            self.bar_base = 0 if self.bar is None else (self.last or 0)
            self.bar = reading.bar
        elif position < self.bar_position and not absolute:
            self.bar_base += self.bar_position   # the bar restarted
        self.bar_count, self.bar_position = reading.count, position
        self.bar_done = reading.total is not None and reading.count >= reading.total
        return self.bar_base + position


def _remember(bounded: dict, key: str, value: object) -> None:
    bounded.pop(key, None)
    bounded[key] = value
    while len(bounded) > MAX_OTHER_BARS:
        del bounded[next(iter(bounded))]


@dataclass(kw_only=True)
class ProgressMatcher:
    """Turns cleaned output lines into (rank, step) progress: each rank's readings become one
    step (RankSteps), and only an increase of it is reported (a redrawn bar repeats its count)."""

    patterns: list[Preset]
    ranks: dict[int | None, RankSteps] = field(default_factory=dict)

    def match(self, rank: int | None, text: str) -> int | None:
        if not self.patterns:
            return None
        reading = read(self.patterns, text)
        if reading is None:
            return None
        steps = self.ranks.setdefault(rank, RankSteps())
        step = steps.step(reading)
        if step is None or not 0 <= step < MAX_STEP or (steps.last is not None and step <= steps.last):
            return None
        steps.last = step
        return step
