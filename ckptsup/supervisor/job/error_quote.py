"""The give-up summary's error quote: the traceback that ended the run, found in the last attempt's
rank logs (`attempt-<N>/ranks-<node>.log`) and quoted within bounds (docs/supervisor.md §Giving up).

Each line is cleaned first: ANSI colour codes and other control characters removed, then every
leading rank prefix (`[rank0]: `; torchrun's `--tee` adds one and torch its own, so there may be
two; `[default0]:` and `[0]:` are torchrun's other templates). Which failure is quoted:

  1. torchrun's ChildFailedError summary, when present: its "Root Cause (first observed failure)"
     names the rank (the earliest one when several nodes printed one). That rank's last traceback
     in the logs, else the traceback the summary carries (an error_file), else what the summary
     says (exit code, signal);
  2. else the rank whose traceback starts first in the logs, and its last traceback (a chained
     exception's final one);
  3. else the last lines that look like errors; else "(no error in the rank logs of ...)".

torchrun's own traceback (ending in ChildFailedError) is never the quote. Everything is pure but
`quote_logs`, which reads the tail of each log.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ...progress import ANSI

TAIL_BYTES = 1 << 20       # of each log: the end holds the failure
MAX_LINES = 40             # of the quote
MAX_CHARS = 4000
MAX_LINE_CHARS = 300
FALLBACK_LINES = 3

START = "Traceback (most recent call last):"
GROUP_START = "Exception Group Traceback (most recent call last):"
CHAINED = ("During handling of the above exception, another exception occurred:",
           "The above exception was the direct cause of the following exception:")
LAUNCHER_ERROR = "ChildFailedError"    # torchrun's own exception: the summary, not the error
ROOT_CAUSE = "Root Cause (first observed failure):"
_PREFIX = re.compile(r"\[([A-Za-z_][\w-]*?)?(\d+)\]:[ ]?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_BORDER = re.compile(r"^(=+|-+)$")
# an exception's line, or argparse's `prog: error: message` (torchrun refusing its command line)
_ERRORISH = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b|^[\w.-]+: error: ")


@dataclass(frozen=True)
class Line:
    who: str | None   # the outermost prefix without brackets ("rank0", "default1", "0"); None: unprefixed
    text: str


@dataclass
class Traceback:
    who: str | None
    start: int                     # line index in its log
    lines: list[str]
    exception: str = ""            # "" when the log ends inside it
    chained: bool = False          # raised while handling the previous traceback of the same `who`


@dataclass
class RootCause:
    """torchrun's "Root Cause (first observed failure)" entry."""

    rank: int | None = None
    local_rank: int | None = None
    exitcode: str = ""
    time: str = ""
    error_file: str = ""
    traceback: list[str] = field(default_factory=list)


@dataclass
class Parsed:
    tracebacks: list[Traceback]
    root_causes: list[RootCause]
    errorish: list[Line]


def clean(raw: str) -> Line:
    """One raw log line: colour codes and control characters out, every leading rank prefix off."""
    text = _CONTROL.sub("", ANSI.sub("", raw)).rstrip()
    who = None
    while (match := _PREFIX.match(text)) is not None:
        if who is None:
            who = (match.group(1) or "") + match.group(2)
        text = text[match.end():]
    return Line(who=who, text=text)


def global_rank(who: str | None) -> int | None:
    """The global rank a prefix names: `[rankN]:` and `[N]:`; `[defaultN]:` is a local rank."""
    if who is None:
        return None
    match = re.fullmatch(r"(rank)?(\d+)", who)
    return int(match.group(2)) if match else None


def parse(text: str) -> Parsed:
    lines = [clean(raw) for raw in re.split(r"\r\n|\r|\n", text)]
    return Parsed(tracebacks=_tracebacks(lines), root_causes=_root_causes(lines),
                  errorish=[x for x in lines if _ERRORISH.match(x.text) and LAUNCHER_ERROR not in x.text])


