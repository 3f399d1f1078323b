"""The agent's part of external checkpoints (checkpoint/external.py): hash the files of an external
step folder that the supervisor names (`ext_hash`, this node's ranks' `__<rank>_*.distcp`, plus
`.metadata` on global rank 0's node) and answer with `ext_hashed`; with `testload` (the folder's
manifest), run a level-3 test load in a subprocess (supervisor/external_testload.py) too. One background thread, so a
large checkpoint's read never stalls the agent's heartbeat or its rank sockets; the agent's loop
sends the answers (one writer of stdout)."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ..checkpoint.external import hash_files, name_ok
from ..checkpoint.hashing import HASH_ALGORITHMS
from ..errors import CkptsupError

MAX_FILES_PER_FRAME = 200   # ~100 bytes an answer entry: well within a 64 KiB frame
MAX_QUEUED = 64             # requests waiting; beyond, the oldest waiting one is answered "busy"


class ExternalRequestError(CkptsupError):
    """An `ext_hash` body the agent cannot carry out."""


def parse_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request's fields, checked: an absolute `dir`, a `folder` and `files` that are single
    path components, a known algorithm."""
    request, part, where, folder, files, algorithm = (body.get(k) for k in
                                                      ("request", "part", "dir", "folder", "files", "algorithm"))
    if not (isinstance(request, str) and 0 < len(request) <= 64):
        raise ExternalRequestError("`request` must be a short string")
    if not (isinstance(part, int) and not isinstance(part, bool) and 0 <= part < 1_000_000):
        raise ExternalRequestError("`part` must be an integer >= 0")
    if not (isinstance(where, str) and os.path.isabs(where) and "\x00" not in where):
        raise ExternalRequestError("`dir` must be an absolute path")
    if not (isinstance(folder, str) and name_ok(folder)):
        raise ExternalRequestError("`folder` must be one path component")
    if not (isinstance(files, list) and len(files) <= MAX_FILES_PER_FRAME
            and all(isinstance(f, str) and name_ok(f) for f in files)):
        raise ExternalRequestError(f"`files` must be at most {MAX_FILES_PER_FRAME} single path components")
    if algorithm not in HASH_ALGORITHMS:
        raise ExternalRequestError(f"`algorithm` must be one of {', '.join(HASH_ALGORITHMS)}")
    testload = body.get("testload")
    if testload is not None and not (isinstance(testload, str) and os.path.isabs(testload) and "\x00" not in testload):
        raise ExternalRequestError("`testload` must be the absolute path of the folder's manifest")
    return {"request": request, "part": part, "dir": where, "folder": folder, "files": files, "algorithm": algorithm,
            "testload": testload}


class ExternalHasher:
    def __init__(self) -> None:
        self.jobs: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.answers: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.thread: threading.Thread | None = None

    def request(self, body: dict[str, Any]) -> None:
        job = parse_request(body)
        if self.jobs.qsize() >= MAX_QUEUED:
            raise ExternalRequestError(f"{MAX_QUEUED} hash requests already wait")
        self.jobs.put(job)
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="ckptsup-external-hash", daemon=True)
            self.thread.start()

    def take(self) -> list[dict[str, Any]]:
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


def answer(job: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        hashed, problems = hash_files(Path(job["dir"]) / job["folder"], job["files"], job["algorithm"])
    except CkptsupError as err:
        hashed, problems = {}, [str(err)]
    out = {"request": job["request"], "part": job["part"], "folder": job["folder"],
           "files": [{"path": n, "size": s, "hash": h} for n, (s, h) in sorted(hashed.items())],
           "problems": [p[:300] for p in problems[:20]], "hash_s": round(time.monotonic() - start, 4)}
    if job.get("testload"):
        from .external_testload import run_test_load

        ok, detail = run_test_load(Path(job["dir"]) / job["folder"], Path(job["testload"]))
        out["testload"] = {"ok": ok, "detail": detail, "duration_s": round(time.monotonic() - start, 4)}
    return out
