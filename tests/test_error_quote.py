"""The give-up summary's error quote (supervisor/job/error_quote.py), on literal rank-log text: plain,
prefixed once and twice, interleaved ranks, torchrun's ChildFailedError summary."""
from __future__ import annotations

import os
from pathlib import Path

from ckptsup.supervisor.job import error_quote
from ckptsup.supervisor.job.error_quote import MAX_CHARS, MAX_LINE_CHARS, MAX_LINES, clean, quote, quote_logs, read_tail
from ckptsup.supervisor.job.recovery import log_tail

# torchrun's own traceback and summary, as torch 2.13 prints them after a rank exits 1 (trimmed frames)
LAUNCHER = """\
W1201 12:08:21.867000 6486 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 6573 closing signal SIGTERM
E1201 12:08:21.874000 6486 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 6575) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
/tmp/train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_12:08:21
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 6573)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 6573
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_12:08:21
  host      : localhost
  rank      : {rank} (local_rank: {local})
  exitcode  : 1 (pid: 6575) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

BANNER = """\
W1201 12:08:21.753000 6486 torch/distributed/run.py:874] 
W1201 12:08:21.753000 6486 torch/distributed/run.py:874] *****************************************
W1201 12:08:21.753000 6486 torch/distributed/run.py:874] Setting OMP_NUM_THREADS environment variable for each process to be 1 in default
W1201 12:08:21.753000 6486 torch/distributed/run.py:874] *****************************************
"""

PLAIN = BANNER + """\
step 0 loss 2.3
Traceback (most recent call last):
  File "/tmp/train.py", line 3, in <module>
    raise ValueError("boom from rank 1")
ValueError: boom from rank 1
""" + LAUNCHER.format(rank=1, local=1)

PREFIXED = BANNER + """\
[rank0]: step 0 loss 2.3
[rank1]: step 0 loss 2.3
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/train.py", line 5, in <module>
[rank1]:     f()
[rank1]:   File "/tmp/train.py", line 4, in f
[rank1]:     raise ValueError("boom from rank 1")
[rank1]: ValueError: boom from rank 1
""" + LAUNCHER.format(rank=1, local=1)

# torch prefixes its own traceback print with [rankN]:, and --tee adds another; ranks interleave
TWICE_INTERLEAVED = """\
[rank0]: [rank0]: step 7
[rank1]: [rank1]: Traceback (most recent call last):
[rank0]: [rank0]: Traceback (most recent call last):
[rank1]: [rank1]:   File "/tmp/train.py", line 40, in <module>
[rank0]: [rank0]:   File "/tmp/train.py", line 41, in <module>
[rank1]: [rank1]:     loss = model(batch)
[rank0]: [rank0]:     dist.all_reduce(t)
[rank1]: [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
[rank0]: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
"""

COLOURED = ("\x1b[31m[rank2]: \x1b[0mTraceback (most recent call last):\n"
            "[rank2]: \x1b[2m  File \"/tmp/train.py\", line 9, in <module>\x1b[0m\n"
            "[rank2]:     step()\n"
            "[rank2]: \x1b[1;31mKeyError\x1b[0m: 'tokens'\x07\n")


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def test_clean_strips_colours_controls_and_any_number_of_rank_prefixes():
    assert clean("[rank0]: [rank0]: Traceback (most recent call last):") == \
        error_quote.Line(who="rank0", text="Traceback (most recent call last):")
    assert clean("\x1b[31m[rank3]: \x1b[0m  File \"x\"\x07") == error_quote.Line(who="rank3", text="  File \"x\"")
    assert clean("[default1]:Traceback") == error_quote.Line(who="default1", text="Traceback")
    assert clean("plain line") == error_quote.Line(who=None, text="plain line")


def test_a_plain_log_quotes_the_traceback_not_torchruns_and_uses_the_summary_rank():
    out = lines_of(quote([("ranks-n1.log", PLAIN)]))
    assert out[0] == ("--- rank 1 failed first (exitcode 1, says torchrun); the first traceback in ranks-n1.log "
                      "(its lines name no rank):")
    assert out[1:] == ["Traceback (most recent call last):", '  File "/tmp/train.py", line 3, in <module>',
                       '    raise ValueError("boom from rank 1")', "ValueError: boom from rank 1"]


def test_a_prefixed_log_quotes_the_failed_ranks_traceback_without_prefixes():
    out = lines_of(quote([("ranks-n1.log", PREFIXED)]))
    assert out[0] == "--- rank 1 failed first (exitcode 1, says torchrun); its last traceback, in ranks-n1.log:"
    assert out[1] == "Traceback (most recent call last):" and out[-1] == "ValueError: boom from rank 1"
    assert not any("[rank" in x or "ChildFailedError" in x for x in out)


def test_prefixed_twice_and_interleaved_ranks_do_not_mix_and_the_first_to_fail_is_quoted():
    out = lines_of(quote([("ranks-n1.log", TWICE_INTERLEAVED)]))
    assert out == ["--- rank 1 failed first; its last traceback, in ranks-n1.log:",
                   "Traceback (most recent call last):", '  File "/tmp/train.py", line 40, in <module>',
                   "    loss = model(batch)", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]


def test_the_rank_the_supervisor_saw_fail_is_preferred_when_torchrun_printed_no_summary():
    out = lines_of(quote([("ranks-n1.log", TWICE_INTERLEAVED)], rank=0))
    assert out[0].startswith("--- rank 0 failed first") and "Connection closed by peer" in out[-1]


def test_the_summarys_root_cause_wins_over_the_first_traceback_in_the_log():
    """rank 1's gloo error printed first, but torchrun observed rank 3 fail first."""
    text = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\", line 1, in <module>\n"
            "[rank1]: RuntimeError: Connection closed by peer\n"
            "[rank3]: Traceback (most recent call last):\n[rank3]:   File \"t.py\", line 2, in <module>\n"
            "[rank3]: ZeroDivisionError: division by zero\n" + LAUNCHER.format(rank=3, local=1))
    out = lines_of(quote([("ranks-n2.log", text)]))
    assert out[0].startswith("--- rank 3 failed first (exitcode 1, says torchrun)")
    assert out[-1] == "ZeroDivisionError: division by zero"


