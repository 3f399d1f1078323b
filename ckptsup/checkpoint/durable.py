"""File-system primitives of the commit protocol: fsync a directory, write a small file durably
with an explicit mode, and rename without ever replacing what exists."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: Path, data: bytes, *, mode: int = 0o600, exclusive: bool = True) -> None:
    """Write a small file with an explicit mode and fsync it."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | os.O_NOFOLLOW
    fd = os.open(path, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- rename without replacing ---------------------------------------------------------------

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _libc_renameat2():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with FileExistsError when dst exists (even an empty dir, which a plain
    rename would silently replace). Uses renameat2(RENAME_NOREPLACE); where the kernel or file
    system lacks it, a check-then-rename (the checkpoint_id check at commit still guards)."""
    fn = _libc_renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))
    os.rename(src, dst)
