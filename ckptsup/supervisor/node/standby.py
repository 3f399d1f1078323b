"""The agent's handle on a pre-imported torchrun (the process itself: rankside/torchrun_standby.py).
The agent keeps one ready, so a fast-path restart skips torch's ~1.7 s import; torch is imported
in that launcher process, never in the agent or the supervisor.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ..processes import terminate


class Standby:
    """A launcher process that has already imported torch.distributed.run (rankside/torchrun_standby.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptsup.rankside.torchrun_standby"],
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
