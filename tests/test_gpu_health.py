"""GPU health (supervisor/health/gpu_health.py) against stand-in nvidia-smi, dcgmi and dmesg that print
recorded output in the real tools' formats (tests/helpers/gpu_tools): XIDs from the kernel log and
DCGM, ECC and pending retirements, row remaps, clock throttling, dcgmi diag; the thresholds in
[health]; and the checks through run_local_checks."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
from pathlib import Path

import pytest

from ckptsup.config import HealthConfig, load_config
from ckptsup.errors import ConfigError
from ckptsup.supervisor.health.gpu_health import Ran, gpu_checks, run_tool

TOOLS = Path(__file__).parent / "helpers" / "gpu_tools"


def which(name: str) -> str | None:
    path = TOOLS / name
    return str(path) if path.exists() else None


def _stand_ins():
    spec = importlib.util.spec_from_file_location("gputool", TOOLS / "gputool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPUTOOL = _stand_ins()


def in_process(argv, timeout_s: float) -> Ran | None:
    """The stand-ins' recorded output without a process per call (the unit tier's budget); the
    tests at the end run them as the executables they are."""
    if not (TOOLS / argv[0]).exists():
        return None
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = GPUTOOL.dispatch(argv[0], list(argv[1:]))
    return Ran(rc=rc, out=out.getvalue(), err=err.getvalue())


def checks(monkeypatch, faults: str = "", *, run=in_process, **health) -> dict[str, tuple[bool, str]]:
    monkeypatch.setenv("CKPTSUP_FAKE_GPU", faults)
    return {r.name: (r.ok, r.detail) for r in gpu_checks(HealthConfig(**health), run)}


def test_a_healthy_node_passes_every_gpu_check(monkeypatch):
    got = checks(monkeypatch, run=run_tool(which))   # the stand-ins as executables
    assert set(got) == {"gpu_xid", "gpu_ecc", "gpu_throttle", "gpu_remap", "gpu_diag"}
    assert all(ok for ok, _ in got.values()), got
    assert got["gpu_xid"][1] == "no XID" and got["gpu_diag"][1] == "dcgmi diag -r 1 passed"


@pytest.mark.parametrize("fault, check, says", [
    ("xid79", "gpu_xid", "XID 79 on PCI:0000:2a:00"),
    ("dcgm_xid48", "gpu_xid", "XID 48 on GPU 1 (DCGM)"),
    ("ecc", "gpu_ecc", "GPU 1: 3 uncorrected ECC"),
    ("retire", "gpu_ecc", "GPU 1: page retirement pending (reset the GPU)"),
    ("remap", "gpu_remap", "00000000:2A:00.0: row remap pending (reset the GPU)"),
    ("remap_failed", "gpu_remap", "00000000:2A:00.0: row remap failed"),
    ("throttle", "gpu_throttle", "GPU 1: hw_thermal_slowdown"),
    ("diagfail", "gpu_diag", "dcgmi diag -r 1 failed: Page Retirement/Row Remap"),
    ("smi_fails", "gpu_ecc", "nvidia-smi --query-gpu exit 255: Unable to determine the device handle"),
])
def test_each_hardware_signal_makes_the_node_unhealthy_naming_the_gpu(monkeypatch, fault, check, says):
    got = checks(monkeypatch, fault)
    ok, detail = got[check]
    assert not ok and says in detail, detail
    assert all(ok for name, (ok, _) in got.items() if name != check)   # only that check fails


def test_an_application_xid_is_reported_but_not_fatal_and_thresholds_come_from_the_site(monkeypatch):
    ok, detail = checks(monkeypatch, "xid13")["gpu_xid"]
    assert ok and "XID 13 on PCI:0000:18:00" in detail and "not in gpu_fatal_xids" in detail
    assert not checks(monkeypatch, "xid13", gpu_fatal_xids=[13])["gpu_xid"][0]
    assert checks(monkeypatch, "ecc", gpu_max_uncorrected_ecc=5)["gpu_ecc"][0]
    assert checks(monkeypatch, "throttle", gpu_fatal_throttle=["hw_slowdown"])["gpu_throttle"][0]
    assert "gpu_diag" not in checks(monkeypatch, dcgm_diag="off")


def test_a_restricted_kernel_log_is_said_not_failed(monkeypatch):
    ok, detail = checks(monkeypatch, "dmesg_restricted")["gpu_xid"]
    assert ok and "kernel log unreadable (dmesg: read kernel buffer failed: Operation not permitted" in detail


def test_without_any_gpu_tool_there_is_no_gpu_result(monkeypatch):
    assert gpu_checks(HealthConfig(), run_tool(lambda name: None)) == []


def test_the_gpu_checks_run_with_the_gpu_count_in_the_nodes_checks(monkeypatch, tmp_path):
    from ckptsup.supervisor.health.health import CheckPaths, run_local_checks

    monkeypatch.setenv("CKPTSUP_FAKE_GPU", "xid79")
    config = load_config().config
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, min_free_gb=0.0))
    results = {r.name: r for r in run_local_checks(config, CheckPaths(run_dir=tmp_path, tiers={}), node="n1",
                                                   which=which, gpus_per_node=2)}
    assert results["gpus"].ok and "2 GPU(s) visible" in results["gpus"].detail
    assert not results["gpu_xid"].ok and results["gpu_ecc"].ok
    cpu_only = run_local_checks(config, CheckPaths(run_dir=tmp_path, tiers={}), node="n1", which=which, gpus_per_node=0)
    assert not [r for r in cpu_only if r.name.startswith("gpu")]   # auto: no GPU in the allocation, no GPU check


def test_xids_in_the_config_are_integers(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[health]\ngpu_fatal_xids = ["79"]\n')
    with pytest.raises(ConfigError, match=r"health.gpu_fatal_xids .*must be a list of integers"):
        load_config(job_config=str(job))
