"""Silent data corruption with real gloo ranks under `ckptsup launch` (docs/sdc.md): three DDP
replicas, a bit flipped in one replica's weight mid-run (tests/helpers/sdc_train.py) — caught at
the next fingerprint step, the rank named, the run resumed from a checkpoint before the flip and
ending with the uninterrupted run's parameters on every replica; a flip just before a save leaves
a checkpoint that is never validated nor resumed from; and no false alarm with fingerprints at
every step."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from run_helpers import run_named

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "helpers" / "sdc_train.py"
RANKS = 3


def launch(tmp: Path, *args: str, every_steps: int, timeout: float = 600, extra: str = "") -> tuple[Path, Path, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "job.toml"
    cfg.write_text("[supervisor]\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\n[checkpoint]\nadaptive_interval = false\n"
                   f"keep_daily_days = 0\ntest_load_every = 0\nkeep_last = 10\n[sdc]\nevery_steps = {every_steps}\n{extra}")
    run, out = tmp / "run", tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", str(RANKS), "--config",
                           str(cfg), "--run-dir", str(run), str(TRAIN), *args, "--out", str(out)],
                          cwd=tmp, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run, out, proc.stdout + proc.stderr


def finals(out: Path) -> list[dict]:
    return [torch.load(out / f"final_rank{r}.pt") for r in range(RANKS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run, fingerprints at every step: no false alarm either."""
    run, out, _ = launch(tmp_path_factory.mktemp("reference"), "--steps", "60", every_steps=1)
    assert not run_named(run, "failure_detected")
    return finals(out)


def test_a_flipped_bit_is_caught_the_rank_named_and_the_run_ends_as_if_it_never_happened(tmp_path, reference):
    # two faults chained in one run: a flip after step 23 on rank 1 (caught by the every-5-steps
    # check at step 24, no save there), then a flip after step 39 on rank 2, just before the save
    # of step_40: that checkpoint is written disagreeing, refused, and the run resumes from step_30
    live = tmp_path / "live.prom"
    run, out, _ = launch(tmp_path, "--steps", "60", "--flip", "23:1", "--flip", "39:2", every_steps=5,
                         extra=f'[report]\nprom_textfile = "{live}"\n')
    failures = run_named(run, "failure_detected")
    assert [(f["kind"], f["rank"], f["step"]) for f in failures] == [("sdc", 1, 24), ("sdc", 2, 39)]
    assert "rank(s) 1" in failures[0]["detail"] and "majority of 3 copies" in failures[0]["detail"]
    assert [r["resume_step"] for r in run_named(run, "restart_done")] == [20, 30]
    [rejected] = run_named(run, "checkpoint_rejected")
    assert rejected["step"] == 40 and "replicas disagreed at step 40 (ranks 2 in dispute)" in rejected["reason"]
    [quarantined] = list((run / "checkpoints" / "quarantine").iterdir())
    assert quarantined.name.startswith("step_40")
    manifest = json.loads((quarantined / "manifest.json").read_text())
    assert manifest["extra"]["replicas"]["agree"] is False and manifest["extra"]["replicas"]["disputed"] == [2]
    redone = json.loads((run / "checkpoints" / "step_40" / "manifest.json").read_text())
    assert redone["extra"]["replicas"] == {"agree": True, "copies": 3,
                                           "fingerprint": redone["extra"]["replicas"]["fingerprint"]}
    # ckptsup ckpt verify / inspect say why the disagreeing one is never used (a copy under its step name)
    evidence = tmp_path / "evidence"
    evidence.mkdir(mode=0o700)
    shutil.copytree(quarantined, evidence / "step_40")
    quarantined = evidence / "step_40"
    cli = [sys.executable, "-m", "ckptsup.cli", "ckpt"]
    verify = subprocess.run([*cli, "verify", str(quarantined)], capture_output=True, text=True)
    assert verify.returncode != 0 and "replicas disagreed at step 40" in verify.stdout + verify.stderr
    shown = subprocess.run([*cli, "inspect", str(quarantined)], capture_output=True, text=True).stdout
    assert "DISAGREED (3 copies; in dispute: [2]): never resumed from" in shown
    got = finals(out)
    for r in range(RANKS):   # every replica identical, and the uninterrupted run's within reduction-order noise
        for name, value in got[r]["params"].items():
            assert torch.equal(value, got[0]["params"][name]), (r, name)
            torch.testing.assert_close(value, reference[r]["params"][name], rtol=1e-6, atol=1e-7)
    the_run_reports_its_sdc(run, live, tmp_path)


