"""`[notify]` in a real run on the dev cluster (issue 40): the GPU-health run of
tests/test_gpu_health_cluster.py (n2 shows XID 79 at start: excluded and drained; the job runs
on n1 and the spare; a torch-free rank, so the run is short) with a real command and a real HTTP
endpoint on 127.0.0.1 configured. Both get the node_drained and run_complete notices as JSON,
the webhook with the secret from the job's environment in its header — and the secret is in no
file of the run."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from ckptsup.events import read_events

from test_gpu_health_cluster import RANK, TOOLS
from test_notify import TOKEN, hook, recorder  # noqa: F401 - hook is a fixture

pytestmark = [pytest.mark.slurm]


def test_a_drained_node_and_the_completion_reach_a_real_command_and_a_real_webhook(dev_cluster, tmp_path, hook):
    h = hook()
    prog, got = recorder(tmp_path)
    faults = tmp_path / "faults"
    faults.write_text("n2: xid79\n")
    env = {**os.environ, "PATH": f"{TOOLS}{os.pathsep}{os.environ['PATH']}", "CKPTSUP_FAKE_GPU_FILE": str(faults),
           "HOOK_TOKEN": TOKEN}
    run, out = tmp_path / "run", tmp_path / "out"
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[health]\ndcgm_diag = "off"\n[notify]\ncommand = [{json.dumps(str(prog))}, "--from", "ckptsup"]\n'
                   f'webhook = "{h.url}"\nwebhook_secret_env = "HOOK_TOKEN"\n')
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "sbatch", "--submit", "--json", "--nodes", "2",
                           "--spares", "1", "--gpus-per-node", "2", "--nproc-per-node", "1", "--config", str(cfg),
                           "--run-dir", str(run), str(RANK), "--steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    try:
        dev_cluster.wait_for(lambda: (s := dev_cluster.job_state(job)) is None or s.finished, 120, what=f"job {job}")
        events = read_events(run)
        [excluded] = [e for e in events if e["event"] == "node_excluded"]
        assert excluded["node"] == "n2" and excluded["drained"] and any(e["event"] == "run_complete" for e in events)
        by_command = [json.loads(line) for line in got.read_text().splitlines()]
        by_webhook = [json.loads(body) for _, body in h.posts]
        for notices in (by_command, by_webhook):
            assert [n["notice"] for n in notices] == ["node_drained", "run_complete"], notices
            drained, done = notices
            assert drained["event"] == excluded and drained["job_id"] == job and drained["run_dir"] == str(run)
            assert drained["summary"].startswith(f"ckptsup job {job}: node n2 drained: health: gpu_xid")
            assert done["event"]["event"] == "run_complete"
        assert {headers["Authorization"] for headers, _ in h.posts} == {f"Bearer {TOKEN}"}
        for path in run.rglob("*"):   # the secret is in no file of the run: not the log, the events, config.json
            if path.is_file() and not stat.S_ISSOCK(path.stat().st_mode):
                assert TOKEN.encode() not in path.read_bytes(), path
        assert "HOOK_TOKEN" in (run / "config.json").read_text()   # only its variable's name
        assert "ckptsup: notify:" not in (run / f"slurm-{job}.out").read_text()   # no delivery failed
    finally:
        dev_cluster.give_back("n2")   # give the drained node back to later tests
