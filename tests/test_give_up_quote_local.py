"""The give-up summary quotes the traceback that ended the run (supervisor/job/error_quote.py), with the
real CLI, agent and torchrun on a script whose rank 1 always raises (local mode, no Slurm)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ("import os, time\n"
          "def load(batch):\n    raise ValueError(f'\\x1b[31mbad batch {batch}\\x1b[0m')\n"
          "if os.environ['RANK'] == '1':\n    load(7)\n"
          "time.sleep(5)\n")


def test_a_crash_loop_gives_up_quoting_the_failed_ranks_traceback(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTSUP_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir",
                           str(tmp_path / "run"), str(tmp_path / "train.py")],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr   # ExitStatus.GIVE_UP
    out = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("ckptsup: giving up:"))
    header, *quote = out[start + 1:]
    assert header.startswith("--- rank 1 failed first") and "/run/attempt-2/ranks-" in header, proc.stdout
    assert quote[0] == "Traceback (most recent call last):" and "in load" in "\n".join(quote)
    assert quote[-1] == "ValueError: bad batch 7", proc.stdout   # colour codes stripped
    assert "ChildFailedError" not in "\n".join(quote) and "(no error" not in proc.stdout
    # torchrun's summary stays (the quote reads it); its own Python traceback does not reach the user
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").glob("attempt-*/ranks-*.log"))
    assert "Root Cause (first observed failure)" in logs
    assert 'distributed/run.py", line' not in logs + proc.stdout + proc.stderr
