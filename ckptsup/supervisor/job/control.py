"""Operator requests to a running job, through its run directory: `ckptsup save-now RUN_DIR` and
`ckptsup stop RUN_DIR [--no-save]` each write one request file into `<run_dir>/control/` (0700,
like the run dir; the file 0600, written whole and renamed in), and the supervisor takes it at
its next tick, acts, and acknowledges it in the restart log (`control`: id, command, outcome).

No listener: only who can write into the 0700 run directory — the job's user — can ask, and the
supervisor takes only regular files of its own uid, bounded in size and nesting (safe_io), with
a well-typed body. A request it cannot use is removed and refused with one line in the log.
"""

from __future__ import annotations

import enum
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ...rundir import atomic_write_json
from ...safe_io import read_json

CONTROL_DIR = "control"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REQUEST_MAX_BYTES = 4096
ACK_WAIT_S = 15.0   # how long the CLI waits for the supervisor's acknowledgement


class ControlCommand(enum.StrEnum):
    SAVE_NOW = "save_now"   # a checkpoint at the next step boundary
    STOP = "stop"           # checkpoint (unless save=False), stop, never requeue: exit CANCELLED
    REPLACE = "replace"     # move `node`'s ranks to a spare at the next checkpoint; exclude and drain it


class Outcome(enum.StrEnum):
    ACCEPTED = "accepted"
    REFUSED = "refused"


@dataclass(frozen=True, kw_only=True)
class ControlRequest:
    id: str
    command: ControlCommand
    save: bool = True
    requested: float = 0.0   # wall clock of the request
    node: str | None = None  # replace: the node to take out

    def to_json(self) -> dict:
        return {"id": self.id, "command": self.command.value, "save": self.save, "requested": self.requested,
                **({"node": self.node} if self.node is not None else {})}


@dataclass(frozen=True, kw_only=True)
class BadRequest:
    id: str
    why: str


def control_dir(run_dir: Path) -> Path:
    return run_dir / CONTROL_DIR


def submit(run_dir: Path, command: ControlCommand, *, save: bool = True, node: str | None = None) -> ControlRequest:
    """Write one request file (the caller checked that the run is live)."""
    directory = control_dir(run_dir)
    directory.mkdir(mode=0o700, exist_ok=True)
    request = ControlRequest(id=uuid.uuid4().hex[:12], command=command, save=save, requested=time.time(), node=node)
    atomic_write_json(directory / f"{request.id}.json", request.to_json())   # its temporary is a dot file: not taken
    return request


def parse(data: object, name: str) -> ControlRequest | BadRequest:
    if not isinstance(data, dict):
        return BadRequest(id=name, why="not a JSON object")
    rid, command, save = data.get("id"), data.get("command"), data.get("save", True)
    if not (isinstance(rid, str) and rid == name):
        return BadRequest(id=name, why="its id does not match its file name")
    try:
        cmd = ControlCommand(command if isinstance(command, str) else "")
    except ValueError:
        return BadRequest(id=name, why=f"unknown command {str(command)[:40]!r} (save_now, stop)")
    if not isinstance(save, bool):
        return BadRequest(id=name, why="`save` must be true or false")
    node = data.get("node")
    if cmd is ControlCommand.REPLACE and not (isinstance(node, str) and NODE_NAME.fullmatch(node)):
        return BadRequest(id=name, why="replace needs `node`: a node name (letters, digits, . _ -)")
    requested = data.get("requested", 0.0)
    ok_time = isinstance(requested, (int, float)) and not isinstance(requested, bool)
    return ControlRequest(id=rid, command=cmd, save=save, requested=float(requested) if ok_time else 0.0,
                          node=node if cmd is ControlCommand.REPLACE else None)


def take(run_dir: Path, seen: set[str]) -> list[ControlRequest | BadRequest]:
    """Every waiting request, oldest first, each removed as it is read; `seen` holds the names
    already answered (one that cannot be removed, a directory say, is answered once)."""
    directory = control_dir(run_dir)
    try:
        entries = sorted(os.scandir(directory), key=lambda e: _mtime(e))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[ControlRequest | BadRequest] = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        name = entry.name[:-len(".json")]
        if name in seen:
            continue
        seen.add(name)
        path = Path(entry.path)
        try:
            st = path.lstat()
            if st.st_uid != os.getuid():
                out.append(BadRequest(id=name, why=f"owned by uid {st.st_uid}, not the job's user"))
            else:
                out.append(parse(read_json(path, max_bytes=REQUEST_MAX_BYTES, what="control request",
                                           error=ConfigError), name))
        except ConfigError as err:
            out.append(BadRequest(id=name, why=str(err)[:200]))
        except OSError as err:
            out.append(BadRequest(id=name, why=err.strerror or str(err)))
        try:
            path.unlink()
        except OSError:
            pass
    return out


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0
