"""Text is data (issue 20): text from ranks, Slurm, files, paths and the environment is shown
literally by every renderer — never rich markup, never a control sequence on the terminal, never a
crash on a lone surrogate, never a 1 MB flood.

The renderers run through the real entry point (`ckptsup.cli.main`, what the console script
calls) on real run directories (events written by `EventWriter`, status by `publish(build_status)`,
checkpoints by the real commit path), with rich and matplotlib as shipped. Hypothesis settings come
from the profile (tests/conftest.py: "ci" by default); the tests that start whole commands run a
tenth of the profile's examples (the PNG one a thirtieth), plus the corpus as explicit examples.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.cli import main
from ckptsup.config import SupervisorConfig
from ckptsup.events import EventWriter
from ckptsup.progress import LineSplitter
from ckptsup.rundir import RunDir
from ckptsup.supervisor.node.rank_output import RankOutput, print_console
from ckptsup.supervisor.job.status import Seen, build_status, publish
from ckptsup.textsafe import LIMIT, literal, mathtext, text

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:1234: Connection reset by peer")
CORPUS = [GLOO, "[/__w/x]", "[bold red]x[/]", "[/]", "[link=http://evil]click[/link]", ":warning:",
          "\x1b]0;pwned\x07", "\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\", "\x1b[31mred\x1b[0m", "\x1b[2J\x1b[H",
          "\x9b31m", "<script>alert(1)</script>", "\ud800", "\udcff", "a\x00b", "\r\nforged line", "tab\there",
          "\u202eevil", "\x7f\x85", "$x^$", "$\\frac$", "back\\[bold]slash\\"]
HOSTILE = "".join(CORPUS)
BIG = "A" * 1_000_000   # 1 MB: the events reader's line cap is 1 MiB, so it is read, not skipped
FEW = max(3, settings.default.max_examples // 10)
FEWER = max(2, settings.default.max_examples // 30)

any_char = st.characters(codec=None, exclude_categories=())   # surrogates and controls included
hostile_text = st.lists(st.one_of(st.sampled_from(CORPUS), st.text(any_char, min_size=1, max_size=12)),
                        min_size=1, max_size=4).map("".join)
# what a terminal would act on: C0 (but \n between lines), DEL, C1; ESC in particular
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
SURROGATE = re.compile("[\ud800-\udfff]")
WHITESPACE = re.compile(r"\s+")


# ---- the helper -------------------------------------------------------------------------------

@given(hostile_text)
@example(HOSTILE)
def test_literal_leaves_nothing_a_terminal_acts_on_and_keeps_plain_text(value):
    shown = literal(value)
    assert not RAW_CONTROL.search(shown) and not SURROGATE.search(shown) and "\n" not in shown
    shown.encode("utf-8")   # strict: no lone surrogate left
    assert len(shown) <= LIMIT + 40
    if not RAW_CONTROL.search(value) and not SURROGATE.search(value) and "\n" not in value:
        assert shown == value   # plain text is shown as it is
    # rich prints the Text as exactly the literal text: no markup, no emoji code, no highlighting
    from rich.console import Console

    screen = io.StringIO()
    Console(file=screen, width=LIMIT + 100, force_terminal=False).print(text(value, "bold"))
    assert screen.getvalue() == shown.rstrip(" ") + "\n"


def test_literal_escapes_each_kind_and_bounds_a_flood():
    assert literal("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert literal("\x1b[31mred") == "\\x1b[31mred" and literal("\x9b") == "\\x9b" and literal("\x7f") == "\\x7f"
    assert literal("a\ud800b") == "a\\ud800b" and literal("a\x00b") == "a\\x00b" and literal("\u202e") == "\\u202e"
    assert literal("one\ntwo\tthree\r") == "one\\ntwo\\tthree\\r"
    assert literal("one\n\ttwo", newlines=True) == "one\n\ttwo"   # a quoted traceback keeps its lines
    big = literal(BIG)
    assert big.startswith("A" * 1000) and big.endswith(f"... ({1_000_000 - LIMIT:,} more characters)")
    assert len(big) < LIMIT + 40
    flood = literal("\x1b" * 10_000)
    assert len(flood) <= LIMIT + 40 and flood.startswith("\\x1b\\x1b") and not flood.split(" ...")[0].endswith("\\x1")
    assert mathtext("$x^$") == "\\$x^\\$"


# ---- run directories --------------------------------------------------------------------------

def write_run(run: Path, h: str, *, big: bool = False) -> None:
    """A run whose every text field is `h`: reasons, messages, node names, kinds, the job id."""
    RunDir.create(run)
    w = EventWriter(run_dir=run, job_id=h, attempt=0)
    t = iter(f"2026-01-01T00:{m:02d}:{s:02d}.000+00:00" for m in range(60) for s in range(0, 60, 5))
    w.emit("supervisor_start", ts=next(t), mono=0.0, script=h)
    w.emit("allocation", ts=next(t), mono=1.0, nodes=[h, "n2"], gpus_per_node=1, spares=[])
    w.emit("launch", ts=next(t), mono=2.0, nodes=[h, "n2"], path="initial")
    w.emit("first_step", ts=next(t), mono=3.0, step=0)
    w.emit("step_progress", ts=next(t), mono=4.0, step=5, step_time_s=0.1)
    w.emit("checkpoint_committed", ts=next(t), mono=5.0, step=5, stall_s=0.5, write_s=1.0, bytes=1000)
    w.emit("checkpoint_failed", ts=next(t), mono=6.0, step=6, reason=f"{GLOO} {h}")
    w.emit("checkpoint_rejected", ts=next(t), mono=6.5, step=5, level=1, reason=h)
    w.emit("failure_detected", ts=next(t), mono=7.0, kind=h, node=h, rank=0, detect_s=1.0)
    w.emit("failure_attributed", ts=next(t), mono=7.5, kind="crash", node=h, was_kind=h, detail=h)
    w.emit("node_excluded", ts=next(t), mono=8.0, node=h, reason=h)
    w.emit("health_check", ts=next(t), mono=8.5, node=h, ok=False, detail=h)
    w.emit("restart_done", ts=next(t), mono=9.0, restart_s=2.0, resume_step=5, path=h,
           phases={"kill_s": 0.1, h: 0.2})
    w.emit("control", ts=next(t), mono=9.5, request=h, command=h, outcome=h, detail=h)
    if big:
        w.emit("checkpoint_failed", ts=next(t), mono=9.7, step=7, reason=BIG)
    w.write_record({"event": h, "ts": next(t), "mono": 9.8, "job_id": h, "attempt": h, "note": h})  # a foreign record
    w.emit("requeue", ts=next(t), mono=10.0, reason=h, by=h, excluded=[h], partition=h)
    w.emit("give_up", ts=next(t), mono=11.0, reason=h)
    w.close()
    with open(run / "events.jsonl", "a") as f:
        f.write("not an event\n")   # so the readers' `skipped` note (it names the path) is printed too
    publish(run, build_status(job_id=h, attempt=1, epoch=0, run_status=h, active=(h,), spares=("n2",),
                              excluded={h: h}, tracker=None, config=SupervisorConfig(),
                              seen=Seen(now_mono=10.0, now_wall=1e9, heard={h: 9.0}, has_agent=lambda n: True,
                                        warm_nodes=frozenset(), checkpoints={"committed": {"step": 5}},
                                        interval_s=None, last_commit_mono=None)))


def as_read(h: str) -> str:
    """`h` as a reader gets it back from a JSON file (a surrogate pair written as two escapes is
    read back as the one character it spells)."""
    return json.loads(json.dumps(h))


def path_name(h: str) -> str:
    """`h` as one directory name the file system takes (no / or NUL; a lone surrogate as the
    undecodable byte it stands for, the way os.listdir would hand it back)."""
    raw = h.replace("/", "|").replace("\x00", "0").encode("utf-8", "backslashreplace")[:120]
    return os.fsdecode(b"d-" + raw)


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`main(args)` with stdout and stderr captured as bytes (decoded strictly: a lone surrogate or
    a broken byte on the terminal fails the test). color=True: click strips nothing, as on a tty."""
    runner = CliRunner()
    code = 0
    with runner.isolation(env={"COLUMNS": "20000", "LINES": "100", "NO_COLOR": None, "FORCE_COLOR": None,
                               "TERM": "dumb", **(env or {})}, color=True) as streams:
        try:
            main(list(args))
        except SystemExit as exit_:
            code = 0 if exit_.code is None else exit_.code
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = streams[0].getvalue(), streams[1].getvalue()
    return code, out.decode("utf-8"), err.decode("utf-8")


