"""The agent's part of external checkpoints (checkpoint/external.py): hash the files of an external
step folder that the supervisor names (`ext_hash`, this node's ranks' `__<rank>_*.distcp`, plus
`.metadata` on global rank 0's node) and answer with `ext_hashed`; with `testload` (the folder's
manifest), run a level-3 test load in a subprocess (supervisor/node/external_testload.py) too. One background thread, so a
large checkpoint's read never stalls the agent's heartbeat or its rank sockets; the agent's loop
sends the answers (one writer of stdout)."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

from ...checkpoint.external import hash_files, name_ok
from ...checkpoint.hashing import HASH_ALGORITHMS
from ...errors import CkptsupError
from ...messages import ExtHash, ExtHashed

MAX_FILES_PER_FRAME = 200   # ~100 bytes an answer entry: well within a 64 KiB frame
MAX_QUEUED = 64             # requests waiting; beyond, the oldest waiting one is answered "busy"


class ExternalRequestError(CkptsupError):
    """An `ext_hash` body the agent cannot carry out."""


def parse_request(cmd: ExtHash) -> ExtHash:
    """The request, checked beyond its types (messages.ExtHash): an absolute `dir`, a `folder` and
    `files` that are single path components, a known algorithm."""
    if not 0 < len(cmd.request) <= 64:
        raise ExternalRequestError("`request` must be a short string")
    if not cmd.part < 1_000_000:
        raise ExternalRequestError("`part` must be an integer >= 0")
    if not (os.path.isabs(cmd.dir) and "\x00" not in cmd.dir):
        raise ExternalRequestError("`dir` must be an absolute path")
    if not name_ok(cmd.folder):
        raise ExternalRequestError("`folder` must be one path component")
    if not (len(cmd.files) <= MAX_FILES_PER_FRAME and all(name_ok(f) for f in cmd.files)):
        raise ExternalRequestError(f"`files` must be at most {MAX_FILES_PER_FRAME} single path components")
    if cmd.algorithm not in HASH_ALGORITHMS:
        raise ExternalRequestError(f"`algorithm` must be one of {', '.join(HASH_ALGORITHMS)}")
    if cmd.testload is not None and not (os.path.isabs(cmd.testload) and "\x00" not in cmd.testload):
        raise ExternalRequestError("`testload` must be the absolute path of the folder's manifest")
    return cmd


class ExternalHasher:
    def __init__(self) -> None:
        self.jobs: "queue.Queue[ExtHash]" = queue.Queue()
        self.answers: "queue.Queue[ExtHashed]" = queue.Queue()
        self.thread: threading.Thread | None = None

    def request(self, cmd: ExtHash) -> None:
        job = parse_request(cmd)
        if self.jobs.qsize() >= MAX_QUEUED:
            raise ExternalRequestError(f"{MAX_QUEUED} hash requests already wait")
        self.jobs.put(job)
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="ckptsup-external-hash", daemon=True)
            self.thread.start()

    def take(self) -> list[ExtHashed]:
        out = []
        while True:
            try:
                out.append(self.answers.get_nowait())
            except queue.Empty:
                return out

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            self.answers.put(answer(job))


def answer(job: ExtHash) -> ExtHashed:
    start = time.monotonic()
    try:
        hashed, problems = hash_files(Path(job.dir) / job.folder, list(job.files), job.algorithm)
    except CkptsupError as err:
        hashed, problems = {}, [str(err)]
    files = tuple({"path": n, "size": s, "hash": h} for n, (s, h) in sorted(hashed.items()))
    found = tuple(p[:300] for p in problems[:20])
    hash_s = round(time.monotonic() - start, 4)
    testload = None
    if job.testload:
        from .external_testload import run_test_load

        ok, detail = run_test_load(Path(job.dir) / job.folder, Path(job.testload))
        testload = {"ok": ok, "detail": detail, "duration_s": round(time.monotonic() - start, 4)}
    return ExtHashed(request=job.request, part=job.part, folder=job.folder, files=files, problems=found,
                     hash_s=hash_s, testload=testload)
