"""An unmodified torchrun script under `ckptsup launch` (local mode, real torchrun and gloo): no
hello, so it is supervised at the process level, and its own `step N` lines are progress lines.
Faults come from outside, as on a cluster: SIGKILL and SIGSTOP of a rank process."""
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from drop_in_helpers import SCRIPT, rank_process, reference, same_model
from run_helpers import CKPTSUP, named, wait_for

pytestmark = pytest.mark.integration


def test_an_unmodified_ddp_script_survives_three_rank_sigkills_and_a_sigstop(tmp_path):
    """init_timeout_s = 2: the script says no hello, and is not killed for it. SIGKILL of rank 1
    at steps 15, 60 and 105 (crash, fast path, resume from the script's own checkpoint), SIGSTOP
    of rank 1 at step 150 (a hang, seen from rank 0's progress lines, pinned on the stopped
    process): rc 0, every restart in warm interpreters, and the final model equals an
    uninterrupted run's."""
    steps = 200
    hold = tmp_path / "hold"   # each fault while the ranks are held at its step (plain_ddp.py --hold-at)
    cfg = tmp_path / "job.toml"
    cfg.write_text("[supervisor]\ninit_timeout_s = 2.0\nheartbeat_interval_s = 0.5\nhang_min_s = 8.0\n")
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
            str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "final.pt"),
            "--hold-at", "15,60,105,150", "--hold-file", str(hold)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        for at, sig in ((15, signal.SIGKILL), (60, signal.SIGKILL), (105, signal.SIGKILL), (150, signal.SIGSTOP)):
            wait_for(lambda: Path(f"{hold}.held-{at}").exists(), 120, f"the ranks held at step {at}")
            ready = len(named(read_events(run), "launch"))   # each launch's warm interpreters for the next
            wait_for(lambda: len(named(read_events(run), "warm_ready")) >= ready, 120, "warm interpreters")
            victim = rank_process(SCRIPT, ckpt, 1)
            victim.send_signal(sig)
            with open(hold, "a") as fh:
                fh.write(f"{at}\n")
            launches = len(named(read_events(run), "launch"))
            wait_for(lambda: len(named(read_events(run), "launch")) > launches, 60, f"the restart after step {at}")
        console, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, console.decode()[-3000:]
    failures = named(events, "failure_detected")
    assert [f["kind"] for f in failures] == ["crash", "crash", "crash", "hang"], failures
    assert all(f["step"] is None or f["step"] > 0 for f in failures)   # only steps that were seen
    assert "process stopped" in failures[-1]["detail"] and failures[-1]["rank"] == 1
    assert not named(events, "give_up") and named(events, "run_complete")
    assert [r["warm"] for r in named(events, "restart_done")] == [True] * 4   # warm interpreters, unhooked too
    # each attempt: process level once the 2 s init allowance passed, progress level from its first line
    final_level = {e["attempt"]: e["level"] for e in named(events, "supervision_level")}
    assert final_level == {a: "progress" for a in range(5)}, final_level
    # the console of `ckptsup launch` shows rank 0's own lines
    assert b"step 200 loss" in console and b"resumed from step" in console
    assert same_model(torch.load(tmp_path / "final.pt"), reference(tmp_path, steps))
