"""Progress lines (ckptsup/progress.py) and the agent's reader of rank output
(supervisor/node/rank_output.py): pure, on literal output of the frameworks we know."""
import io
import os

import pytest

from ckptsup.config import load_config
from ckptsup.errors import ConfigError
from ckptsup.progress import (PRESETS, LineSplitter, PatternError, ProgressMatcher, clean, compile_pattern,
                              pattern_problem, split_rank, step_of)
from ckptsup.messages import Output
from ckptsup.supervisor.node.rank_output import CONSOLE_BURST, FRAME_LINES, RankOutput, print_console


@pytest.mark.parametrize(("line", "preset", "step"), [
    ("[titan] 2025-01-01 12:00:00,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 10.8", "torchtitan", 1),
    ("[titan] 2025-01-01 12:00:00,000 - root - INFO - step: 120  loss:  7.1245  memory: 3.1GiB", "torchtitan", 120),
    (" [2024-05-01 10:00:00] iteration       10/     100 | consumed samples: 640 | lm loss: 9.1E+00", "megatron", 10),
    ("step 5 loss 1.0", "plain", 5),
    ("Step 7/100", "plain", 7),
    ("step=12", "plain", 12),
    # the lines below were printed by the installed frameworks (tests/helpers/progress_*.py under `ckptsup
    # launch`, transformers 5.25.0, lightning 2.6.6, tqdm 4.70.1, rich 15.0.0); nanoGPT's is its train.py's
    # f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%"
    ("iter 10: loss 2.3101, time 41.20ms, mfu 1.20%", "nanogpt", 10),
    ("{'loss': 1.25, 'grad_norm': 0.5, 'learning_rate': 0.01, 'epoch': 0.5, 'step': 4}", "hf_log", 4),  # log_history
    (" 25%|██▌       | 2/8 [00:00<00:00, 68.56it/s]", "tqdm", 2),                                  # HF's bar
    ("Epoch 1:  33%|███▎      | 2/6 [00:00<00:00, 436.59it/s, loss=10.00, val_loss=7.490]", "tqdm", 2),
    ("Epoch 2: 3it [00:00, 40844.53it/s]", "tqdm", 3),                                           # no total
    ("\x1b[2KEpoch 0/1  \x1b[35m━━━━━━━━━━━\x1b[0m\x1b[90m╺\x1b[0m\x1b[90m━━━━━\x1b[0m 4/6 \x1b[2m0:00:00 • 0:00:01\x1b[0m "
     "\x1b[2;4m243.60it/s\x1b[0m \x1b[3mloss: 14.208      \x1b[0m", "rich", 4),                      # TTY_COMPATIBLE=1
    ("Epoch 1/1  ━━━━━━━━━━━━━━━━━ 6/6 0:00:00 • 0:00:00 110.76it/s loss: 5.105       ", "rich", 6),   # its end, piped
])
def test_each_preset_reads_its_frameworks_lines_and_auto_reads_them_all(line, preset, step):
    text = clean(line)
    assert step_of(compile_pattern(preset), text) == step
    assert step_of(compile_pattern("auto"), text) == step


@pytest.mark.parametrize("line", ["we took 3 steps", "stepping 4", "loss 0.5 at lr 3e-4", "Epoch 2: 50%|#####"])
def test_lines_that_are_not_progress_match_no_preset(line):
    assert step_of(compile_pattern("auto"), clean(line)) is None


@pytest.mark.parametrize(("evaluating", "training"), [
    ("Validation DataLoader 0:  67%|██████▋   | 2/3 [00:00<00:00, 1060.91it/s]\x1b[A",
     "Epoch 0:  67%|██████▋   | 4/6 [00:00<00:00, 187.86it/s, loss=6.040]"),
    ("Sanity Checking DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 47.07it/s]",
     "Epoch 0:  17%|█▋        | 1/6 [00:00<00:00, 98.68it/s]"),
    ("Validation \x1b[35m━━━━━\x1b[0m\x1b[35m╸\x1b[0m\x1b[90m━━━━━━━━━━━\x1b[0m 1/3 \x1b[2m0:00:00 • -:--:--\x1b[0m",
     "\x1b[2KEpoch 0/1  \x1b[35m━━━━━━━\x1b[0m\x1b[35m╸\x1b[0m\x1b[90m━━━━━━━━━━━━━━━\x1b[0m 2/6 \x1b[2m0:00:00 • 0:00:01"),
    ("{'eval_loss': '3.795', 'eval_runtime': '0.0071', 'eval_samples_per_second': '2249', "
     "'eval_steps_per_second': '281.1', 'epoch': '0.75'}",
     "{'loss': 1.25, 'grad_norm': 0.5, 'learning_rate': 0.01, 'epoch': 0.5, 'step': 4}"),
])
def test_evaluation_bars_and_metrics_are_no_progress_where_their_training_lines_are(evaluating, training):
    """A bar or log line that says it evaluates is evidence of life, not training progress."""
    presets = compile_pattern("auto")
    assert step_of(presets, clean(evaluating)) is None and step_of(presets, clean(training)) is not None


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