def the_run_reports_its_sdc(run: Path, live: Path, tmp: Path) -> None:
    """ckptsup report (JSON, terminal, --prom), ckptsup status --json and the live textfile on the
    chained run above (docs/sdc.md §Where to see it): two incidents, each caught within 5 steps of
    the last agreeing check (the every-5-steps schedule), 5 + 10 steps run again, one checkpoint
    refused, and a fingerprint cost that was measured."""
    prom = tmp / "report.prom"
    cli = [sys.executable, "-m", "ckptsup.cli"]
    done = subprocess.run([*cli, "report", str(run), "--json", "--prom", str(prom)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    sdc = json.loads(done.stdout)["sdc"]
    assert [(i["step"], i["ranks"], i["agreed_step"], i["detect_lag_steps"], i["resume_step"], i["rolled_back_steps"],
             i["outcome"]) for i in sdc["list"]] == [(24, [1], 19, 5, 20, 5, "transient"),
                                                      (39, [2], 34, 5, 30, 10, "transient")]
    assert sdc["incidents"] == 2 and sdc["detect_lag_steps_max"] == 5 and sdc["rolled_back_steps"] == 15
    assert sdc["checkpoints_refused"] == 1 and sdc["nan"]["incidents"] == 0
    assert sdc["fingerprint_s"] > 0 and 0 < sdc["fingerprint_share"] < 1
    terminal = subprocess.run([*cli, "report", str(run)], capture_output=True, text=True, env={**os.environ,
                                                                                              "COLUMNS": "200"})
    assert "SDC incidents" in terminal.stdout and "2 (transient 2)" in terminal.stdout, terminal.stdout
    status = subprocess.run([*cli, "status", str(run), "--json"], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["sdc"]["list"] == sdc["list"]
    for text in (prom.read_text(), live.read_text()):
        assert re.search(r'^ckptsup_sdc_incidents_total\{job_id="[^"]*"\} 2$', text, re.M), text
        assert re.search(r'^ckptsup_sdc_rolled_back_steps_total\{job_id="[^"]*"\} 15$', text, re.M)
        assert re.search(r'^ckptsup_sdc_detect_lag_steps\{job_id="[^"]*"\} 5$', text, re.M)
        assert float(re.search(r'^ckptsup_sdc_fingerprint_seconds_total\{[^}]*\} (\S+)$', text, re.M).group(1)) > 0


def test_no_false_alarm_over_2000_steps_with_fingerprints_at_every_step(tmp_path):
    run, out, _ = launch(tmp_path, "--steps", "2000", "--save-every-steps", "500", every_steps=1)
    assert not [e for e in run_named(run, "failure_detected")]
    assert [f["checks"] for f in finals(out)] == [2000] * RANKS
    for step in (500, 1000, 1500, 2000):
        manifest = json.loads((run / "checkpoints" / f"step_{step}" / "manifest.json").read_text())
        assert manifest["extra"]["replicas"]["agree"] is True


def test_ranks_that_hold_different_models_by_design_are_not_compared(tmp_path):
    """A plain module per rank, each seeded differently (as pipeline stages or per-rank models hold
    other bytes): at the defaults nothing says they are replicas, so no check runs and nothing is
    a false alarm, even with fingerprints due at every step."""
    run, out, log = launch(tmp_path, "--steps", "20", "--per-rank-model", every_steps=1)
    assert not run_named(run, "failure_detected"), [(e["kind"], e["detail"]) for e in run_named(run, "failure_detected")]
    assert [f["checks"] for f in finals(out)] == [0] * RANKS
    assert "no replica fingerprints: the model is not DistributedDataParallel" in log
    manifest = json.loads((run / "checkpoints" / "step_20" / "manifest.json").read_text())
    assert "replicas" not in manifest["extra"]
