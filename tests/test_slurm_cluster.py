"""Slurm behaviours ckptsup relies on, through SlurmClient, on the real dev cluster
(docs/slurm.md §Seen on the dev cluster)."""

from __future__ import annotations

import sys
import time

import pytest

from ckptsup.errors import SlurmCommandError
from ckptsup.slurm.client import SlurmClient, subprocess_runner
from ckptsup.slurm.parsers import JobState, NodeState

pytestmark = pytest.mark.slurm

SLEEPER = "#!/bin/bash\necho start $(hostname) restart=${SLURM_RESTART_COUNT:-0}\nsleep 300\n"


def running_on(fx, job_id):
    info = fx.job(job_id)
    return info.nodes if info and info.state is JobState.RUNNING else None


def test_submitted_job_is_queried_while_running_and_after_it_completes(dev_cluster):
    fx = dev_cluster
    job = fx.submit("#!/bin/bash\nsrun hostname\nsleep 1\n", "-N", "2", "-J", "query-me")
    info = fx.wait_for(lambda: (i := fx.job(job)) and i.state is JobState.RUNNING and i, 20, what="job running")
    assert info.name == "query-me" and len(info.nodes) == 2 and info.batch_host == info.nodes[0]
    assert info.partition == "main" and info.restart_count == 0
    done = fx.wait_for(lambda: (i := fx.job(job)) and i.state.finished and i, 20, what="job finished")
    assert done.state is JobState.COMPLETED and done.exit_code == 0
    assert sorted(fx.output(job).split()) == sorted(info.nodes)


def test_failed_job_reports_its_exit_status_in_squeue_and_sacct(dev_cluster):
    job = dev_cluster.submit("#!/bin/bash\nexit 3\n")
    info = dev_cluster.wait_for(lambda: (i := dev_cluster.job(job)) and i.state.finished and i, 20, what="job failed")
    assert (info.state, info.exit_code) == (JobState.FAILED, 3)
    rows = dev_cluster.wait_for(lambda: dev_cluster.client.accounting(job), 10, what="sacct record")
    assert (rows[0]["JobID"], rows[0]["State"], rows[0]["ExitCode"]) == (job, "FAILED", "3:0")


def test_requeue_then_exclude_and_start_now_runs_the_job_elsewhere_at_once(dev_cluster):
    fx = dev_cluster
    job = fx.submit(SLEEPER, "--requeue")
    first = fx.wait_for(lambda: running_on(fx, job), 20, what="job running")
    # Slurm refuses node exclusion on a running job: requeue first
    # (docs/slurm.md §Seen on the dev cluster)
    with pytest.raises(SlurmCommandError, match="no longer pending"):
        fx.client.update_job(job, exc_nodes=first)
    fx.client.requeue(job)
    pending = fx.wait_for(lambda: (i := fx.job(job)) and i.state is JobState.PENDING and i, 30, what="job pending")
    assert pending.reason == "BeginTime"  # requeue holds it ~121 s unless StartTime is lifted
    t0 = time.monotonic()
    fx.client.update_job(job, exc_nodes=first, start_time_now=True)
    second = fx.wait_for(lambda: running_on(fx, job), 15, interval=0.1, what="job running again")
    elapsed = time.monotonic() - t0
    assert set(second).isdisjoint(first)
    info = fx.job(job)
    assert info.restart_count == 1 and info.excluded_nodes == first
    assert elapsed < 10, f"requeued job took {elapsed:.1f}s to start after StartTime=now"
    fx.client.cancel(job)


def test_requeue_into_the_spanning_partition_lands_on_the_spare(dev_cluster):
    fx = dev_cluster
    job = fx.submit(SLEEPER, "--requeue", "-p", "main")
    fx.wait_for(lambda: running_on(fx, job), 20, what="job running")
    fx.client.requeue(job)
    fx.wait_for(lambda: fx.job_state(job) is JobState.PENDING, 30, what="job pending")
    fx.client.update_job(job, exc_nodes=["n1", "n2", "n3", "n4"], partition="mainspare", start_time_now=True)
    assert fx.wait_for(lambda: running_on(fx, job), 15, what="job on the spare") == ["n5"]
    assert fx.job(job).partition == "mainspare"
    fx.client.cancel(job)


PREEMPTABLE_TASK = """\
import signal, sys, time
path = sys.argv[1]
def on_term(signum, frame):
    with open(path, "a") as fh:
        fh.write(f"term {time.time()}\\n")
signal.signal(signal.SIGTERM, on_term)
while True:
    with open(path, "a") as fh:
        fh.write(f"alive {time.time()}\\n")
    time.sleep(0.2)
"""


def test_preempted_step_gets_sigterm_grace_time_before_the_kill_and_is_requeued(dev_cluster, tmp_path):
    fx = dev_cluster
    task = tmp_path / "task.py"
    task.write_text(PREEMPTABLE_TASK)
    trace = tmp_path / "trace"
    low = fx.submit(f"#!/bin/bash\nsrun {sys.executable} {task} {trace}\n",
                    "-p", "lowprio", "-w", "n4", "--exclusive", "--requeue")
    fx.wait_for(lambda: trace.exists() and "alive" in trace.read_text(), 30, what="low-priority task running")
    high = fx.submit("#!/bin/bash\nhostname\n", "-p", "highprio", "-w", "n4", "--exclusive")
    fx.wait_for(lambda: fx.job_state(high) is JobState.COMPLETED, fx.grace_time_s + 30, what="high-priority job done")
    lines = [line.split() for line in trace.read_text().splitlines()]
    terms = [float(t) for kind, t in lines if kind == "term"]
    alive = [float(t) for kind, t in lines if kind == "alive"]
    # Seen on 22.05: SIGTERM at preemption; at the end of GraceTime the job is ended: SIGTERM
    # again (to steps and batch shell), then SIGKILL KillWait later.
    assert len(terms) >= 2, lines[-5:]
    grace = terms[1] - terms[0]
    assert fx.grace_time_s - 2 <= grace <= fx.grace_time_s + 3, f"second SIGTERM {grace:.1f}s after the first"
    kill_wait = fx.cluster.spec.kill_wait_s
    last_alive = max(alive) - terms[0]  # the last sign of life is just before SIGKILL
    assert fx.grace_time_s + kill_wait - 2 <= last_alive <= fx.grace_time_s + kill_wait + 3, last_alive
    info = fx.wait_for(lambda: (i := fx.job(low)) and i.restart_count >= 1 and i, 30, what="preempted job requeued")
    assert info.state in (JobState.PENDING, JobState.RUNNING)
    fx.client.cancel(low)


