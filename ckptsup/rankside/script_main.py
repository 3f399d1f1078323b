"""Run a rank's script as `__main__` in this process, as `python SCRIPT` or `python -m MODULE`
would: shared by the cold rank (cold_rank.py) and the warm interpreter (warm_rank.py).
The standard library and env.py."""

from __future__ import annotations

import os
import runpy
import sys

from ..env import RANK_MODULE_FLAG


def split_module_flag(args: list[str]) -> tuple[list[str], bool]:
    """(argv, module) from `[--ckptsup-module] SCRIPT ARGS`."""
    if args and args[0] == RANK_MODULE_FLAG:
        return args[1:], True
    return args, False


def run_script(argv: list[str], *, module: bool) -> None:
    """sys.argv and sys.path[0] as python sets them, then the script; its exceptions and
    SystemExit propagate to the caller."""
    sys.argv = list(argv)
    if module:
        sys.path[0] = os.getcwd()   # as `python -m`
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
