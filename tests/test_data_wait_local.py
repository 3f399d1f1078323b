"""Waiting for data is not a hang (docs/timeouts.md §Evidence, waiting for data): an unmodified
2-rank DDP script whose data comes from DataLoader workers (tests/helpers/data_ddp.py:
num_workers=2, rank 0 prints `step N`, no ckptsup) under `ckptsup launch` at the defaults. A 40 s
stall of the workers at an epoch's first batch — computing, or blocked in a network read — is busy,
not hung, and the run ends with torchrun's model; a worker blocked for good is a hang past
busy_limit_s that names the rank and what its worker waits in; a dead worker is the loader's crash
(that run with ckptsup's hooks: the hooks level judges data waits alike)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events
from ckptsup.supervisor.job.status import read_status

from drop_in_helpers import same_model
from run_helpers import config_args, named, uninterrupted

pytestmark = pytest.mark.integration

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
SCRIPT = Path(__file__).parent / "helpers" / "data_ddp.py"
EPOCHS = 4


@pytest.fixture(scope="module")
def torchrun_model(tmp_path_factory) -> dict:
    """The same script under plain torchrun, without stalls (a stall only delays the data)."""
    tmp = tmp_path_factory.mktemp("data-reference")
    uninterrupted(SCRIPT, "--epochs", str(EPOCHS), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "final.pt"),
                  cwd=tmp)
    return torch.load(tmp / "final.pt")


def start(tmp: Path, *faults: str, config: str | None = None, script: Path = SCRIPT) -> subprocess.Popen:
    argv = [*CKPTSUP, "launch", *config_args(tmp, config), "--nproc-per-node", "2", "--run-dir", str(tmp / "run"),
            str(script), "--epochs", str(EPOCHS), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "final.pt"), *faults]
    return subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_40s_stall_computing_or_reading_in_the_workers_is_waiting_for_data_not_a_hang(tmp_path, torchrun_model):
    """Epoch 1 starts with 40 s of CPU in rank 0's worker while rank 1's worker sits 40 s in a stalled
    socket read (recvfrom: no CPU, no I/O). One busy spell "waiting for data" for both, each as it
    is, shown by `ckptsup status` while it lasts; no failure, one attempt, torchrun's model."""
    proc = start(tmp_path, "--cpu-stall", "1:0", "--io-stall", "1:1", "--stall-s", "40")
    shown: list[str] = []
    while proc.poll() is None:
        time.sleep(1.0)
        try:
            busy = read_status(tmp_path / "run").get("busy")
        except Exception:   # not published yet, or mid-rewrite
            continue
        if isinstance(busy, dict) and busy.get("detail") not in shown:
            shown.append(busy["detail"])
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-4000:]
    events = read_events(tmp_path / "run")
    assert not named(events, "failure_detected"), [(f["kind"], f["detail"]) for f in named(events, "failure_detected")]
    [busy] = named(events, "busy")
    assert busy["ranks"] == [0, 1], busy
    computing, reading = busy["detail"].split("rank 1 ")
    assert "rank 0 waiting for data (2 workers, " in computing and "waiting for data (2 workers, 0% CPU)" in reading, busy
    assert int(computing.split("% CPU")[0].rsplit(" ", 1)[-1]) >= 20, computing   # its worker computes (2 shared cores)
    assert any("waiting for data (2 workers" in s for s in shown), shown      # ckptsup status said so
    assert "busy, not hung" in out and "waiting for data" in out
    assert [e["attempt"] for e in named(events, "launch")] == [0] and named(events, "run_complete")
    assert all(35.0 <= o["busy_s"] <= 60.0 for o in named(events, "busy_over")), named(events, "busy_over")
    assert same_model(torch.load(tmp_path / "final.pt"), torchrun_model)


def test_at_the_hooks_level_a_worker_blocked_for_good_is_a_data_hang_and_a_dead_worker_the_loaders_crash(
        tmp_path, torchrun_model):
    """The same script with ckptsup.attach and step_done (tests/helpers/data_ddp_hooks.py: its ranks
    say hello, steps come as frames). Rank 0's worker blocks forever in a socket read at epoch 1
    (rank 1 waits in DDP's all-reduce): busy "waiting for data" at the hang timeout, then past
    busy_limit_s (set short: the knob) a hang naming rank 0, its worker's pid and the system call it
    waits in, no node suspected. Resumed; at epoch 2 rank 0's worker is killed: the DataLoader's own
    error, a crash of rank 0, not a hang. Resumed; torchrun's model."""
    proc = start(tmp_path, "--forever", "1:0", "--dead-worker", "2:0", config="[supervisor]\nbusy_limit_s = 20\n",
                 script=SCRIPT.with_name("data_ddp_hooks.py"))
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out[-4000:]
    events = read_events(tmp_path / "run")
    assert {e["level"] for e in named(events, "supervision_level")} == {"hooks"}
    busy = named(events, "busy")[0]
    assert busy["ranks"] == [0] and "rank 0 waiting for data (2 workers, " in busy["detail"], busy
    hang, crash = named(events, "failure_detected")
    assert hang["kind"] == "hang" and hang["rank"] == 0, hang
    assert 20.0 <= hang["detect_s"] <= 26.0, hang["detect_s"]
    assert "rank 0 on " in hang["detail"] and "waiting for data for 2" in hang["detail"], hang["detail"]
    assert "in recvfrom()" in hang["detail"] and "worker pid " in hang["detail"], hang["detail"]
    assert "rank 1 waiting in " in hang["detail"], hang["detail"]      # the peer, in its collective, is not blamed
    seen = {r["rank"]: r["where"] for r in hang["ranks_seen"]}
    assert seen == {0: "data", 1: "waiting"}, hang["ranks_seen"]
    assert not named(events, "node_excluded")
    assert crash["kind"] == "crash" and crash["attempt"] == 1 and crash["rank"] == 0, crash
    assert "DataLoader worker (pid" in out      # the loader's own error, on the console
    assert same_model(torch.load(tmp_path / "final.pt"), torchrun_model)