def test_drain_and_resume_a_node(dev_cluster):
    fx = dev_cluster
    assert fx.client.drain("n4", "ckptsup test: suspect node") is True
    info = fx.client.node_info(["n4"])["n4"]
    assert info.state is NodeState.DRAINED and info.reason == "ckptsup test: suspect node"
    job = fx.submit("#!/bin/bash\nhostname\n", "-w", "n4")
    time.sleep(1)
    assert fx.job_state(job) is JobState.PENDING  # a drained node takes no new work
    assert fx.client.resume("n4") is True
    # right after a resume Slurm shows "idle*" until its next ping of the node
    fx.wait_for(lambda: fx.client.node_info(["n4"])["n4"].healthy, 20, what="n4 back in service")
    fx.wait_for(lambda: fx.job_state(job) is JobState.COMPLETED, 20, what="job on the resumed node")
    assert fx.client.resume("n4") is True  # resuming a node in service is a no-op


def test_drain_without_permission_returns_false_and_changes_nothing(dev_cluster):
    fx = dev_cluster

    def as_nobody(argv, timeout_s, env):
        return subprocess_runner(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv], timeout_s, env)

    nobody = SlurmClient(env=fx.client.env, runner=as_nobody)
    assert nobody.node_info(["n3"])["n3"].healthy  # an ordinary user can read
    assert nobody.drain("n3", "not allowed") is False
    assert fx.client.node_info(["n3"])["n3"].healthy


def test_node_death_is_reported_by_slurm_and_a_requeue_job_without_no_kill_is_requeued(dev_cluster):
    fx = dev_cluster
    job = fx.submit("#!/bin/bash\nsrun sleep 300\n", "-N", "2", "-w", "n2,n3", "--requeue")
    fx.wait_for(lambda: running_on(fx, job), 20, what="job running on n2,n3")
    fx.wait_for(lambda: len(fx.node_pids("n2")) >= 3, 10, what="step on n2")
    with fx.revived("n2"):
        t0 = time.monotonic()
        fx.kill_node("n2")
        fx.wait_for(lambda: not fx.client.node_info(["n2"])["n2"].responding, 40, what="n2 not responding")
        fx.wait_for(lambda: (i := fx.job(job)) and i.restart_count >= 1, 60, what="job requeued after n2 died")
        print(f"kill -> requeued in {time.monotonic() - t0:.1f}s")
        node = fx.client.node_info(["n2"])["n2"]
        assert node.state is NodeState.DOWN or node.reason == "Not responding", node
        # COMPLETING while the surviving node's step is cleaned up, then back in the queue
        fx.wait_for(lambda: fx.job_state(job) in (JobState.PENDING, JobState.RUNNING), 30, what="job pending again")
    fx.client.cancel(job)


def test_no_kill_job_survives_node_death_and_an_overlap_step_runs_on_the_rest(dev_cluster):
    fx = dev_cluster
    script = ("#!/bin/bash\nsrun -N3 sleep 300 &\n"
              "while [ ! -e go-$SLURM_JOB_ID ]; do sleep 0.1; done\n"
              "srun --overlap -N2 -w n1,n3 hostname\nsleep 300\n")
    job = fx.submit(script, "-N", "3", "-w", "n1,n2,n3", "--no-kill", f"--chdir={fx.jobs_dir}")
    fx.wait_for(lambda: running_on(fx, job), 20, what="job running")
    fx.wait_for(lambda: len(fx.node_pids("n2")) >= 3, 10, what="step on n2")
    with fx.revived("n2"):
        fx.kill_node("n2")
        (fx.jobs_dir / f"go-{job}").touch()
        fx.wait_for(lambda: {"n1", "n3"} <= set(fx.output(job).splitlines()), 20,
                    what="overlap step on the surviving nodes")
        assert fx.job_state(job) is JobState.RUNNING
    fx.client.cancel(job)


def test_srun_in_front_of_ckptsup_launch_is_refused_on_every_task_in_one_line(dev_cluster, tmp_path):
    """`srun -N2 ckptsup launch` would start two supervisors, each launching the whole job: every
    task exits 2 and task 0 says why and what to write instead (docs/drop-in.md §srun)."""
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    job = dev_cluster.submit(f"#!/bin/bash\nsrun -N2 {sys.executable} -m ckptsup.cli launch {script}\necho rc=$?\n",
                             "-N", "2")
    done = dev_cluster.wait_for(lambda: (i := dev_cluster.job(job)) and i.state.finished and i, 60, what="job finished")
    text = dev_cluster.output(job)
    assert text.count("ckptsup launch: started by srun as 2 tasks") == 1, text
    assert "without srun in front" in text and "the script ran" not in text and "rc=2" in text, text
    assert "Traceback" not in text and done.state is JobState.COMPLETED   # the batch script itself ended 0
