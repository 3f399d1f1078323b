"""The dev cluster itself: up, kill-node, revive-node, down (real daemons)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ckptsup.slurm.devcluster import DevCluster
from ckptsup.slurm.devconf import ClusterSpec
from ckptsup.slurm.parsers import JobState, NodeState

pytestmark = pytest.mark.slurm


def test_every_node_is_idle_after_up_and_has_its_own_hostname_and_local_dir(dev_cluster):
    info = dev_cluster.client.node_info()
    assert sorted(info) == dev_cluster.nodes == ["n1", "n2", "n3", "n4", "n5"]
    assert all(i.healthy for i in info.values()), info
    job = dev_cluster.submit("#!/bin/bash\nsrun hostname\n", "-p", "mainspare", "-N", "5")
    dev_cluster.wait_for(lambda: dev_cluster.job_state(job) == JobState.COMPLETED, 30, what="5-node job")
    assert sorted(dev_cluster.output(job).split()) == dev_cluster.nodes
    for node in dev_cluster.nodes:
        assert dev_cluster.node_local_dir(node).is_dir()


def test_nodes_have_two_gpus_and_a_gpu_job_sees_them_in_its_batch_script_and_steps(dev_cluster):
    import stat

    for device in dev_cluster.cluster.spec.gpu_devices():
        assert stat.S_ISCHR(device.stat().st_mode) and device.parent == dev_cluster.dir / "dev"
    gres = dev_cluster.client.run(["sinfo", "-h", "-N", "-o", "%N %G"]).stdout.split("\n")
    assert {line.split()[1] for line in gres if line.strip()} == {"gpu:2"}  # no node dropped its GPUs
    show = 'echo "$(hostname) on=$SLURM_GPUS_ON_NODE job=$SLURM_JOB_GPUS cvd=$CUDA_VISIBLE_DEVICES"'
    job = dev_cluster.submit(f"#!/bin/bash\n{show}\nsrun --overlap -N2 --ntasks-per-node=1 bash -c '{show}'\n"
                             "scontrol show job -d $SLURM_JOB_ID\n", "-N", "2", "--gpus-per-node=2")
    dev_cluster.wait_for(lambda: dev_cluster.job_state(job) == JobState.COMPLETED, 30, what="GPU job")
    out = dev_cluster.output(job)
    lines = [x for x in out.splitlines() if " on=" in x]
    assert len(lines) == 3 and all(x.endswith(" on=2 job=0,1 cvd=0,1") for x in lines), out
    from ckptsup.slurm.allocation import gpus_from_scontrol

    assert gpus_from_scontrol(out) == 2  # the parser on this Slurm's own output
    plain = dev_cluster.submit(f"#!/bin/bash\n{show}\n", "-N", "1")
    dev_cluster.wait_for(lambda: dev_cluster.job_state(plain) == JobState.COMPLETED, 30, what="CPU job")
    assert dev_cluster.output(plain).strip().endswith(" on= job= cvd=")  # no GPU asked, none given


def test_up_is_idempotent_and_starts_nothing_new_when_running(dev_cluster):
    before = dev_cluster.cluster.status().daemons
    dev_cluster.cluster.up()
    assert dev_cluster.cluster.status().daemons == before


def test_kill_node_kills_every_process_of_the_node_at_once_and_revive_returns_it(dev_cluster):
    job = dev_cluster.submit("#!/bin/bash\nsrun sleep 300\n", "-w", "n3", "--no-requeue")
    dev_cluster.wait_for(lambda: len(dev_cluster.node_pids("n3")) >= 4, 20, what="step running on n3")
    pids = dev_cluster.node_pids("n3")
    with dev_cluster.revived("n3"):
        seconds = dev_cluster.kill_node("n3")
        assert seconds < 1.0
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert dev_cluster.node_pids("n3") == []
        dev_cluster.wait_for(lambda: not dev_cluster.client.node_info(["n3"])["n3"].responding, 30,
                             what="Slurm to see n3 not responding")
    assert dev_cluster.client.node_info(["n3"])["n3"].healthy
    dev_cluster.client.cancel(job)


def test_unknown_node_is_refused_with_one_line(dev_cluster):
    from ckptsup.errors import DevClusterError

    with pytest.raises(DevClusterError, match="unknown node 'n9'; nodes: n1, n2"):
        dev_cluster.kill_node("n9")


def test_second_cluster_on_other_ports_coexists_and_down_leaves_no_process(dev_cluster, tmp_path):
    spec = ClusterSpec(dir=tmp_path / "second", port_base=dev_cluster.cluster.spec.port_base + 500, nodes=2, spares=1)
    second = DevCluster(spec)
    try:
        second.up()
        assert set(second.client().node_info()) == {"n1", "n2"}
        pids = second.running_pids()
        assert len(pids) >= 2 + 2 * 2  # munged, slurmctld, and per node: unshare + tini + slurmd
    finally:
        second.down()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert second.running_pids() == []
    # the session's cluster is untouched
    assert all(i.healthy for i in dev_cluster.client.node_info().values())


def test_cli_up_prints_export_line_and_status_reports_nodes(dev_cluster):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "ckptsup.cli", "dev-cluster"]
    args = ["--dir", str(dev_cluster.dir), "--port-base", str(dev_cluster.cluster.spec.port_base)]
    same = ["--first-job-id", str(dev_cluster.cluster.spec.first_job_id)]   # the session's slot (conftest)
    out = subprocess.run(cmd + ["up", *args, *same], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"export SLURM_CONF={dev_cluster.conf}"
    st = subprocess.run(cmd + ["status", "--json", *args], capture_output=True, text=True, env=env, timeout=60)
    import json

    nodes = json.loads(st.stdout)["nodes"]
    assert sorted(nodes) == dev_cluster.nodes
    assert all(v["responding"] and NodeState(v["state"]).usable for v in nodes.values()), nodes


def test_no_daemon_of_the_cluster_listens_on_every_interface(dev_cluster):
    pids = set(dev_cluster.cluster.running_pids())
    listeners = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert {c.laddr.port for c in listeners} >= set(dev_cluster.cluster.spec.ports())
    assert all(c.laddr.ip == "127.0.0.1" for c in listeners), listeners


def test_node_names_resolve_inside_the_nodes_and_the_hosts_file_of_this_machine_is_untouched(dev_cluster):
    before = Path("/etc/hosts").read_text()
    job = dev_cluster.submit("#!/bin/bash\nsrun getent hosts n2\n", "-w", "n1")
    dev_cluster.wait_for(lambda: dev_cluster.job_state(job) == JobState.COMPLETED, 20, what="job done")
    assert dev_cluster.output(job).split() == ["127.0.0.1", "n1", "n2", "n3", "n4", "n5"]
    assert Path("/etc/hosts").read_text() == before


def test_cancel_all_leaves_no_job_and_every_node_usable(idle_cluster):
    dev_cluster = idle_cluster
    jobs = [dev_cluster.submit("#!/bin/bash\nsleep 300\n", "-N", "2") for _ in range(3)]
    dev_cluster.wait_for(lambda: any(dev_cluster.job_state(j) == JobState.RUNNING for j in jobs), 20, what="a job running")
    dev_cluster.cancel_all()
    assert all(dev_cluster.job_state(j) in (JobState.CANCELLED, None) for j in jobs)
    assert all(i.healthy for i in dev_cluster.client.node_info().values())


def test_a_second_cluster_on_ports_in_use_is_refused_with_one_line(dev_cluster, tmp_path):
    from ckptsup.errors import DevClusterError

    other = DevCluster(ClusterSpec(dir=tmp_path / "clash", port_base=dev_cluster.cluster.spec.port_base))
    with pytest.raises(DevClusterError, match=r"port \d+ on 127.0.0.1 is in use .*choose another --port-base"):
        other.up()
    assert other.running_pids() == []