# ---- the frameworks' own output, as the agent reads it ----------------------------------------------
# Captured from tests/helpers/progress_hf.py and progress_lightning.py under `ckptsup launch
# --nproc-per-node 2` (attempt-0/ranks-<node>.log: torchrun's tee turns each \r into a line end and
# prefixes every piece it reads, so a bar cut mid-read continues under a second prefix), less
# torchrun's and torch's warning lines; and, for the \r redraws, their own stdout/stderr without torchrun.

def replay(data: bytes, tmp_path, pattern: str = "auto", chunk: int = 1) -> list[dict[int, int]]:
    """Feed `data` to a RankOutput `chunk` bytes at a time (the pipe's reads): the progress taken after
    each (one byte: every step; a longer read hands over only its newest step per rank)."""
    out = RankOutput.open(str(tmp_path / "ranks.log"), pattern=pattern)
    sent = []
    for at in range(0, len(data), chunk):
        out.feed(data[at:at + chunk])
        if progress := out.take_progress():
            sent.append(progress)
    out.close()   # the partial line left is matched too
    if progress := out.take_progress():
        sent.append(progress)
    return sent


# HF Trainer, eval every 3 steps (8 steps, eval set 2 batches): its log dicts come on stdout, its bars
# on stderr, each tailed by torchrun on its own, so a dict can come before the bar's first line
HF_RANK_LOG = """\
[rank0]: {'loss': '8.602', 'grad_norm': '3.521', 'learning_rate': '0.00875', 'epoch': '0.5'}
[rank0]: 
[rank0]:   0%|          | 0/8 [00:00<?, ?it/s][rank0]:[W1206 02:17:27.294830701 reducer.cpp:1529] Warning: ...
[rank0]: 
[rank0]:                                      
[rank0]: 
[rank0]:  25%|██▌       | 2/8 [00:00<00:00, 68.56it/s][rank0]: {'eval_loss': '3.795', 'eval_runtime': '0.0071', \
'eval_samples_per_second': '2249', 'eval_steps_per_second': '281.1', 'epoch': '0.75'}
[rank0]: {'loss': '5.354', 'grad_norm': '6.423', 'learning_rate': '0.00625', 'epoch': '1'}
[rank0]: {'loss': '8.667', 'grad_norm': '3.695', 'learning_rate': '0.00375', 'epoch': '1.5'}
[rank0]: {'eval_loss': '3.757', 'eval_runtime': '0.0055', 'eval_samples_per_second': '2891', 'eval_steps_per_second': \
'361.4', 'epoch': '1.5'}
[rank0]: {'loss': '4.165', 'grad_norm': '3.193', 'learning_rate': '0.00125', 'epoch': '2'}
[rank0]: {'train_runtime': '0.0836', 'train_samples_per_second': '765.1', 'train_steps_per_second': '95.64', \
'train_loss': '6.697', 'epoch': '2'}
[rank0]: 
[rank0]: 
[rank0]:   0%|          | 0/2 [00:00<?, ?it/s]\x1b[A
[rank0]:                                              
[rank0]: 
[rank0]:                                      
[rank0]: \x1b[A
[rank0]:  38%|███▊      | 3/8 [00:00<00:00, 70.93it/s]
[rank0]: 
[rank0]: 100%|██████████| 2/2 [00:00<00:00, 1138.52it/s]\x1b[A
[rank0]: 
[rank0]:                                                \x1b[A
[rank0]:                                              
[rank0]: 
[rank0]:  50%|█████     | 4/8 [00:00<00:00, 83.37it/s]
[rank0]:                                              
[rank0]: 
[rank0]:  75%|███████▌  | 6/8 [00:00<00:00, 105.58it/s]
[rank0]: 
[rank0]:   0%|          | 0/2 [00:00<?, ?it/s]\x1b[A
[rank0]: \x1b[A
[rank0]:  75%|███████▌  | 6/8 [00:00<00:00, 93.07it/s]
[rank0]: 
[rank0]: 100%|██████████| 2/2 [00:00<00:00, 1347.35it/s]\x1b[A
[rank0]: 
[rank0]:                                                \x1b[A
[rank0]: 100%|██████████| 8/8 [00:00<00:00, 109.92it/s]
[rank0]: 
[rank0]:   0%|          | 0/2 [00:00<?, ?it/s]\x1b[A
[rank0]: \x1b[A
[rank0]: 100%|██████████| 8/8 [00:00<00:00, 100.44it/s]
[rank0]: 
[rank0]: 100%|██████████| 2/2 [00:00<00:00, 1499.30it/s]\x1b[A
[rank0]: 
[rank0]:                                                \x1b[A
[rank0]: 100%|██████████| 8/8 [00:00<00:00, 99.23it/s]
[rank0]: 100%|██████████| 8/8 [00:00<00:00, 98.86it/s]
""".encode()


