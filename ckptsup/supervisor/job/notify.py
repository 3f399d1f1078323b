"""Notifications (`[notify]`): the events a person must know about — a give-up, a drained node, a
silent-data-corruption verdict, a requeue, a preemption, the run's completion — handed to a
command (argv, no shell; the notice as JSON on stdin) and/or POSTed to a webhook.

The supervisor's loop never waits for them: `offer` only puts the notice on a bounded queue (a
full queue drops it, said once), and one daemon thread per channel delivers it within
`timeout_s` — the command is killed with its process group past it; the webhook's tries
(tenacity, exponential backoff) stop there too. A failure is one console line and never the
run's problem. `close` (the supervisor's exit) waits at most `timeout_s` + 1 s for what is queued,
so that the last notice (run_complete, give_up, requeue) leaves before the process does.

Text is data: the event's values travel JSON-encoded, never through a shell or a format string.
The webhook's secret is read once from the environment variable the config names; it goes only
into the request's header — never into an argv, a console line or an event — and is refused over
plain http:// to anything but the loopback. A log line names the webhook by scheme and host only
(the path of many webhook URLs is itself a token).
"""

from __future__ import annotations

import enum
import ipaddress
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ... import console
from ...config import NotifyConfig
from ...errors import ConfigError
from ...events import Event, FailureKind, last_event
from ...textsafe import literal

QUEUE_MAX = 32            # notices waiting per channel; a run that makes more at once is in a storm
MAX_STRING = 4096         # an event value longer than this is cut in the payload (a 1 MB reason stays in the log)
STDERR_TAIL = 300         # bytes of a failed command's stderr quoted in its line


class Notice(str, enum.Enum):
    """What a person is told about; the names of `[notify] events` (config.NOTIFY_EVENTS)."""

    GIVE_UP = "give_up"
    NODE_DRAINED = "node_drained"
    SDC = "sdc"
    REQUEUE = "requeue"
    PREEMPTION = "preemption"
    RUN_COMPLETE = "run_complete"
    # config.NOTIFY_EVENTS spells the same names (config.py imports nothing of the supervisor); a test holds them equal


def notice_of(record: Mapping[str, Any]) -> Notice | None:
    """The notice an event is, None for the rest (pure): a node excluded *and drained*, an sdc
    failure (the replicas' verdict), and the four events of the same name."""
    match Event.parse(record.get("event")):
        case Event.GIVE_UP:
            return Notice.GIVE_UP
        case Event.NODE_EXCLUDED if record.get("drained") is True:
            return Notice.NODE_DRAINED
        case Event.FAILURE_DETECTED if record.get("kind") == FailureKind.SDC:
            return Notice.SDC
        case Event.REQUEUE:
            return Notice.REQUEUE
        case Event.PREEMPTION:
            return Notice.PREEMPTION
        case Event.RUN_COMPLETE:
            return Notice.RUN_COMPLETE
    return None


def _bounded(value: Any, depth: int = 0) -> Any:
    """The event's values with long strings cut (a notice is a page, not the log)."""
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + f" ... ({len(value) - MAX_STRING} more characters)"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)   # strict JSON has no NaN: a receiver's parser may refuse it
    if depth > 8:
        return "..."
    if isinstance(value, dict):
        return {str(k)[:200]: _bounded(v, depth + 1) for k, v in list(value.items())[:200]}
    if isinstance(value, list):
        return [_bounded(v, depth + 1) for v in value[:200]]
    return value


def summary(notice: Notice, record: Mapping[str, Any]) -> str:
    """One literal line for a human (a chat message, a page's title)."""
    g = record.get
    job = f"ckptsup job {g('job_id')}"
    match notice:
        case Notice.GIVE_UP:
            text = f"{job} gave up: {g('reason', '')}"
        case Notice.NODE_DRAINED:
            text = f"{job}: node {g('node')} drained: {g('reason', '')}"
        case Notice.SDC:
            text = f"{job}: silent data corruption at step {g('step')}: {g('detail', '')}"
        case Notice.REQUEUE:
            text = f"{job} requeued by {g('by', '?')}: {g('reason', '')}"
        case Notice.PREEMPTION:
            text = f"{job} preempted ({g('signal', '?')}); emergency checkpoint: {bool(g('emergency_save'))}"
        case Notice.RUN_COMPLETE:
            text = f"{job} complete at step {g('step')}"
    return literal(text, limit=500)


