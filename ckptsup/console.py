"""The console and log output of ckptsup's own processes: one logging path, through structlog.

Every line the supervisor, a node agent, the watchdog or a rank's hooks write about the run goes
through one processor chain: the level, the process's component (`supervisor`, `agent <node>`,
`rank <r>`, `watchdog`, ...) and a UTC timestamp are added as fields, the message is made literal
(textsafe.literal: untrusted text never acts on a terminal, a lone surrogate never kills the
process), and a renderer writes it:

- console (the default): exactly the message, one line, flushed; the fields are not shown, so
  the job's output reads as it always has;
- json (`CKPTSUP_LOG_FORMAT=json`, for log shippers): one JSON object per line, the same
  message as `event` beside `timestamp`, `level` and `component`.

The stream is the caller's: `err=True` writes to stderr, else stdout. Today's choice is kept: the
supervisor's account of the run goes to stdout; the launch's preparation, placement, recovery
warnings, requeue errors, the node agents and the watchdog write to stderr. The level is the
line's meaning (shown in JSON), not its stream.

ckptsup's stdlib loggers (`ckptsup.*`: the hooks, the integrations, checkpoint/) reach the same
renderer through `bridge_stdlib` (structlog's ProcessorFormatter), installed by `configure` in
the processes ckptsup starts (the supervisor, agents, watchdog, the ranks it launches). It stands
where the standard library's last-resort handler stood (WARNING and up, to stderr) and yields to
any handler the process configured itself (a training script's `logging.basicConfig` keeps
formatting ckptsup's records as before). A process ckptsup does not start (a script that imports
the hooks under a torchrun of its own) is not configured: a library leaves logging to its host.

Not logging, so not here: a command's output (`ckptsup status`, `report`, `log`, `config show`
tables and JSON, a control command's ack line, the watchdog's and requeue's result line), the
requeue finisher's JSON lines on stdout (a protocol its parent reads), the CLI's one-line
`ckptsup: error:` (cli.main), and what a rank-side process prints in place of python or torchrun.

Top-level and torch-free; structlog is imported on the first line written, so a process that
writes none (a healthy agent, a cold rank) does not pay for it.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

from .env import LOG_FORMAT
from .errors import ConfigError
from .textsafe import literal

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


class Format(enum.Enum):
    CONSOLE = "console"
    JSON = "json"


def log_format(environ: Mapping[str, str] = os.environ) -> Format:
    """The renderer `CKPTSUP_LOG_FORMAT` names (unset or empty: console); a ConfigError naming
    the value and the choices otherwise."""
    raw = environ.get(LOG_FORMAT, "").strip()
    if not raw:
        return Format.CONSOLE
    try:
        return Format(raw.lower())
    except ValueError:
        choices = " or ".join(f.value for f in Format)
        raise ConfigError(f"environment {LOG_FORMAT}={raw!r} is not a log format; set it to {choices}, "
                          "or unset it for the console lines") from None


class _State:
    """This process's settings: set once by `configure` at its entry point."""

    component = "ckptsup"
    format: Format | None = None   # None: read from the environment at the first line


_state = _State()
_loggers: dict[bool, FilteringBoundLogger] = {}


def configure(component: str, *, environ: Mapping[str, str] = os.environ) -> None:
    """Once per process, at its entry: name the component, check `CKPTSUP_LOG_FORMAT` (a bad
    value is a ConfigError: one line, exit 2, at the edge), and bridge ckptsup's stdlib loggers."""
    _state.format = log_format(environ)
    _state.component = component
    bridge_stdlib()


def configure_rank(environ: Mapping[str, str] = os.environ) -> None:
    """`configure` for a rank process the agent started (component `rank <RANK>`). Never raises:
    the supervisor refused a bad format at launch, and a rank started by hand with one still runs
    its script, with the console lines and one warning saying so."""
    try:
        configure(f"rank {environ.get('RANK', '?')}", environ=environ)
    except ConfigError as err:
        _state.format = Format.CONSOLE
        _state.component = f"rank {environ.get('RANK', '?')}"
        bridge_stdlib()
        warning(f"ckptsup: warning: {err}; writing the console lines", err=True)


