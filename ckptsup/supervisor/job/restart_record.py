"""The restart's record (`restart_done`, docs/contracts.md): what a recovery cost, from the failure's
detection to the first step after it. Its fields gather on the way — the decision's path, kind,
backoff and nodes when the loop restarts (`begin`), whether every node's ranks started warm (their
`launched`), where the checkpoint's files came from (the ranks' `checkpoint_loaded`) — and the
record is complete at the attempt's first step (`done`), with the phase breakdown (attempt.Marks)
and the load phase split by source. Plain state, no effects: the loop emits what `done` returns.
"""

from __future__ import annotations

from typing import Any, Sequence

from .observations import FailureKind, RecoveryPath


def load_by_source(load_s: Any, files: dict[str, Any]) -> dict[str, float]:
    """The restart's load phase split by where its files came from, in proportion to the files
    read from each source (checkpoint_loaded's files_by_source); {} without a load. Pure."""
    counts = {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, (int, float)) and v > 0}
    total = sum(counts.values())
    if not isinstance(load_s, (int, float)) or not total:
        return {}
    return {k: round(load_s * v / total, 4) for k, v in sorted(counts.items())}


class RestartRecord:
    """The restart under way (None between restarts) and the current launch's loaded files."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None   # restart_done's fields so far, with its `detect` time
        self.loaded_files: dict[str, Any] = {}        # the attempt's checkpoint_loaded files_by_source

    def begin(self, *, detect: float | None, path: RecoveryPath, kind: FailureKind, backoff_s: float,
              nodes: Sequence[str]) -> None:
        """The loop restarts in the allocation after a failure detected at `detect` (clock)."""
        self.pending = {"detect": detect, "path": path.value, "kind": kind.value, "backoff_s": backoff_s,
                        "nodes": list(nodes)}

    def new_launch(self) -> None:
        self.loaded_files = {}

    def launched(self, warm: bool | None) -> None:
        """A node of the restarted attempt launched its ranks: the restart was warm only if every
        node's ranks started in warm interpreters."""
        if self.pending is not None:
            self.pending["warm"] = self.pending.get("warm", True) and warm is True

    def loaded(self, files_by_source: dict[str, Any]) -> None:
        self.loaded_files = files_by_source

    def done(self, *, recv: float, resume_step: int | None, phases: dict[str, float]) -> dict[str, Any] | None:
        """The restart_done event's fields at the attempt's first step (received at `recv`); None
        when no restart was under way (a start-up's first launch). Ends the record."""
        if self.pending is None:
            return None
        restart, self.pending = self.pending, None
        restart_s = recv - restart.pop("detect")
        return {"restart_s": round(restart_s, 4), "resume_step": resume_step, "phases": phases,
                "load_by_source": load_by_source(phases.get("load_s"), self.loaded_files), **restart}
