"""A quiet evaluation is not a hang, at the defaults (issue 22 §4), under the real `ckptsup launch`
(local mode, torchrun, 2 gloo ranks, CPU): an attach script computing 45 s inside
`ckptsup.phase("eval")`, Lightning with a 40 s validation pass, Hugging Face with a 40 s
`evaluate()` — each without a print or a step for longer than the hang timeout (30 s), each must
complete with no failure and its eval phase in `ckptsup log` and the report's time per phase. And
the knob can fail: an eval phase past its own `eval_timeout_s` is a hang, named as such."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.events import read_events

from hooks_helpers import base_env, private_dir
from run_helpers import config_args, named

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"


def launch(tmp: Path, script: str, *args: str, config: str | None = None, timeout: float = 420) -> tuple[int, str, Path]:
    """`ckptsup launch --nproc-per-node 2 SCRIPT ...`, at the defaults unless `config` (a job TOML)."""
    tmp = private_dir(tmp)
    run, out = tmp / "run", tmp / "out"
    argv = [sys.executable, "-m", "ckptsup.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run),
            *config_args(tmp, config), str(HELPERS / script), *args, "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, run


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", *args], env=base_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_quiet_eval_survived(rc: int, output: str, run: Path, *, at_least_s: float,
                               eval_steps: list[int]) -> dict[str, float]:
    events = read_events(run)
    assert rc == 0, output[-4000:]
    assert not named(events, "failure_detected"), named(events, "failure_detected")
    assert len(named(events, "launch")) == 1 and named(events, "run_complete")
    entered = [e for e in named(events, "phase") if e.get("phase") == "eval"]
    assert [e["step"] for e in entered] == eval_steps and all(e["rank"] == 0 for e in entered), named(events, "phase")
    log = cli("log", str(run))
    assert "phase" in log and "eval" in log, log[-3000:]
    report = json.loads(cli("report", str(run), "--json"))
    times = report["time_per_phase_s"]
    assert times["eval"] >= at_least_s and times["train"] > 0, times
    status = json.loads(cli("status", str(run), "--json"))
    assert status["time_per_phase_s"]["eval"] == pytest.approx(times["eval"], abs=0.01)
    assert status["step_p99_s"] < 2.0, status   # the evaluation was not taken for a step (nor its hang timeout)
    return times


def test_an_attach_script_computing_45s_inside_phase_eval_completes_at_the_defaults(tmp_path: Path) -> None:
    rc, output, run = launch(tmp_path, "phase_train.py", "--mode", "attach", "--steps", "40", "--eval-at", "20",
                             "--eval-s", "45")
    assert_quiet_eval_survived(rc, output, run, at_least_s=44.0, eval_steps=[20])
    assert (tmp_path / "out" / "done_rank0").read_text() == "40"


def test_an_eval_phase_past_its_own_timeout_is_a_hang(tmp_path: Path) -> None:
    """heartbeat() ranks, rank 0 sleeping 40 s in phase("eval"), rank 1 in a barrier inside it;
    eval_timeout_s = 8 (below the 30 s hang timeout: the eval allowance is the one in force)."""
    rc, output, run = launch(tmp_path, "phase_train.py", "--mode", "heartbeat", "--steps", "30", "--eval-at", "10",
                             "--eval-s", "40", "--eval-rank", "0", "--sleep",
                             config="[supervisor]\neval_timeout_s = 8\nmax_restarts = 0\n")
    events = read_events(run)
    failures = named(events, "failure_detected")
    assert rc == 3 and len(failures) == 1, output[-4000:]
    hang = failures[0]
    assert hang["kind"] == "hang" and "phase eval" in hang["detail"], hang
    assert 8.0 <= hang["detect_s"] <= 12.0, hang
    entered = [e for e in named(events, "phase") if e.get("phase") == "eval"]
    assert len(entered) == 1 and entered[0]["step"] == 10


def test_lightning_with_a_40s_validation_pass_completes_at_the_defaults(tmp_path: Path) -> None:
    rc, output, run = launch(tmp_path, "lightning_eval.py", "--steps", "30", "--val-every", "20",
                             "--val-batches", "8", "--val-batch-s", "5")
    assert_quiet_eval_survived(rc, output, run, at_least_s=39.0, eval_steps=[20])
    done = json.loads((tmp_path / "out" / "done.json").read_text())
    assert done == {"steps": 30, "validations": 1}


def test_hf_with_a_40s_evaluate_completes_at_the_defaults(tmp_path: Path) -> None:
    rc, output, run = launch(tmp_path, "hf_eval.py", "--steps", "16", "--eval-every", "10",
                             "--eval-batches", "8", "--eval-batch-s", "5")
    # HF evaluates at step 10 and once more when training ends (max_steps): 2 x 40 s, each entered
    # at on_step_end, before its first batch
    assert_quiet_eval_survived(rc, output, run, at_least_s=79.0, eval_steps=[10, 16])
    done = json.loads((tmp_path / "out" / "done.json").read_text())
    assert done == {"steps": 16, "evaluations": 2}
