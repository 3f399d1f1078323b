"""A pre-imported torchrun (`Standby` is the agent's handle on one): started by the agent ahead of need, it imports torch's launcher
(~1.7 s here) and then waits for one JSON request on stdin: {"argv": [...], "env": {...},
"cwd": "..."}. On it, it becomes torchrun; its stdout and stderr are one pipe to the agent
(supervisor/rank_output.py reads it into the rank log, progress lines and the console).
The agent keeps one ready, so a fast-path restart skips the import.

Run as `python -m ckptsup.supervisor.standby`. Torch is imported here, in the launcher process,
never in the agent or the supervisor.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

from .processes import terminate


class Standby:
    """A launcher process that has already imported torch.distributed.run (standby.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptsup.supervisor.standby"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self, *, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        """Hand over the request; the returned process's stdout is the output pipe to read."""
        assert self.proc.stdin is not None
        request = {"argv": argv, "env": env, "cwd": cwd}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.close()
        return self.proc

    def discard(self) -> None:
        terminate(self.proc, 0)


def main() -> int:
    # Until a request arrives this process is idle; the agent kills it with SIGKILL if unused.
    import torch.distributed.run as torchrun  # the expensive import, done ahead of need
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent went away or closed us: nothing to launch
    request = json.loads(line)
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
