"""Shared fixtures. The `dev_cluster` fixture is the real local Slurm cluster (ckptsup.slurm.
devcluster) for every test marked `@pytest.mark.slurm`.

Usage:

    @pytest.mark.slurm
    def test_something(dev_cluster):
        job = dev_cluster.submit("#!/bin/bash\\nsrun hostname\\n", "-N", "2")
        dev_cluster.wait_for(lambda: dev_cluster.job_state(job) == JobState.COMPLETED, 30)
        print(dev_cluster.output(job))

The cluster is brought up once per session (fresh: any leftover of an earlier session in the
same directory is stopped first) and torn down at the end, which fails if a daemon survives.
os.environ gets SLURM_CONF (so SlurmClient() and plain sbatch/squeue reach it) and the venv's
bin directory on PATH (so jobs can run `ckptsup`). Tests that kill a node revive it before they
end (`revived(node)` does that as a context manager).

`idle_cluster` is the same handle after cancelling every job and waiting for all nodes usable.

Several pytest sessions on one machine do not share a cluster: the fixture takes an flock on
/tmp/ckptsup-test-cluster.lock and, when another session holds it, uses
/tmp/ckptsup-test-cluster-K with port base 17100+10K instead. CKPTSUP_TEST_CLUSTER_DIR and
CKPTSUP_TEST_CLUSTER_PORT_BASE pin one explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

TEST_CLUSTER_DIR = Path("/tmp/ckptsup-test-cluster")
TEST_PORT_BASE = 17100


@dataclass
class DevClusterFixture:
    """Handle on the session's dev cluster (see the module docstring)."""

    cluster: Any                      # ckptsup.slurm.devcluster.DevCluster
    client: Any                       # ckptsup.slurm.client.SlurmClient bound to this cluster
    _lock: Any = field(repr=False, default=None)

    @property
    def dir(self) -> Path:
        return self.cluster.spec.dir

    @property
    def conf(self) -> Path:
        return self.cluster.conf

    @property
    def nodes(self) -> list[str]:
        return self.cluster.spec.node_names

    @property
    def jobs_dir(self) -> Path:
        return self.dir / "jobs"

    @property
    def grace_time_s(self) -> int:
        return self.cluster.spec.grace_time_s

    def node_local_dir(self, node: str) -> Path:
        return self.cluster.spec.node_local_dir(node)

    def kill_node(self, node: str) -> float:
        return self.cluster.kill_node(node)

    def revive_node(self, node: str, timeout_s: float = 30.0) -> float:
        return self.cluster.revive_node(node, timeout_s=timeout_s)

    @contextlib.contextmanager
    def revived(self, *nodes: str) -> Iterator[None]:
        """Revive `nodes` (and wait until usable) when the block ends, however it ends."""
        try:
            yield
        finally:
            for node in nodes:
                self.revive_node(node)

    def node_pids(self, node: str) -> list[int]:
        """Host PIDs of every process of `node`."""
        return self.cluster.node_pids(node)

    def submit(self, script_text: str, *args: str) -> str:
        """Write `script_text` to jobs/ and sbatch it with `args`; output goes to
        jobs/<job_id>.out unless args name --output/-o. Returns the job id."""
        self.jobs_dir.mkdir(exist_ok=True)
        path = self.jobs_dir / f"job-{uuid.uuid4().hex[:8]}.sbatch"
        path.write_text(script_text)
        path.chmod(0o700)
        extra = list(args)
        if not any(a in ("-o", "--output") or a.startswith("--output=") for a in extra):
            extra.append(f"--output={self.jobs_dir}/%j.out")
        return self.client.submit(path, extra)

    def output(self, job_id: str) -> str:
        path = self.jobs_dir / f"{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def job(self, job_id: str):
        return self.client.job_info(job_id)

    def give_back(self, node: str, timeout: float = 30.0) -> None:
        """Resume `node` and wait until it is healthy: 24.11+ show it `idle*` (not responding)
        for ~1 s after RESUME, and a later test must not start on it before that clears."""
        self.client.resume(node)
        self.wait_for(lambda: (i := self.client.node_info([node]).get(node)) and i.healthy, timeout,
                      what=f"{node} back in service")

    def job_state(self, job_id: str):
        """The job's JobState, or None when Slurm no longer knows it."""
        info = self.client.job_info(job_id)
        return info.state if info else None

    @staticmethod
    def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "") -> Any:
        """Poll `predicate` until it returns something truthy (returned); fail the test after
        `timeout` seconds naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:g}s waiting for {what or predicate}")
            time.sleep(interval)

    def cancel_all(self, timeout: float = 30.0) -> None:
        """Cancel every job and wait until every node is usable again."""
        from ckptsup.slurm.parsers import JobState

        result = self.client.run(["squeue", "-h", "-o", "%i"])
        for job_id in result.stdout.split():
            self.client.cancel(job_id)

        def settled() -> bool:
            out = self.client.run(["squeue", "-h", "-o", "%i %T"]).stdout.split("\n")
            live = [line for line in out if line.strip() and not JobState(line.split()[1]).finished]
            return not live and all(i.healthy for i in self.client.node_info().values())

        self.wait_for(settled, timeout, what="all jobs gone and all nodes usable")


def _acquire_cluster_slot() -> tuple[Path, int, int, Any]:
    """(directory, port base, first job id, lock) of a free dev-cluster slot."""
    if os.environ.get("CKPTSUP_TEST_CLUSTER_DIR"):
        directory = Path(os.environ["CKPTSUP_TEST_CLUSTER_DIR"])
        base = int(os.environ.get("CKPTSUP_TEST_CLUSTER_PORT_BASE", TEST_PORT_BASE))
        lock = open(f"{directory}.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return directory, base, 1, lock
    for k in range(9):
        directory = TEST_CLUSTER_DIR if k == 0 else Path(f"{TEST_CLUSTER_DIR}-{k}")
        lock = open(f"{directory}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return directory, TEST_PORT_BASE + 10 * k, 1 + 100_000 * k, lock
    pytest.fail("nine pytest sessions already hold a dev cluster; wait for one to finish")


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[DevClusterFixture]:
    from ckptsup.slurm.devcluster import DevCluster
    from ckptsup.slurm.devconf import ClusterSpec

    directory, base, first_job_id, lock = _acquire_cluster_slot()
    # Slurm's OCI containers with runc (tests/test_container_slurm.py) where runc is installed (`make setup`)
    spec = ClusterSpec(dir=directory, port_base=base, first_job_id=first_job_id,
                       containers=shutil.which("runc") is not None)
    with fresh_cluster(DevCluster(spec), lock, "dev cluster") as handle:
        yield handle


@contextlib.contextmanager
def fresh_cluster(cluster: Any, lock: Any, what: str) -> Iterator[DevClusterFixture]:
    """`cluster` (a DevCluster) stopped, started, and made this process's Slurm (SLURM_CONF, and
    PATH for `ckptsup`); at the end stopped, `lock` released, and a failure if a daemon survives."""
    cluster.down()  # a fresh cluster: whatever an earlier session left here is stopped first
    cluster.up()
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    os.environ["SLURM_CONF"] = str(cluster.conf)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        yield DevClusterFixture(cluster=cluster, client=cluster.client(), _lock=lock)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        cluster.down()
        left = cluster.running_pids()
        lock.close()
        if left:
            pytest.fail(f"{what} left processes behind: {left}")


@pytest.fixture
def idle_cluster(dev_cluster: DevClusterFixture) -> DevClusterFixture:
    """The session's dev cluster with no job left from earlier tests and every node usable."""
    dev_cluster.cancel_all()
    return dev_cluster


