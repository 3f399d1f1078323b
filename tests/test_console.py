"""ckptsup's one logging path (ckptsup/console.py): the console renderer prints the lines and
streams the supervisor and agents always printed, made literal; CKPTSUP_LOG_FORMAT=json gives
one JSON object per line with level, component and timestamp; a bad value is one line at the
edge; the hooks' stdlib records reach the same renderer in a rank the agent starts, and yield
to a handler the script configured itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from ckptsup import console
from ckptsup.env import LOG_FORMAT, cold_rank_argv


@pytest.fixture
def fresh(monkeypatch):
    """This process's logging settings as a process starts with them; restored afterwards."""
    monkeypatch.delenv(LOG_FORMAT, raising=False)
    monkeypatch.setattr(console._state, "format", None)
    monkeypatch.setattr(console._state, "component", "ckptsup")
    return monkeypatch


def test_the_console_lines_are_todays_text_on_todays_stream(fresh, capsys) -> None:
    console.info("ckptsup: attempt 1: supervised at the hooks level")
    console.warning("ckptsup agent: ignored a stop command: \x1b[2Jbad \u202eevil", err=True)
    console.error("ckptsup: giving up: rank 0 said \ud800 [bold]x[/]")
    console.error("Traceback (most recent call last):\n  File \"t.py\", line 1\n\x1b[31mValueError\x1b[0m",
                  newlines=True)
    out, err = capsys.readouterr()
    assert out == ("ckptsup: attempt 1: supervised at the hooks level\n"
                   "ckptsup: giving up: rank 0 said \\ud800 [bold]x[/]\n"
                   "Traceback (most recent call last):\n  File \"t.py\", line 1\n\\x1b[31mValueError\\x1b[0m\n")
    assert err == "ckptsup agent: ignored a stop command: \\x1b[2Jbad \\u202eevil\n"


def test_a_line_with_a_line_break_stays_one_line_and_a_flood_is_cut(fresh, capsys) -> None:
    console.warning("ckptsup: lease renewal failed: a\nb\rc")
    console.info("ckptsup: " + "x" * 100_000)
    first, second = capsys.readouterr().out.splitlines()
    assert first == "ckptsup: lease renewal failed: a\\nb\\rc"
    assert second.endswith(" ... (91,817 more characters)") and len(second) < 8300


def test_a_stream_that_cannot_show_a_character_gets_its_escape_not_a_crash(fresh, monkeypatch) -> None:
    screen = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stderr", screen)
    console.warning("ckptsup: NodeAddr of n\u00e9 unavailable \ud800 (scontrol \u2014 timeout)", err=True)
    assert screen.buffer.getvalue() == b"ckptsup: NodeAddr of n\\xe9 unavailable \\ud800 (scontrol \\u2014 timeout)\n"


def test_json_lines_carry_level_component_and_timestamp(fresh, capsys) -> None:
    fresh.setenv(LOG_FORMAT, "json")
    console.configure("agent n3")
    console.info("ckptsup: resuming the run in /runs/7: lease stale", err=True)
    console.error("ckptsup: giving up: \x1b]0;title\x07 \ud800")
    out, err = capsys.readouterr()
    [shown], [quoted] = [json.loads(line) for line in err.splitlines()], [json.loads(line) for line in out.splitlines()]
    assert list(shown) == ["timestamp", "level", "component", "event"]
    assert shown["level"] == "info" and shown["component"] == "agent n3"
    assert shown["event"] == "ckptsup: resuming the run in /runs/7: lease stale"
    assert datetime.fromisoformat(shown["timestamp"].replace("Z", "+00:00")).utcoffset().total_seconds() == 0
    assert quoted["level"] == "error" and quoted["event"] == "ckptsup: giving up: \\x1b]0;title\\x07 \\ud800"


@pytest.mark.parametrize("value", ["console", "json", " JSON ", ""])
def test_the_format_names_one_renderer(value: str) -> None:
    expected = console.Format.JSON if "json" in value.lower() else console.Format.CONSOLE
    assert console.log_format({LOG_FORMAT: value}) is expected


def test_a_bad_format_stops_ckptsup_launch_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('never runs')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "launch", "train.py"], cwd=tmp_path,
                          env={**env, LOG_FORMAT: "yaml"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"ckptsup: error: environment {LOG_FORMAT}='yaml' is not a log format; set it to console "
                           "or json, or unset it for the console lines\n")
    assert not (tmp_path / "run").exists()


# A rank's script: the hooks' logger as session.py and rank_link.py use it, then the script's own
# logging set up; it reports which handlers the ckptsup logger holds.
RANK_SCRIPT = """
import logging, sys
log = logging.getLogger("ckptsup.hooks")
log.warning("ckptsup: rank %d exits with %s: %s", 3, "PREEMPTED", "stopped after step 9 \\x1b[2J")
log.info("ckptsup: committed step %d", 9)          # below WARNING: not shown, as before
logging.basicConfig(format="script: %(levelname)s %(message)s", stream=sys.stderr)
log.warning("ckptsup: lost the agent channel (%s); continuing without it", "EOF")
print("done", flush=True)
"""


def run_rank(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k != LOG_FORMAT}
    return subprocess.run(cold_rank_argv(sys.executable, [str(script)], module=False), cwd=tmp_path,
                          env={**base, "RANK": "3", **env}, capture_output=True, text=True, timeout=120)


def test_a_ranks_hook_lines_go_through_the_console_renderer_until_the_script_configures_logging(tmp_path) -> None:
    proc = run_rank(tmp_path)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    assert proc.stderr.splitlines() == [
        "ckptsup: rank 3 exits with PREEMPTED: stopped after step 9 \\x1b[2J",   # literal, on stderr, as the
        "script: WARNING ckptsup: lost the agent channel (EOF); continuing without it",  # script's own, once
    ]


def test_a_ranks_hook_lines_are_json_lines_of_component_rank_r(tmp_path) -> None:
    proc = run_rank(tmp_path, **{LOG_FORMAT: "json"})
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    first, second = proc.stderr.splitlines()
    shown = json.loads(first)
    assert {k: shown[k] for k in ("level", "component", "event")} == {
        "level": "warning", "component": "rank 3",
        "event": "ckptsup: rank 3 exits with PREEMPTED: stopped after step 9 \\x1b[2J"}
    assert second.startswith("script: WARNING ckptsup: lost the agent channel")


def test_a_rank_started_by_hand_with_a_bad_format_still_runs_its_script(tmp_path) -> None:
    proc = run_rank(tmp_path, **{LOG_FORMAT: "xml"})
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    assert proc.stderr.splitlines()[:2] == [
        f"ckptsup: warning: environment {LOG_FORMAT}='xml' is not a log format; set it to console or json, or "
        "unset it for the console lines; writing the console lines",
        "ckptsup: rank 3 exits with PREEMPTED: stopped after step 9 \\x1b[2J"]
