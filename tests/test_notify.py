"""`[notify]` (issue 40): which events are notices, the config's edge, and delivery to a real
command (argv, no shell, the notice on stdin) and a real HTTP server on 127.0.0.1 — retried,
bounded, never blocking the caller, the secret only in the request's header. The dev-cluster run
is tests/test_notify_slurm.py."""

from __future__ import annotations

import http.server
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptsup import console
from ckptsup.config import NOTIFY_EVENTS, NotifyConfig, load_config
from ckptsup.errors import ConfigError
from ckptsup.supervisor.job.notify import Notice, Notifier, notice_of, payload

HOSTILE = "$(touch PWNED); `id`; ' \" \x1b]0;pwned\x07 \x1b[31mRED\n[bold]x[/] \u202e {job_id} %s"
TOKEN = "s3cr3t-token-for-the-hook"


def event(name: str, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": "2026-01-01T00:00:00.000+00:00", "mono": 1.0, "job_id": "7", "attempt": 0, **fields}


def site(tmp_path: Path, body: str, monkeypatch) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(body)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(path))
    return path


@pytest.fixture
def lines(monkeypatch) -> list[str]:
    """Every console line the notifier says (warnings included)."""
    said: list[str] = []
    monkeypatch.setattr(console, "warning", lambda line, **_: said.append(line))
    return said


def recorder(tmp_path: Path, *, rc: int = 0, sleep_s: float = 0.0) -> tuple[Path, Path]:
    """A real program that appends its stdin (one notice) as a line to out.jsonl, then exits `rc`."""
    out = tmp_path / "out.jsonl"
    prog = tmp_path / "notify-me"
    prog.write_text(f"#!{sys.executable}\nimport sys, time\ndata = sys.stdin.read()\ntime.sleep({sleep_s})\n"
                    f"open({str(out)!r}, 'a').write(data + '\\n')\nprint('boom on stderr', file=sys.stderr)\n"
                    f"sys.exit({rc})\n")
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    return prog, out