# Test tiers. `make test-fast` runs `-m "not slurm and not integration"` (the unit tier, < 2 min on
# 2 cores); `make test` runs everything. Files whose tests start real multi-process torch runs
# (torchrun, the supervisor over examples/train.py) are the integration tier; listing them here
# keeps the split in one place instead of a marker line in each file.
INTEGRATION_FILES = frozenset({
    "test_accounting_real.py",
    "test_control_local.py",
    "test_elastic.py",
    "test_external_titan.py",
    "test_external_unit.py",
    "test_give_up_quote_local.py",
    "test_heartbeat_torchrun.py",
    "test_integration_hf.py",
    "test_integration_hf_unit.py",
    "test_integration_lightning.py",
    "test_integration_lightning_unit.py",
    "test_memory_sources.py",
    "test_memory_tier.py",
    "test_hooks_api.py",
    "test_hooks_agent_socket.py",
    "test_hooks_corruption.py",
    "test_hooks_disk_full.py",
    "test_hooks_metadata.py",
    "test_hooks_node_local.py",
    "test_hooks_object_restore.py",
    "test_hooks_preemption.py",
    "test_relaunch_local.py",
    "test_resume_bitexact.py",
    "test_resume_fsdp2.py",
    "test_spare_agent.py",
    "test_supervisor_local.py",
    "test_supervisor_train.py",
    "test_sdc_real.py",                       # real torchrun runs: SDC caught, no false alarm
    "test_sdc_hsdp.py",
    "test_integration_hf_memory.py",
    "test_integration_hf_save_strategy.py",
    "test_gpu_check_dry.py",                  # bench/gpu_check.py --dry-run: real stand-in runs
})