def assert_literal(output: str, h: str, *, present: bool = True) -> None:
    assert "Traceback" not in output
    assert not RAW_CONTROL.search(output), f"a raw control character reached the terminal: {output[:300]!r}"
    if present:   # whitespace aside: rich wraps a table's title to the table's width
        needle = WHITESPACE.sub("", literal(h)[:200])
        assert needle in WHITESPACE.sub("", output), f"{needle!r} not shown literally in {output[:500]!r}"


@pytest.fixture(autouse=True)
def _site(monkeypatch, tmp_path_factory):
    site = tmp_path_factory.mktemp("site") / "site.toml"
    site.write_text("[cost]\nprice_per_gpu_hour = 2.0\ngpu_mtbf_hours = 20000.0\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))


def fresh() -> Path:
    return Path(tempfile.mkdtemp(prefix="ckptsup-text-"))


# ---- every terminal renderer --------------------------------------------------------------------

@settings(max_examples=FEW, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_text)
@example(HOSTILE)
def test_log_status_and_report_show_hostile_text_literally(h):
    base = fresh()
    hr = as_read(h)
    run = base / path_name(h) / "run"
    write_run(run, h)
    code, out, err = cli("log", str(run))
    assert code == 0 and "ckptsup restart log" in out and "Connection reset by peer" in out
    assert_literal(out, hr)
    assert_literal(err, path_name(h))   # the skipped-lines note names the run dir
    code, out, err = cli("log", "--all", "--json", str(run))
    assert code == 0 and json.loads(out)[-1]["reason"] == hr and not RAW_CONTROL.search(out)

    code, out, err = cli("status", str(run))
    assert code == 0 and "heartbeat" in out
    assert_literal(out, hr)
    code, out, err = cli("status", "--json", str(run))
    assert code == 0 and not RAW_CONTROL.search(out)
    st = json.loads(out)
    assert set(st["nodes"]) == {hr, "n2"} and st["excluded"] == {hr: hr}   # --json keeps the data exactly

    prom = base / "r.prom"
    code, out, err = cli("report", "--prom", str(prom), str(run))
    assert code == 0 and "ckptsup goodput report" in out and "where the paid time went" in out
    assert_literal(out, hr)
    assert_valid_prom(prom.read_bytes(), hr)

    missing = run.parent / "no-such-run"   # an error line quotes the path: literal too
    code, out, err = cli("status", str(missing))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("ckptsup: error:")
    assert_literal(err, str(missing))


PROM_LINE = re.compile(r'^(# (HELP|TYPE) ckptsup_\w+ .*|ckptsup_\w+\{(\w+="(?:[^"\\\n]|\\[\\"n])*")'
                       r'(,\w+="(?:[^"\\\n]|\\[\\"n])*")*\} \S+)$')


def assert_valid_prom(data: bytes, h: str) -> None:
    """Exposition format: UTF-8, lines split on \\n only, each a comment or a sample whose label
    values escape \\, " and line feeds; no raw control character; the job label unescapes to the
    job id as the terminal shows it."""
    text_ = data.decode("utf-8")
    assert text_.endswith("\n") and not RAW_CONTROL.search(text_)
    bad = [line for line in text_[:-1].split("\n") if not PROM_LINE.match(line)]
    assert not bad, bad[:3]
    label = re.search(r'ckptsup_goodput_ratio\{job_id="((?:[^"\\\n]|\\[\\"n])*)"\}', text_).group(1)
    unescaped = re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), label)
    assert unescaped == literal(h, limit=1024)


