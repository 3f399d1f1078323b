"""Text is data: untrusted text (from ranks, Slurm, files, paths, the environment) made literal
for a terminal, a rich renderer or a matplotlib label.

`literal` is the one rule: control characters (C0, DEL, C1, so every ESC of an ANSI CSI or OSC
sequence; a tab and a line break stay themselves only in multi-line text, `newlines=True`), the
bidirectional and line-separator format characters and lone surrogates are shown as Python-style
escapes (`\\x1b`, `\\u202e`, `\\ud800`), and the result is bounded with a marker, so a 1 MB
reason cannot flood a terminal. `text` wraps it in a rich Text: never parsed as
markup, no emoji codes (`[127.0.0.1]:1234:` in a markup string would print an emoji), no
highlighting — so data goes to rich only as Text, never as a str (rich.markup.escape leaves the
emoji codes alone); our own styles are Text styles. `mathtext` for matplotlib, where `$` starts
mathtext. A console line about the run goes through console.py, which makes it literal here.
A top-level module: imports nothing of ckptsup, and rich only on use.
"""

from __future__ import annotations

import re
from typing import Any

LIMIT = 8192   # characters per shown value or line: a terminal screenful or two, never a flood
# C0 but \t and \n (escaped too unless `newlines`: one line stays one line, and rich would expand a
# tab), DEL, C1, bidi overrides/isolates and marks, U+2028/2029 (a terminal may break the line
# there), lone surrogates.
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_ONE_LINE = re.compile(f"[\t\n{_UNSAFE}]")
_MULTI_LINE = re.compile(f"[{_UNSAFE}]")


_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def literal(value: Any, *, limit: int = LIMIT, newlines: bool = False) -> str:
    """`value` as text that shows itself on a terminal: escapes for what would act (see the module
    docstring); a line break and a tab stay themselves only with `newlines`; at most `limit`
    characters plus a `... (N more characters)` marker."""
    s = value if isinstance(value, str) else str(value)
    unsafe = _MULTI_LINE if newlines else _ONE_LINE
    head = s[:limit]
    out = unsafe.sub(lambda m: _escape(m.group()), head)
    if len(out) <= limit and len(s) <= limit:
        return out
    parts, size, used = [], 0, 0
    for ch in head:   # cut on a character boundary of the escaped text, never inside an escape
        piece = _escape(ch) if unsafe.match(ch) else ch
        if size + len(piece) > limit:
            break
        parts.append(piece)
        size += len(piece)
        used += 1
    return "".join(parts) + f" ... ({len(s) - used:,} more characters)"


def text(value: Any, style: str = "", *, limit: int = LIMIT, newlines: bool = False) -> Any:
    """A rich Text of `literal(value)`: a table cell, a title or a printed line that rich shows
    as it is (a str would be parsed as markup, with emoji codes and highlighting)."""
    from rich.text import Text

    return Text(literal(value, limit=limit, newlines=newlines), style=style)


def mathtext(value: Any, *, limit: int = 200) -> str:
    """`literal(value)` for a matplotlib label: `$` would start mathtext (a bad formula raises)."""
    return literal(value, limit=limit).replace("$", r"\$")