def payload(notice: Notice, record: Mapping[str, Any], *, run_dir: str) -> bytes:
    """The JSON every channel gets: the notice, a summary line, the job, the run dir and the event."""
    body = {"notice": notice.value, "summary": summary(notice, record), "job_id": _bounded(record.get("job_id")),
            "run_dir": run_dir, "host": socket.gethostname(), "event": _bounded(dict(record))}
    return json.dumps(body, default=str, allow_nan=False).encode()


def _where(url: str) -> str:
    """A webhook as a log line may name it: scheme and host, never its path or query (often a token)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a failure: following it would send the secret header to wherever it points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ARG002
        return None


class _Transient(Exception):
    """A try that may succeed later (connection refused, timeout, HTTP 5xx or 429)."""


@dataclass(frozen=True, kw_only=True)
class Channel:
    """Where notices go: a name for log lines and the call that delivers one within `timeout_s`."""

    name: str
    deliver: Callable[[bytes], None]   # raises with a one-line message on failure


def command_channel(argv: list[str], timeout_s: float) -> Channel:
    """The command, the notice on its stdin; killed (its whole process group) past `timeout_s`."""
    def deliver(data: bytes) -> None:
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True, close_fds=True)
            try:
                try:
                    proc.communicate(data, timeout=timeout_s)
                except BrokenPipeError:   # it exited without reading its stdin: its status says how it went
                    proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RuntimeError(f"still running after {timeout_s:g}s: killed") from None
            if proc.returncode != 0:
                err.seek(0, os.SEEK_END)
                err.seek(max(0, err.tell() - STDERR_TAIL))
                tail = err.read().decode("utf-8", "replace").strip().splitlines()
                raise RuntimeError(f"exited {proc.returncode}" + (f": {tail[-1]}" if tail else ""))
    return Channel(name=f"command {argv[0]}", deliver=deliver)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass   # a process in D state: reaped by nobody, never waited for longer


def webhook_channel(url: str, token: str | None, *, retries: int, timeout_s: float) -> Channel:
    """A POST of the notice, retried with exponential backoff on transient failures, every try and
    wait inside `timeout_s` together."""
    import tenacity

    opener = urllib.request.build_opener(_NoRedirect)
    headers = {"Content-Type": "application/json", "User-Agent": "ckptsup-notify"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    def once(data: bytes, deadline: float) -> None:
        left = max(0.1, deadline - time.monotonic())
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with opener.open(request, timeout=left) as response:
                response.read(1024)
        except urllib.error.HTTPError as err:
            if err.code >= 500 or err.code == 429:
                raise _Transient(f"HTTP {err.code}") from None
            raise RuntimeError(f"HTTP {err.code}" + (" (a redirect: give the final URL)" if 300 <= err.code < 400
                                                      else "")) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise _Transient(f"{type(reason).__name__}: {reason}") from None

    def deliver(data: bytes) -> None:
        deadline = time.monotonic() + timeout_s
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retries) | tenacity.stop_after_delay(timeout_s),
            wait=tenacity.wait_exponential(multiplier=0.25, max=max(0.25, timeout_s / 4)),
            retry=tenacity.retry_if_exception_type(_Transient), reraise=True)
        try:
            retrying(once, data, deadline)
        except _Transient as err:
            raise RuntimeError(f"{err} (after {retries} tries or {timeout_s:g}s)") from None
    return Channel(name=f"webhook {_where(url)}", deliver=deliver)


class _Worker:
    """One channel's thread and bounded queue."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.queue: "queue.Queue[bytes | None]" = queue.Queue(maxsize=QUEUE_MAX)
        self.dropped = 0
        self.delivered = 0
        self.failed = 0
        self.closed = False   # past close's bound: the rest is not sent (the supervisor is leaving)
        self.thread = threading.Thread(target=self._run, name=f"notify {channel.name}", daemon=True)
        self.thread.start()

    def offer(self, data: bytes) -> None:
        try:
            self.queue.put_nowait(data)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                console.warning(f"ckptsup: notify: {literal(self.channel.name)} is behind ({QUEUE_MAX} notices "
                                "waiting): dropping new ones; is it slow or hanging?", err=True)

    def _run(self) -> None:
        while True:
            data = self.queue.get()
            if data is None:
                return
            if self.closed:
                continue
            try:
                self.channel.deliver(data)
                self.delivered += 1
            except Exception as err:   # any failure of a notice is a line, never the run's problem
                self.failed += 1
                if self.closed:   # close has said what was not delivered
                    continue
                console.warning(f"ckptsup: notify: {literal(self.channel.name)} failed: {literal(err, limit=400)}; "
                                "the run goes on", err=True)