def test_hf_trainer_output_gives_its_global_step_and_its_eval_bars_and_dicts_do_not_count(tmp_path):
    """The first dict (before any bar) is a tick; from its bar on, the bar's count is the step. The
    eval bars (total 2, drawn beside the training bar, the last one after it finished) never count,
    nor the eval dicts: the step never jumps or goes back."""
    sent = replay(HF_RANK_LOG, tmp_path)
    assert [p[0] for p in sent] == [1, 2, 3, 4, 6, 8]
    coarse = [p[0] for p in replay(HF_RANK_LOG, tmp_path, chunk=97)]   # however the pipe cuts it
    assert coarse == sorted(set(coarse)) and set(coarse) <= {1, 2, 3, 4, 6, 8} and coarse[-1] == 8


def test_hf_log_dicts_without_a_bar_are_ticks_and_their_eval_dicts_are_not(tmp_path):
    """disable_tqdm=True: PrinterCallback's dicts alone (here every 2 steps, on stdout)."""
    no_bar = (b"[rank0]: {'loss': '8.602', 'grad_norm': '3.521', 'learning_rate': '0.0075', 'epoch': '0.5'}\n"
              b"[rank0]: {'eval_loss': '3.104', 'eval_runtime': '0.0145', 'eval_samples_per_second': '828.1', "
              b"'eval_steps_per_second': '207', 'epoch': '0.5'}\n"
              b"[rank0]: {'loss': '5.373', 'grad_norm': '6.412', 'learning_rate': '0.0025', 'epoch': '1'}\n"
              b"[rank0]: {'train_runtime': '0.0495', 'train_samples_per_second': '647.1', 'train_steps_per_second': "
              b"'80.89', 'train_loss': '6.987', 'epoch': '1'}\n")
    assert replay(no_bar, tmp_path) == [{0: 1}, {0: 2}, {0: 3}]


