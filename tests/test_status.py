"""`ckptsup status` (supervisor/job/status.py, supervisor/ops/cli_status.py): the published status from the
in-process loop (scripted agents: a spare, a node death), and the CLI's one-line refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptsup.rundir import RunDir
from ckptsup.supervisor.job.status import STATUS_FILE, read_status

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


def test_a_prom_textfile_in_a_missing_directory_is_refused_at_launch_in_one_line(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[report]\nprom_textfile = "{tmp_path}/no/such/dir/x.prom"\n')
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    done = ckptsup("launch", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), str(script), cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert "report.prom_textfile" in done.stderr and "its directory does not exist" in done.stderr
    assert not (tmp_path / "run").exists()   # refused before anything was created


def test_the_live_textfile_is_exposition_format_with_conventional_units():
    from ckptsup.supervisor.job.prom_live import live_text

    text = live_text({"job_id": 'j"1', "written": 1.5, "status": "running", "attempt": 2, "step": 7,
                      "step_p50_s": 0.1, "step_p99_s": float("nan"), "active": ["n1"], "spares": [], "excluded": {},
                      "nodes": {"n1": {"role": "active", "agent": True, "heartbeat_age_s": 0.4, "ranks_alive": [0, 1]}},
                      "checkpoints": {"committed": {"step": 5}}, "next_save_in_s": None}, 0.9)
    assert 'ckptsup_step_duration_seconds{job_id="j\\"1",quantile="0.5"} 0.1' in text
    assert 'quantile="0.99"' not in text and "next_save_seconds" not in text   # NaN and None are left out
    assert 'ckptsup_node_ranks_alive{job_id="j\\"1",node="n1"} 2' in text
    assert 'ckptsup_goodput_ratio{job_id="j\\"1"} 0.9' in text and text.count("# TYPE ckptsup_") == text.count("# HELP ")
