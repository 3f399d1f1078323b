"""The small error hierarchy. Every error a user or cluster can cause is one of these and is
rendered by the CLI as one line: what is wrong, and how to fix it. Never a traceback."""

from __future__ import annotations


# Every line break str.splitlines() splits on. A name quoted in a message (a file called "a\nb", a
# quoted TOML key, a path from the command line) must not split the line it is quoted in.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_ESCAPED_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in LINE_BREAKS})


def one_line(text: str) -> str:
    """`text` with every line break shown as its escape (\\n, \\x85, \\u2028 ...)."""
    return text.translate(_ESCAPED_BREAKS)


class CkptsupError(Exception):
    """Base of every expected error. `str(err)` is the one line shown to the user: line breaks
    in it (from whatever names it quotes) are shown escaped."""

    exit_code: int = 2  # usage/config class by default (never requeue); see env.ExitStatus

    def __str__(self) -> str:
        return one_line(super().__str__())


class ConfigError(CkptsupError):
    """A bad value in a TOML file, a flag or the environment."""


class SlurmCommandError(CkptsupError):
    """A Slurm command failed permanently (after retries of transient failures)."""

    exit_code = 1

    def __init__(self, cmd: list[str] | tuple[str, ...], rc: int, stderr: str):
        self.cmd = list(cmd)
        self.rc = rc
        self.stderr = stderr.strip()
        last = self.stderr.splitlines()[-1] if self.stderr else "(no stderr)"
        super().__init__(f"{' '.join(self.cmd[:3])} failed (rc={rc}): {last}")


class NotInAllocationError(CkptsupError):
    """A command that needs a Slurm allocation ran outside one."""


class CheckpointError(CkptsupError):
    """A checkpoint could not be written, read or trusted."""

    exit_code = 1


class ManifestError(CheckpointError):
    """A manifest is missing, unreadable, or names something outside its directory."""


class ValidationError(CheckpointError):
    """A checkpoint failed validation (size, hash, structure or test load)."""


class TrustError(CheckpointError):
    """A checkpoint directory is not safe to read (owner, permissions, symlinks)."""


class FencedError(CheckpointError):
    """A zombie attempt tried to commit after a newer attempt took over (fencing epoch)."""


class DevClusterError(CkptsupError):
    """The local Slurm cluster could not be started, stopped or changed."""

    exit_code = 1
