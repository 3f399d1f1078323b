"""Health checks through one `srun --overlap` step on real dev-cluster nodes: each node reports
its own results; a failing site command marks exactly that node unhealthy; a dead node is
unhealthy because it reports nothing."""

from __future__ import annotations

import time

import pytest

from ckptsup.config import Config, Resolved, write_config_json
from ckptsup.rundir import RunDir
from ckptsup.slurm.parsers import JobState
from ckptsup.supervisor.health.health import run_node_checks

pytestmark = pytest.mark.slurm


def setup(tmp_path, commands):
    rd = RunDir.create(tmp_path / "run")
    config = Config()
    config.health.commands = commands
    config.health.timeout_s = 5.0
    config.health.check_gpus = "off"
    config.storage.min_free_gb = 0.001
    write_config_json(Resolved(config=config, provenance={}), rd.config_json_path)
    return rd, config


def allocation(dev_cluster, n: int, *extra: str):
    job = dev_cluster.submit("#!/bin/bash\nsleep 300\n", "-N", str(n), "-p", "main", *extra)
    info = dev_cluster.wait_for(lambda: (i := dev_cluster.job(job)) and i.state == JobState.RUNNING and i, 30,
                                what="allocation running")
    return job, info.nodes


def test_failing_site_command_marks_only_that_node_unhealthy(dev_cluster, tmp_path):
    job, nodes = allocation(dev_cluster, 2)
    try:
        bad = nodes[1]
        rd, config = setup(tmp_path, ["true", f"sh -c 'test \"$CKPTSUP_NODE\" != {bad} || {{ echo disk errors >&2; exit 1; }}'"])
        t0 = time.monotonic()
        results = run_node_checks(nodes, rd.path, config, job_id=job)
        took = time.monotonic() - t0
        assert set(results) == set(nodes)
        assert results[nodes[0]].ok, results[nodes[0]]
        assert not results[bad].ok
        (failed,) = results[bad].failed
        assert failed.name.startswith("site:sh -c") and "disk errors" in failed.detail
        assert {r.name for r in results[nodes[0]].results} == {"site:true", failed.name, "free_space:shared", "shared_fs"}
        print(f"\nHEALTH_STEP nodes={nodes} took {took:.2f}s")
    finally:
        dev_cluster.client.cancel(job)


def test_dead_node_reports_nothing_and_is_unhealthy(dev_cluster, tmp_path):
    job, nodes = allocation(dev_cluster, 2, "--no-kill")
    dead = nodes[1]
    try:
        rd, config = setup(tmp_path, [])
        with dev_cluster.revived(dead):
            dev_cluster.kill_node(dead)
            results = run_node_checks(nodes, rd.path, config, job_id=job)
        assert not results[dead].ok and "no health result" in results[dead].summary()
        assert results[nodes[0]].ok, results[nodes[0]].summary()  # the dead node blames no one else
    finally:
        dev_cluster.client.cancel(job)


def test_a_node_slurm_refuses_fails_alone(dev_cluster, tmp_path):
    job, nodes = allocation(dev_cluster, 1)
    outsider = next(n for n in dev_cluster.nodes if n not in nodes)  # not in the allocation
    try:
        rd, config = setup(tmp_path, [])
        results = run_node_checks([nodes[0], outsider], rd.path, config, job_id=job)
        assert results[nodes[0]].ok
        assert not results[outsider].ok and "srun exit" in results[outsider].summary()
    finally:
        dev_cluster.client.cancel(job)
