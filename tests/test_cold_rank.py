"""A rank started cold (rankside/cold_rank.py) as a real process: it is python running the script
as __main__ — argv, sys.path, exit status, exceptions and module mode as `python SCRIPT` gives
them — titled as its rank, with the stack dump installed before the script's first line, so
that the agent can ask an unhooked rank where it is from the first attempt on."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptsup.env import ATTEMPT, RUN_DIR, cold_rank_argv
from ckptsup.stack_dump import STACK_SIGNAL, stack_file

pytestmark = pytest.mark.integration

SCRIPT = """
import os, sys, time
print("name", __name__, "argv", sys.argv, "path0", sys.path[0], "file", __file__, flush=True)
if sys.argv[1] == "raise":
    raise ValueError("from the script")
if sys.argv[1] == "wait":
    time.sleep(60)   # the line the dump must show
sys.exit(int(sys.argv[1]))
"""


def start(tmp_path: Path, *args: str, module: bool = False, run: bool = True) -> subprocess.Popen:
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(SCRIPT)
    env = {**os.environ, "RANK": "2", **({RUN_DIR: str(tmp_path / "run"), ATTEMPT: "0"} if run else {})}
    target = "pkg.train" if module else str(pkg / "train.py")
    return subprocess.Popen(cold_rank_argv(sys.executable, [target, *args], module=module), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_cold_rank_runs_its_script_as_python_would_and_exits_with_its_status(tmp_path):
    p = start(tmp_path, "5")
    out, err = p.communicate(timeout=60)
    script = tmp_path / "pkg" / "train.py"
    assert p.returncode == 5, err
    assert f"name __main__ argv ['{script}', '5'] path0 {script.parent} file {script}" in out, out


def test_a_module_rank_runs_as_python_dash_m(tmp_path):
    p = start(tmp_path, "0", module=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "name __main__" in out and f"path0 {tmp_path}" in out and "pkg/train.py" in out, out


def test_the_scripts_exception_is_pythons_own_traceback_and_exit_1(tmp_path):
    p = start(tmp_path, "raise", run=False)   # outside a ckptsup run: no dump, the script runs all the same
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and err.rstrip().endswith("ValueError: from the script"), err


def test_a_cold_rank_is_titled_and_dumps_its_stack_where_the_agent_reads_it(tmp_path):
    p = start(tmp_path, "wait")
    try:
        assert p.stdout.readline().startswith("name __main__")
        with open(f"/proc/{p.pid}/cmdline", "rb") as fh:
            title = fh.read().rstrip(b"\0").decode()
        assert title == f"ckptsup rank 2: {tmp_path / 'pkg' / 'train.py'} wait", title
        path = stack_file(tmp_path / "run", 0, 2)
        deadline = time.monotonic() + 30
        # asked again until the dump shows the sleep: the first answer can still be inside the print
        while "line 7 in <module>" not in (path.read_text() if path.exists() else ""):
            assert time.monotonic() < deadline, "no stack of the sleeping line dumped"
            os.kill(p.pid, STACK_SIGNAL)
            time.sleep(0.5)
        assert "train.py" in path.read_text() and path.stat().st_mode & 0o777 == 0o600
        assert p.poll() is None   # the signal dumped; it did not kill the rank
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