@settings(max_examples=FEWER, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_text)
@example(HOSTILE)
def test_png_and_html_reports_take_hostile_text(h):
    base = fresh()
    run = base / "run"
    write_run(run, h)
    png, page = base / "r.png", base / "r.html"
    code, out, err = cli("report", "--png", str(png), "--html", str(page), str(run))
    assert code == 0, err
    assert_literal(out, as_read(h))
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")   # a `$` did not start mathtext
    html_ = page.read_text(encoding="utf-8")
    assert "<script>" not in html_ and not SURROGATE.search(html_)
    if "<script>" in h:
        assert "&lt;script&gt;" in html_


def test_a_1mb_reason_is_cut_on_the_terminal_not_a_flood():
    run = fresh() / "run"
    write_run(run, "n1", big=True)
    code, out, err = cli("log", str(run))
    assert code == 0 and "A" * 1000 in out and "more characters)" in out
    assert len(out) < 200_000   # 1 MB in the file, a bounded screen on the terminal


def test_our_own_styles_still_style_and_data_escapes_stay_escaped_on_a_colour_terminal():
    run = fresh() / "run"
    write_run(run, HOSTILE + "\x1b[7;38;5;201mINVERSE")
    code, out, err = cli("log", str(run), env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert code == 0
    assert "\x1b[1;31m" in out or "\x1b[31m" in out      # failure_detected is still bold red (our style)
    assert "\x1b[7;38;5;201m" not in out and "\x1b]" not in out and "\x9b" not in out   # the data's are not
    assert "\\x1b[7;38;5;201mINVERSE" in out and "\\x1b]0;pwned\\x07" in out and GLOO in out


def test_the_gloo_line_in_a_checkpoint_failed_reason_is_shown_by_ckptsup_log():
    """Regression (issue 20): this reason reached rich as markup and `ckptsup log` died of MarkupError."""
    run = fresh() / "run"
    RunDir.create(run)
    w = EventWriter(run_dir=run, job_id="7", attempt=0)
    w.emit("supervisor_start", ts="2026-01-01T00:00:00.000+00:00", mono=0.0)
    w.emit("checkpoint_failed", ts="2026-01-01T00:00:01.000+00:00", mono=1.0, step=40, reason=GLOO)
    w.close()
    ckptsup = str(Path(sys.executable).with_name("ckptsup"))
    done = subprocess.run([ckptsup, "log", str(run)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    assert "MarkupError" not in done.stderr and "Traceback" not in done.stderr
    assert f"step=40 reason={GLOO}" in done.stdout


# ---- ckpt commands ------------------------------------------------------------------------------

@settings(max_examples=FEW, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_text)
@example(HOSTILE)
def test_ckpt_commands_show_hostile_names_and_fields_literally(h):
    base = fresh()
    ck = base / path_name(h) / "ck"
    write_synthetic(ck, step=5, job_id=h, item_bytes=100)            # the manifest's job id (a surrogate: refused)
    job = SURROGATE.sub("?", h)   # a manifest can hold anything but a lone surrogate
    good = write_synthetic(ck, step=6, job_id=job, item_bytes=100)
    stray = os.fsencode(good) + b"/" + os.fsencode(path_name(h))     # an unlisted file: a problem naming it
    os.close(os.open(stray, os.O_WRONLY | os.O_CREAT, 0o600))

    code, out, err = cli("ckpt", "list", str(ck))
    assert code == 0 and "STEP" in out
    assert_literal(out, "")
    code, out, err = cli("ckpt", "verify", str(ck))
    assert code == 1 and len(err.splitlines()) == 1 and "failed verification" in err
    assert_literal(out, path_name(h)[:60])   # the unlisted file's name, in the problem
    code, out, err = cli("ckpt", "inspect", str(ck / "step_6"))
    assert code == 0
    assert_literal(out, str(ck / "step_6"))
    assert_literal(out, job)                 # the manifest's job id
    code, out, err = cli("ckpt", "inspect", str(ck))
    assert code == 0
    assert_literal(out, str(ck))
    code, out, err = cli("ckpt", "list", "--json", str(ck))
    assert code == 0 and not RAW_CONTROL.search(out) and len(json.loads(out)) == 2


# ---- the console relay of rank output: the rank's bytes, untouched ------------------------------

def relay(chunks: list[bytes], *, tee: bool) -> bytes:
    """Rank output through the agent's reader, an HMAC'd output frame and the supervisor's printer."""
    from ckptsup import messages, wire
    from ckptsup.wire import MessageKind

    secret = b"k" * 64
    with tempfile.TemporaryDirectory() as d:
        out = RankOutput.open(os.path.join(d, "ranks.log"), pattern="auto", tee=tee)
        for chunk in chunks:
            out.feed(chunk)
        out.finish()
        shown = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
        while (console := out.take_console()) is not None:
            sent = messages.Output(lines=tuple(console[0]), dropped=console[1])
            frame = wire.encode(MessageKind.OUTPUT, sent.to_body(), seq=1, secret=secret)
            m, _, body = wire.decode(frame, secret=secret)
            print_console(messages.parse(m, body), out=shown)
        out.close()
        return shown.buffer.getvalue()


RANK0 = (b"[rank0]: \x1b[31mERROR\x1b[0m [bold]not markup[/] \x1b]0;title\x07 <script>\n"
         b"[rank0]: 10%|\xe2\x96\x88   |\r[rank0]: 20%|\xe2\x96\x88\xe2\x96\x88  |\r\n"
         b"[rank0]: not utf-8 \xff\xfe\n[rank0]: \n[rank0]: step 3 \xf0\x9f\x9a\x80 tab\tend\n")


def test_rank_0s_console_lines_are_its_bytes_colour_codes_and_redraws_included():
    assert relay([RANK0], tee=False) == RANK0
    assert relay([RANK0[i:i + 7] for i in range(0, len(RANK0), 7)], tee=False) == RANK0   # cut anywhere
    other = b"[rank1]: \x1b[32mrank one\x1b[0m\n"
    assert relay([RANK0 + other], tee=False) == RANK0      # rank 1 only with --tee
    assert relay([RANK0 + other], tee=True) == RANK0 + other


@given(st.lists(st.binary(max_size=60), max_size=6))
def test_any_rank_bytes_reach_the_console_unchanged(chunks):
    lines = b"".join(b"[rank0]: " + c.replace(b"\n", b"").replace(b"\r", b"") + b"\n" for c in chunks)
    assert relay([lines], tee=True) == lines


def test_the_splitter_keeps_every_separator_for_the_relay():
    s = LineSplitter()
    segs = s.segments(b"a\rb\r\nc\n\nd") + s.flush_segments()
    assert [(x.raw, x.continued, x.end) for x in segs] == [
        (b"a", False, b"\r"), (b"b", True, b"\r\n"), (b"c", False, b"\n"), (b"", False, b"\n"), (b"d", False, b"")]


# ---- the supervisor's own console messages ------------------------------------------------------

def test_a_console_message_quoting_data_is_literal_and_survives_a_strict_stdout(monkeypatch):
    from ckptsup import console

    screen = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", screen)
    console.error(f"ckptsup: giving up: {HOSTILE}")   # a bare print() of this raises UnicodeEncodeError (\ud800)
    console.error("Traceback (most recent call last):\n  File \"x.py\", line 1\n\x1b[31mValueError\x1b[0m", newlines=True)
    shown = screen.buffer.getvalue().decode("utf-8")
    lines = shown.splitlines()
    assert lines[0] == "ckptsup: giving up: " + literal(HOSTILE) and len(lines) == 4   # the quote keeps its lines
    assert lines[3] == "\\x1b[31mValueError\\x1b[0m" and "\x1b" not in shown


def test_the_give_up_quote_of_a_rank_traceback_is_literal_on_the_supervisors_console(tmp_path, capsys, monkeypatch):
    """The in-process supervisor loop (tests/test_supervisor_loop.py's scripted world) gives up on a
    crash loop and quotes the rank's last traceback from its log: its lines stay lines, anything
    a terminal would act on (a C1 CSI, a bidi override, NUL) is shown escaped."""
    from test_supervisor_loop import Clock, Fault, World, supervisor

    site = tmp_path / "site.toml"
    site.write_text("[checkpoint]\nadaptive_interval = false\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    world = World(clock=Clock(), faults={i: Fault("crash", 1) for i in range(10)})
    sv = supervisor(tmp_path, world)
    log = tmp_path / "run" / "attempt-2"
    log.mkdir(mode=0o700)
    (log / "ranks-n1.log").write_bytes(
        b'[rank0]: Traceback (most recent call last):\n[rank0]:   File "t.py", line 3, in <module>\n'
        b"[rank0]: ValueError: \xc2\x9b2J \xe2\x80\xaeevil \x00nul [bold]x[/]\n")
    assert sv.run() == 3
    out = capsys.readouterr().out
    assert "ckptsup: giving up:" in out and '  File "t.py", line 3, in <module>\n' in out
    assert "ValueError: \\x9b2J \\u202eevil nul [bold]x[/]" in out   # (the quote itself drops NUL)
    assert not RAW_CONTROL.search(out)
