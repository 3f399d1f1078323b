"""A pre-imported torchrun: started by the node agent ahead of need (supervisor/node/standby.py is its
handle), it imports torch's launcher (~1.7 s here) and then waits for one JSON request on stdin:
{"argv": [...], "env": {...}, "cwd": "..."}. On it, it becomes torchrun; its stdout and stderr are
one pipe to the agent (supervisor/node/rank_output.py reads it into the rank log, progress lines and
the console).

Run as `python -m ckptsup.rankside.torchrun_standby`. Rank side: it imports torch, so it lives
outside supervisor/ (docs/architecture.md §Layers).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys


def main() -> int:
    # Until a request arrives this process is idle; the agent kills it with SIGKILL if unused.
    import torch.distributed.run  # noqa: F401 — the expensive import, done ahead of need

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent went away or closed us: nothing to launch
    request = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return become_torchrun(request)


def become_torchrun(request: dict) -> int:
    """Run torchrun with the request's argv, environment and cwd (stdin, stdout and stderr are
    already the ones torchrun gets); its exit status."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # a pipe is block-buffered: rank lines must be live
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["torchrun", *request["argv"]]
    try:
        torchrun.main(request["argv"])
    except ChildFailedError as err:
        # A failed rank is the supervisor's to handle and report (error_quote reads this summary);
        # torchrun's own Python traceback above it would only tell the user where torchrun raised.
        print(f"torchrun: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
