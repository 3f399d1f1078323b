"""Progress lines (ckptsup/progress.py) and the agent's reader of rank output
(supervisor/node/rank_output.py): pure, on literal output of the frameworks we know."""
import io
import os

import pytest

from ckptsup.config import load_config
from ckptsup.errors import ConfigError
from ckptsup.progress import (PRESETS, LineSplitter, PatternError, ProgressMatcher, clean, compile_pattern, split_rank,
                              step_of)
from ckptsup.messages import Output
from ckptsup.supervisor.node.rank_output import CONSOLE_BURST, FRAME_LINES, RankOutput, print_console


@pytest.mark.parametrize(("line", "preset", "step"), [
    ("[titan] 2025-01-01 12:00:00,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 10.8", "torchtitan", 1),
    ("[titan] 2025-01-01 12:00:00,000 - root - INFO - step: 120  loss:  7.1245  memory: 3.1GiB", "torchtitan", 120),
    (" [2024-05-01 10:00:00] iteration       10/     100 | consumed samples: 640 | lm loss: 9.1E+00", "megatron", 10),
    ("step 5 loss 1.0", "plain", 5),
    ("Step 7/100", "plain", 7),
    ("step=12", "plain", 12),
])
def test_each_preset_reads_its_frameworks_lines_and_auto_reads_them_all(line, preset, step):
    text = clean(line)
    assert step_of(compile_pattern(preset), text) == step
    assert step_of(compile_pattern("auto"), text) == step


@pytest.mark.parametrize("line", ["we took 3 steps", "stepping 4", "loss 0.5 at lr 3e-4", "Epoch 2: 50%|#####"])
def test_lines_that_are_not_progress_match_no_preset(line):
    assert step_of(compile_pattern("auto"), clean(line)) is None


def test_a_custom_pattern_needs_exactly_one_group_and_off_matches_nothing():
    assert step_of(compile_pattern(r"global_step=(\d+)"), "x global_step=42 y") == 42
    assert compile_pattern("off") == []
    with pytest.raises(PatternError, match="exactly one capture group"):
        compile_pattern(r"(\d+) (\d+)")
    with pytest.raises(PatternError, match="not a valid regular expression"):
        compile_pattern("step (")


def test_a_bad_pattern_in_the_config_is_one_line_with_the_choices(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[supervisor]\nprogress_pattern = "step ("\n')
    with pytest.raises(ConfigError) as err:
        load_config(job_config=job, env={})
    message = str(err.value)
    assert "supervisor.progress_pattern" in message and "not a valid regular expression" in message
    assert all(name in message for name in PRESETS) and "\n" not in message


def test_output_is_split_on_cr_and_lf_and_a_partial_line_waits_for_its_end():
    s = LineSplitter()
    assert s.feed(b"step 1\rstep 2\r\nste") == [("step 1", False), ("step 2", True)]
    assert s.feed(b"p 3\n") == [("step 3", False)]
    assert s.feed(b"x" * 5000) == [("x" * 4096, False)] and s.lines_cut == 1   # bounded


def test_the_rank_prefix_gives_the_rank_and_a_step_only_counts_going_up():
    assert split_rank("[rank3]: step 9") == (3, "step 9")
    assert split_rank("W1201 torch/distributed/run.py") == (None, "W1201 torch/distributed/run.py")
    m = ProgressMatcher(patterns=compile_pattern("plain"))
    assert [m.match(0, "step 5"), m.match(0, "step 5"), m.match(0, "step 4"), m.match(1, "step 4"),
            m.match(0, "step 6")] == [5, None, None, 4, 6]


def test_rank_output_logs_every_byte_matches_unhooked_ranks_and_sends_rank_0_to_the_console(tmp_path):
    log = tmp_path / "ranks.log"
    out = RankOutput.open(str(log), pattern="auto", hooked=lambda rank: rank == 1)
    out.feed(b"[rank0]: step 1 loss 2.0\n[rank1]: step 1\n[rank1]: hello from 1\n[rank0]: \x1b[31mstep 2\x1b[0m\rst")
    out.feed(b"ep 3\ntorchrun's own line\n")
    assert out.take_progress() == {0: 3}   # rank 1 said hello: its steps come as frames
    lines, dropped = out.take_console()
    # the console gets the rank's bytes as they came: its colour codes, its \r redraw, each separator
    assert lines == ["[rank0]: step 1 loss 2.0\n", "[rank0]: \x1b[31mstep 2\x1b[0m\r", "step 3\n"] and dropped == 0
    out.close()
    assert log.read_bytes().startswith(b"[rank0]: step 1 loss 2.0\n[rank1]: step 1\n") and b"own line" in log.read_bytes()
    assert oct(os.stat(log).st_mode & 0o777) == "0o600"


def test_the_launch_lines_local_ranks_filter_keeps_ranks_off_the_console_not_the_log(tmp_path):
    """--local-ranks-filter 1 (and -r): a rank's local rank is rank % ranks per node; torchrun's
    own lines (no prefix) stay with tee; progress lines of every rank still count."""
    log = tmp_path / "ranks.log"
    out = RankOutput.open(str(log), pattern="plain", tee=True, nproc_per_node=2, console_local_ranks=[1])
    out.feed(b"[rank0]: step 1\n[rank1]: step 1\n[rank2]: step 1\n[rank3]: step 2\ntorchrun says\n")
    assert out.take_console() == (["[rank1]: step 1\n", "[rank3]: step 2\n", "torchrun says\n"], 0)
    assert out.take_progress() == {0: 1, 1: 1, 2: 1, 3: 2}
    out.close()
    assert log.read_bytes().count(b"\n") == 5
    quiet = RankOutput.open(str(tmp_path / "r2.log"), pattern="off", nproc_per_node=2, console_local_ranks=[])
    quiet.feed(b"[rank0]: step 1\n")   # -r 3: rank 0 redirected to its files only
    assert quiet.take_console() is None
    quiet.close()


def test_a_flood_costs_console_lines_not_the_log_and_the_console_says_so(tmp_path):
    log = tmp_path / "ranks.log"
    out = RankOutput.open(str(log), pattern="off", tee=True)
    out.feed(b"".join(b"[rank%d]: line %d\n" % (i % 2, i) for i in range(3000)))
    frames = []
    while (frame := out.take_console()) is not None:
        frames.append(frame)
    assert sum(len(lines) for lines, _ in frames) == CONSOLE_BURST
    assert max(len(lines) for lines, _ in frames) <= FRAME_LINES and frames[0][1] == 3000 - CONSOLE_BURST
    assert log.read_bytes().count(b"\n") == 3000
    shown = io.StringIO()
    print_console(Output(lines=tuple(frames[0][0]), dropped=frames[0][1]), out=shown)
    assert "line 0" in shown.getvalue() and f"({3000 - CONSOLE_BURST} rank output line(s) not shown" in shown.getvalue()
