"""Is a script's own checkpoint file whole? Torch-free, never unpickles, one line per verdict
(docs/drop-in.md §The script's own checkpoint file).

What a file is, by its first bytes and its name:

- a `torch.save` file (a zip, `PK\\x03\\x04`): the end-of-central-directory record (zip64 too)
  ends the file, the central directory is where it says, every entry's local header matches it,
  its data lies inside the file, and the CRC-32 of every entry's bytes is the one recorded (a torn
  save has no end record; a changed byte breaks its entry's CRC);
- a legacy pickle (`_use_new_zipfile_serialization=False`, or any pickle): the pickles at its
  start walked opcode by opcode (pickletools, nothing built) to their STOP, then a full read of
  the rest and its size (its tensor bytes carry no checksum: a file torn inside them is not seen);
- a `.safetensors` file: the 8-byte header length, the JSON header (every tensor's dtype, shape
  and data_offsets consistent, the offsets tiling the data section without a hole), the total
  length, and a full read;
- anything else: a full read and its size. A name ending in .pt, .pth, .ckpt or .bin must be a
  zip or a pickle (torch.load reads nothing else).

An empty file is never whole. CRC-32 uses libdeflate when the system has it (several GB/s),
else zlib; either way the reading is into a buffer reused (CHUNK bytes per thread), never an mmap
(a file truncated under an mmap kills the reader with SIGBUS). A stored entry of STRIPE_MIN bytes
or more is cut into UNIT-byte pieces, read and CRC'd by one thread per CPU (at most MAX_THREADS;
preadv and both CRCs release the GIL) taking them in turn, and the pieces' CRCs joined in order
(`crc32_combine`): every byte is still read and CRC'd once. Threads started from a low-priority thread (the keeper's) inherit
its scheduling class and I/O priority."""

from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import json
import os
import pickletools
import stat
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CHUNK = 1 << 20
STRIPE_MIN = 8 << 20                 # a stored entry this large is CRC'd by several threads
UNIT = 4 << 20                       # in pieces of this many bytes, each CRC'd by one thread
MAX_THREADS = 4                      # threads (and buffers) at most
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
ZIP_MAGIC = b"PK\x03\x04"
EMPTY_ZIP_MAGIC = b"PK\x05\x06"
EOCD = 0x06054B50
ZIP64_LOCATOR = 0x07064B50
ZIP64_EOCD = 0x06064B50
CENTRAL = 0x02014B50
LOCAL = 0x04034B50
MAX_CENTRAL_BYTES = 1 << 30          # a central directory this large is not a checkpoint's
MAX_ENTRIES = 10_000_000
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PICKLES = 5                   # magic, protocol, sys_info, the object, the storage keys
MAX_PICKLE_BYTES = 1 << 30
# safetensors dtypes -> bits per element
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
                    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class Kind(str, enum.Enum):
    ZIP = "torch.save zip"
    PICKLE = "pickle"
    SAFETENSORS = "safetensors"
    FILE = "file"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    ok: bool
    kind: Kind
    bytes: int
    problem: str = ""      # one line: what is wrong (empty when ok)
    seconds: float = 0.0
    entries: int = 0       # zip entries or safetensors tensors checked

    def line(self, name: str) -> str:
        return f"{name}: {self.kind.value}, {self.bytes} bytes, whole" if self.ok else f"{name}: {self.problem}"


class Corrupt(Exception):
    """What is wrong with the file, in one line (internal: check() turns it into a Verdict)."""


# ---- CRC-32 -------------------------------------------------------------------------------------

def _libdeflate() -> Callable[[int, int, int], int] | None:
    try:
        lib = ctypes.CDLL("libdeflate.so.0")
        fn = lib.libdeflate_crc32
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_FAST: list[Callable[[int, int, int], int] | None] = []


def crc_backend() -> str:
    return "libdeflate" if _fast_crc() is not None else "zlib"


def _fast_crc() -> Callable[[int, int, int], int] | None:
    if not _FAST:
        _FAST.append(_libdeflate())
    return _FAST[0]


# crc32_combine (zlib's, by powers of x modulo the CRC-32 polynomial): the CRC of A+B from the
# CRCs of A and B and the length of B; Python 3.11's zlib does not have it.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial (bit-reflected, as zlib)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]                      # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=16)
def _x8n(n: int) -> int:
    """x^(8n) modulo the polynomial: what a CRC is multiplied by to move it past n bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A followed by B, from crc32(A), crc32(B) and len(B)."""
    return _multmodp(_x8n(len2), crc1) ^ (crc2 & 0xFFFFFFFF)