def test_the_earliest_summary_of_several_nodes_names_the_log():
    early = LAUNCHER.format(rank=2, local=0).replace("2026-12-01_12:08:21\n  host      : localhost\n  rank      : 2",
                                                     "2026-12-01_12:08:19\n  host      : localhost\n  rank      : 2")
    logs = [("ranks-n1.log", "[rank0]: Traceback (most recent call last):\n[rank0]: OSError: late\n"
             + LAUNCHER.format(rank=0, local=0)),
            ("ranks-n2.log", "[rank2]: Traceback (most recent call last):\n[rank2]:   File \"t.py\", line 1\n"
             "[rank2]: ValueError: early\n" + early)]
    out = lines_of(quote(logs))
    assert "rank 2 failed first" in out[0] and out[0].endswith("in ranks-n2.log:") and out[-1] == "ValueError: early"


def test_the_summarys_own_traceback_is_quoted_dedented_when_the_rank_printed_none():
    """@record wrote an error_file: torchrun's summary carries the traceback, indented by two."""
    summary = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_12:08:38
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7888) 
  error_file: /tmp/torchelastic_x/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
      return f(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^
    File "/tmp/bad3.py", line 6, in main
      raise RuntimeError("oom")
  RuntimeError: \x1b[31mCUDA out of memory\x1b[0m
  
============================================================
"""
    out = lines_of(quote([("ranks-n1.log", summary)]))
    assert out[0] == ("--- rank 0 failed first (exitcode 1); its traceback, from torchrun's summary in ranks-n1.log:")
    assert out[1] == "Traceback (most recent call last):" and out[-2] == '    raise RuntimeError("oom")'
    assert out[-1] == "RuntimeError: CUDA out of memory"


def test_a_rank_killed_by_a_signal_without_a_traceback_says_so():
    text = LAUNCHER.format(rank=4, local=0).replace("exitcode  : 1 (pid: 6575) ", "exitcode  : -11 (pid: 6575)  (SIGSEGV)")
    text = text.replace("traceback : To enable", "traceback : Signal 11 (SIGSEGV) received by PID 6575\n#To enable")
    out = lines_of(quote([("ranks-n1.log", text)]))
    assert out == ["--- rank 4 failed first (exitcode -11 (SIGSEGV)) and printed no traceback; torchrun's summary in "
                   "ranks-n1.log: Signal 11 (SIGSEGV) received by PID 6575"]


def test_default_prefixes_name_local_ranks_of_their_own_node():
    text = ("[default0]:Traceback (most recent call last):\n[default0]:  File \"t.py\", line 1\n[default0]:OSError: other\n"
            "[default1]:Traceback (most recent call last):\n[default1]:  File \"t.py\", line 2\n[default1]:KeyError: 'x'\n"
            + LAUNCHER.format(rank=9, local=1))
    out = lines_of(quote([("ranks-n1.log", "[default1]:Traceback (most recent call last):\n[default1]:IndexError: n1\n"),
                          ("ranks-n5.log", text)]))
    assert out[0].startswith("--- rank 9 failed first") and out[0].endswith("in ranks-n5.log:")
    assert out[-1] == "KeyError: 'x'"


def test_colour_codes_and_control_characters_never_reach_the_quote():
    out = quote([("ranks-n1.log", COLOURED)])
    assert "\x1b" not in out and "\x07" not in out
    assert lines_of(out)[1:] == ["Traceback (most recent call last):", '  File "/tmp/train.py", line 9, in <module>',
                                 "    step()", "KeyError: 'tokens'"]


def test_a_chained_exception_quotes_the_end_of_the_chain_not_a_later_failure():
    text = ("Traceback (most recent call last):\n  File \"t.py\", line 1\nKeyError: 'a'\n\n"
            "During handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n  File \"t.py\", line 3\nValueError: while handling\n"
            "Traceback (most recent call last):\n  File \"t.py\", line 9\nRuntimeError: a later rank's gloo error\n")
    out = lines_of(quote([("ranks-n1.log", text)]))
    assert out[-1] == "ValueError: while handling"


def test_a_rank_that_failed_twice_is_quoted_by_its_last_traceback():
    text = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"t.py\", line 1\n[rank0]: UserWarning: handled\n"
            "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"t.py\", line 2\n[rank0]: SystemError: fatal\n")
    assert lines_of(quote([("ranks-n1.log", text)]))[-1] == "SystemError: fatal"


def test_the_quote_is_bounded_in_lines_and_characters_and_keeps_the_exception():
    frames = "".join(f"[rank0]:   File \"/very/long/{'p' * 400}/mod{i}.py\", line {i}, in f{i}\n[rank0]:     f{i + 1}()\n"
                     for i in range(500))
    text = f"[rank0]: Traceback (most recent call last):\n{frames}[rank0]: RecursionError: {'m' * 1000}\n"
    out = lines_of(quote([("ranks-n1.log", text)]))
    assert len(out) <= MAX_LINES + 1 and len("\n".join(out[1:])) <= MAX_CHARS
    assert all(len(x) <= MAX_LINE_CHARS for x in out[1:])
    assert out[1] == "Traceback (most recent call last):" and "lines left out)" in out[2]
    assert out[-1].startswith("RecursionError: mmm") and out[-1].endswith("...")


def test_only_torchruns_traceback_is_not_an_error_and_error_lines_are_the_fallback():
    assert quote([("ranks-n1.log", BANNER + "\n".join(LAUNCHER.splitlines()[:7]) + "\n")], where="X") == "(no error in X)"
    out = lines_of(quote([("ranks-n1.log", "[rank0]: step 3\n[rank0]: RuntimeError: NCCL error in: x.cpp:12\n")]))
    assert out == ["--- ranks-n1.log:", "RuntimeError: NCCL error in: x.cpp:12"]


def test_log_tail_reads_the_attempts_logs_and_names_the_file(tmp_path):
    attempt = tmp_path / "attempt-2"
    attempt.mkdir()
    (attempt / "ranks-n1.log").write_text(PREFIXED)
    (attempt / "agents.log").write_text("Traceback (most recent call last):\nNotRankError: ignored\n")
    out = log_tail(attempt)
    assert f"in {attempt / 'ranks-n1.log'}:" in out.splitlines()[0] and out.endswith("ValueError: boom from rank 1")
    (attempt / "ranks-n1.log").write_text("all fine\n")
    assert log_tail(attempt) == f"(no error in the rank logs of {attempt})"


def test_read_tail_drops_the_cut_line_and_never_blocks_on_a_fifo(tmp_path):
    path = tmp_path / "ranks-a.log"
    path.write_text("x" * 100 + "\nTraceback (most recent call last):\nValueError: end\n")
    assert read_tail(path, max_bytes=40) == "ValueError: end\n"
    os.mkfifo(tmp_path / "ranks-fifo.log")
    assert read_tail(tmp_path / "ranks-fifo.log") == ""
    assert quote_logs(tmp_path).endswith("ValueError: end")
    assert read_tail(Path(tmp_path / "absent.log")) == ""


def test_a_deep_traceback_of_short_lines_is_bounded_in_lines():
    frames = "".join(f"  File \"m.py\", line {i}, in f\n    f()\n" for i in range(500))
    out = lines_of(quote([("ranks-n1.log", f"Traceback (most recent call last):\n{frames}RecursionError: deep\n")]))
    assert len(out) == MAX_LINES + 1   # the header, then the bounded traceback
    assert out[2] == f"  ... ({1001 - (MAX_LINES - 2)} lines left out)" and out[-1] == "RecursionError: deep"


def test_torchrun_refusing_its_command_line_is_quoted_not_reported_as_no_error():
    """The GPU machine's torch 2.11 torchrun refused --shutdown-timeout: argparse's usage and
    `torchrun: error: ...` were the whole log, and the give-up said "no error in the rank logs"."""
    text = ("usage: torchrun [-h] [--nnodes NNODES] [--nproc-per-node NPROC_PER_NODE]\n"
            "                training_script ...\n"
            "torchrun: error: unrecognized arguments: --shutdown-timeout\n")
    assert "torchrun: error: unrecognized arguments: --shutdown-timeout" in quote([("ranks-n1.log", text)])
