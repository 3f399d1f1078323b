"""`ckptsup status` (supervisor/status.py, supervisor/cli_status.py): the published status from the
in-process loop (scripted agents: a spare, a node death), and the CLI's one-line refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptsup.rundir import RunDir
from ckptsup.supervisor.status import STATUS_FILE, read_status

from test_supervisor_loop import Clock, Fault, FakeSlurm, World, fast_ticks, site, supervisor  # noqa: F401


def ckptsup(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptsup.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def test_the_final_status_shows_the_spare_that_took_over_and_the_excluded_node(tmp_path, site):
    world = World(clock=Clock(), faults={0: Fault("node_death", 2, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm())
    sv.run()
    st = read_status(tmp_path / "run")
    assert oct(os.stat(tmp_path / "run" / STATUS_FILE).st_mode & 0o777) == "0o600"
    assert st["status"] == "done" and st["attempt"] == 1 and st["active"] == ["n1", "n3"] and st["spares"] == []
    assert list(st["excluded"]) == ["n2"] and "node_down" in st["excluded"]["n2"]
    assert st["nodes"]["n3"]["role"] == "active" and st["nodes"]["n3"]["agent"] is True
    assert st["level"] == "hooks" and st["step"] == 5 and "hang_min_s" in st["hang_why"]


def test_a_status_file_that_is_not_ours_and_a_missing_run_are_one_line_each(tmp_path):
    run = RunDir.create(tmp_path / "run")
    missing = ckptsup("status", str(run.path))
    assert missing.returncode == 2 and "has not published yet" in missing.stderr and len(missing.stderr.splitlines()) == 1
    (run.path / STATUS_FILE).write_text(json.dumps({"v": 99}))
    foreign = ckptsup("status", str(run.path))
    assert foreign.returncode == 2 and "is not a ckptsup status file" in foreign.stderr
    (run.path / STATUS_FILE).write_text("[" * 200_000)
    deep = ckptsup("status", str(run.path))
    assert deep.returncode == 2 and len(deep.stderr.splitlines()) == 1 and "Traceback" not in deep.stderr
    nowhere = ckptsup("status", "4242", cwd=tmp_path)
    assert nowhere.returncode == 2 and "no run directory for job 4242 at ckptsup-runs/4242" in nowhere.stderr
