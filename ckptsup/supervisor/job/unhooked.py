"""What the supervisor can know of a script that does not use ckptsup's hooks (docs/drop-in.md):
whether a script uses them at all, whether its own checkpoint directory moved, where a failed
attempt started and whether it progressed (`failed_attempt`), and the words for each supervision
level."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from ...config import SupervisorConfig
from .attempt import AttemptTracker
from .observations import AttemptResult, Failure, Outcome, SupervisionLevel

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


def failed_attempt(tracker: AttemptTracker, *, attempt: int, failure: Failure,
                   progressed: Callable[[], bool]) -> AttemptResult:
    """The history entry of an attempt that just failed. A hooked one (or one expected to be)
    started at its resume step. An attempt without hooks starts at its first progress line (the
    script resumes itself: ckptsup does not know where); one without any step progressed when
    `progressed()` says so (asked only then: it may read the disk)."""
    level = tracker.level or SupervisionLevel.PROCESS
    if level in (SupervisionLevel.HOOKS, SupervisionLevel.HEARTBEAT) or tracker.expect_hello:
        return AttemptResult(attempt=attempt, outcome=Outcome.FAILED, start_step=tracker.resume_step,
                             last_step=tracker.last_step, failure=failure, level=level)
    if tracker.first_step is not None:
        return AttemptResult(attempt=attempt, outcome=Outcome.FAILED, start_step=tracker.first_step,
                             last_step=tracker.last_step, failure=failure, level=level)
    return AttemptResult(attempt=attempt, outcome=Outcome.FAILED, start_step=0, last_step=None,
                         failure=failure, level=level, progress=progressed())


def stepless_progress(*, ran_s: float, init_timeout_s: float, newer: bool | None) -> bool:
    """Whether an attempt without any step progressed: `newer` (a newer entry in progress_dir, a
    framework's own save) when it is known, else whether it outlived the init allowance (a script
    that dies on start-up does not). Pure."""
    return newer if newer is not None else ran_s > init_timeout_s


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
