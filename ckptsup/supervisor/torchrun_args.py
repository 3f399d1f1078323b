"""torchrun's command line under `ckptsup launch` (pure): every option of torch 2.13's torchrun,
what ckptsup does with it (`OPTIONS`, one row per option, its `Handling`), the tokenizer in front
of click (`normalize`: torchrun's spellings, abbreviations, `-t/--tee VALUE`, unknown options in
torchrun's words plus "did you mean") and the interpretation of the values (`interpret`).

- OWN: ckptsup's meaning, said in the row (`--nproc-per-node`, `--nnodes`, `--max-restarts`, `-m`,
  `--no-python`); torchrun is always started with `--max-restarts 0` and the resolved counts;
- PASS: handed on to the torchrun ckptsup starts on every node, with torchrun's meaning;
- RELAY: honoured by ckptsup's relay of the ranks' output (supervisor/node/rank_output.py), not passed:
  torchrun always runs with `--tee 3` because the relay reads every rank's lines from its console
  (a redirect or a console filter there would starve progress lines, the rank log, error quotes);
- IGNORE: accepted, one info line (the rendezvous group: ckptsup picks it; `--run-path`).

A value ckptsup cannot honour is an info line when harmless, a one-line UsageError (exit 2) when it
would change what the training does or contradicts the allocation.
"""

from __future__ import annotations

import difflib
import enum
import functools
import math
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..config import AUTO, GPU
from ..env import ExitStatus
from ..errors import CkptsupError


class UsageError(CkptsupError):
    exit_code = int(ExitStatus.USAGE)


class Handling(enum.Enum):
    OWN = "ckptsup's"          # ckptsup's meaning (the row says which)
    PASS = "passed on"         # to every node's torchrun, torchrun's meaning
    RELAY = "rank relay"       # honoured by ckptsup's rank-output relay; torchrun keeps --tee 3
    IGNORE = "ignored"         # accepted, one info line


@dataclass(frozen=True, kw_only=True)
class Option:
    """One option of torchrun's (torch 2.13 `torchrun --help`)."""

    dest: str                       # argparse's dest, the click parameter name
    spellings: tuple[str, ...]      # every spelling torchrun accepts
    value: bool                     # takes a value (else a flag)
    handling: Handling
    does: str                       # what ckptsup does with it (docs/drop-in.md's table)


def _opt(dest: str, *spellings: str, value: bool = True, handling: Handling, does: str) -> Option:
    if not spellings:
        dashed = "--" + dest.replace("_", "-")
        spellings = (dashed, "--" + dest) if "_" in dest else (dashed,)
    return Option(dest=dest, spellings=spellings, value=value, handling=handling, does=does)


_RDZV = "ignored, one info line: ckptsup picks the rendezvous of every attempt ([supervisor] rdzv_backend, rdzv_port)"
_WARM_OFF = "every launch starts cold ranks (warm interpreters are started outside torchrun and would escape it)"

