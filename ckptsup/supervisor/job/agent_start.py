"""Whether the job's agents can work at all, decided before the first launch costs anything more:
an agent's hello whose ckptsup cannot talk to this supervisor's (an image's older or newer ckptsup),
and a step whose agents never spoke because they could not start (no ckptsup or torch in the image,
no such interpreter, the runtime refusing the image). Both end the run in one line naming the fix:
retrying would fail the same way on every node, and excluding nodes for it would be wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

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
