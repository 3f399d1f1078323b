"""Preemption: SIGTERM only sets a flag; at the next step boundary the ranks agree on a stop step,
write an emergency checkpoint only when the measured save time x margin fits the budget, and exit
with ExitStatus.PREEMPTED."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from hooks_helpers import Running, private_dir

from ckptsup.checkpoint.catalog import list_checkpoints
from ckptsup.env import ExitStatus

pytestmark = pytest.mark.torch

ARGS = ["--steps", "400", "--step-sleep-s", "0.05", "--save-every-steps", "3"]


def steps_saved(ck: Path) -> list[int]:
    return [info.step for info in list_checkpoints(ck)]


def rank_process(run: Running, rank: int) -> psutil.Process:
    for child in psutil.Process(run.proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"rank {rank} not found")


def test_sigterm_with_a_budget_writes_an_emergency_checkpoint_and_exits_preempted(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    run = Running(1, [*ARGS, "--checkpoint-dir", str(ck)], env={"CKPTSUP_PREEMPT_BUDGET_S": "60"})
    run.wait_for(lambda: run.saw("step 4 rank 0"))  # step_3 was saved: the save time is measured
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(60) == ExitStatus.PREEMPTED
    last_step = max(int(line.split()[1]) for line in run.lines if line.startswith("step "))
    assert steps_saved(ck)[-1] == last_step + 1


def test_sigterm_without_a_budget_skips_the_emergency_save(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    run = Running(1, [*ARGS, "--save-every-steps", "1000", "--checkpoint-dir", str(ck)])
    run.wait_for(lambda: run.saw("step 4 rank 0"))
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(60) == ExitStatus.PREEMPTED
    assert steps_saved(ck) == []
    assert run.saw("emergency save skipped")


def test_a_signal_on_one_rank_stops_both_ranks_at_the_same_step_with_one_emergency_checkpoint(tmp_path: Path) -> None:
    ck = private_dir(tmp_path) / "ck"
    run = Running(2, [*ARGS, "--checkpoint-dir", str(ck)], env={"CKPTSUP_PREEMPT_BUDGET_S": "60"})
    run.wait_for(lambda: run.saw("step 5 rank 1"))
    rank_process(run, 1).send_signal(signal.SIGTERM)  # torchrun and rank 0 see nothing
    run.finish(90)
    for rank in (0, 1):
        assert run.saw(f"rank {rank} exits with PREEMPTED"), "\n".join(run.lines[-20:])
    last = {rank: max(int(line.split()[1]) for line in run.lines if line.startswith("step ") and f"rank {rank} " in line)
            for rank in (0, 1)}
    assert last[0] == last[1]
    assert steps_saved(ck)[-1] == last[0] + 1


def test_sighup_during_a_save_is_a_preemption_stop_and_the_save_is_private_and_finished(tmp_path: Path) -> None:
    """A hangup (a closed terminal, an ssh session ending) stops like a preemption: the in-flight
    save finishes, the rank exits PREEMPTED, no `.tmp-*` directory is left, and while it was being
    written every file of the save was 0600 in a 0700 directory."""
    import stat

    ck = private_dir(tmp_path) / "ck"
    run = Running(1, [*ARGS, "--checkpoint-dir", str(ck)], env={"CKPTSUP_TEST_SAVE_DELAY_S": "2"})
    run.wait_for(lambda: run.saw("delaying the commit of step 3"))
    [tmp] = [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp.rglob("*")}
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o700 and modes, modes
    assert all(mode == (0o700 if (tmp / name).is_dir() else 0o600) for name, mode in modes.items()), modes
    run.proc.send_signal(signal.SIGHUP)
    assert run.finish(60) == ExitStatus.PREEMPTED, "\n".join(run.lines[-20:])
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
    assert 3 in steps_saved(ck)
    assert run.saw("exits with PREEMPTED")
