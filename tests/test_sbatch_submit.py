"""The rendered train.sbatch on the real dev cluster, with a stand-in supervisor: it submits and
runs, starts the watchdog step on another node, forwards the time-limit signal, and requeues the
job itself when the supervisor dies. Also `ckptsup sbatch --submit` end to end."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptsup.resources import sbatch_templates_dir
from ckptsup.slurm.parsers import JobState
from ckptsup.slurm.render import SbatchParams, render_sbatch
from ckptsup.slurm.submit import Prepared, submit_script
from ckptsup.supervisor.job.requeue import CREDENTIAL_SETTLE_S

pytestmark = pytest.mark.slurm
TEMPLATE = sbatch_templates_dir() / "train.sbatch"


def prepared(run_dir: Path, **kw) -> Prepared:
    params = SbatchParams(run_dir=str(run_dir), script="/unused.py", nodes=2, spares=0, time="00:10:00",
                          signal_lead_s=60, **kw)
    return Prepared(params=params, template=TEMPLATE, text=render_sbatch(TEMPLATE.read_text(), params))


def finished(fx, job):
    info = fx.job(job)
    return info if info and info.state.finished else None


def test_rendered_script_runs_the_launch_command_and_a_watchdog_on_another_node(dev_cluster, tmp_path):
    fx = dev_cluster
    run_dir = tmp_path / "runs" / "{job_id}"
    p = prepared(run_dir, launch_command='sleep 2; echo "supervisor on $(hostname) in $RUN_DIR"; exit 0',
                 watchdog_command='bash -c "echo watchdog on \\$(hostname); sleep 60"')
    result = submit_script(p, client=fx.client)
    assert stat.S_IMODE(result.run_dir.stat().st_mode) == 0o700
    assert result.run_dir == tmp_path / "runs" / result.job_id
    info = fx.wait_for(lambda: finished(fx, result.job_id), 30, what="job finished")
    assert info.state is JobState.COMPLETED and info.restart_count == 0
    out = (result.run_dir / f"slurm-{result.job_id}.out").read_text()
    assert f"supervisor on {info.batch_host} in {result.run_dir}" in out
    other = next(n for n in info.nodes if n != info.batch_host)
    assert f"watchdog on {other}" in out
    assert "supervisor exited 0: not requeueing" in out


def test_supervisor_killed_is_requeued_by_the_script_and_the_job_comes_back(dev_cluster, tmp_path):
    fx = dev_cluster
    launch = ('if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then echo dying; kill -9 $BASHPID; fi; '
              'echo "second life restart=$SLURM_RESTART_COUNT"; exit 0')
    p = prepared(tmp_path / "run", launch_command=f"bash -c '{launch}'",
                 requeue_command="false", watchdog_command="sleep 60")  # exercise the scontrol fallback
    result = submit_script(p, client=fx.client)

    held_since: list[float] = []

    def second_run_done():
        info = fx.job(result.job_id)
        if info and info.state is JobState.PENDING and info.reason == "BeginTime":
            # lift the 121 s hold as `ckptsup requeue` does, only once the wall-clock second of
            # the requeue has turned over: a restart within it is killed ("Job credential revoked")
            if not held_since:
                held_since.append(time.monotonic())
            if time.monotonic() - held_since[0] >= CREDENTIAL_SETTLE_S:
                fx.client.update_job(result.job_id, start_time_now=True)
        # the first run's end may show briefly as a terminal state: only the second run counts
        return info if info and info.state.finished and info.restart_count >= 1 else None

    info = fx.wait_for(second_run_done, 40, what="second run finished")
    assert info.state is JobState.COMPLETED and info.restart_count == 1
    out = (result.run_dir / f"slurm-{result.job_id}.out").read_text()  # --open-mode=append keeps both runs
    assert "supervisor died (status 137)" in out and "falling back to scontrol requeue" in out
    assert "second life restart=1" in out


def test_time_limit_signal_reaches_the_supervisor_through_the_batch_shell(dev_cluster, tmp_path):
    fx = dev_cluster
    supervisor = tmp_path / "supervisor.sh"  # stand-in: exits PREEMPTED on USR1
    supervisor.write_text("trap 'echo supervisor got USR1; exit 5' USR1\n"
                          'echo ready > "$CKPTSUP_RUN_DIR/ready"\nfor i in $(seq 600); do sleep 0.1; done\nexit 0\n')
    requeue = tmp_path / "requeue.sh"  # stand-in for `ckptsup requeue --run-dir DIR`: records its arguments
    requeue.write_text('echo "requeue $*" >> "$CKPTSUP_RUN_DIR/requeues"\n')
    p = prepared(tmp_path / "run", launch_command=f"bash {supervisor}", requeue_command=f"bash {requeue}",
                 watchdog_command="sleep 60")
    result = submit_script(p, client=fx.client)
    fx.wait_for(lambda: (result.run_dir / "ready").exists(), 30, what="stand-in supervisor running")
    fx.client.cancel(result.job_id, signal="USR1", batch=True)  # what --signal=B:USR1@T sends
    fx.wait_for(lambda: finished(fx, result.job_id), 30, what="job finished")
    out = (result.run_dir / f"slurm-{result.job_id}.out").read_text()
    assert "SIGUSR1 received; forwarding to the supervisor" in out
    assert "supervisor got USR1" in out and "stopped for preemption or time limit" in out
    assert (result.run_dir / "requeues").read_text() == "requeue --reason preempted\n"


def test_ckptsup_sbatch_submit_creates_the_run_directory_and_submits(dev_cluster, tmp_path):
    # a site template that uses a subset of the placeholders (any is optional)
    template = tmp_path / "mini.sbatch"
    template.write_text("#!/bin/bash\n#SBATCH --nodes={{total_nodes}}\n#SBATCH --output={{output}}\n"
                        "#SBATCH --job-name={{job_name}}\nRUN_DIR={{run_dir}}\n"
                        "echo \"ran in $RUN_DIR on $SLURM_JOB_NUM_NODES nodes\"\n")
    train = tmp_path / "train.py"
    train.write_text("pass\n")
    env = dict(os.environ, CKPTSUP_SITE_CONFIG=str(Path(__file__).parents[1] / "site_config" / "default.toml"))
    out = subprocess.run([sys.executable, "-m", "ckptsup.cli", "sbatch", "--submit", "--json",
                          "--template", str(template), "--nodes", "2", "--spares", "1", "--job-name", "mini",
                          "--run-dir", str(tmp_path / "runs" / "{job_id}"), str(train)],
                         capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    run_dir = Path(result["run_dir"])
    assert run_dir == tmp_path / "runs" / result["job_id"] and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert (run_dir / "job.sbatch").exists()
    info = dev_cluster.wait_for(lambda: finished(dev_cluster, result["job_id"]), 30, what="job finished")
    assert info.state is JobState.COMPLETED and info.name == "mini"
    assert (run_dir / f"slurm-{result['job_id']}.out").read_text().strip() == f"ran in {run_dir} on 3 nodes"


def test_prepared_text_is_what_the_cluster_runs(dev_cluster, tmp_path):
    p = prepared(tmp_path / "run", launch_command="true", watchdog_command="true")
    result = submit_script(p, client=dev_cluster.client)
    assert (result.run_dir / "job.sbatch").read_text() == p.text
    info = dev_cluster.wait_for(lambda: finished(dev_cluster, result.job_id), 30, what="job finished")
    assert info.state is JobState.COMPLETED and len(info.nodes) == p.params.total_nodes
