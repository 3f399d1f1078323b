"""A rank started cold (no warm interpreter: a first attempt, warm restarts off, or a warm
interpreter that was not there): `python -u -m ckptsup.rankside.cold_rank [--ckptsup-module]
SCRIPT ARGS`, what torchrun runs instead of `python -u SCRIPT ARGS`.

It installs the stack dump (stack_dump.py) before the script runs, so that the agent can ask where
an unhooked rank is — which collective it waits in and from which line of the script — from
the first attempt on, as it can in a warm interpreter; then it titles the process as the warm
interpreter does (`ckptsup rank R: SCRIPT ARGS`) and runs SCRIPT as `__main__` in this same
process (the pid torchrun knows is the rank's). The script's exceptions and exit status are
python's own. Light: the standard library, env.py and stack_dump.py (~50 ms).
"""

from __future__ import annotations

import os
import sys

from ..env import RANK_MODULE_FLAG, set_rank_title, split_module_flag
from ..stack_dump import install
from .script_main import run_script


def main() -> None:
    argv, module = split_module_flag(sys.argv[1:])
    if not argv:
        print(f"usage: python -m ckptsup.rankside.cold_rank [{RANK_MODULE_FLAG}] SCRIPT [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    install()   # None outside a ckptsup run: the script runs all the same
    set_rank_title(os.environ.get("RANK", "?"), (["-m"] if module else []) + argv)
    run_script(argv, module=module)


if __name__ == "__main__":
    main()
