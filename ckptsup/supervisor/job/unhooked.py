"""What the supervisor can know of a script that does not use ckptsup's hooks (docs/drop-in.md):
whether a script uses them at all, whether its own checkpoint directory moved, and the words
for each supervision level."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...config import SupervisorConfig
from .observations import SupervisionLevel

SOURCE_BYTES = 1 << 20   # a script's first MiB is read to see whether it uses ckptsup
DIR_ENTRIES = 100_000
MTIME_SLACK_S = 0.05    # progress_dir entries looked at (a huge directory costs a bounded scan)


# an import of ckptsup (attach, heartbeat, a framework callback all need one), indented or not;
# a mere mention — "# run with ckptsup launch" in a comment — is no use of the hooks
_IMPORTS_CKPTSUP = re.compile(rb"^[ \t]*(?:from[ \t]+ckptsup\b|import[ \t]+[^\n#]*\bckptsup\b)"
                              rb"|(?:import_module|__import__)\(\s*[\"']ckptsup\b", re.M)


def uses_hooks(script: str, *, module: bool = False, no_python: bool = False) -> bool:
    """Whether the script imports ckptsup (attach, heartbeat, a callback): then a rank that does
    not say hello within the init allowance hangs. A module (-m) or an executable is not read:
    it is watched at the process level until a rank says hello."""
    if module or no_python:
        return False
    try:
        with open(script, "rb") as f:
            return _IMPORTS_CKPTSUP.search(f.read(SOURCE_BYTES)) is not None
    except OSError:
        return False


def progress_dir_newer(progress_dir: str, cwd: str, *, since_wall: float) -> bool | None:
    """Whether `progress_dir` (relative to the job's cwd) has an entry modified after
    `since_wall`; None when no progress_dir is configured or it cannot be read."""
    if not progress_dir:
        return None
    path = Path(cwd, progress_dir)
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= DIR_ENTRIES:
                    break
                try:
                    # file times come from a coarse kernel clock (a few ms behind time.time())
                    if entry.stat(follow_symlinks=False).st_mtime > since_wall - MTIME_SLACK_S:
                        return True
                except OSError:
                    continue
    except OSError:
        return None
    return False


def level_detail(level: SupervisionLevel, config: SupervisorConfig) -> str:
    if level is SupervisionLevel.HOOKS:
        return "ckptsup hooks: steps, phases, checkpoints and stops at a step"
    if level is SupervisionLevel.HEARTBEAT:
        return "heartbeat-only hooks: steps and NaN checks; the script checkpoints itself"
    if level is SupervisionLevel.PROGRESS:
        return f"progress lines (supervisor.progress_pattern = {config.progress_pattern!r}): hang detection by their steps"
    return (f"no rank said hello within supervisor.init_timeout_s={config.init_timeout_s:g}s and no line matched "
            f"supervisor.progress_pattern = {config.progress_pattern!r}: supervised at the process level "
            f"(crashes, node deaths, exits; no hang detection)")