OPTIONS: tuple[Option, ...] = (
    _opt("nnodes", handling=Handling.OWN,
         does="active nodes (= `--nodes`); the rest of the allocation are hot spares; more than the allocation "
              "has is an error naming both; `MIN:MAX`: MAX active nodes, and a lost node with no spare left "
              "continues on the survivors (>= MIN) when that costs less than a requeue (supervisor.min_nodes)"),
    _opt("nproc_per_node", handling=Handling.OWN,
         does="ranks per node: a number, `gpu` (the allocation's GPUs per node) or `auto` (its GPUs, else 1), "
              "resolved by ckptsup; `cpu`/`xpu` are refused"),
    _opt("rdzv_backend", handling=Handling.IGNORE, does=_RDZV),
    _opt("rdzv_endpoint", handling=Handling.IGNORE, does=_RDZV),
    _opt("rdzv_id", handling=Handling.IGNORE, does=_RDZV),
    _opt("rdzv_conf", handling=Handling.IGNORE, does=_RDZV),
    _opt("standalone", value=False, handling=Handling.IGNORE, does=_RDZV),
    _opt("max_restarts", handling=Handling.OWN,
         does="ckptsup's restart budget, all attempts of the run together ([supervisor] max_restarts); "
              "torchrun itself always gets `--max-restarts 0` (ckptsup decides every restart)"),
    _opt("monitor_interval", handling=Handling.PASS,
         does="torchrun's poll of its workers (ckptsup's default 0.1 s); a crash is seen up to this much later"),
    _opt("start_method", handling=Handling.PASS,
         does="passed on (spawn, fork, forkserver); torchrun uses it only for function entrypoints, "
              "so a script runs the same"),
    _opt("event_log_handler", handling=Handling.PASS,
         does="passed on (console, dynamic_rendezvous, null: torch 2.13's); another name is an error "
              "(torchrun would fail every attempt); ckptsup's own events are in <run_dir>/events.jsonl"),
    _opt("role", handling=Handling.PASS, does="passed on: the workers' role name (ROLE_NAME)"),
    _opt("module", "-m", "--module", value=False, handling=Handling.OWN,
         does="SCRIPT is a module, run as `python -m` (as torchrun)"),
    _opt("no_python", value=False, handling=Handling.OWN, does="SCRIPT is an executable (as torchrun)"),
    _opt("run_path", value=False, handling=Handling.IGNORE,
         does="ignored, one info line: every rank is a python process of its own running SCRIPT as "
              "`__main__` with its arguments, as with runpy; like torchrun, it wins over `--no-python` and `-m`"),
    _opt("log_dir", handling=Handling.PASS,
         does="torchrun's log directory instead of ckptsup's attempt-<N>/torchrun-<node>/: each attempt's "
              "torchrun makes its `<rdzv_id>_<random>/attempt_0/<local_rank>/` there, with every rank's "
              "stdout.log and stderr.log (ckptsup tees them all, see `-t`)"),
    _opt("redirects", "-r", "--redirects", handling=Handling.RELAY,
         does="ckptsup's console shows torchrun's: every rank's lines but a local rank's whose stdout and "
              "stderr are redirected (and not teed); the files are written as with `-t 3`; the relay still reads "
              "every line"),
    _opt("tee", "-t", "--tee", handling=Handling.RELAY,
         does="`-t VALUE` (one that tees a stream): every rank's output on ckptsup's console (`[rankN]: ` "
              "lines), its files in the log directory; a bare `--tee` (no tee value after it) = every rank's "
              "output ([supervisor] tee); torchrun always gets `--tee 3`, so a VALUE below 3 still writes every "
              "file (info line with `--log-dir`)"),
    _opt("local_ranks_filter", handling=Handling.RELAY,
         does="ckptsup's console shows these local ranks' lines, on every node, as torchrun's does (the "
              "files, the rank log and the relay keep every rank)"),
    _opt("duplicate_stdout_filters", handling=Handling.PASS,
         does="passed on: matching lines also in the log directory's filtered_stdout.log"),
    _opt("duplicate_stderr_filters", handling=Handling.PASS,
         does="passed on: matching lines also in the log directory's filtered_stderr.log"),
    _opt("node_rank", handling=Handling.IGNORE, does=_RDZV),
    _opt("master_addr", handling=Handling.IGNORE, does=_RDZV),
    _opt("master_port", handling=Handling.IGNORE, does=_RDZV),
    _opt("local_addr", handling=Handling.IGNORE, does=_RDZV),
    _opt("logs_specs", handling=Handling.PASS,
         does="passed on when installed (a `torchrun.logs_specs` entry point, else an error naming the "
              "installed ones), one info line: it must keep torchrun's tee, which ckptsup's relay reads"),
    _opt("numa_binding", handling=Handling.PASS,
         does=f"passed on (node, socket, exclusive, core-complex); {_WARM_OFF}, one info line"),
    _opt("signals_to_handle", handling=Handling.PASS,
         does="passed on (names of signals, checked); ckptsup stops torchrun's whole tree itself"),
    _opt("shutdown_timeout", handling=Handling.PASS,
         does="passed on instead of ckptsup's derived value (max(60 s, kill_grace_s, the preemption window)); "
              "a shorter one can cut a SIGTERM-time save short"),
    _opt("virtual_local_rank", value=False, handling=Handling.PASS,
         does=f"passed on; {_WARM_OFF}, one info line; an error with `[storage] node_local` "
              "(its cache is per LOCAL_RANK, which this makes 0 on every rank)"),
)
BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}