# The fuzz tier (tests/test_fuzz_*.py, property-based with Hypothesis) is marked `fuzz`, and
# `integration` too: under the "ci" profile it takes ~50 s on 2 cores, too much for the unit tier's
# budget, so `make test` runs it and `make test-fast` does not; `make fuzz` runs it alone under the
# "fuzz" profile.
FUZZ_PREFIX = "test_fuzz_"


# `make test` hands whole files to pytest-xdist workers in collection order (`--dist loadfile
# --no-loadscope-reorder`). The longest files go first (longest-processing-time-first): a long file
# picked up last would set the wall time alone. Seconds per file from a measured `-n 4` run
# (BENCHMARKS.md §Test suite; refresh from a run's `--junitxml` with `python tests/file_seconds.py
# JUNIT --min-s 40`); a file not listed keeps its place after them.
FILE_SECONDS: dict[str, float] = {   # 2026-12-06 21:00, a clean clone at -n 4 (make test 20 m 29 s); files >= 40 s
    "test_supervisor_slurm_node_death.py": 285,
    "test_phase_local.py": 237,
    "test_supervisor_slurm_memory.py": 234,
    "test_supervisor_slurm_sdc_elastic.py": 194,
    "test_liveness_local.py": 159,
    "test_supervisor_train.py": 141,
    "test_integration_hf.py": 139,
    "test_supervisor_local.py": 133,
    "test_integration_hf_slurm.py": 120,
    "test_resume_bitexact.py": 119,
    "test_stragglers_cluster.py": 114,
    "test_data_wait_local.py": 109,
    "test_drop_in_slurm.py": 100,
    "test_watchdog_template.py": 98,
    "test_integration_lightning_slurm.py": 98,
    "test_integration_hf_save_strategy.py": 97,
    "test_progress_frameworks.py": 97,
    "test_integration_lightning.py": 94,
    "test_hf_dropin_local.py": 92,
    "test_integration_lightning_frameworks.py": 87,
    "test_heartbeat_torchrun.py": 87,
    "test_slurm_lost_step.py": 85,
    "test_container_slurm.py": 83,
    "test_teardown_local.py": 76,
    "test_slurm_cluster.py": 73,
    "test_script_checkpoint_local.py": 71,
    "test_sdc_real.py": 68,
    "test_elastic.py": 68,
    "test_script_checkpoint_slurm.py": 62,
    "test_data_wait_slurm.py": 62,
    "test_checkpoint_hostile.py": 54,
    "test_requeue_template.py": 52,
    "test_drop_in_local.py": 51,
    "test_hf_dropin_slurm.py": 51,
    "test_cloud_notice_slurm.py": 49,
    "test_resume_fsdp2.py": 48,
    "test_relaunch_local.py": 45,
    "test_progress_frameworks_slurm.py": 44,
    "test_cli_bad_inputs.py": 42,
    "test_integration_hf_memory.py": 42,
    "test_hooks_node_local.py": 42,
    "test_hooks_agent_socket.py": 41,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0.0))   # stable: each file stays whole, in order
    for item in items:
        if item.path.name in INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)
        if item.path.name.startswith(FUZZ_PREFIX):
            item.add_marker(pytest.mark.fuzz)
            item.add_marker(pytest.mark.integration)


# Hypothesis profiles. "ci", the default, is deterministic (derandomized: the same examples on every
# run, so a property test never flakes) and cheap; "fuzz" is `make fuzz` (HYPOTHESIS_PROFILE=fuzz, or
# pytest --hypothesis-profile=fuzz): 10,000 examples per test, a fresh random seed each run. Neither
# keeps an example database in the checkout: a failure prints its example and a reproduction blob.
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the dev extra installs it; without it only the fuzz tier cannot run
    pass
else:
    _hypothesis_settings.register_profile("ci", deadline=None, max_examples=150, derandomize=True,
                                          database=None, print_blob=True)
    _hypothesis_settings.register_profile("fuzz", deadline=None, max_examples=10_000, database=None,
                                          print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