def crc_threads() -> int:
    """How many threads a long stored entry is CRC'd by: one per CPU this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


class _Buffer:
    """One reused read buffer and, with libdeflate, its address."""

    def __init__(self, fast: bool) -> None:
        self.buf = bytearray(CHUNK)
        self.view = memoryview(self.buf)
        self.addr = ctypes.addressof((ctypes.c_char * CHUNK).from_buffer(self.buf)) if fast else 0


class _Reader:
    """Positioned reads into reused buffers; the CRC of a byte range (by `threads` threads in
    UNIT-byte pieces when it is long; 1: everything in the calling thread)."""

    def __init__(self, fd: int, size: int, *, threads: int = 1) -> None:
        self.fd, self.size, self.threads = fd, size, max(1, threads)
        self.fast = _fast_crc()
        first = _Buffer(self.fast is not None)
        self.buf, self.view, self.addr = first.buf, first.view, first.addr
        self.spare: list[_Buffer] = []           # the pool threads' buffers (at most threads - 1)
        self.spare_lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def read(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`, or Corrupt."""
        out = bytearray()
        while len(out) < length:
            got = os.pread(self.fd, min(length - len(out), 64 << 20), offset + len(out))
            if not got:
                raise Corrupt(f"ends at byte {offset + len(out)} while {length} bytes at {offset} were expected "
                              "(the file shrank while it was read)")
            out += got
        return bytes(out)

    def scan(self, offset: int, length: int, each: Callable[[memoryview, int], None] | None = None) -> int:
        """Read `length` bytes at `offset` chunk by chunk; their CRC-32 (and `each(chunk, n)`, in
        order, in this thread: such a scan is never split)."""
        if each is None and self.threads > 1 and length >= STRIPE_MIN:
            return self._striped(offset, length)
        return self._scan(offset, length, offset + length, self.view, self.addr, each)

    def _scan(self, offset: int, length: int, end: int, view: memoryview, addr: int,
              each: Callable[[memoryview, int], None] | None = None) -> int:
        crc, done, fast = 0, 0, self.fast
        while done < length:
            n = os.preadv(self.fd, [view[:min(CHUNK, length - done)]], offset + done)
            if n <= 0:
                raise Corrupt(f"ends at byte {offset + done}, inside data that runs to byte {end} "
                              "(the file shrank while it was read)")
            crc = fast(crc, addr, n) if fast else zlib.crc32(view[:n], crc)
            if each is not None:
                each(view[:n], n)
            done += n
        return crc

    def _striped(self, offset: int, length: int) -> int:
        """The CRC of `length` bytes at `offset`, in UNIT-byte pieces that this thread and the
        pool's (`threads` in all, one buffer each) take in turn from a shared counter (a thread
        the scheduler puts off leaves its share to the others), their CRCs joined in order."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="script-file-crc")
        end = offset + length
        units = -(-length // UNIT)
        crcs = [0] * units
        failed: dict[int, BaseException] = {}
        counter = itertools.count()   # next() is atomic under the GIL
        stop = threading.Event()

        def work(view: memoryview, addr: int) -> None:
            while not stop.is_set():
                i = next(counter)
                if i >= units:
                    return
                at = offset + i * UNIT
                try:
                    crcs[i] = self._scan(at, min(UNIT, end - at), end, view, addr)
                except BaseException as err:   # noqa: BLE001 - raised below, the first piece's first
                    failed[i] = err
                    stop.set()
                    return

        def pooled() -> None:
            with self.spare_lock:
                buffer = self.spare.pop() if self.spare else _Buffer(self.fast is not None)
            try:
                work(buffer.view, buffer.addr)
            finally:
                with self.spare_lock:
                    self.spare.append(buffer)

        futures: list[Future[None]] = []
        try:
            for _ in range(self.threads - 1):
                futures.append(self.pool.submit(pooled))
        except RuntimeError:   # the interpreter is shutting down (no new threads): this one does the rest
            pass
        work(self.view, self.addr)
        for future in futures:
            future.result()
        if failed:
            raise failed[min(failed)]
        crc, x_unit = crcs[0], _x8n(UNIT)
        for i in range(1, units):
            last = min(UNIT, end - (offset + i * UNIT))
            crc = (_multmodp(x_unit, crc) ^ crcs[i]) if last == UNIT else crc32_combine(crc, crcs[i], last)
        return crc


    def read_all(self) -> None:
        """A full read: every byte readable, exactly `size` of them."""
        done = 0
        while True:
            n = os.preadv(self.fd, [self.view], done)
            if n <= 0:
                break
            done += n
        if done != self.size:
            raise Corrupt(f"{done} bytes read, but the file is {self.size} bytes (it changed while it was read)")


# ---- the check ----------------------------------------------------------------------------------

def kind_of(path: Path, head: bytes) -> Kind:
    if path.name.endswith(".safetensors"):
        return Kind.SAFETENSORS
    if head.startswith(ZIP_MAGIC) or head.startswith(EMPTY_ZIP_MAGIC):
        return Kind.ZIP
    if head[:1] == b"\x80" or path.suffix in (".pkl", ".pickle"):
        return Kind.PICKLE
    return Kind.FILE


def check(path: str | os.PathLike[str], *, threads: int | None = None) -> Verdict:
    """Whether the file at `path` is whole (see the module's docstring); never raises for the
    file's content or a read error: those are the verdict's `problem`. `threads`: how many read
    and CRC a long entry (default: `crc_threads()`, one per CPU, at most MAX_THREADS)."""
    path = Path(path)
    start = time.monotonic()
    kind, size, entries = Kind.FILE, 0, 0
    reader: _Reader | None = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        return Verdict(ok=False, kind=kind, bytes=0, problem=f"cannot be opened ({err.strerror})",
                       seconds=time.monotonic() - start)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Corrupt("is not a regular file")
        size = st.st_size
        reader = _Reader(fd, size, threads=crc_threads() if threads is None else threads)
        head = os.pread(fd, 8, 0)
        kind = kind_of(path, head)
        if size == 0:
            raise Corrupt("is empty (0 bytes): a save that never wrote")
        if kind is Kind.ZIP:
            entries = _check_zip(reader, require_torch=path.suffix in TORCH_SUFFIXES)
        elif kind is Kind.SAFETENSORS:
            entries = _check_safetensors(reader)
        elif kind is Kind.PICKLE:
            _check_pickle(reader)
        else:
            if path.suffix in TORCH_SUFFIXES:
                raise Corrupt(f"is neither a zip (torch.save) nor a pickle (legacy torch.save): it starts with "
                              f"{head[:4].hex()}")
            reader.read_all()
    except Corrupt as err:
        return Verdict(ok=False, kind=kind, bytes=size, problem=f"{kind.value}: {err}",
                       seconds=time.monotonic() - start, entries=entries)
    except OSError as err:
        return Verdict(ok=False, kind=kind, bytes=size, problem=f"{kind.value}: unreadable ({err.strerror or err})",
                       seconds=time.monotonic() - start, entries=entries)
    finally:
        if reader is not None:
            reader.close()
        os.close(fd)
    return Verdict(ok=True, kind=kind, bytes=size, seconds=time.monotonic() - start, entries=entries)


# ---- zip (torch.save) ---------------------------------------------------------------------------

def _end_records(reader: _Reader) -> tuple[int, int, int, int]:
    """(entries, central directory offset, its size, where the end records begin)."""
    size = reader.size
    tail_len = min(size, 22 + 65535)
    tail = reader.read(size - tail_len, tail_len)
    at = -1
    for i in range(tail_len - 22, -1, -1):
        if tail[i:i + 4] == b"PK\x05\x06":
            comment = struct.unpack_from("<H", tail, i + 20)[0]
            if i + 22 + comment == tail_len:
                at = i
                break
    if at < 0:
        raise Corrupt(f"no end-of-central-directory record at the end of its {size} bytes: a save cut short "
                      "(torn) or not a zip")
    eocd_pos = size - tail_len + at
    _, disk, cd_disk, n_disk, n, cd_size, cd_off, _ = struct.unpack_from("<IHHHHIIH", tail, at)
    if disk or cd_disk or n_disk != n:
        raise Corrupt("is a multi-disk zip, not a torch.save file")
    begin = eocd_pos
    if n == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF or \
            (eocd_pos >= 20 and reader.read(eocd_pos - 20, 4) == struct.pack("<I", ZIP64_LOCATOR)):
        if eocd_pos < 20:
            raise Corrupt("its zip64 end records are missing")
        loc = reader.read(eocd_pos - 20, 20)
        sig, _, z64_off, _ = struct.unpack("<IIQI", loc)
        if sig != ZIP64_LOCATOR:
            raise Corrupt("its zip64 end-of-central-directory locator is missing")
        if z64_off + 56 > eocd_pos - 20:
            raise Corrupt(f"its zip64 end record offset {z64_off} lies outside the file")
        rec = reader.read(z64_off, 56)
        sig, _, _, _, _, _, n_disk64, n64, cd_size64, cd_off64 = struct.unpack("<IQHHIIQQQQ", rec)
        if sig != ZIP64_EOCD or n_disk64 != n64:
            raise Corrupt("its zip64 end-of-central-directory record is damaged")
        n, cd_size, cd_off, begin = n64, cd_size64, cd_off64, z64_off
    if cd_off + cd_size != begin:
        raise Corrupt(f"its central directory ({cd_size} bytes at {cd_off}) does not end where the end records "
                      f"begin ({begin})")
    if n > MAX_ENTRIES or cd_size > MAX_CENTRAL_BYTES:
        raise Corrupt(f"claims {n} entries in a {cd_size}-byte central directory: not a checkpoint's")
    return n, cd_off, cd_size, begin


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4:at + 4 + length]
        if tag == 1:
            values, pos = [], 0
            for current in (usize, csize, offset):
                if current == 0xFFFFFFFF:
                    if pos + 8 > len(body):
                        raise Corrupt("a zip64 extra field is short")
                    values.append(struct.unpack_from("<Q", body, pos)[0])
                    pos += 8
                else:
                    values.append(current)
            return values[0], values[1], values[2]
        at += 4 + length
    return usize, csize, offset


def _check_zip(reader: _Reader, *, require_torch: bool) -> int:
    n, cd_off, cd_size, _ = _end_records(reader)
    cd = reader.read(cd_off, cd_size)
    at, entries = 0, []
    for i in range(n):
        if at + 46 > len(cd) or struct.unpack_from("<I", cd, at)[0] != CENTRAL:
            raise Corrupt(f"central directory entry {i} of {n} is damaged")
        (_, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len, _, _, _,
         offset) = struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, at)
        name = cd[at + 46:at + 46 + name_len]
        extra = cd[at + 46 + name_len:at + 46 + name_len + extra_len]
        usize, csize, offset = _zip64_extra(extra, usize, csize, offset)
        entries.append((name, method, flags, crc, csize, usize, offset))
        at += 46 + name_len + extra_len + comment_len
    if at != len(cd):
        raise Corrupt(f"its central directory holds {len(cd) - at} bytes past its {n} entries")
    names = [e[0] for e in entries]
    if require_torch and not any(nm.endswith(b"data.pkl") for nm in names):
        raise Corrupt("is a zip without data.pkl: not a torch.save file")
    for name, method, flags, crc, csize, usize, offset in entries:
        shown = name.decode("utf-8", "replace")[:120]
        if offset + 30 > cd_off:
            raise Corrupt(f"entry {shown!r}: its local header at {offset} lies past the data")
        local = reader.read(offset, 30)
        sig, _, _, lmethod, _, _, _, _, _, lname_len, lextra_len = struct.unpack("<IHHHHHIIIHH", local)
        if sig != LOCAL or lmethod != method:
            raise Corrupt(f"entry {shown!r}: its local header at {offset} is damaged")
        if reader.read(offset + 30, lname_len) != name:
            raise Corrupt(f"entry {shown!r}: its local header names another entry")
        data = offset + 30 + lname_len + lextra_len
        if data + csize > cd_off:
            raise Corrupt(f"entry {shown!r}: its {csize} bytes at {data} run past the data section (ends at {cd_off})")
        if flags & 1:
            raise Corrupt(f"entry {shown!r} is encrypted: not a torch.save file")
        if method == 0:
            if csize != usize:
                raise Corrupt(f"entry {shown!r}: stored with {csize} bytes but {usize} recorded")
            got = reader.scan(data, csize)
        elif method == 8:
            got = _inflated_crc(reader, data, csize, usize, shown)
        else:
            raise Corrupt(f"entry {shown!r}: compression method {method} is not one torch.save writes")
        if got != crc:
            raise Corrupt(f"entry {shown!r}: CRC-32 {got:08x}, but {crc:08x} recorded (a changed or torn byte in "
                          f"its {usize} bytes)")
    return n


def _inflated_crc(reader: _Reader, data: int, csize: int, usize: int, shown: str) -> int:
    inflater = zlib.decompressobj(-15)
    state = {"crc": 0, "out": 0}

    def each(chunk: memoryview, _n: int) -> None:
        try:
            out = inflater.decompress(chunk)
        except zlib.error as err:
            raise Corrupt(f"entry {shown!r}: its deflate stream is damaged ({err})") from None
        state["crc"] = zlib.crc32(out, state["crc"])
        state["out"] += len(out)

    reader.scan(data, csize, each)
    rest = inflater.flush()
    state["crc"] = zlib.crc32(rest, state["crc"])
    state["out"] += len(rest)
    if state["out"] != usize or not inflater.eof:
        raise Corrupt(f"entry {shown!r}: inflates to {state['out']} bytes, {usize} recorded")
    return state["crc"]


# ---- safetensors ----------------------------------------------------------------------------------

def _check_safetensors(reader: _Reader) -> int:
    size = reader.size
    if size < 8:
        raise Corrupt(f"is {size} bytes, shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", reader.read(0, 8))
    if length > MAX_SAFETENSORS_HEADER:
        raise Corrupt(f"header length {length} is over safetensors' limit of {MAX_SAFETENSORS_HEADER}")
    if 8 + length > size:
        raise Corrupt(f"header of {length} bytes runs past the end of the file ({size} bytes): torn")
    raw = reader.read(8, length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise Corrupt(f"header is not JSON ({str(err)[:100]})") from None
    if not isinstance(header, dict):
        raise Corrupt("header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise Corrupt("__metadata__ is not a table of strings")
            continue
        shown = str(name)[:120]
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise Corrupt(f"tensor {shown!r}: needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SAFETENSORS_BITS:
            raise Corrupt(f"tensor {shown!r}: unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise Corrupt(f"tensor {shown!r}: shape is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or \
                not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets) or \
                offsets[0] > offsets[1]:
            raise Corrupt(f"tensor {shown!r}: data_offsets is not [begin, end]")
        numel = 1
        for d in shape:
            numel *= d
        bits = numel * SAFETENSORS_BITS[dtype]
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            raise Corrupt(f"tensor {shown!r}: {dtype} {shape} is {bits / 8:g} bytes, but data_offsets span "
                          f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], shown))
    data_len = size - 8 - length
    at = 0
    for begin, end, shown in sorted(spans):
        if begin != at:
            raise Corrupt(f"tensor {shown!r} begins at {begin}, where {at} was expected (a hole or an overlap)")
        at = end
    if at != data_len:
        raise Corrupt(f"the tensors end at data byte {at}, but the file holds {data_len} data bytes "
                      f"({'torn' if at > data_len else 'trailing bytes'})")
    reader.read_all()
    return len(spans)


# ---- pickle ---------------------------------------------------------------------------------------

class _PickleStream:
    """A file-like view of the file for pickletools.genops (read and readline), bounded."""

    def __init__(self, reader: _Reader) -> None:
        self.reader, self.pos = reader, 0

    def read(self, n: int = -1) -> bytes:
        n = self.reader.size - self.pos if n < 0 else min(n, self.reader.size - self.pos)
        if self.pos + n > MAX_PICKLE_BYTES:
            raise Corrupt(f"its pickles run past {MAX_PICKLE_BYTES} bytes")
        data = self.reader.read(self.pos, n) if n > 0 else b""
        self.pos += len(data)
        return data

    def readline(self) -> bytes:
        out = bytearray()
        while self.pos < self.reader.size:
            ch = self.read(1)
            out += ch
            if ch == b"\n" or len(out) > 1 << 16:
                break
        return bytes(out)

    def tell(self) -> int:
        return self.pos


def _one_pickle(stream: _PickleStream, which: str) -> object:
    """Walk one pickle to its STOP; the first opcode's argument (the legacy magic number)."""
    first: object = None
    try:
        for i, (op, arg, _pos) in enumerate(pickletools.genops(stream)):  # type: ignore[arg-type]
            if i <= 1 and op.name in ("LONG1", "LONG4", "LONG", "INT"):
                first = arg
    except ValueError as err:
        raise Corrupt(f"{which} ends before its STOP opcode ({str(err)[:80]}): torn") from None
    return first


def _check_pickle(reader: _Reader) -> None:
    stream = _PickleStream(reader)
    magic = _one_pickle(stream, "the first pickle")
    if magic == TORCH_LEGACY_MAGIC:   # torch's legacy format: 4 more pickles, then the storages
        for which in ("the protocol pickle", "the sys_info pickle", "the object pickle", "the storage-keys pickle"):
            if stream.pos >= reader.size:
                raise Corrupt(f"{which} is missing: torn after byte {stream.pos}")
            _one_pickle(stream, which)
    reader.read_all()