# Lightning's TQDMProgressBar, 2 epochs of 6 batches, validation (3 batches) every 5: its sanity check
# and `Training: 0/?` placeholder first, the validation bars drawn beside the epoch bar
LIGHTNING_RANK_LOG = """\
[rank0]: Sanity Checking: |          | 0/? [00:00<?, ?it/s]
[rank0]: Sanity Checking DataLoader 0:   0%|          | 0/2 [00:00<?, ?it/s]
[rank0]: Sanity Checking DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 47.07it/s]
[rank0]: Sanity Checking DataLoader 0: 100%|██████████| 2/2 [00:00<00:00, 88.85it/s]
[rank0]:                                                                            
[rank0]: 
[rank0]: Training: |          | 0/? [00:00<?, ?it/s]
[rank0]: Training: |          | 0/? [00:00<?, ?it/s]
[rank0]: Epoch 0:   0%|          | 0/6 [00:00<?, ?it/s]
[rank0]: Epoch 0:  17%|█▋        | 1/6 [00:00<00:00, 98.68it/s]
[rank0]: Epoch 0:  17%|█▋        | 1/6 [00:00<00:00, 96.32it/s, loss=16.30]
[rank0]: Epoch 0:  33%|███▎      | 2/6 [00:00<00:00, 146.85it/s, loss=16.30]
[rank0]: Epoch 0:  50%|█████     | 3/6 [00:00<00:00, 159.42it/s, loss=5.280]
[rank0]: Epoch 0:  67%|██████▋   | 4/6 [00:00<00:00, 187.86it/s, loss=6.040]
[rank0]: Epoch 0:  83%|████████▎ | 5/6 [00:00<00:00, 186.61it/s, loss=12.60]
[rank0]: 
[rank0]: Validation: |          | 0/? [00:00<?, ?it/s]\x1b[A
[rank0]: 
[rank0]: Validation DataLoader 0:   0%|          | 0/3 [00:00<?, ?it/s]\x1b[A
[rank0]: 
[rank0]: Validation DataLoader 0:  33%|███▎      | 1/3 [00:00<00:00, 1091.13it/s]\x1b[A
[rank0]: 
[rank0]: Validation DataLoader 0: 100%|██████████| 3/3 [00:00<00:00, 1077.12it/s]\x1b[A
[rank0]: 
[rank0]:                                                                         \x1b[A
[rank0]: Epoch 0:  83%|████████▎ | 5/6 [00:00<00:00, 141.67it/s, loss=4.160, val_loss=7.490]
[rank0]: Epoch 0: 100%|██████████| 6/6 [00:00<00:00, 160.04it/s, loss=4.160, val_loss=7.490]
[rank0]: Epoch 0: 100%|██████████| 6/6 [00:00<00:00, 158.82it/s, loss=9.510, val_loss=7.490]
[rank0]: Epoch 0:   0%|          | 0/6 [00:00<?, ?it/s, loss=9.510, val_loss=7.490]         
[rank0]: Epoch 1:   0%|          | 0/6 [00:00<?, ?it/s, loss=9.510, val_loss=7.490]
[rank0]: Epoch 1:  17%|█▋        | 1/6 [00:00<00:00, 445.07it/s, loss=9.510, val_loss=7.490]
[rank0]: Epoch 1:  33%|███▎      | 2/6 [00:00<00:00, 452.29it/s, loss=3.620, val_loss=7.490]
[rank0]: Epoch 1:  83%|████████▎ | 5/6 [00:00<00:00, 475.06it/s, loss=2.160, val_loss=7.490]
[rank0]: 
[rank0]: Validation DataLoader 0:  67%|██████▋   | 2/3 [00:00<00:00, 1319.79it/s]\x1b[A
[rank0]: 
[rank0]:                                                                         \x1b[A
[rank0]: Epoch 1:  83%|████████▎ | 5/6 [00:00<00:00, 333.86it/s, loss=11.80, val_loss=6.780][rank0]: `Trainer.fit` \
stopped: `max_epochs=2` reached.
[rank0]: 
[rank0]: Epoch 1: 100%|██████████| 6/6 [00:00<00:00, 317.11it/s, loss=11.80, val_loss=6.780]
""".encode()


