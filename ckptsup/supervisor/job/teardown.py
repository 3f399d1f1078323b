"""The attempt's teardown, after its ranks finished (docs/architecture.md §Every wait has an end, the
teardown bound): rank processes that did not exit within `[supervisor] exit_grace_s` (a stuck
destroy_process_group, a non-daemon thread) are killed, named in `teardown_hang`, and their nodes
end as if torchrun had exited 0 there — the final checkpoint was committed before the bye, so the
run completes; a torchrun that exited non-zero after every rank on its node finished is a
`teardown_error`, said and not restarted. The tracker detects both (attempt.py); this module says
them and carries the kill out through the loop's kill window.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...events import Event
from ... import console
from .attempt import AttemptTracker
from .kill_window import KillWindow
from .observations import Failure
from .operating import Emit


def survivors_in_order(survivors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The processes the `report` acks named, by rank, then node. Pure."""
    return sorted(survivors, key=lambda e: (e.get("rank", -1), e["node"]))


def hang_line(survivors: Sequence[dict[str, Any]], nodes: Sequence[str], exit_grace_s: float) -> str:
    """The console line of a teardown hang: the processes killed, or the nodes' torchrun when no ack
    named any. Pure."""
    named = ", ".join(f"rank {e.get('rank')} on {e['node']} (pid {e.get('pid')})" for e in survivors) or \
        f"torchrun on {', '.join(nodes)}"
    return (f"ckptsup: the ranks finished, but {named} had not exited {exit_grace_s:g}s later "
            "([supervisor] exit_grace_s): killed; the run counts as finished")


def error_line(error: dict[str, Any]) -> str:
    """The console line of a teardown error (the tracker's teardown_errors entry). Pure."""
    return (f"ckptsup: every rank on {error['node']} finished, then torchrun exited rc={error['rc']}: "
            "a crash in process teardown; nothing is lost, not restarting")


def end_teardown(tracker: AttemptTracker, *, kills: KillWindow, emit: Emit, clock: Callable[[], float],
                 exit_grace_s: float) -> Failure | None:
    """Past the teardown deadline (`AttemptTracker.teardown_hang`): kill the processes left (the
    agents SIGKILL the whole tree, stopped processes included) with a `report` of what was still
    alive, record `teardown_hang`, and end those nodes as if torchrun had exited 0. The tracker's
    verdict on the last node's end (normally none: the run is complete) is returned."""
    hang = tracker.teardown_hang(clock())
    if hang is None:
        return None
    acks = kills.kill(hang.nodes, wait_for=hang.nodes, report=True)
    survivors = survivors_in_order(acks.survivors if acks is not None else [])
    emit(Event.TEARDOWN_HANG, ranks=survivors, nodes=list(hang.nodes), exit_grace_s=exit_grace_s,
         waited_s=round(hang.waited_s, 3))
    console.warning(hang_line(survivors, hang.nodes, exit_grace_s))
    failure = None
    for node in hang.nodes:
        failure = failure or tracker.teardown_done(node)
    return failure


def report_errors(tracker: AttemptTracker, emit: Emit) -> None:
    """Say every teardown error the tracker found since the last call (each once)."""
    while tracker.teardown_errors:
        error = tracker.teardown_errors.pop(0)
        console.warning(error_line(error))
        emit(Event.TEARDOWN_ERROR, **error)