def _tracebacks(lines: list[Line]) -> list[Traceback]:
    """Every traceback, separately per prefix, so that interleaved ranks do not mix."""
    done: list[Traceback] = []
    open_: dict[str | None, Traceback] = {}
    chain: set[str | None] = set()
    for i, line in enumerate(lines):
        who, text = line.who, line.text
        if text.startswith((START, GROUP_START)):
            if who in open_:
                done.append(open_.pop(who))
            open_[who] = Traceback(who=who, start=i, lines=[text], chained=who in chain)
            chain.discard(who)
        elif who in open_:
            if not text.strip():
                continue
            tb = open_[who]
            tb.lines.append(text)
            if not text[0].isspace():  # frames are indented; the exception line is not
                tb.exception = text
                done.append(open_.pop(who))
        elif text.strip() in CHAINED:
            chain.add(who)
    done.extend(open_.values())
    done.sort(key=lambda tb: tb.start)
    return [tb for tb in done if LAUNCHER_ERROR not in tb.exception]


def _root_causes(lines: list[Line]) -> list[RootCause]:
    out: list[RootCause] = []
    i = 0
    while i < len(lines):
        if lines[i].text.strip() != ROOT_CAUSE:
            i += 1
            continue
        cause, in_traceback = RootCause(), False
        i += 1
        while i < len(lines) and not _BORDER.match(lines[i].text.strip()):
            text = lines[i].text
            match = _FIELD.match(text)
            if match and not (in_traceback and text.startswith("    ")):
                name, value = match.groups()
                in_traceback = name == "traceback"
                _set_field(cause, name, value.strip())
            elif in_traceback:
                cause.traceback.append(text[2:] if text.startswith("  ") else text)  # torchrun indents by 2
            i += 1
        while cause.traceback and not cause.traceback[-1].strip():
            cause.traceback.pop()
        out.append(cause)
    return out


def _set_field(cause: RootCause, name: str, value: str) -> None:
    if name == "rank":
        match = re.match(r"(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", value)
        if match:
            cause.rank = int(match.group(1))
            cause.local_rank = int(match.group(2)) if match.group(2) else None
    elif name == "exitcode":
        code = re.match(r"-?\d+", value)
        signal = re.search(r"\((SIG\w+)\)", value)
        cause.exitcode = (code.group(0) if code else value[:40]) + (f" ({signal.group(1)[:20]})" if signal else "")
    elif name == "traceback":
        cause.traceback = [value] if value else []
    elif name in ("time", "error_file"):
        setattr(cause, name, value)


# ---- choosing and quoting -----------------------------------------------------------------------

def quote(logs: list[tuple[str, str]], *, rank: int | None = None, where: str = "the rank logs") -> str:
    """The quote for `logs` ((name, text) pairs, in order). `rank`: the rank the supervisor saw
    fail first, used when torchrun printed no summary."""
    parsed = [(name, parse(text)) for name, text in logs]
    causes = [(c.time, n, name, c) for n, (name, p) in enumerate(parsed) for c in p.root_causes]
    if causes:
        _, _, log, cause = min(causes, key=lambda x: (x[0], x[1]))
        return _quote_root_cause(parsed, log, cause)
    tracebacks = [(name, tb) for name, p in parsed for tb in p.tracebacks]
    if tracebacks:
        first = next(((n, tb) for n, tb in tracebacks if rank is not None and global_rank(tb.who) == rank),
                     tracebacks[0])
        log, tb = _last_of(tracebacks, first)
        return _render(f"{_who(tb.who)} failed first; its last traceback, in {log}:", tb.lines)
    out = []
    for name, p in parsed:
        if p.errorish:
            out.append(f"--- {name}:")
            out.extend(_cut(x) for x in dict.fromkeys(x.text.strip() for x in p.errorish[-FALLBACK_LINES:]))
    return "\n".join(out) or f"(no error in {where})"


