"""Before each launch: the newest external step folder that validates is the one the framework's
own "load latest" must find, so every newer folder that fails (or never finished: no `.metadata`)
is moved out of `external_dir` (checkpoint/external.py `move_aside`), never renamed in place:
torchtitan matches `step-(\\d+)` anywhere in a name.

The check of a candidate, newest first: its manifest (none yet: a save the crash interrupted
before the agents hashed it is hashed now and adopted), trust, names and sizes (a stat each),
then every file re-hashed and compared with the manifest, each node's agent hashing its own
ranks' files. Files of a node without a live agent (the first launch of a supervisor, a node
path's new node) are hashed on the supervisor's host: only for the one folder about to be loaded,
only then. One `ExternalResume` per supervisor, made in its constructor with what it uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from ...checkpoint import external as ext
from ...checkpoint.manifest import Manifest
from ...errors import CkptsupError
from ...events import Event
from ... import console
from ...messages import ExtHash, ExtHashed
from .agent_step import Message
from .external_watch import ExternalCheckpoints, send_requests, take_answer


class Emit(Protocol):
    def __call__(self, name: Event, **fields: Any) -> None: ...


class Agents(Protocol):
    """What it asks of the supervisor's AgentSet."""

    def send(self, msg: ExtHash, *, nodes: list[str]) -> bool: ...
    def has_agent(self, node: str) -> bool: ...


# the supervisor's wait for agents' answers (loop.Supervisor._await: done, deadline, until)
Await = Callable[..., bool]


class ExternalResume:
    """The pre-launch check of a framework's own step folders ([checkpoint] external_dir)."""

    def __init__(self, *, watch: ExternalCheckpoints, agents: Agents, run_dir: Path, job_id: str,
                 nproc_per_node: int, load_timeout_s: float, clock: Callable[[], float], emit: Emit,
                 await_answers: Await) -> None:
        self.watch = watch
        self.agents = agents
        self.run_dir = run_dir
        self.job_id = job_id
        self.nproc_per_node = nproc_per_node
        self.load_timeout_s = load_timeout_s
        self.clock = clock
        self.emit = emit
        self.await_answers = await_answers

    def before_launch(self, nodes: tuple[str, ...], *, attempt: int, epoch: int) -> None:
        """Move every newer folder that fails out of the way of the one that validates."""
        watch = self.watch
        watch.pending = None   # a commit-time request of the attempt that ended: its answers are ignored
        moved: list[str] = []
        for folder in reversed(watch.folders()):
            start = self.clock()
            problems, checked, manifest = self._check(folder, nodes, attempt=attempt, epoch=epoch)
            if problems:
                reason = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                try:
                    where = str(ext.move_aside(watch.dir, folder.name, reason, run_dir=self.run_dir))
                except CkptsupError as err:
                    self.emit(Event.CHECKPOINT_REJECTED, step=folder.step, level=1, external=folder.name,
                              reason=reason[:400], quarantined="")
                    raise CkptsupError(f"external step folder {folder.name} is bad ({reason[:200]}) and {err}") from None
                self.emit(Event.CHECKPOINT_REJECTED, step=folder.step, level=1, external=folder.name,
                          reason=reason[:400], quarantined=where)
                console.warning(f"ckptsup: moved {folder.name} out of {watch.dir} to {where}: {reason[:300]}")
                moved.append(folder.name)
                continue
            assert manifest is not None
            self.emit(Event.CHECKPOINT_VALIDATED, step=folder.step, level=1, external=folder.name, checked=checked,
                      duration_s=round(self.clock() - start, 4))
            self.emit(Event.EXTERNAL_RESUME, folder=folder.name, step=folder.step, checked=checked, moved_aside=moved)
            console.info(f"ckptsup: the framework resumes from {folder.name} (validated: {checked})")
            return
        if moved:
            self.emit(Event.EXTERNAL_RESUME, folder=None, step=None, checked="", moved_aside=moved)
            console.warning(f"ckptsup: no external step folder in {watch.dir} validates: the framework starts fresh")

    def _check(self, folder: ext.StepFolder, nodes: tuple[str, ...], *, attempt: int,
               epoch: int) -> tuple[list[str], str, Manifest | None]:
        """(problems, how it was checked, its manifest)."""
        watch = self.watch
        if not ext.is_complete(folder.path):
            return [f"{folder.name} has no .metadata: a save that did not finish"], "", None
        try:
            manifest = ext.load_manifest(self.run_dir, folder.name)
        except ext.ExternalError as err:
            return [str(err)], "", None
        adopted = manifest is None
        if manifest is None:   # saved, then the crash came before the agents hashed it
            listed, problems = ext.listing(folder.path)
            if problems:
                return problems, "", None
            hashed, problems = self._hash(folder, sorted(listed), nodes)
            if problems:
                return problems, "", None
            if {n: s for n, (s, _) in hashed.items()} != listed:
                return [f"{folder.name}: its files changed while they were hashed"], "", None
            manifest = ext.build_manifest(folder, hashed, algorithm=watch.algorithm, external_dir=watch.dir,
                                          job_id=self.job_id, attempt=attempt, epoch=epoch,
                                          world_size=len(nodes) * self.nproc_per_node)
            ext.write_manifest(self.run_dir, folder.name, manifest)
            self.emit(Event.CHECKPOINT_COMMITTED, step=folder.step, external=folder.name, path=str(folder.path),
                      bytes=manifest.total_bytes, files=len(manifest.files), adopted=True)
        problems = ext.check_against(folder.path, manifest)
        if problems:
            return problems, "", manifest
        if adopted:
            return [], "hashes (adopted at resume)", manifest
        hashed, problems = self._hash(folder, [f.path for f in manifest.files], nodes)
        problems = problems + ext.compare_hashes(folder.name, manifest, hashed)
        missing = sorted(set(manifest.file_map()) - set(hashed))
        if not problems and missing:
            problems = [f"{folder.name}/{missing[0]}: not hashed"]
        return problems, "hashes", manifest

    def _hash(self, folder: ext.StepFolder, names: list[str],
              nodes: tuple[str, ...]) -> tuple[dict[str, tuple[int, str]], list[str]]:
        """Hashes of `names`: by the live agents of `nodes` (each its ranks' files), the rest on
        this host; an agent that does not answer within load_timeout_s has its files hashed here."""
        watch = self.watch
        request = watch.new_request_id()
        assignment = ext.assign_files(names, nodes, self.nproc_per_node)
        parts: dict[tuple[str, int], list[str]] = {}   # what each request asked for

        def send(msg: ExtHash, *, nodes: list[str]) -> bool:
            parts[(nodes[0], msg.part)] = list(msg.files)
            return self.agents.send(msg, nodes=nodes)

        waiting, here = send_requests(send, request, folder, assignment, watch.algorithm, self.agents.has_agent)
        hashed: dict[str, tuple[int, str]] = {}
        problems: list[str] = []

        def answered(msg: Message) -> bool:
            if isinstance(msg.body, ExtHashed) and msg.body.request == request:
                key = (msg.node, msg.body.part)
                if key in waiting:
                    waiting.discard(key)
                    take_answer(msg.body, hashed, problems)
            return not waiting

        if waiting:
            self.await_answers(answered, self.clock() + self.load_timeout_s, until=lambda: not waiting)
        for key in waiting:   # silent agents: their files are hashed here
            here.extend(parts.get(key, []))
        if here:
            found, more = ext.hash_files(folder.path, here, watch.algorithm)
            hashed.update(found)
            problems.extend(more)
        return hashed, problems
