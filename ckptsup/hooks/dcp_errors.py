"""DCP reports a failure on any rank as one CheckpointException on every rank. It derives from
BaseException (not Exception), so it must be caught by name; these helpers reduce it to the one
line and the underlying error that ckptsup acts on."""

from __future__ import annotations

from typing import Any

from ..errors import CkptsupError


def checkpoint_exception_type() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def failure_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load may raise when storage, a peer or the data is bad."""
    return (checkpoint_exception_type(), CkptsupError, OSError, RuntimeError, ValueError, KeyError)


def root_cause(err: BaseException) -> BaseException:
    """The first rank's original exception inside a CheckpointException, else err itself."""
    failures: Any = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = sorted(failures)[0]
        pair = failures[rank]
        if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
            return pair[0]
    return err


def one_line(err: BaseException) -> str:
    cause = root_cause(err)
    prefix = ""
    failures: Any = getattr(err, "failures", None)
    if cause is not err and isinstance(failures, dict):
        prefix = f"rank {sorted(failures)[0]}: "
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    if not isinstance(cause, CkptsupError):
        first = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return (prefix + first)[:400]
