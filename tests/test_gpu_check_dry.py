"""bench/gpu_check.py (issue 25, docs/gpu.md) cannot rot between lent GPUs: its --dry-run runs every
part's code path on the CPU (tiny sizes, recorded nvidia-smi output and missing tools), and the
JSON it writes has the shape the device run's reader expects. The runner's budget and failure
handling are checked on stand-in parts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PARTS = ["env", "async_save", "restore", "memory_tier", "restart", "gpu_health", "nccl", "fingerprint"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--budget-s", "240",
                           "--out", str(out)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert out.exists(), proc.stderr[-2000:]
    data = json.loads(out.read_text())
    data["_rc"], data["_stderr"], data["_txt"] = proc.returncode, proc.stderr, out.with_suffix(".txt")
    return data


def test_dry_run_writes_the_whole_report(dry: dict) -> None:
    assert dry["_rc"] == 0, dry["_stderr"][-2000:]
    assert dry["schema"] == "ckptsup-gpu-check/1" and dry["dry_run"] is True and dry["device"] == "cpu"
    assert dry["complete"] is True
    assert list(dry["parts"]) == PARTS
    assert dry["summary"][0].startswith("ckptsup gpu_check — DRY RUN")
    assert dry["_txt"].read_text().splitlines() == dry["summary"]


def test_every_part_ran_or_says_why_not(dry: dict) -> None:
    for name, entry in dry["parts"].items():
        assert entry["status"] in ("ran", "skipped"), (name, entry.get("reason"), entry.get("traceback"))
        if entry["status"] == "skipped":
            assert entry["reason"], name
        else:
            assert entry["figures"] and entry["checks"], name
        assert entry["elapsed_s"] >= 0 and entry["share_s"] > 0


def test_every_correctness_check_passes_on_the_cpu(dry: dict) -> None:
    """Correctness holds on any device (timing targets are only claimed on a GPU)."""
    failed = {(name, check) for name, entry in dry["parts"].items() for check, ok in entry.get("checks", {}).items()
              if not ok}
    assert not failed
    parts = dry["parts"]
    assert parts["restore"]["checks"]["parameters and optimizer state bit-exact"]
    assert parts["async_save"]["figures"]["stager_allocations"] == 1
    assert parts["memory_tier"]["checks"]["restored from the agent bit-exact"]
    assert parts["restart"]["figures"]["ckptsup"]["fault_to_first_step_s"] > 0
    assert parts["nccl"]["figures"]["steady_timeout_s"] < parts["nccl"]["figures"]["init_timeout_s"]
    missing = parts["gpu_health"]["figures"]["missing"]["verdicts"]
    assert {v["status"] for v in missing.values()} == {"unknown"}
    assert not any("TARGET" in line for line in dry["summary"])


# ---- the runner on stand-in parts ------------------------------------------------------------------

def _runner():
    sys.path.insert(0, str(BENCH))
    import gpu_check

    return gpu_check


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    gc = _runner()
    ctx = gc.Context(dry_run=True, device="cpu", work=tmp_path, budget_s=60, args=argparse.Namespace())
    report = gc.Report(tmp_path / "r.json", ctx)

    def boom(ctx):
        raise RuntimeError("CUDA error: out of memory\nsecond line")

    def fine(ctx):
        return {"figures": {"x": 1.0}, "checks": {"ok": True}}

    def needs_budget(ctx):
        ctx.need(1e6, "a big step")
        return {}

    gc.run_parts([gc.Part("a", 1, 0, boom), gc.Part("b", 1, 0, fine, needs=("a",)), gc.Part("c", 1, 0, fine),
                  gc.Part("d", 1, 0, needs_budget), gc.Part("e", 1, 1e6, fine)], ctx, report)
    parts = json.loads((tmp_path / "r.json").read_text())["parts"]
    assert parts["a"]["status"] == "failed" and parts["a"]["reason"] == "RuntimeError: CUDA error: out of memory"
    assert parts["b"] == {**parts["b"], "status": "skipped", "reason": "needs part(s) a, which did not run"}
    assert parts["c"]["status"] == "ran" and parts["c"]["figures"] == {"x": 1.0}
    assert parts["d"]["status"] == "skipped" and parts["d"]["reason"].startswith("budget:")
    assert parts["e"]["status"] == "skipped" and "of the whole run" in parts["e"]["reason"]


def test_an_unreadable_kernel_log_without_dcgm_is_not_healthy() -> None:
    """The issue's rule: an absent source is "unknown", never healthy. gpu_health's XID check says
    ok ("kernel log unreadable") when dmesg fails and DCGM is missing; the verdicts flag that."""
    sys.path.insert(0, str(BENCH))
    from gpu_parts_proc import health_round

    from ckptsup.supervisor.health.gpu_health import Ran

    def runner(argv, timeout_s):
        if argv[0] == "dmesg":
            return Ran(rc=1, out="", err="dmesg: read kernel buffer failed: Operation not permitted")
        return None   # no nvidia-smi, no dcgmi

    verdicts = health_round(runner)["verdicts"]
    assert verdicts["gpu_xid"].get("absent_as_healthy") is True
    assert {verdicts[c]["status"] for c in ("gpu_ecc", "gpu_throttle", "gpu_remap", "gpu_diag")} == {"unknown"}
