"""Accounting on a real faulted run: `ckptsup launch` (local mode, 2 gloo ranks on CPU) with an
injected crash after a checkpoint; the report's categories plus useful time equal paid time, and
the crash shows up as lost progress, detection and restart phases. The dev-cluster version (the
lead's) runs the same checks under Slurm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.planning.accounting import account

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def faulted_run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("faulted")
    run_dir = base / "run"
    cmd = [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           str(ROOT / "examples" / "train.py"), "--steps", "60", "--save-every-steps", "10",
           "--step-sleep-s", "0.05", "--crash-at-step", "35", "--out", str(base / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_dir


def test_real_run_badput_plus_useful_equals_paid_within_one_percent(faulted_run_dir):
    acc = account(read_events(faulted_run_dir))
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert acc.paid_device_s > 0
    assert abs(total - acc.paid_device_s) <= 0.01 * acc.paid_device_s
    assert acc.failures.get("crash") == 1 and acc.end_reason == "run_complete"


def test_real_crash_is_charged_to_lost_progress_detection_and_restart(faulted_run_dir):
    acc = account(read_events(faulted_run_dir))
    bad = acc.badput_device_s
    assert bad["lost_progress"] > 0          # steps 30..35 were redone
    # a crash is seen as the process exits (detect_s may be 0.0): detection is charged exactly what
    # the failure_detected events measured, on the job's 2 devices
    detect_s = sum(e.get("detect_s") or 0.0 for e in read_events(faulted_run_dir) if e["event"] == "failure_detected")
    assert acc.detects_s and bad["detection"] == pytest.approx(2 * detect_s, rel=0.01, abs=1e-6)
    assert sum(v for k, v in bad.items() if k.startswith("restart_")) > 0
    assert acc.useful_device_s > 0
    # GPU-less local node: its 2 ranks are the devices
    assert acc.mean_active_devices == pytest.approx(2)


def test_real_run_report_json_and_prom(faulted_run_dir, tmp_path):
    prom = tmp_path / "run.prom"
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "report", str(faulted_run_dir), "--json",
                           "--prom", str(prom)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["measured_stall_s"] is not None and rep["measured_restart_s"] > 0
    assert rep["recommended"]["interval_daly_s"] > 0
    assert "ckptsup_goodput_ratio" in prom.read_text()


def test_real_run_retunes_the_interval_from_measured_costs(faulted_run_dir):
    changes = [e for e in read_events(faulted_run_dir) if e["event"] == "interval_changed"]
    assert changes, "the supervisor never applied the adaptive interval"
    assert all(e["interval_s"] > 0 and "Daly" in e["why"] for e in changes)
    # the failure moved the posterior MTBF, and with it the interval
    assert any(e["why"].startswith("failure_detected") for e in changes)
