"""Issue 24 part 1, for real: torchrun command lines run under `ckptsup launch` with the word
replaced and nothing else changed (real torchrun, gloo, CPU, 2 ranks, tests/helpers/plain_ddp.py),
each ending equal to torchrun's own run of the same script. One torchrun reference run (the
`--log-dir` line, which also writes the log dir to compare with) serves the four lines: the
script's model does not depend on how the ranks were launched."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drop_in_helpers import SCRIPT, same_model
from hooks_helpers import base_env, free_port
from run_helpers import CKPTSUP

pytestmark = pytest.mark.integration

STEPS = 12
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LOGS_LINE = "--nproc-per-node 2 --max-restarts 3 --monitor-interval 1 --log-dir {logs} -r 3 -t 3 --local-ranks-filter 0"
LINES = {
    "standalone": "--standalone --nnodes 1 --nproc-per-node 2",
    "c10d": "--nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:{port} --rdzv-id {id}",
    "static": "--nnodes=1 --nproc_per_node=2 --node-rank 0 --master-addr 127.0.0.1 --master-port {port}",
    "log-dir": LOGS_LINE,
}


def env() -> dict[str, str]:
    return {k: v for k, v in base_env().items() if not k.startswith("SLURM_")}


def run_line(launcher: list[str], line: str, where: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`launcher LINE plain_ddp.py ...` in a fresh directory `where`: its output and log dir."""
    where.mkdir()
    logs = where / "logs"
    words = shlex.split(line.format(port=free_port(), id=f"job{os.getpid()}", logs=logs))
    script = [str(SCRIPT), "--steps", str(STEPS), "--ckpt-dir", str(where / "ckpt"), "--out", str(where / "final.pt"),
              "--step-s", "0", "--all-print"]
    proc = subprocess.run([*launcher, *words, *script], cwd=where, env=env(), capture_output=True, text=True,
                          timeout=240)
    return proc, logs


def layout(logs: Path) -> dict[str, bytes]:
    """The one job directory torchrun made under --log-dir (its <rdzv_id>_ prefix dropped) and the
    files below it, stdout.log files with their bytes (stderr: torch's own warnings vary)."""
    jobs = sorted(logs.iterdir())
    assert len(jobs) == 1, jobs
    files = {str(p.relative_to(jobs[0])): (p.read_bytes() if p.name == "stdout.log" else b"")
             for p in sorted(jobs[0].rglob("*")) if p.is_file()}
    return files


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """torchrun's own run of the --log-dir line: its final model, its log dir, its console."""
    proc, logs = run_line(TORCHRUN, LOGS_LINE, tmp_path_factory.mktemp("torchrun") / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(logs.parent / "final.pt"), layout(logs), proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(LINES))
def test_a_torchrun_line_under_ckptsup_launch_ends_as_torchruns_own_run(tmp_path, torchrun_reference, name):
    model, files, torchrun_console = torchrun_reference
    proc, logs = run_line(CKPTSUP + ["launch"], LINES[name], tmp_path / "run")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert same_model(torch.load(tmp_path / "run" / "final.pt"), model)
    assert "Traceback" not in console, console[-3000:]
    if name != "log-dir":
        assert "ckptsup: ckptsup picks the rendezvous ([supervisor] rdzv_backend, rdzv_port);" in console
        assert not logs.exists()
        return
    # the log dir holds what torchrun writes there: one job dir, attempt_0/<local rank>/, the same
    # stdout.log bytes for both ranks (the ranks' own lines, unprefixed)
    ours = layout(logs)
    assert ours == files, (sorted(ours), sorted(files))
    assert {"attempt_0/0/stdout.log", "attempt_0/1/stdout.log", "attempt_0/0/stderr.log"} <= set(ours)
    assert f"step {STEPS} loss".encode() in ours["attempt_0/1/stdout.log"]
    # --local-ranks-filter 0: local rank 0's lines on the console, rank 1's only in its files (as torchrun)
    assert f"[rank0]: step {STEPS} loss" in console and "[rank1]:" not in console, console[-3000:]
    assert f"[default0]:step {STEPS} loss" in torchrun_console and "[default1]:" not in torchrun_console
    run = tmp_path / "run" / "ckptsup-runs" / "local"
    assert not list((run / "attempt-0").glob("torchrun-*"))  # torchrun's files went to DIR instead
    spec = json.loads((run / "attempt-0" / "launch.json").read_text())   # what every node's torchrun got
    assert spec["monitor_interval_s"] == 1 and spec["torchrun_log_dir"] == str(logs) and spec["console_local_ranks"] == [0]
    assert json.loads((run / "config.json").read_text())["config"]["supervisor"]["max_restarts"] == 3
