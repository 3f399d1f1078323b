"""A cold launch's torchrun (rankside/torchrun_standby.py): started when the agent's zygote
(zygote.py) cannot fork one (not started yet, stopped, dead). It pays torch's import now; the
request goes in on stdin at once.
"""

from __future__ import annotations

import json
import subprocess
import sys


def start_cold(*, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
    """torchrun with this argv, environment and cwd; the returned process's stdout (stderr
    merged) is the output pipe to read."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptsup.rankside.torchrun_standby"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write((json.dumps({"argv": argv, "env": env, "cwd": cwd}) + "\n").encode())
    proc.stdin.close()
    return proc