def options_table() -> str:
    """docs/drop-in.md's table: option -> what ckptsup does with it (a test holds the page to it)."""
    rows = [f"| {', '.join(f'`{s}`' for s in o.spellings)} | {o.handling.value} | {o.does} |" for o in OPTIONS]
    return "\n".join(["| torchrun option | ckptsup | what ckptsup does with it |", "|---|---|---|", *rows])


BY_SPELLING: dict[str, Option] = {s: o for o in OPTIONS for s in o.spellings}

RENDEZVOUS = ("standalone", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr", "master_port",
              "node_rank", "local_addr")
TEE_ALL = "all"   # a bare --tee, as `normalize` writes it for click
_STD = re.compile(r"^[0-3]$|^\d:[0-3](,\d:[0-3])*$")   # torchrun's Std.from_str: 3, or 0:3,1:0 (one digit)
_DOTTED = re.compile(r"^[^\W\d]\w*(\.[^\W\d]\w*)*$")
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")            # argparse: a negative number is a value
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")   # torch 2.13 elastic/events/handlers.py
START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def passed_option(token: object) -> bool:
    """A token of LaunchSpec.torchrun_options: `--opt=value` or `--flag` of a PASS row (the three
    with a field of their own aside), as `interpret` writes them."""
    if not isinstance(token, str):
        return False
    name, eq, _ = token.partition("=")
    opt = BY_SPELLING.get(name)
    return (opt is not None and opt.handling is Handling.PASS and name == opt.spellings[0] and opt.value == bool(eq)
            and opt.dest not in ("monitor_interval", "shutdown_timeout", "log_dir"))


def is_std(value: str) -> bool:
    """A value of torchrun's -r/-t: 0-3 for every local rank, or LOCAL:0-3 pairs."""
    return bool(_STD.match(value))


# ---- the tokenizer in front of click --------------------------------------------------------------

# ckptsup's options whose value is the script's words, so may start with a dash (--resume-args "--init_from=resume")
DASH_VALUES = frozenset({"--resume-args"})

def normalize(args: Iterable[str], takes_value: Mapping[str, bool]) -> list[str]:
    """The tokens before SCRIPT as click can take them: every option spelled in full, a value
    attached (`--log-dir=D`), a bare `--tee` as `--tee=all`; SCRIPT and what follows untouched.
    `takes_value`: every spelling `ckptsup launch` knows (torchrun's and its own) -> takes a value.
    As torchrun's argparse: unique prefixes of long options, `-r3`, `--opt=v`; an unknown or
    ambiguous option is torchrun's error line, with "did you mean"."""
    args = list(args)
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--" or not tok.startswith("-") or tok == "-" or _NUMBER.match(tok):
            out += args[i:]   # SCRIPT and its arguments
            break
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            name = _resolve(name, takes_value)
        elif tok[:2] in takes_value and len(tok) > 2:   # -r3, -t0:3 (a flag such as -m takes nothing attached)
            name, eq, value = tok[:2], "=", tok[2:]
            if not takes_value[name]:
                raise UsageError(f"argument {name}: ignored explicit argument {value[:40]!r}")
        else:
            name, eq, value = _resolve(tok, takes_value), "", ""
        if name in ("-t", "--tee"):
            if eq:
                out.append(f"--tee={value}")
            elif i + 1 < len(args) and is_std(args[i + 1]):
                out.append(f"--tee={args[i + 1]}")
                i += 1
            else:
                out.append(f"--tee={TEE_ALL}")   # ckptsup's bare --tee: every rank's output
        elif takes_value[name]:
            name = _long(name) if not name.startswith("--") else name
            if eq:
                out.append(f"{name}={value}")
            elif i + 1 < len(args) and (not args[i + 1].startswith("-") or _NUMBER.match(args[i + 1])
                                        or name in DASH_VALUES):
                out.append(f"{name}={args[i + 1]}")
                i += 1
            else:
                raise UsageError(f"argument {_shown(name)}: expected one argument")
        elif eq:
            raise UsageError(f"argument {_shown(name)}: ignored explicit argument {value[:40]!r}")
        else:
            out.append(name)
        i += 1
    return out