class Hook:
    """A real HTTP server on 127.0.0.1 that records each POST and answers the statuses given, in turn."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.statuses = list(statuses or [])
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.posts.append((dict(self.headers), body))
                code = hook.statuses.pop(0) if hook.statuses else 200
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T0K3N-IN-PATH"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    made: list[Hook] = []

    def make(statuses: list[int] | None = None) -> Hook:
        made.append(Hook(statuses))
        return made[-1]
    yield make
    for h in made:
        h.close()


# ---- which events are notices ------------------------------------------------------------------

def test_the_notices_are_the_events_a_person_must_know() -> None:
    assert tuple(n.value for n in Notice) == NOTIFY_EVENTS
    assert notice_of(event("give_up", reason="x")) is Notice.GIVE_UP
    assert notice_of(event("node_excluded", node="n2", reason="node_down", drained=True)) is Notice.NODE_DRAINED
    assert notice_of(event("node_excluded", node="n2", reason="cloud notice", drained=False)) is None   # not drained
    assert notice_of(event("failure_detected", kind="sdc", step=40)) is Notice.SDC
    assert notice_of(event("failure_detected", kind="crash", step=40)) is None
    assert notice_of(event("requeue", reason="node_down", by="supervisor")) is Notice.REQUEUE
    assert notice_of(event("preemption", signal="preemption")) is Notice.PREEMPTION
    assert notice_of(event("run_complete", step=149)) is Notice.RUN_COMPLETE
    for routine in ("checkpoint_committed", "launch", "restart_done", "memory_saved", "not_an_event"):
        assert notice_of(event(routine)) is None


def test_a_notice_is_json_with_the_event_as_data_and_a_literal_summary() -> None:
    body = json.loads(payload(Notice.GIVE_UP, event("give_up", reason=HOSTILE), run_dir="/r"))
    assert body["notice"] == "give_up" and body["job_id"] == "7" and body["run_dir"] == "/r"
    assert body["event"]["reason"] == HOSTILE   # exactly the data, JSON-escaped
    assert "\x1b" not in body["summary"] and "\\x1b]0;pwned" in body["summary"] and "\n" not in body["summary"]
    big = json.loads(payload(Notice.GIVE_UP, event("give_up", reason="A" * 1_000_000), run_dir="/r"))
    assert len(big["event"]["reason"]) < 5000 and big["event"]["reason"].endswith("more characters)")


# ---- the config's edge ---------------------------------------------------------------------------

def test_an_unknown_notice_name_is_one_line_naming_the_valid_ones(tmp_path, monkeypatch) -> None:
    site(tmp_path, '[notify]\nevents = ["give_up", "node_dead"]\n', monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config()
    line = str(err.value)
    assert "\n" not in line and "notify.events" in line and "'node_dead'" in line
    assert "valid: give_up, node_drained, sdc, requeue, preemption, run_complete" in line


@pytest.mark.parametrize(("body", "says"), [
    ('[notify]\ncommand = "rm -rf /tmp/x"\n', "must be a list of strings"),
    ('[notify]\ncommand = [""]\n', "argv list"),
    ('[notify]\nwebhook = "ftp://example.com/x"\n', "https:// URL"),
    ('[notify]\nwebhook_secret_env = "$TOKEN"\n', "name of an environment variable"),
    ('[notify]\ntimeout_s = 0\n', "must be > 0"),
    ('[notify]\nretries = 50\n', "at most 10"),
])
def test_bad_notify_values_are_one_line(tmp_path, monkeypatch, body, says) -> None:
    site(tmp_path, body, monkeypatch)
    with pytest.raises(ConfigError, match=says) as err:
        load_config()
    assert "\n" not in str(err.value)


def test_the_notifier_refuses_what_would_fail_later_in_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not an executable file"):
        Notifier.from_config(NotifyConfig(command=[str(tmp_path / "nope")]), run_dir="/r")
    with pytest.raises(ConfigError, match="WEBHOOK_TOKEN, which is not set") as err:
        Notifier.from_config(NotifyConfig(webhook="https://h.example/x", webhook_secret_env="WEBHOOK_TOKEN"),
                             run_dir="/r", environ={})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="in clear; use https://") as err:
        Notifier.from_config(NotifyConfig(webhook="http://hooks.example.com/T0K3N", webhook_secret_env="T"),
                             run_dir="/r", environ={"T": TOKEN})
    assert "T0K3N" not in str(err.value) and TOKEN not in str(err.value)
    assert not Notifier.from_config(NotifyConfig(), run_dir="/r").workers   # nothing configured: nothing runs


# ---- a real command --------------------------------------------------------------------------------

def test_a_real_command_gets_each_chosen_notice_on_stdin_and_no_shell_sees_the_text(tmp_path, lines) -> None:
    prog, out = recorder(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)   # a shell would create PWNED here
    try:
        n = Notifier.from_config(NotifyConfig(command=[str(prog), "--flag", HOSTILE], events=["give_up", "node_drained"]),
                                 run_dir=str(tmp_path))
        n.offer(event("checkpoint_committed", step=5))
        n.offer(event("node_excluded", node=HOSTILE, reason=HOSTILE, drained=True))
        n.offer(event("run_complete", step=9))   # not chosen
        n.offer(event("give_up", reason=HOSTILE))
        n.close()
    finally:
        os.chdir(cwd)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["notice"] for g in got] == ["node_drained", "give_up"]
    assert got[0]["event"]["node"] == HOSTILE and got[1]["event"]["reason"] == HOSTILE
    assert not (tmp_path / "PWNED").exists() and not lines


def test_a_failing_or_hanging_command_is_one_line_and_never_blocks_the_caller(tmp_path, lines) -> None:
    prog, out = recorder(tmp_path, rc=3)
    n = Notifier.from_config(NotifyConfig(command=[str(prog)]), run_dir="/r")
    n.offer(event("give_up", reason="x"))
    n.close()
    assert len(lines) == 1 and "exited 3: boom on stderr" in lines[0] and "the run goes on" in lines[0]
    lines.clear()
    (tmp_path / "slow").mkdir()
    slow, out = recorder(tmp_path / "slow", sleep_s=30)
    n = Notifier.from_config(NotifyConfig(command=[str(slow)], timeout_s=1.0), run_dir="/r")
    t0 = time.monotonic()
    for _ in range(100):   # a storm while the command hangs: the caller never waits
        n.offer(event("run_complete", step=1))
    assert time.monotonic() - t0 < 0.5
    n.close()
    took = time.monotonic() - t0
    assert took < 4.0, took   # close waits timeout_s + 1 s at most
    assert any("behind" in line and "dropping" in line for line in lines), lines
    assert any("still running after 1s: killed" in line for line in lines), lines
    assert any("not delivered within 1s + 1s" in line for line in lines), lines
    assert not out.exists()   # it was killed before it wrote


# ---- a real HTTP endpoint --------------------------------------------------------------------------

def test_a_real_webhook_gets_the_json_and_the_secret_only_in_its_header(hook, lines) -> None:
    h = hook()
    n = Notifier.from_config(NotifyConfig(webhook=h.url, webhook_secret_env="HOOK_TOKEN"), run_dir="/r",
                             environ={"HOOK_TOKEN": TOKEN})
    n.offer(event("node_excluded", node="n2", reason=HOSTILE, drained=True))
    n.close()
    [(headers, body)] = h.posts
    assert headers["Authorization"] == f"Bearer {TOKEN}" and headers["Content-Type"] == "application/json"
    got = json.loads(body)
    assert got["notice"] == "node_drained" and got["event"]["reason"] == HOSTILE and TOKEN not in body.decode()
    assert not lines


def test_a_webhook_is_retried_on_5xx_and_a_dead_one_is_one_line_without_its_path_or_secret(hook, lines) -> None:
    h = hook([503, 500])
    n = Notifier.from_config(NotifyConfig(webhook=h.url, retries=3, timeout_s=5.0), run_dir="/r")
    n.offer(event("requeue", reason="node_down", by="supervisor"))
    n.close()
    assert len(h.posts) == 3 and not lines   # two 5xx, then delivered
    dead = hook([500] * 10)
    n = Notifier.from_config(NotifyConfig(webhook=dead.url, webhook_secret_env="HOOK_TOKEN", retries=2, timeout_s=3.0),
                             run_dir="/r", environ={"HOOK_TOKEN": TOKEN})
    n.offer(event("give_up", reason="x"))
    n.close()
    assert len(dead.posts) == 2
    [line] = lines
    assert "HTTP 500" in line and "http://127.0.0.1:" in line
    assert "T0K3N-IN-PATH" not in line and TOKEN not in line
    lines.clear()
    refused = hook()
    url = refused.url
    refused.close()   # nothing listens there any more
    n = Notifier.from_config(NotifyConfig(webhook=url, retries=2, timeout_s=2.0), run_dir="/r")
    t0 = time.monotonic()
    n.offer(event("give_up", reason="x"))
    assert time.monotonic() - t0 < 0.1
    n.close()
    assert len(lines) == 1 and "ConnectionRefusedError" in lines[0] and time.monotonic() - t0 < 4.0


def test_a_redirect_is_not_followed_with_the_secret(hook, lines) -> None:
    h = hook([302])
    n = Notifier.from_config(NotifyConfig(webhook=h.url, webhook_secret_env="HOOK_TOKEN"), run_dir="/r",
                             environ={"HOOK_TOKEN": TOKEN})
    n.offer(event("give_up", reason="x"))
    n.close()
    assert len(h.posts) == 1 and len(lines) == 1 and "HTTP 302" in lines[0] and "redirect" in lines[0]


def test_a_requeue_in_the_supervisors_absence_is_told_and_a_broken_notifier_never_stops_it(tmp_path, lines) -> None:
    """`ckptsup requeue` (the batch script's) and the watchdog append the fenced requeue event
    themselves; they tell it through the same [notify], and a notifier that cannot start is a line."""
    from ckptsup.config import Config
    from ckptsup.events import EventWriter
    from ckptsup.supervisor.ops.cli_ops import _notify_requeue

    prog, out = recorder(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    writer = EventWriter(run_dir=run, job_id="7", attempt=3, epoch=4)
    writer.emit("requeue", reason="supervisor_died", by="batch_script", excluded=[])
    writer.close()
    settings = Config()
    settings.notify.command = [str(prog)]
    _notify_requeue(settings, run)
    [told] = [json.loads(line) for line in out.read_text().splitlines()]
    assert told["notice"] == "requeue" and told["event"]["by"] == "batch_script" and not lines
    settings.notify.command = [str(tmp_path / "gone")]
    _notify_requeue(settings, run)
    assert len(lines) == 1 and "not an executable file" in lines[0]
