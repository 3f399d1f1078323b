"""Run a rank's script as `__main__` in this process, as `python SCRIPT` or `python -m MODULE`
would: shared by the cold rank (cold_rank.py) and the warm interpreter (warm_rank.py).
The standard library and console.py (ckptsup's log lines as `rank <RANK>`)."""

from __future__ import annotations

import os
import runpy
import sys

from .. import console


def run_script(argv: list[str], *, module: bool) -> None:
    """sys.argv and sys.path[0] as python sets them, then the script; its exceptions and
    SystemExit propagate to the caller."""
    console.configure_rank()   # the rank's environment is in place by now: RANK names it
    sys.argv = list(argv)
    if module:
        sys.path[0] = os.getcwd()   # as `python -m`
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
