"""Reading what a user, another process or a cluster hands us: one bounded reader for every file
boundary (config, run-dir state, manifests and validation records, events, agent specs) and one
bounded JSON decoder (files and wire frames).

The rules, so that no input can hang, exhaust or crash a reader:
- a path that `os.fsencode` cannot encode (a lone surrogate) is refused by name, not a traceback;
- files are opened O_NONBLOCK (a FIFO must not block the open), optionally O_NOFOLLOW, then
  `fstat`ed: anything but a regular file is refused (FIFOs, devices such as /dev/zero, directories);
- at most `max_bytes` are read, whatever the file claims or grows to;
- JSON nesting is bounded before the parser sees it (json recurses: a 100,000-deep line is a
  RecursionError), and NaN / Infinity are refused unless the caller allows them.
Every refusal is the caller's own one-line `CkptsupError` subclass, naming the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from .errors import CkptsupError

MAX_JSON_DEPTH = 64


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def encodable(path: str | os.PathLike[str], *, what: str, error: type[CkptsupError]) -> Path:
    """`path` as a Path, or `error` when the file system cannot be given its name."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise error(f"{what} {os.fspath(path)!r} has a name that cannot be encoded (a lone surrogate); "
                    "rename it") from None
    return Path(path)


def read_regular(path: str | os.PathLike[str], *, max_bytes: int, what: str, error: type[CkptsupError],
                 follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most `max_bytes`. FileNotFoundError passes through
    (callers decide what a missing file means); every other problem is one `error` line."""
    p = encodable(path, what=what, error=error)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise
    except PermissionError:
        raise error(f"cannot read {what} {p}: it is not readable by you (permission denied); "
                    "fix its permissions") from None
    except OSError as err:   # ELOOP is what O_NOFOLLOW answers for a symlink (is_symlink() may itself fail: EACCES)
        if not follow_symlinks and err.errno == errno.ELOOP:
            raise error(f"{what} {p} is a symlink; only regular files are read here") from None
        raise error(f"cannot read {what} {p}: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {p} is a {_kind(st.st_mode)}, not a regular file; replace it with the file itself")
        if st.st_size > max_bytes:
            raise error(f"{what} {p} is {st.st_size} bytes; at most {max_bytes} are read (is it the right file?)")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise error(f"{what} {p} grew past {max_bytes} bytes while being read")
        return data
    except OSError as err:
        raise error(f"cannot read {what} {p}: {err.strerror or err}") from None
    finally:
        os.close(fd)


_STRING = re.compile(rb'"[^"]*"')                       # a string without escapes
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_ok(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the bracket nesting of a JSON text stays within `max_depth` (strings skipped)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return True  # cannot nest deeper than it has brackets: the common case costs two counts
    if b"\\" not in data:
        # without escapes, strings pair up left to right as JSON's scanner pairs them (a lone last
        # quote only makes us count more): strip them, keep the brackets, and peel the innermost
        # pairs off, a level a pass, in C (a heartbeat of 8 ranks has 40 brackets)
        brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
        for _ in range(max_depth):
            brackets = _INNERMOST.sub(b"", brackets)   # one scan: the pairs inside none other
        if not brackets:
            return True
        # too deep, or unbalanced (not JSON): the exact walk below says which
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:    # backslash
                escaped = True
            elif byte == 0x22:    # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                return False
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


# one decoder for every strict read: json.loads(..., parse_constant=) would build a new one per
# call, a fifth of a heartbeat's decode at 16,384 agents (BENCHMARKS.md §Supervisor cost)
_STRICT_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _strict_loads(text: str | bytes) -> Any:
    """json.loads(text, parse_constant=_no_constant), the same steps, with the shared decoder."""
    if isinstance(text, str):
        if text.startswith("\ufeff"):
            raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
    else:
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    return _STRICT_DECODER.decode(text)


def loads_json(text: str | bytes, *, what: str, error: type[CkptsupError], max_depth: int = MAX_JSON_DEPTH,
               allow_nonfinite: bool = False) -> Any:
    """json.loads with the nesting bounded first; any failure is one `error` line."""
    if not json_depth_ok(text, max_depth):
        raise error(f"{what} nests deeper than {max_depth} levels; not a file or frame of ours")
    try:
        if allow_nonfinite:
            return json.loads(text)
        return _strict_loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{what} is not valid JSON ({str(err)[:120]})") from None


def read_json(path: str | os.PathLike[str], *, max_bytes: int, what: str, error: type[CkptsupError],
              follow_symlinks: bool = True, allow_nonfinite: bool = False) -> Any:
    """read_regular + loads_json."""
    data = read_regular(path, max_bytes=max_bytes, what=what, error=error, follow_symlinks=follow_symlinks)
    return loads_json(data, what=f"{what} {path}", error=error, allow_nonfinite=allow_nonfinite)
