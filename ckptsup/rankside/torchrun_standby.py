"""A cold launch's torchrun: started by the node agent when its zygote cannot fork one
(supervisor/node/standby.py starts it), it imports torch's launcher (~1.7 s here) and reads one
JSON request on stdin: {"argv": [...], "env": {...}, "cwd": "..."}. On it, it becomes torchrun; its
stdout and stderr are one pipe to the agent (supervisor/node/rank_output.py reads it into the rank
log, progress lines and the console). `become_torchrun` also serves the zygote's torchrun child.

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
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent went away or closed us: nothing to launch
    return become_torchrun(json.loads(line))


def become_torchrun(request: dict) -> int:
    """Run torchrun with the request's argv, environment and cwd (stdout and stderr are already
    the agent's pipe; stdin becomes /dev/null, which its workers inherit); its exit status."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

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