def _long(name: str) -> str:
    """A short spelling of a table row as its long one (click reads `-r=3` as the value '=3')."""
    opt = BY_SPELLING.get(name)
    return next((s for s in opt.spellings if s.startswith("--")), name) if opt is not None else name


def _shown(name: str) -> str:
    opt = BY_SPELLING.get(name)
    return "/".join(opt.spellings) if opt is not None else name


def _resolve(name: str, takes_value: Mapping[str, bool]) -> str:
    if name in takes_value:
        return name
    if name.startswith("--") and len(name) > 2:
        matches = [s for s in takes_value if s.startswith(name)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise UsageError(f"ambiguous option: {name[:60]} could match {', '.join(matches)}")
    return _unknown(name, takes_value)


def _unknown(name: str, known: Iterable[str]) -> str:
    shown = name[:60]
    close = difflib.get_close_matches(shown, [k for k in known if k.startswith("--") == name.startswith("--")],
                                      n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise UsageError(f"unrecognized arguments: {shown}{hint} (`ckptsup launch --help` lists the options; "
                     "your script's own arguments go after SCRIPT)")


# ---- what the values mean ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TorchrunLine:
    """What `interpret` made of the torchrun options given: what every node's torchrun gets, what
    the rank relay shows, and the info lines to print once."""

    infos: tuple[str, ...] = ()
    passed: tuple[str, ...] = ()            # `--opt=value` / `--flag` for torchrun (PASS rows but the three below)
    monitor_interval_s: float | None = None
    shutdown_timeout_s: int | None = None
    log_dir: str = ""                       # absolute; "" = ckptsup's attempt-<N>/torchrun-<node>/
    tee_all: bool | None = None             # every rank on the console (None: not said)
    redirects: str = ""
    tee: str = ""
    local_ranks_filter: tuple[int, ...] | None = None
    cold_ranks: bool = False                # numa binding / virtual local rank: no warm interpreters
    run_path: bool = False
    virtual_local_rank: bool = False

    def console_local_ranks(self, nproc: int) -> list[int] | None:
        """The local ranks whose lines ckptsup's console may show (None: no restriction): the
        --local-ranks-filter, less the ranks -r sends to files only (redirected and not teed)."""
        if self.local_ranks_filter is None and not self.redirects:
            return None
        shown = set(self.local_ranks_filter if self.local_ranks_filter is not None else range(nproc))
        redirected, teed = std_map(self.redirects, nproc), std_map(self.tee, nproc)
        return sorted(r for r in shown if not (redirected.get(r, 0) == 3 and not teed.get(r, 0)))


def std_map(value: str, nproc: int) -> dict[int, int]:
    """torchrun's to_map of a -r/-t value: local rank -> streams (1 out, 2 err, 3 both)."""
    if not value:
        return {}
    if ":" not in value:
        return dict.fromkeys(range(nproc), int(value))
    return {int(k): int(v) for k, v in (pair.split(":") for pair in value.split(","))}


@functools.cache
def installed_torchrun_has(flag: str) -> bool:
    """Whether the installed torchrun knows `flag` (torch 2.11's has no --shutdown-timeout, and
    rejects the whole line for it). Read from torch/distributed/run.py's text, without importing
    torch (supervisor/ never does); True when that file cannot be read: torchrun then answers."""
    import importlib.util

    spec = importlib.util.find_spec("torch")   # a top-level name: torch itself is not imported
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        try:
            return f'"{flag}"' in (Path(root) / "distributed" / "run.py").read_text(errors="replace")
        except OSError:
            continue
    return True


def interpret(given: Mapping[str, str | bool | None], *, cwd: str | os.PathLike[str],
              logs_specs_installed: Callable[[], list[str]] | None = None,
              torchrun_has: Callable[[str], bool] = installed_torchrun_has) -> TorchrunLine:
    """The PASS, RELAY and IGNORE options given (dest -> click's value; None/False = absent),
    validated value by value: a TorchrunLine, or the one-line UsageError of the first bad one."""
    values = {k: v for k, v in given.items() if v not in (None, False)}
    unknown = sorted(k for k in values if k not in BY_DEST or BY_DEST[k].handling is Handling.OWN)
    if unknown:
        raise ValueError(f"not a PASS/RELAY/IGNORE option: {unknown[0]}")
    for dest in values:
        opt = BY_DEST[dest]
        if opt.handling is Handling.PASS and not torchrun_has(opt.spellings[0]):
            raise UsageError(f"{opt.spellings[0]}: the installed torchrun has no such option (an older torch); "
                             "drop it from the launch line or upgrade torch")
    infos: list[str] = []
    kw: dict = {}
    ignored = rendezvous_ignored(values)
    if ignored:
        infos.append(ignored)
    if values.get("run_path"):
        kw["run_path"] = True
        infos.append("--run-path ignored: every rank is a python process of its own running SCRIPT as __main__ "
                     "(as runpy would)")
    passed: list[str] = []
    for dest in ("start_method", "event_log_handler", "role", "signals_to_handle", "numa_binding", "logs_specs",
                 "duplicate_stdout_filters", "duplicate_stderr_filters", "virtual_local_rank"):
        if dest in values:
            raw = values[dest]
            _check_pass(dest, raw, logs_specs_installed)
            flag = BY_DEST[dest].spellings[0]
            passed.append(flag if raw is True else f"{flag}={raw}")
    kw["passed"] = tuple(passed)
    if "monitor_interval" in values:
        kw["monitor_interval_s"] = _seconds("--monitor-interval", str(values["monitor_interval"]), integer=False)
    if "shutdown_timeout" in values:
        kw["shutdown_timeout_s"] = int(_seconds("--shutdown-timeout", str(values["shutdown_timeout"]), integer=True))
    if "log_dir" in values:
        kw["log_dir"] = _log_dir(str(values["log_dir"]), cwd)
    for dest, flag in (("redirects", "-r/--redirects"), ("tee", "-t/--tee")):
        std = values.get(dest)
        if std is None or (dest == "tee" and std == TEE_ALL):
            continue
        if not is_std(str(std)):
            raise UsageError(f"{flag} {str(std)[:40]!r}: a value is 0-3 (1 stdout, 2 stderr, 3 both) for every "
                             "local rank, or LOCAL:0-3 pairs such as 0:3,1:1")
        kw[dest] = str(std)
    if "local_ranks_filter" in values:
        kw["local_ranks_filter"] = _local_ranks(str(values["local_ranks_filter"]))
    # a bare --tee: every rank's output; -r, a -t that tees a stream or --local-ranks-filter: torchrun's
    # console (every rank's, less the filtered and the redirected-only local ranks: console_local_ranks)
    if (values.get("tee") == TEE_ALL or any(std_map(kw.get("tee", ""), 1).values()) or "redirects" in kw
            or "local_ranks_filter" in kw):
        kw["tee_all"] = True
    if "log_dir" in values and "3" not in (kw.get("redirects"), kw.get("tee")):
        infos.append("--log-dir gets every local rank's stdout.log and stderr.log: ckptsup runs torchrun with "
                     "--tee 3 (its relay reads every line)")
    if values.get("numa_binding") or values.get("virtual_local_rank"):
        kw["cold_ranks"] = True
        which = "--numa-binding" if values.get("numa_binding") else "--virtual-local-rank"
        infos.append(f"{which}: every launch starts cold ranks under torchrun (warm interpreters would escape it)")
    if values.get("virtual_local_rank"):
        kw["virtual_local_rank"] = True
    if "logs_specs" in values:
        infos.append(f"--logs-specs {str(values['logs_specs'])[:40]}: it must keep torchrun's tee, which ckptsup's "
                     "relay of the ranks' output reads (progress lines, console, error quotes)")
    return TorchrunLine(infos=tuple(infos), **kw)


def _check_pass(dest: str, raw: str | bool | None, installed: Callable[[], list[str]] | None) -> None:
    value = str(raw)
    if dest == "start_method" and value not in START_METHODS:
        raise UsageError(f"--start-method {value[:40]!r}: pass one of {', '.join(START_METHODS)}")
    if dest == "numa_binding" and value not in NUMA_MODES:
        raise UsageError(f"--numa-binding {value[:40]!r}: pass one of {', '.join(NUMA_MODES)}")
    if dest == "event_log_handler" and value not in EVENT_LOG_HANDLERS:
        raise UsageError(f"--event-log-handler {value[:40]!r}: torch 2.13 has {', '.join(EVENT_LOG_HANDLERS)} "
                         "(torchrun would fail every attempt); ckptsup's events are in <run_dir>/events.jsonl")
    if dest == "signals_to_handle":
        names = [n.strip() for n in value.split(",")]
        bad = [n for n in names if not (n.startswith("SIG") and isinstance(getattr(signal, n, None), signal.Signals))]
        if bad:
            raise UsageError(f"--signals-to-handle: {bad[0][:40]!r} is not a signal name; pass names such as "
                             "SIGTERM,SIGUSR1")
    if dest == "role" and not value.strip():
        raise UsageError("--role: pass a role name")
    if dest == "logs_specs":
        names = (installed or _installed_logs_specs)()
        if value not in names:
            have = ", ".join(sorted(names)) or "none"
            raise UsageError(f"--logs-specs {value[:40]!r}: no torchrun.logs_specs entry point of that name is "
                             f"installed (installed: {have}); install its package or drop the flag")


def _installed_logs_specs() -> list[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="torchrun.logs_specs")]


def _seconds(flag: str, raw: str, *, integer: bool) -> float:
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= 86400 if flag == "--monitor-interval" else 0 <= value <= 7 * 86400):
        kind = "a whole number of seconds >= 0" if integer else "seconds > 0"
        raise UsageError(f"{flag} {raw[:40]!r} must be {kind}")
    return value


