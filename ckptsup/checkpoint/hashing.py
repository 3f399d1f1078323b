"""Checksums of checkpoint files and items. Values are self-describing strings,
"<algorithm>:<hex>", so a manifest, a tier and a reader never have to agree out of band.

xxh3-128 is the default: several GB/s per core, so hashing stays off the critical path
(bench/bench_hash.py measures it against sha256 in the same run). crc32 (zlib) is the fallback
for sites that want a standard CRC; sha256 is there for sites that want a cryptographic digest.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import zlib
from typing import Callable, Protocol

import xxhash

from ..errors import CheckpointError

HASH_ALGORITHMS: tuple[str, ...] = ("xxh3-128", "crc32", "sha256")
DEFAULT_ALGORITHM = "xxh3-128"
CHUNK = 8 << 20  # 8 MiB reads: large enough to amortise syscalls, small enough to stay in cache


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib.crc32 behind the hashlib-like interface."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value & 0xFFFFFFFF:08x}"


class _Prefixed:
    """Wraps a hasher so hexdigest() returns "<algorithm>:<hex>"."""

    def __init__(self, algorithm: str, inner: Hasher) -> None:
        self.algorithm = algorithm
        self._inner = inner

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._inner.update(data)

    def hexdigest(self) -> str:
        return f"{self.algorithm}:{self._inner.hexdigest()}"


def check_algorithm(algorithm: str) -> str:
    if algorithm not in HASH_ALGORITHMS:
        raise CheckpointError(f"unknown hash algorithm {algorithm!r}; valid: {', '.join(HASH_ALGORITHMS)}")
    return algorithm


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> _Prefixed:
    """A fresh hasher; .update(bytes) then .hexdigest() -> "<algorithm>:<hex>"."""
    check_algorithm(algorithm)
    if algorithm == "xxh3-128":
        inner: Hasher = xxhash.xxh3_128()
    elif algorithm == "crc32":
        inner = _Crc32()
    else:
        inner = hashlib.sha256()
    return _Prefixed(algorithm, inner)


def algorithm_of(value: str) -> str:
    """The algorithm named by a prefixed hash value; CheckpointError when malformed."""
    algorithm, sep, digest = value.partition(":")
    if not sep or not digest:
        raise CheckpointError(f"hash value {value[:40]!r} has no '<algorithm>:' prefix")
    return check_algorithm(algorithm)


def hash_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of a regular file: no symlink followed (O_NOFOLLOW), and a FIFO or
    device swapped in after a check neither blocks the open (O_NONBLOCK) nor gets read (OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def hash_file(path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM, *,
              offset: int = 0, length: int | None = None) -> str:
    """Hash a file, or the byte range [offset, offset+length). Never follows a symlink
    (O_NOFOLLOW). Raises CheckpointError when the range runs past the end of the file."""
    hasher = new_hasher(algorithm)
    if offset < 0 or (length is not None and length < 0):
        raise CheckpointError(f"bad byte range offset={offset} length={length} for {path}")
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = open_regular(path)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length or 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        remaining = length
        while remaining is None or remaining > 0:
            want = CHUNK if remaining is None else min(CHUNK, remaining)
            got = os.readv(fd, [view[:want]])
            if got == 0:
                if remaining is not None:
                    raise CheckpointError(f"{path}: byte range {offset}+{length} runs past the end of the file")
                break
            hasher.update(view[:got])
            if remaining is not None:
                remaining -= got
    finally:
        os.close(fd)
    return hasher.hexdigest()


def hash_file_and_ranges(path: str | os.PathLike[str], algorithm: str,
                         ranges: list[tuple[int, int, str]],
                         sink: Callable[[memoryview], None] | None = None) -> tuple[str, int, list[str]]:
    """One sequential read of a file: (file hash, size, [hash of each (offset, length, algorithm)
    range]). Ranges may come in any order and may overlap; a range past the end of the file
    hashes what exists (the caller compares lengths). Never follows a symlink. `sink` gets every
    chunk as it is hashed (to copy exactly the bytes that were hashed)."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    file_h = new_hasher(algorithm)
    range_h = [new_hasher(ranges[i][2]) for i in range(len(ranges))]
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    pos = 0
    k = 0   # index into `order` of the first range not yet complete
    fd = open_regular(path)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            got = os.readv(fd, [view])
            if got == 0:
                break
            chunk = view[:got]
            if sink is not None:
                sink(chunk)
            file_h.update(chunk)
            end = pos + got
            j = k
            while j < len(order):
                i = order[j]
                off, length = ranges[i][0], ranges[i][1]
                if off >= end:
                    break
                lo, hi = max(off, pos), min(off + length, end)
                if hi > lo:
                    range_h[i].update(chunk[lo - pos:hi - pos])
                if off + length <= end and j == k:
                    k += 1
                j += 1
            pos = end
    finally:
        os.close(fd)
    return file_h.hexdigest(), pos, [h.hexdigest() for h in range_h]