def _quote_root_cause(parsed: list[tuple[str, Parsed]], log: str, cause: RootCause) -> str:
    facts = f"exitcode {cause.exitcode}" if cause.exitcode else "torchrun's root cause"
    who = f"rank {cause.rank}" if cause.rank is not None else "a rank"
    mine = [(name, tb) for name, p in parsed for tb in p.tracebacks
            if cause.rank is not None and global_rank(tb.who) == cause.rank]
    if not mine and cause.local_rank is not None:  # [defaultN]: prefixes name local ranks, on its own node
        mine = [(name, tb) for name, p in parsed if name == log for tb in p.tracebacks
                if tb.who is not None and global_rank(tb.who) is None and tb.who.endswith(str(cause.local_rank))]
    if mine:
        name, tb = mine[-1]
        return _render(f"{who} failed first ({facts}, says torchrun); its last traceback, in {name}:", tb.lines)
    if cause.traceback and cause.traceback[0].startswith(START):
        return _render(f"{who} failed first ({facts}); its traceback, from torchrun's summary in {log}:",
                       cause.traceback)
    plain = [tb for name, p in parsed if name == log for tb in p.tracebacks if tb.who is None]
    if plain:  # lines without rank prefixes: the first traceback printed is the first failure
        _, tb = _last_of([(log, t) for t in plain], (log, plain[0]))
        return _render(f"{who} failed first ({facts}, says torchrun); the first traceback in {log} "
                       "(its lines name no rank):", tb.lines)
    said = f": {_cut(cause.traceback[0])}" if cause.traceback else ""
    return _render(f"{who} failed first ({facts}) and printed no traceback; torchrun's summary in {log}{said}", [])


def _last_of(tracebacks: list[tuple[str, Traceback]], first: tuple[str, Traceback]) -> tuple[str, Traceback]:
    """For a prefixed rank: its last traceback. For unprefixed lines (any rank): the end of the
    chain that starts at `first` (a traceback raised while handling it)."""
    log, tb = first
    # a global rank is one process in every log; a local rank or no prefix only within its own log
    same = [(n, t) for n, t in tracebacks if t.who == tb.who and (global_rank(tb.who) is not None or n == log)]
    if tb.who is not None:
        return same[-1]
    after = same[[t for _, t in same].index(tb) + 1:]
    for n, t in after:
        if not t.chained:
            break
        log, tb = n, t
    return log, tb


def _who(who: str | None) -> str:
    rank = global_rank(who)
    if rank is not None:
        return f"rank {rank}"
    return f"[{who}]" if who else "a rank"


def _render(header: str, lines: list[str]) -> str:
    return "\n".join([f"--- {header}", *bound(lines)])


def bound(lines: list[str], *, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> list[str]:
    """The first line, then as many of the last lines as fit (the innermost frames and the
    exception matter most), with a marker for what was left out."""
    lines = [_cut(x) for x in lines]
    if not lines:
        return []
    head, tail = lines[0], lines[1:]
    budget = max_chars - len(head) - 40
    kept: list[str] = []
    for line in reversed(tail):
        if len(kept) >= max_lines - 2 or len(line) + 1 > budget:
            break
        kept.append(line)
        budget -= len(line) + 1
    kept.reverse()
    left = len(tail) - len(kept)
    marker = [f"  ... ({left} line{'' if left == 1 else 's'} left out)"] if left else []
    return [head, *marker, *kept]


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 3] + "..."


# ---- the files ----------------------------------------------------------------------------------

def read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> str:
    """The last `max_bytes` of a regular file as text ("" for anything else), never blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        offset = max(0, st.st_size - max_bytes)
        data = os.pread(fd, max_bytes, offset)
    except OSError:
        return ""
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[-1] if offset else text  # the tail starts inside a line


def quote_logs(attempt_dir: Path, *, rank: int | None = None) -> str:
    logs = [(str(p), read_tail(p)) for p in sorted(Path(attempt_dir).glob("ranks-*.log"))]
    return quote(logs, rank=rank, where=f"the rank logs of {attempt_dir}")
