"""The supervisor's watch over external step folders (checkpoint/external.py): every POLL_S it
lists `[checkpoint] external_dir` (names and sizes; it never reads a file there), forgets the
manifests of folders the framework purged, and asks the agents to hash the newest complete folder
that has no manifest yet: each node the files of its own ranks, global rank 0's node `.metadata`
and the rest. When every file of the listing is answered for, with the listed size, the manifest
is written (<run_dir>/external/, 0600) and `checkpoint_committed` (`external`: the folder) is
emitted; every `[checkpoint] test_load_every`-th of them gets a level-3 test load on global rank 0's
node (supervisor/node/external_testload.py), and a folder that fails it is moved out of the framework's
folder. One request at a time; a request that is not answered within HASH_TIMEOUT_S, or whose
files changed under it, is asked again later (MAX_TRIES in all)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ...checkpoint import external as ext
from ...config import Config
from ...errors import CkptsupError
from ...events import Event
from ... import console
from ...messages import ExtHash, ExtHashed
from ..node.external_agent import MAX_FILES_PER_FRAME

POLL_S = 2.0
HASH_TIMEOUT_S = 300.0
TESTLOAD_TIMEOUT_S = 600.0
MAX_TRIES = 3

Send = Callable[..., bool]          # AgentSet.send(msg, nodes=[...])
Emit = Callable[..., Any]


@dataclass(kw_only=True)
class Pending:
    request: str
    folder: ext.StepFolder
    listed: dict[str, int]
    waiting: set[tuple[str, int]]
    deadline: float
    started: float
    hashed: dict[str, tuple[int, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    testload: bool = False


def resolve_dir(config: Config, cwd: str) -> Path | None:
    configured = config.checkpoint.external_dir
    return Path(os.path.abspath(os.path.join(cwd, configured))) if configured else None


def send_requests(send: Send, request: str, folder: ext.StepFolder, assignment: dict[str, list[str]],
                  algorithm: str, nodes_with_agent: Callable[[str], bool]) -> tuple[set[tuple[str, int]], list[str]]:
    """`ext_hash` frames (MAX_FILES_PER_FRAME files each) to the agents of the assigned nodes:
    ({(node, part)} sent, the files of nodes without a live agent or whose send failed)."""
    waiting: set[tuple[str, int]] = set()
    unsent: list[str] = []
    part = itertools.count()
    for node, names in assignment.items():
        for i in range(0, len(names), MAX_FILES_PER_FRAME):
            chunk = names[i:i + MAX_FILES_PER_FRAME]
            number = next(part)
            body = ExtHash(request=request, part=number, dir=str(folder.path.parent), folder=folder.name,
                           files=tuple(chunk), algorithm=algorithm)
            if nodes_with_agent(node) and send(body, nodes=[node]):
                waiting.add((node, number))
            else:
                unsent.extend(chunk)
    return waiting, unsent


def take_answer(body: ExtHashed, into: dict[str, tuple[int, str]], problems: list[str]) -> None:
    """Fold one `ext_hashed` body in (each entry's types checked: it comes from an agent, signed,
    but a bug must not become a manifest)."""
    for entry in body.files:
        if not isinstance(entry, dict):
            continue
        path, size, digest = entry.get("path"), entry.get("size"), entry.get("hash")
        if (isinstance(path, str) and ext.name_ok(path) and isinstance(size, int) and not isinstance(size, bool)
                and size >= 0 and isinstance(digest, str)):
            into[path] = (size, digest)
    problems.extend(p for p in body.problems if isinstance(p, str))


class ExternalCheckpoints:
    def __init__(self, *, config: Config, directory: Path, run_dir: Path, emit: Emit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = directory
        self.pattern = ext.compile_pattern(config.checkpoint.external_pattern)
        self.algorithm = config.checkpoint.hash_algorithm
        self.test_load_every = config.checkpoint.test_load_every   # every Nth manifest gets a test load; 0 = none
        self.commits = 0
        self.testload_due: ext.StepFolder | None = None
        self.run_dir = run_dir
        self.emit = emit
        self.clock = clock
        self.pending: Pending | None = None
        self.polled = -float("inf")
        self.tries: dict[str, int] = {}
        self.said: set[str] = set()
        self.counter = itertools.count(1)

    def new_request_id(self) -> str:
        return f"x{os.getpid()}-{next(self.counter)}"

    def folders(self) -> list[ext.StepFolder]:
        return ext.list_folders(self.dir, self.pattern)

    def has_manifest(self, name: str) -> bool:
        try:
            return os.path.lexists(ext.manifest_path(self.run_dir, name))
        except ext.ExternalError:
            return True   # a name we cannot keep a manifest for: never asked about

    # ---- while an attempt runs ----------------------------------------------------------------
    def poll(self, *, send: Send, has_agent: Callable[[str], bool], nodes: Sequence[str], nproc_per_node: int,
             ids: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.polled < POLL_S:
            return
        self.polled = now
        folders = self.folders()
        ext.forget_vanished(self.run_dir, (f.name for f in folders))
        if self.pending is not None:
            if now < self.pending.deadline and os.path.lexists(self.pending.folder.path):
                return
            self._failed(self.pending.folder.name, "no answer in time" if now >= self.pending.deadline else None)
            self.pending = None
        due, self.testload_due = self.testload_due, None
        if due is not None and os.path.lexists(due.path) and nodes and has_agent(nodes[0]):
            self._request_testload(due, send=send, node=nodes[0])
            return
        for folder in reversed(folders):
            if self.tries.get(folder.name, 0) >= MAX_TRIES or self.has_manifest(folder.name):
                continue
            if not ext.is_complete(folder.path):
                continue   # a save under way (or one that never finished: the next resume moves it aside)
            self._request(folder, send=send, has_agent=has_agent, nodes=nodes, nproc_per_node=nproc_per_node,
                          ids=ids)
            return

    def _request(self, folder: ext.StepFolder, *, send: Send, has_agent: Callable[[str], bool], nodes: Sequence[str],
                 nproc_per_node: int, ids: dict[str, Any]) -> None:
        listed, problems = ext.listing(folder.path)
        if problems:
            self._failed(folder.name, problems[0], final=True)
            return
        request = self.new_request_id()
        assignment = ext.assign_files(listed, nodes, nproc_per_node)
        waiting, unsent = send_requests(send, request, folder, assignment, self.algorithm, has_agent)
        if unsent:
            self._failed(folder.name, None)   # an agent just went away: asked again at a later poll
            return
        now = self.clock()
        self.pending = Pending(request=request, folder=folder, listed=listed, waiting=waiting,
                               deadline=now + HASH_TIMEOUT_S, started=now)
        self.ids = ids

    def _request_testload(self, folder: ext.StepFolder, *, send: Send, node: str) -> None:
        request = self.new_request_id()
        body = ExtHash(request=request, part=0, dir=str(folder.path.parent), folder=folder.name, files=(),
                       algorithm=self.algorithm, testload=str(ext.manifest_path(self.run_dir, folder.name)))
        if send(body, nodes=[node]):
            now = self.clock()
            self.pending = Pending(request=request, folder=folder, listed={}, waiting={(node, 0)},
                                   deadline=now + HASH_TIMEOUT_S + TESTLOAD_TIMEOUT_S, started=now, testload=True)

    def _tested(self, pending: Pending, result: Any) -> None:
        """A test load's verdict: validated at level 3, or moved out of the framework's folder."""
        folder = pending.folder
        if not isinstance(result, dict) or not os.path.lexists(folder.path):
            return
        detail = str(result.get("detail", ""))[:400]
        duration = result.get("duration_s")
        if result.get("ok") is True:
            self.emit(Event.CHECKPOINT_VALIDATED, step=folder.step, level=3, external=folder.name, duration_s=duration)
            return
        try:
            manifest = ext.load_manifest(self.run_dir, folder.name)
        except ext.ExternalError:
            manifest = None
        if manifest is None or any(p.endswith((": missing", " is gone")) for p in ext.check_against(folder.path, manifest)):
            return   # the framework purged it under the test load (keep_latest_k): not a verdict on its bytes
        try:
            where = str(ext.move_aside(self.dir, folder.name, f"test load: {detail}", run_dir=self.run_dir))
        except ext.ExternalError as err:
            where = ""
            self._say(str(err))
        self.emit(Event.CHECKPOINT_REJECTED, step=folder.step, level=3, external=folder.name, reason=detail,
                  quarantined=where)
        console.warning(f"ckptsup: {folder.name} failed its test load ({detail}); moved to {where or 'nowhere'}")

    def on_answer(self, node: str, body: ExtHashed) -> None:
        pending = self.pending
        if pending is None or body.request != pending.request:
            return   # a resume's answer, or one of a request given up on
        key = (node, body.part)
        if key not in pending.waiting:
            return
        pending.waiting.discard(key)
        take_answer(body, pending.hashed, pending.problems)
        if not pending.waiting:
            self.pending = None
            if pending.testload:
                self._tested(pending, body.testload)
            else:
                self._finish(pending)

    def _finish(self, pending: Pending) -> None:
        folder = pending.folder
        if not os.path.lexists(folder.path):
            return   # purged by the framework (keep_latest_k) while it was hashed: nothing to keep, nothing to say
        sizes = {name: size for name, (size, _) in pending.hashed.items()}
        if pending.problems or sizes != pending.listed:
            self._failed(folder.name, pending.problems[0] if pending.problems else "its files changed while hashed")
            return
        ids = getattr(self, "ids", {})
        manifest = ext.build_manifest(folder, pending.hashed, algorithm=self.algorithm, external_dir=self.dir,
                                      job_id=str(ids.get("job_id", "")), attempt=int(ids.get("attempt", 0)),
                                      epoch=int(ids.get("epoch", 0)), world_size=int(ids.get("world_size", 1)))
        try:
            ext.write_manifest(self.run_dir, folder.name, manifest)
        except (CkptsupError, OSError) as err:
            self._say(f"cannot write the manifest of {folder.name}: {getattr(err, 'strerror', None) or err}")
            return
        self.emit(Event.CHECKPOINT_COMMITTED, step=folder.step, external=folder.name, path=str(folder.path),
                  bytes=manifest.total_bytes, files=len(manifest.files),
                  hash_s=round(self.clock() - pending.started, 4))
        self.commits += 1
        if self.test_load_every and self.commits % self.test_load_every == 0:
            self.testload_due = folder   # at the next poll, on global rank 0's node

    def _failed(self, name: str, why: str | None, *, final: bool = False) -> None:
        self.tries[name] = MAX_TRIES if final else self.tries.get(name, 0) + 1
        if why and self.tries[name] >= MAX_TRIES:
            self._say(f"external step folder {name} has no manifest yet ({why}); a resume that reaches it hashes "
                      "it then")

    def _say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            console.warning(f"ckptsup: {line}")