def test_lightnings_epoch_bar_becomes_epoch_times_batches_plus_count_and_validation_does_not_count(tmp_path):
    """Epoch E: N/M is step E*M+N: the rollover (`Epoch 0: 0/6`, then `Epoch 1: 0/6`) neither goes
    back nor skips; the sanity check, the `Training: 0/?` placeholder and the validation bars count
    for nothing."""
    assert [p[0] for p in replay(LIGHTNING_RANK_LOG, tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]


def test_bars_redrawn_with_cr_keep_their_rank_and_a_bar_that_restarts_continues(tmp_path):
    """Output as a script writes it, \\r redraws and colour codes and all, each \\n-line prefixed once
    (the redraws carry no prefix of their own): Lightning's own stdout (an epoch's bar, a validation
    bar beside it) and plain tqdm bars restarting each epoch (`for b in tqdm(loader)` twice), each
    counted on from where the last ended."""
    lightning = ("[rank0]: \rEpoch 0:   0%|          | 0/4 [00:00<?, ?it/s]\rEpoch 0:  25%|██▌       | 1/4 "
                 "[00:00<00:00, 428.69it/s]\rEpoch 0:  50%|█████     | 2/4 [00:00<00:00, 515.27it/s, loss=3.320]\n"
                 "[rank0]: \rValidation DataLoader 0:  33%|███▎      | 1/3 [00:00<00:00, 1524.65it/s]\x1b[A\n"
                 "[rank0]: \r                                                                        \x1b[A\rEpoch 0:  75%|"
                 "███████▌  | 3/4 [00:00<00:00, 336.09it/s, loss=12.00, val_loss=5.230]\rEpoch 0: 100%|██████████| "
                 "4/4 [00:00<00:00, 388.19it/s, loss=1.580, val_loss=5.230]\rEpoch 0:   0%|          | 0/4 [00:00<?, "
                 "?it/s, loss=14.20, val_loss=5.390]         \rEpoch 1:   0%|          | 0/4 [00:00<?, ?it/s, "
                 "loss=14.20, val_loss=5.390]\rEpoch 1:  25%|██▌       | 1/4 [00:00<00:00, 615.99it/s, loss=14.20, "
                 "val_loss=5.390]").encode()
    assert [p[0] for p in replay(lightning, tmp_path)] == [1, 2, 3, 4, 5]
    restarts = ("[rank1]: \r  0%|          | 0/3 [00:00<?, ?it/s]\r 33%|███▎      | 1/3 [00:00<00:00,  8.32it/s]"
                "\r 67%|██████▋   | 2/3 [00:00<00:00,  8.31it/s]\r100%|██████████| 3/3 [00:00<00:00,  8.30it/s]"
                "\r100%|██████████| 3/3 [00:00<00:00,  8.30it/s]\n[rank1]: \r  0%|          | 0/3 [00:00<?, ?it/s]"
                "\r 33%|███▎      | 1/3 [00:00<00:00,  8.32it/s]\r 67%|██████▋   | 2/3 [00:00<00:00,  8.31it/s]"
                "\r100%|██████████| 3/3 [00:00<00:00,  8.30it/s]\r100%|██████████| 3/3 [00:00<00:00,  8.30it/s]\n"
                ).encode()
    assert [p[1] for p in replay(restarts, tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_finished_bar_is_taken_over_by_a_new_one_and_ticks_stop_once_a_bar_speaks():
    """A first phase's bar (unnamed, 3 batches) done, a second phase's bar takes over from the
    rank's last step; a bar drawn beside the running training bar never does; an HF log dict after
    the bar adds nothing; step lines and bars mix by only going up."""
    m = ProgressMatcher(patterns=compile_pattern("auto"))
    bar = "{:3d}%|          | {}/{} [00:00<00:00,  8.30it/s]".format
    assert m.match(0, "{'loss': '8.602', 'epoch': '0.5'}") == 1
    assert [m.match(0, bar(0, n, 3)) for n in (1, 2, 3)] == [None, 2, 3]
    assert [m.match(0, bar(0, n, 5)) for n in (0, 1, 2)] == [None, 4, 5]                 # took over
    assert [m.match(0, bar(0, n, 2)) for n in (1, 2)] == [None, None]                    # beside it
    assert m.match(0, "{'loss': '5.373', 'epoch': '1'}") is None
    assert [m.match(0, bar(0, n, 5)) for n in (3, 4, 5)] == [6, 7, 8]
    assert [m.match(0, bar(0, n, 2)) for n in (1, 2)] == [None, None]                    # ran beside it: never
    assert [m.match(0, "step 20"), m.match(0, bar(0, 1, 9)), m.match(1, "iter 3: loss 1.0")] == [20, 21, 3]


def test_the_presets_have_names_the_config_lists_and_a_custom_pattern_gives_steps_only():
    assert list(PRESETS) == ["torchtitan", "megatron", "nanogpt", "plain", "hf_log", "tqdm", "rich"]
    custom = ProgressMatcher(patterns=compile_pattern(r"global_step=(\d+)"))
    assert [custom.match(0, "global_step=5"), custom.match(0, " 25%|██▌       | 2/8 [00:00<00:00, 68.56it/s]"),
            custom.match(0, "global_step=6")] == [5, None, 6]
    assert pattern_problem("auto") is None and "hf_log, tqdm, rich" in (pattern_problem("(a)(b)") or "")