def _log_dir(raw: str, cwd: str | os.PathLike[str]) -> str:
    path = Path(cwd, os.path.expanduser(raw))
    if path.exists() and not path.is_dir():
        raise UsageError(f"--log-dir {raw[:60]} is not a directory; pass a directory (torchrun makes it if missing)")
    return str(path.resolve())


def _local_ranks(raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",")]
    if not parts or not all(re.fullmatch(r"\d{1,6}", p) for p in parts):
        raise UsageError(f"--local-ranks-filter {raw[:40]!r}: pass local ranks separated by commas, e.g. 0,1")
    return tuple(sorted({int(p) for p in parts}))


def rendezvous_ignored(given: Mapping[str, str | bool | None]) -> str:
    """torchrun's rendezvous group (--standalone, --rdzv-*, --master-*, --node-rank, --local-addr):
    accepted and ignored, said in one info line ("" when none was given)."""
    shown = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {str(v)[:40]}")
             for k in RENDEZVOUS if (v := given.get(k)) not in (None, False)]
    if not shown:
        return ""
    return (f"ckptsup picks the rendezvous ([supervisor] rdzv_backend, rdzv_port); {', '.join(shown)} ignored")


def nproc_choice(raw: str | None, *, flag: str = "--nproc-per-node") -> int | str | None:
    """`--nproc-per-node`: a number (its bounds are the config's), gpu or auto; None when unset."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in (GPU, AUTO):
        return value
    if re.fullmatch(r"[+-]?\d{1,9}", value):
        return int(value)
    if value in ("cpu", "xpu"):
        raise UsageError(f"{flag} {raw}: ckptsup sets ranks per node from the allocation; "
                         f"pass a number, {GPU} (its GPUs per node) or {AUTO} (its GPUs, else 1)")
    raise UsageError(f"{flag} {raw[:40]!r} must be a number, {GPU} or {AUTO}")


def node_count(raw: str | None, *, flag: str = "--nnodes") -> int | None:
    """`--nodes` / `--nnodes`: the number of active nodes (MAX of torchrun's MIN:MAX; N:N is N)."""
    return node_range(raw, flag=flag)[1]


def node_range(raw: str | None, *, flag: str = "--nnodes") -> tuple[int | None, int | None]:
    """`--nnodes N` or torchrun's elastic `MIN:MAX`: (MIN, MAX); MIN is None without a colon.
    MAX is the active nodes; MIN the fewest the job may continue on when a node is lost and no
    spare is left (supervisor.min_nodes, docs/supervisor.md §Fewer nodes)."""
    if raw is None:
        return None, None
    low, sep, high = raw.strip().partition(":")
    if not re.fullmatch(r"\d{1,9}", low) or (sep and not re.fullmatch(r"\d{1,9}", high)):
        raise UsageError(f"{flag} {raw[:40]!r} must be a number of nodes, or MIN:MAX")
    if not sep:
        return None, int(low)
    least, most = int(low), int(high)
    if least < 1 or least > most:
        raise UsageError(f"{flag} {raw[:40]}: MIN {least} must be at least 1 and at most MAX {most}; "
                         f"pass {flag} MIN:MAX with 1 <= MIN <= MAX, e.g. {flag} {max(1, most - 1)}:{most}")
    return least, most


def resolve_nproc(choice: int | str, gpus_per_node: int, *, in_slurm: bool) -> tuple[int, str]:
    """Ranks per node for a choice, with where it came from ("" when it was a number)."""
    if isinstance(choice, int):
        return choice, ""
    if gpus_per_node > 0:
        return gpus_per_node, f"{gpus_per_node} GPU(s) per node"
    if choice == AUTO:
        return 1, "no GPU in the allocation: 1"
    if in_slurm:
        fix = "submit with --gpus-per-node N (sbatch, ckptsup sbatch) or pass --nproc-per-node N"
        where = "the allocation has no GPUs (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS and scontrol name none)"
    else:
        fix = "set CUDA_VISIBLE_DEVICES (e.g. 0,1) or pass --nproc-per-node N"
        where = "this machine names no GPU (CUDA_VISIBLE_DEVICES is unset, empty or -1)"
    raise UsageError(f"--nproc-per-node {GPU}: {where}; {fix}")


@dataclass(frozen=True, kw_only=True)
class Target:
    """What torchrun runs on every node: a script file, a module (`-m`) or an executable
    (`--no-python`)."""

    script: str           # an absolute path for files, the module name for -m
    module: bool = False
    no_python: bool = False


def check_target(script: str, *, module: bool, no_python: bool, cwd: str | os.PathLike[str],
                 which: Callable[[str], str | None] = shutil.which) -> Target:
    """Check SCRIPT as torchrun will run it; an option in its place is refused by name."""
    if script.startswith("-") and len(script) > 1:
        _unknown(script.split("=", 1)[0], BY_SPELLING)
    if module and no_python:
        raise UsageError("-m and --no-python exclude each other (a module needs python); pass one of them")
    if module:
        if script.endswith(".py"):   # a dotted name, but python -m would look for a module `py`
            raise UsageError(f"-m {script[:60]} names a file; pass its module name ({script[:-3][:60]}), "
                             "or drop -m to run the file")
        if not _DOTTED.match(script):
            raise UsageError(f"-m {script[:60]!r} is not a module name; pass dotted Python names, e.g. -m pkg.train")
        return Target(script=script, module=True)
    path = Path(cwd, script)
    if no_python:
        if "/" not in script:
            found = which(script)
            if found is None:
                raise UsageError(f"--no-python: {script} is not on PATH; pass the path of the executable")
            return Target(script=str(Path(found).resolve()), no_python=True)
        if not path.is_file():
            raise UsageError(f"--no-python: {script} does not exist; pass the path of the executable")
        if not os.access(path, os.X_OK):
            raise UsageError(f"--no-python: {script} is not executable; chmod +x it, or drop --no-python")
        return Target(script=str(path.resolve()), no_python=True)
    if path.is_dir():
        raise UsageError(f"script {script} is a directory; pass the path of your training script (or -m MODULE)")
    if not path.is_file():
        raise UsageError(f"script {script} does not exist; pass the path of your training script (or -m MODULE)")
    return Target(script=str(path.resolve()))
