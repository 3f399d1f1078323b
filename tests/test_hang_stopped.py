"""A stopped rank (SIGSTOP, state T) is a hang at once, not after the hang timeout; and the ranks
of an unmodified script are alive in `ckptsup status` whether they run cold or in warm
interpreters (issue 22, the "blind" and "late" cases)."""
import json
import signal
import subprocess
import time

import pytest

from ckptsup.config import SupervisorConfig
from ckptsup.events import read_events
from ckptsup.supervisor.detection import RankView, detect_hang
from ckptsup.supervisor.observations import FailureKind
from ckptsup.wire import Phase

from drop_in_helpers import CKPTSUP, ROOT, named, newest_step, rank_process, wait_for

SLEEPY = ROOT / "tests" / "helpers" / "sleepy_ddp.py"
CFG = SupervisorConfig()   # the defaults: hang_min_s 30 s, heartbeat_interval_s 1 s


def view(r, *, stopped_since=None, last=100.0):
    return RankView(rank=r, node=f"n{r}", phase=Phase.TRAIN, phase_since=0.0, last_step=9, last_progress=last,
                    stopped=stopped_since is not None, stopped_since=stopped_since)


def test_a_rank_stopped_through_two_heartbeats_is_a_hang_at_once():
    ranks = [view(0), view(1, stopped_since=101.0)]
    assert detect_hang(ranks, now=101.5, config=CFG, train_timeout_s=30.0) is None   # one heartbeat: maybe a stop-and-continue
    f = detect_hang(ranks, now=102.0, config=CFG, train_timeout_s=30.0)
    assert f.kind is FailureKind.HANG and f.rank == 1 and f.node == "n1" and f.detect_s == 1.0
    assert "state T" in f.detail and "process stopped" in f.detail


def test_a_continued_rank_is_no_longer_a_hang():
    assert detect_hang([view(0), view(1)], now=102.0, config=CFG, train_timeout_s=30.0) is None


def status(run):
    out = subprocess.run([*CKPTSUP, "status", str(run), "--json"], capture_output=True, timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.integration
def test_sigstop_of_a_cold_then_a_warm_rank_is_a_hang_before_the_timeout_at_the_defaults(tmp_path):
    """No config: SIGSTOP of rank 1's real process (found as a user would, by its command line)
    in the first, cold attempt, then in the second, warm one (the rank is a warm interpreter, not
    torchrun's child). Each is one hang pinned on rank 1 as stopped, well inside the 30 s timeout;
    both ranks are alive in `ckptsup status` while they train; the run completes."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--run-dir", str(run), str(SLEEPY), "--steps", "60",
            "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "final.pt")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    delays = []
    try:
        for at in (10, 30):
            wait_for(lambda: len(named(read_events(run), "first_step")) == 1 + (at == 30), 240, "the attempt's first step")
            wait_for(lambda: newest_step(run) >= at, 240, f"step {at}")
            if at == 30:
                wait_for(lambda: status(run)["nodes"]["vm"]["ranks_alive"] == [0, 1], 30, "both ranks alive")
            if at == 10:   # warm interpreters for the next attempt: the second stop hits one
                wait_for(lambda: named(read_events(run), "warm_ready"), 120, "warm interpreters")
            failures = len(named(read_events(run), "failure_detected"))
            rank_process(SLEEPY, ckpt, 1).send_signal(signal.SIGSTOP)
            sent = time.monotonic()   # CLOCK_MONOTONIC: the same clock as the events' `mono`
            wait_for(lambda: len(named(read_events(run), "failure_detected")) > failures, 60, f"the hang after step {at}")
            delays.append(named(read_events(run), "failure_detected")[-1]["mono"] - sent)
        console, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console.decode()[-3000:]
    failures = named(events, "failure_detected")
    assert [(f["kind"], f["rank"]) for f in failures] == [("hang", 1), ("hang", 1)], failures
    assert all("state T" in f["detail"] for f in failures), failures
    assert named(events, "restart_done")[0]["warm"] is True   # the second stop hit a warm interpreter
    print(f"SIGSTOP -> failure_detected: {[round(d, 2) for d in delays]} s")
    assert max(delays) < CFG.hang_min_s   # the stop itself, not the timeout, was the evidence
