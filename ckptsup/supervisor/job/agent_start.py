"""Whether the job's agents can work at all, decided before the first launch costs anything more:
an agent's hello whose ckptsup cannot talk to this supervisor's (an image's older or newer ckptsup),
and a step whose agents never spoke because they could not start (no ckptsup or torch in the image,
no such interpreter, the runtime refusing the image). Both end the run in one line naming the fix:
retrying would fail the same way on every node, and excluding nodes for it would be wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import messages
from ..._version import __version__
from ...textsafe import literal
from ...wire import WIRE_VERSION

TAIL_BYTES = 64 * 1024

# (a line of the agents' log, the fix it calls for); the first that matches, from the log's end back
_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"No module named '?ckptsup'?"),
     f"install ckptsup in the image (pip install ckptsup=={__version__}), or set [container] python to an "
     "interpreter that has it"),
    (re.compile(r"No module named '?torch'?"),
     "the container's interpreter has no torch: use an image with PyTorch, or set [container] python to one that has it"),
    # slurmstepd's execve, a shell's "not found", runc's `exec: "PATH": stat PATH: no such file`
    (re.compile(r"execve\(\): .*No such file|: not found$|No such file or directory.*python|python[0-9.]*: No such file"
                r"|exec: .*: no such file or directory"),
     "the interpreter named by [container] python is not in the container: set it to the image's python "
     "(e.g. /usr/bin/python3)"),
    (re.compile(r"^ckptsup: error: "), ""),
    (re.compile(r"pyxis:|enroot|\[ERROR\]"),
     "pyxis/enroot could not start the image: check the image's name and that the nodes can pull it"),
    (re.compile(r"^FATAL: |apptainer"),
     "apptainer could not start the image: check the image's path and the binds"),
    (re.compile(r"oci|runc|container", re.I),
     "Slurm's OCI runtime could not start the bundle: check the bundle and oci.conf (docs/containers.md)"),
    (re.compile(r"^\w+(Error|Exception): "), ""),
)


def start_failure(log_text: str) -> str | None:
    """The reason the agents' log gives for agents that never started, with its fix; None when it
    names none (a node's trouble, say: then the usual health checks decide)."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for pattern, fix in _CAUSES:
        for line in reversed(lines):
            if pattern.search(line):
                said = line[:300]
                return f"{said}: {fix}" if fix else said
    return None


def read_start_failure(log_path: Path) -> str | None:
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(fh.tell() - TAIL_BYTES, 0))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    return start_failure(text)


def hello_problem(node: str, hello: messages.AgentHello) -> str | None:
    """One line when this agent cannot talk with this supervisor."""
    if hello.wire == WIRE_VERSION:
        return None
    return literal(f"the agent on {node} runs ckptsup {hello.version} (wire {hello.wire}), this supervisor "
                   f"ckptsup {__version__} (wire {WIRE_VERSION}): they cannot work together; install ckptsup=="
                   f"{__version__} in the image (or run `ckptsup launch` from ckptsup {hello.version})")


def version_note(node: str, hello: messages.AgentHello) -> str | None:
    """One warning when the versions differ but speak the same wire."""
    if hello.version == __version__:
        return None
    return literal(f"ckptsup: the agent on {node} runs ckptsup {hello.version}, this supervisor {__version__}; "
                   f"they speak the same wire ({WIRE_VERSION}), so the run goes on")


@dataclass(frozen=True, kw_only=True)
class HelloSeen:
    """What one agent's hello means for the loop (AgentStarts.hello)."""

    problem: str | None      # the run ends with this line: the agent cannot talk with this supervisor
    note: str | None         # a version warning, said once per other version
    all_up: bool             # it was the last agent a launch in containers waited for (Marks.agents_up)
    fields: dict[str, Any]   # the agent_started event's


class AgentStarts:
    """The agents' start as this supervisor has seen it: whether any agent of it ever spoke (until
    one does, a step that ends with a reason in its log ends the run), the other ckptsup versions
    already warned about, and the agents a launch in containers still waits for."""

    def __init__(self) -> None:
        self.heard = False              # an agent of this supervisor said hello: the agents can start at all
        self.versions_noted: set[str] = set()
        self.awaiting: set[str] = set()   # a launch's new agents in containers, until each says hello

    def hello(self, node: str, hello: messages.AgentHello, *, recv: float, started: float | None) -> HelloSeen:
        """An agent's first frame, received at `recv`, of a step started at `started` (None: not
        known): its container phase is the step's srun to the agent's process."""
        problem = hello_problem(node, hello)
        if problem is not None:
            return HelloSeen(problem=problem, note=None, all_up=False, fields={})
        note = version_note(node, hello)
        if note is not None and hello.version in self.versions_noted:
            note = None
        elif note is not None:
            self.versions_noted.add(hello.version)
        self.heard = True
        all_up = False
        if node in self.awaiting:
            self.awaiting.discard(node)
            all_up = not self.awaiting
        container_s = None if started is None else round(max(recv - started - hello.age_s, 0.0), 3)
        fields = dict(node=node, version=hello.version, container=hello.container, pid=hello.pid, pid_ns=hello.pid_ns,
                      node_from=hello.node_from, shm_free=hello.shm_free, container_s=container_s,
                      python_s=round(hello.age_s, 3))
        return HelloSeen(problem=None, note=note, all_up=all_up, fields=fields)

    def never_started(self, *, rc: int | None, log: str) -> str | None:
        """A step's end before any agent of this supervisor spoke: if their log says why (no
        ckptsup in the image, no such interpreter, the runtime refused), every node would fail the
        same — the line that ends the run; else None (the usual failure handling decides)."""
        if self.heard or not log:
            return None
        why = read_start_failure(Path(log))
        return None if why is None else f"the agents could not start (rc={rc}; {log}): {why}"