class Notifier:
    """The supervisor's notifications: `offer(record)` for every event it writes (cheap, never
    raises, never blocks), `close()` at its exit."""

    def __init__(self, channels: list[Channel], events: frozenset[Notice], *, run_dir: str, timeout_s: float) -> None:
        self.events = events
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.workers = [_Worker(c) for c in channels]

    @classmethod
    def from_config(cls, config: NotifyConfig, *, run_dir: str,
                    environ: Mapping[str, str] | None = None) -> "Notifier":
        """The notifier of `[notify]` (without channels, offer does nothing); one ConfigError line for
        a command that cannot run, a secret variable that is not set, or a secret that would cross
        the network in clear: the launch stops at its edge, not at the first incident."""
        environ = os.environ if environ is None else environ
        channels = []
        if config.command:
            program = config.command[0]
            found = shutil.which(program)
            if found is None:
                raise ConfigError(f"notify.command: {literal(program, limit=200)} is not an executable file "
                                  "(nor one on PATH); give the program's absolute path")
            channels.append(command_channel([found, *config.command[1:]], config.timeout_s))
        token = None
        if config.webhook_secret_env:
            token = environ.get(config.webhook_secret_env)
            if not token:
                raise ConfigError(f"notify.webhook_secret_env names {config.webhook_secret_env}, which is not set in "
                                  "the supervisor's environment; export it in the job script or empty the key")
            if not config.webhook:
                raise ConfigError("notify.webhook_secret_env is set but notify.webhook is empty; give the URL")
        if config.webhook:
            if token and config.webhook.startswith("http://") and not _loopback(config.webhook):
                raise ConfigError(f"notify.webhook {_where(config.webhook)} is plain http: the secret of "
                                  "notify.webhook_secret_env would cross the network in clear; use https://")
            channels.append(webhook_channel(config.webhook, token, retries=config.retries, timeout_s=config.timeout_s))
        return cls(channels, frozenset(Notice(n) for n in config.events), run_dir=run_dir, timeout_s=config.timeout_s)

    def offer(self, record: Mapping[str, Any]) -> None:
        if not self.workers:
            return
        try:
            notice = notice_of(record)
            if notice is None or notice not in self.events:
                return
            data = payload(notice, record, run_dir=self.run_dir)
            for worker in self.workers:
                worker.offer(data)
        except Exception as err:   # a notice must never cost the run anything
            console.warning(f"ckptsup: notify: could not make a notice: {literal(err, limit=300)}", err=True)

    def offer_last(self, run_dir: Any) -> None:
        """The restart log's last event, when another writer appended it (requeue_job's fenced requeue)."""
        try:
            record = last_event(run_dir)
        except Exception:   # a notice must never cost the run anything
            return
        if record is not None and record.get("event") == Event.REQUEUE:
            self.offer(record)

    def close(self) -> None:
        """Deliver what is queued within timeout_s + 1 s in all, then leave (the threads are daemons)."""
        deadline = time.monotonic() + self.timeout_s + 1.0
        for worker in self.workers:
            try:
                worker.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
        for worker in self.workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                worker.closed = True
                console.warning(f"ckptsup: notify: {literal(worker.channel.name)}: {worker.queue.qsize()} notice(s) "
                                f"not delivered within {self.timeout_s:g}s + 1s of the supervisor's exit", err=True)
