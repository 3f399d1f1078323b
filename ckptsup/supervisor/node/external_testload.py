"""Level 3 for an external step folder, the agent's side: the test load runs in its own process
(hooks/external_testload.py: torch and DCP stay out of the agent), on global rank 0's node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 600.0
MODULE = "ckptsup.hooks.external_testload"


def run_test_load(folder: Path, manifest_file: Path, *, timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(ok, its one line) of the test load in a subprocess."""
    argv = [sys.executable, "-m", MODULE, str(folder), str(manifest_file)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return False, f"test load did not finish within {timeout_s:.0f} s"
    lines = (proc.stdout.strip() or proc.stderr.strip() or "(no output)").splitlines()
    return proc.returncode == 0, lines[-1][:400]
