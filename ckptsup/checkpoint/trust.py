"""The trust boundary (issue 3, item 8). A checkpoint directory is treated as code: DCP's
`.metadata` is a pickle. So before anything in it is read we require that the directory is owned
by us, not writable by group or others, and holds no symlinks, device files or hard links to files
elsewhere. Each refusal is one line with the command that fixes it.

Two kinds of refusal (docs/checkpoint-core.md §Trust is not content):
- `OwnerModeError`: who owns, may write or may read it (owner, mode, permissions). Fixed in place
  with chmod/chown; says nothing about the bytes, so it never quarantines a checkpoint: the
  supervisor skips that checkpoint and tries an older one.
- plain `TrustError`: what the directory holds (a symlink, a special file, a hard link, not a
  directory). That is structure, i.e. content: validation fails and the checkpoint is quarantined.
`CheckpointDirUntrusted` is any of them on the checkpoint directory itself: nothing there can be
resumed from or saved, so the supervisor stops with the fix (exit status USAGE, never requeued).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Collection

from ..env import ExitStatus
from ..errors import TrustError
from ..safe_io import encodable


class OwnerModeError(TrustError):
    """A checkpoint is owned by someone else, or writable by group/others, or unreadable to us:
    a permission problem with a one-line fix (chmod/chown), never a reason to quarantine it."""


class CheckpointDirUntrusted(TrustError):
    """The checkpoint directory itself fails the trust check: a usage/config problem."""

    exit_code = int(ExitStatus.USAGE)


def _describe_mode(mode: int) -> str:
    return oct(stat.S_IMODE(mode))


def check_dir_trusted(path: str | os.PathLike[str], *, recursive: bool = False, uid: int | None = None,
                      skip: Collection[str] = ()) -> Path:
    """Refuse `path` unless it is a real directory owned by the current user and not writable by
    group or others; refuse symlinks among its entries (and, with recursive, anywhere below, plus
    foreign-owned or group/other-writable entries, special files and multiply-linked files).
    Entries of `path` named in `skip` are not looked at (validation.json: a record ckptsup only
    ever replaces by rename and reads with O_NOFOLLOW, never content). `uid` defaults to the
    current user. Returns the path. Raises OwnerModeError (owner, mode, permissions) or
    TrustError (symlinks, special files, hard links, not a directory)."""
    uid = os.getuid() if uid is None else uid
    path = encodable(path, what="checkpoint path", error=TrustError)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TrustError(f"{path} does not exist") from None
    except OSError as err:
        raise OwnerModeError(f"cannot look at {path}: {err.strerror}; check the permissions of its parent directories") from None
    if stat.S_ISLNK(st.st_mode):
        raise TrustError(f"{path} is a symlink; point ckptsup at the real directory {os.path.realpath(path)} after checking it")
    if not stat.S_ISDIR(st.st_mode):
        raise TrustError(f"{path} is not a directory")
    _check_owner_mode(path, st, uid)
    _check_entries(path, recursive=recursive, uid=uid, skip=frozenset(skip))
    return path


def _check_owner_mode(path: Path, st: os.stat_result, uid: int) -> None:
    """Owner and mode of one entry; and, for anyone but root (who reads regardless of the mode),
    that its owner may read it: an unreadable file is a permission problem, not corrupt content."""
    if st.st_uid != uid:
        raise OwnerModeError(f"{path} is owned by uid {st.st_uid}, not you (uid {uid}); a checkpoint from another user could run code on load. "
                             f"If you trust it: `chown -R {uid} {path}` (as its owner/root) or copy it into a directory you own")
    if st.st_mode & 0o022:
        raise OwnerModeError(f"{path} is writable by group or others (mode {_describe_mode(st.st_mode)}); run `chmod -R go-w {path}`")
    if os.geteuid() != 0 and uid == os.geteuid():
        needed = stat.S_IRUSR | stat.S_IXUSR if stat.S_ISDIR(st.st_mode) else stat.S_IRUSR
        if st.st_mode & needed != needed:
            fix = "u+rx" if stat.S_ISDIR(st.st_mode) else "u+r"
            raise OwnerModeError(f"{path} is not readable by you (mode {_describe_mode(st.st_mode)}); run `chmod {fix} {path}`")


def _check_entries(top: Path, *, recursive: bool, uid: int, skip: frozenset[str] = frozenset()) -> None:
    try:
        entries = os.scandir(top)
    except OSError as err:
        raise OwnerModeError(f"cannot list {top}: {err.strerror}; give yourself read access (`chmod u+rx {top}`) "
                             f"or run as its owner") from None
    with entries:
        for entry in entries:
            if entry.name in skip:
                continue
            full = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing: a concurrent validator's record being renamed into place
            except OSError as err:
                raise OwnerModeError(f"cannot look at {full}: {err.strerror}; give yourself access (`chmod u+rx {top}`)") from None
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


def check_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """The checkpoint directory itself (not the checkpoints in it): False when it does not exist
    yet (nothing to resume from; the first save creates it), True when it passes the trust check,
    else CheckpointDirUntrusted with the fix. Nothing can be resumed or saved in an untrusted one
    (every save's make_tmp_dir refuses it too), so the run must stop rather than start over."""
    try:
        check_dir_trusted(path)
    except TrustError as err:
        try:
            present = os.path.lexists(path)
        except ValueError:
            present = True
        if not present:
            return False
        raise CheckpointDirUntrusted(f"the checkpoint directory cannot be used: {err}") from None
    return True


def private_mkdir(path: Path) -> Path:
    """Create a directory 0700 (explicit mode, not umask) and check what exists is ours."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise TrustError(f"cannot create directory {path}: {err.strerror}; choose a writable location") from None
    return check_dir_trusted(path)
