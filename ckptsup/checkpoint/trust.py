"""The trust boundary (issue 3, item 8). A checkpoint directory is treated as code: DCP's
`.metadata` is a pickle. So before anything in it is read we require that the directory is owned
by us, not writable by group or others, and holds no symlinks, device files or hard links to files
elsewhere. Each refusal is one line with the command that fixes it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import TrustError


def _describe_mode(mode: int) -> str:
    return oct(stat.S_IMODE(mode))


def check_dir_trusted(path: str | os.PathLike[str], *, recursive: bool = False, uid: int | None = None) -> Path:
    """Refuse `path` unless it is a real directory owned by the current user and not writable by
    group or others; refuse symlinks among its entries (and, with recursive, anywhere below, plus
    foreign-owned or group/other-writable entries, special files and multiply-linked files).
    `uid` defaults to the current user. Returns the path. Raises TrustError."""
    uid = os.getuid() if uid is None else uid
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TrustError(f"{path} does not exist") from None
    except OSError as err:
        raise TrustError(f"cannot look at {path}: {err.strerror}; check the permissions of its parent directories") from None
    if stat.S_ISLNK(st.st_mode):
        raise TrustError(f"{path} is a symlink; point ckptsup at the real directory {os.path.realpath(path)} after checking it")
    if not stat.S_ISDIR(st.st_mode):
        raise TrustError(f"{path} is not a directory")
    _check_owner_mode(path, st, uid)
    _check_entries(path, recursive=recursive, uid=uid)
    return path


def _check_owner_mode(path: Path, st: os.stat_result, uid: int) -> None:
    if st.st_uid != uid:
        raise TrustError(f"{path} is owned by uid {st.st_uid}, not you (uid {uid}); a checkpoint from another user could run code on load. "
                         f"If you trust it: `chown -R {uid} {path}` (as its owner/root) or copy it into a directory you own")
    if st.st_mode & 0o022:
        raise TrustError(f"{path} is writable by group or others (mode {_describe_mode(st.st_mode)}); run `chmod -R go-w {path}`")


def _check_entries(top: Path, *, recursive: bool, uid: int) -> None:
    try:
        entries = os.scandir(top)
    except OSError as err:
        raise TrustError(f"cannot list {top}: {err.strerror}; give yourself read access (`chmod u+rx {top}`) "
                         f"or run as its owner") from None
    with entries:
        for entry in entries:
            full = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing: a concurrent validator's record being renamed into place
            if stat.S_ISLNK(st.st_mode):
                raise TrustError(f"{full} is a symlink; checkpoints must not contain symlinks: remove it (`rm {full}`)")
            if not recursive:
                continue
            if stat.S_ISDIR(st.st_mode):
                _check_owner_mode(full, st, uid)
                _check_entries(full, recursive=True, uid=uid)
            elif stat.S_ISREG(st.st_mode):
                _check_owner_mode(full, st, uid)
                if st.st_nlink > 1:
                    raise TrustError(f"{full} has {st.st_nlink} hard links; a checkpoint file must not be shared with another path: copy it (`cp --remove-destination`)")
            else:
                raise TrustError(f"{full} is not a regular file or directory; remove it")


def private_mkdir(path: Path) -> Path:
    """Create a directory 0700 (explicit mode, not umask) and check what exists is ours."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise TrustError(f"cannot create directory {path}: {err.strerror}; choose a writable location") from None
    return check_dir_trusted(path)