def info(line: str, *, err: bool = False, newlines: bool = False) -> None:
    """A line about the run that needs no attention. `err`: to stderr (else stdout); `newlines`:
    a multi-line text (a quoted traceback) keeps its line breaks."""
    _logger(err).info(line, newlines=newlines)


def warning(line: str, *, err: bool = False, newlines: bool = False) -> None:
    """Something went wrong that ckptsup works around, or that a human may want to look at."""
    _logger(err).warning(line, newlines=newlines)


def error(line: str, *, err: bool = False, newlines: bool = False) -> None:
    """Something failed: the run gives up, stops, or loses what the line names."""
    _logger(err).error(line, newlines=newlines)


# ---- the chain ----------------------------------------------------------------------------------
def _add_component(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event["component"] = _state.component
    return event


def _literal_event(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    newlines = bool(event.pop("newlines", False))
    message = event.get("event", "")
    exc = event.pop("exception", None)   # a stdlib record's exc_info, rendered by format_exc_info
    if exc:
        message, newlines = f"{message}\n{exc.rstrip()}", True
    event["event"] = literal(message, newlines=newlines)
    return event


def _render(logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
    if _format() is Format.CONSOLE:
        return str(event["event"])
    fields = {key: value for key, value in event.items() if not key.startswith("_")}
    ordered = {key: fields.pop(key) for key in ("timestamp", "level", "component", "event") if key in fields}
    return json.dumps({**ordered, **fields}, default=str)


def _format() -> Format:
    if _state.format is None:   # a process nobody configured: the variable, else console
        try:
            _state.format = log_format()
        except ConfigError:
            _state.format = Format.CONSOLE
    return _state.format


def _chain() -> list[Any]:
    """Level, component, timestamp: the fields every line carries, before the message is made
    literal and rendered."""
    import structlog

    return [structlog.processors.add_log_level, _add_component,
            structlog.processors.TimeStamper(fmt="iso", utc=True)]


class _Sink:
    """Where the rendered line goes: the stream looked up at each write (a rank's warm
    interpreter swaps its streams; tests capture them), flushed per line."""

    def __init__(self, err: bool) -> None:
        self.err = err

    def write(self, line: str) -> None:
        stream = sys.stderr if self.err else sys.stdout
        try:
            print(line, file=stream, flush=True)
        except UnicodeEncodeError:   # a stream that cannot show a character of ours shows its escape
            encoding = getattr(stream, "encoding", None) or "ascii"
            print(line.encode(encoding, "backslashreplace").decode(encoding), file=stream, flush=True)

    debug = info = warning = error = critical = exception = msg = write


def _logger(err: bool) -> FilteringBoundLogger:
    found = _loggers.get(err)
    if found is None:
        import structlog

        # the class structlog builds (typed as its Protocol, whose constructor mypy cannot see);
        # built directly, never through structlog.configure: a rank's script may use structlog
        wrapper: Any = structlog.make_filtering_bound_logger(logging.NOTSET)
        found = _loggers[err] = wrapper(_Sink(err), [*_chain(), _literal_event, _render], {})
    return found


# ---- the standard library's records -------------------------------------------------------------
class _Fallback(logging.Handler):
    """On the `ckptsup` logger: renders a record (WARNING and up, as the stdlib's last resort)
    through the chain to stderr, unless another handler on its way up would take it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._formatter: logging.Formatter | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._others_take(record):
            return
        try:
            line = self._format(record)
        except Exception:   # noqa: BLE001 - as logging.Handler: a bad record never kills the process
            self.handleError(record)
            return
        _Sink(err=True).write(line)

    def _others_take(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False

    def _format(self, record: logging.LogRecord) -> str:
        if self._formatter is None:
            import structlog

            self._formatter = structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[*_chain(), structlog.processors.format_exc_info],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _literal_event, _render])
        return self._formatter.format(record)


def bridge_stdlib() -> None:
    """ckptsup's stdlib loggers through the chain (once per process)."""
    root = logging.getLogger("ckptsup")
    if not any(isinstance(h, _Fallback) for h in root.handlers):
        root.addHandler(_Fallback())
