"""Typed message bodies: one frozen dataclass per `wire.MessageKind` (docs/contracts.md §Wire frames).

`wire.py` moves frames (JSON, MAC, sequence numbers); this module says what a body holds. A
sender builds the kind's class and sends it (`encode`, or `to_body()` to a transport that adds an
envelope); a receiver turns the body it got into the class with `parse(kind, body)` at its
boundary, the one place a body is checked, and reads attributes from then on. docs/contracts.md's message table lists the same fields (optional
ones with `?`); tests/test_messages.py holds them together both ways.

Frozen dataclasses, not TypedDicts: a TypedDict checks nothing at run time, so the body of a
well-signed frame from a buggy or hostile peer would still reach the readers as whatever it is;
a dataclass is built by one validating constructor (`from_body`), gives attribute access that
mypy checks, and is immutable, so a reader cannot change what the next one sees.

The rules, for every kind:
- a missing required field, or a field of the wrong type or out of its bounds, is a
  `wire.FrameError` naming the field: the receiver drops the frame and counts it, as it does a
  forged one (numbers are finite ints or floats, never bools; `float` fields take ints too);
- a missing optional field takes its default, the value the readers assumed before the types;
- an unknown field is ignored, not refused: the envelope keys a hop adds (`node` and `agent` on
  everything an agent sends up, `nodes` on a command) travel in the same JSON object, and a
  peer of a newer ckptsup may say more than this one reads. Ignored means dropped: a relayed
  body is re-encoded from its type, so only fields this version knows go on;
- `to_body()` writes every field, except an optional one marked `?` (`opt=True`) while it is
  None: the JSON keys are the ones the dict bodies had, so the wire format did not change.
"""

from __future__ import annotations

import itertools
import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from types import NoneType, UnionType
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence, TypeVar

from . import wire
from .wire import FrameError, MessageKind, Phase

MAX_LIST_ITEMS = 1 << 16   # a list field's length bound (a frame is at most 64 KiB anyway)
MAX_REPLICAS = 3           # config.MAX_REPLICAS: the buddies of a memory_peers command (a test holds them equal)


class Problem(ValueError):
    """A field's value that its type refuses (becomes the FrameError's text)."""


def fld(*, default: Any = MISSING, opt: bool = False, low: float | None = None, high: float | None = None,
         max_items: int = MAX_LIST_ITEMS, lenient: bool = False, check: Callable[[Any], bool] | None = None,
         what: str = "") -> Any:
    """A field of a body. `opt`: optional in the docs (`?`), left out of `to_body()` while None.
    `low`/`high`: bounds of a number, or of each number of a list. `lenient`: a bad value reads as
    the default instead of refusing the frame (fields a reader already dropped when junk).
    `check`: a further test of the whole value; `what`: the field's description in a refusal."""
    meta = {"opt": opt, "low": low, "high": high, "max_items": max_items, "lenient": lenient, "check": check,
            "what": what}
    if opt and default is MISSING:
        default = None
    if isinstance(default, (list, dict)):
        raise TypeError("a mutable default")   # a frozen body holds tuples
    return field(default=default, metadata=meta)


# ---- value checks, built once per field from its annotation --------------------------------------
Check = Callable[[Any], Any]


def _anything(v: Any) -> Any:
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounded(what: str, ok: Callable[[Any], bool], low: float | None, high: float | None) -> tuple[Check, str]:
    desc = what + (f" >= {low:g}" if low is not None else "") + (f" <= {high:g}" if high is not None else "")

    def check(v: Any) -> Any:
        if not ok(v) or (low is not None and v < low) or (high is not None and v > high):
            raise Problem(desc)
        return v
    return check, desc


def _checker(tp: Any, meta: Mapping[str, Any]) -> tuple[Check, str]:
    """(check, description) for a value of annotation `tp`; check returns the value to keep."""
    low, high = meta.get("low"), meta.get("high")
    if tp is Any:
        return _anything, "anything"
    if tp is int:
        return _bounded("an integer", _is_int, low, high)
    if tp is float:
        return _bounded("a number", _is_number, low, high)
    if tp is bool:
        return _bounded("a bool", lambda v: isinstance(v, bool), None, None)
    if tp is str:
        return _bounded("a string", lambda v: isinstance(v, str), None, None)
    if tp is Phase:
        def phase(v: Any) -> Phase:
            if not isinstance(v, str):
                raise Problem("a phase name")
            return Phase.parse(v)   # lenient: a newer rank's phase counts as training
        return phase, "a phase name"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (UnionType, typing.Union):
        parts = [_checker(a, meta) for a in args if a is not NoneType]
        nullable = NoneType in args
        desc = " or ".join([d for _, d in parts] + (["null"] if nullable else []))
        if len(parts) == 1:   # X | None (one type besides None is always Optional): no loop, no try
            only = parts[0][0]

            def optional(v: Any) -> Any:
                return None if v is None else only(v)
            return optional, desc

        def union(v: Any) -> Any:
            if v is None and nullable:
                return None
            for check, _ in parts:
                try:
                    return check(v)
                except Problem:
                    continue
            raise Problem(desc)
        return union, desc
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item, item_desc = _checker(args[0], meta)
        most = int(meta.get("max_items", MAX_LIST_ITEMS))
        item_as_is = _as_is(args[0], meta)

        def items(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, (list, tuple)) or len(v) > most:
                raise Problem(desc)
            if item is _anything or all(type(x) in item_as_is for x in v):
                return tuple(v)
            return tuple([item(x) for x in v])
        desc = f"a list of at most {most} ({item_desc})"
        return items, desc
    if origin is dict and args and args[0] is str:
        value, value_desc = _checker(args[1], {})

        def mapping(v: Any) -> dict[str, Any]:
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise Problem(desc)
            return {k: value(x) for k, x in v.items()}
        desc = "an object" if args[1] is Any else f"an object of ({value_desc})"
        return mapping, desc
    raise TypeError(f"no check for the annotation {tp!r}")


def _as_is(tp: Any, meta: Mapping[str, Any]) -> frozenset[type]:
    """The exact types a field of annotation `tp` keeps unchanged with nothing more to check (an
    unbounded int, a bool, a string, or None where allowed): from_body's fast path, which the
    heartbeats of 16,384 agents take (BENCHMARKS.md §Supervisor cost)."""
    if meta.get("check") is not None or meta.get("low") is not None or meta.get("high") is not None:
        return frozenset()
    if tp in (int, bool, str):
        return frozenset({tp})
    if typing.get_origin(tp) in (UnionType, typing.Union):
        parts = [_as_is(a, meta) if a is not NoneType else frozenset({NoneType}) for a in typing.get_args(tp)]
        return frozenset().union(*parts)
    return frozenset()


@dataclass(frozen=True)
class _Field:
    name: str
    check: Check
    desc: str
    default: Any          # MISSING: required
    opt: bool
    lenient: bool
    extra: Callable[[Any], bool] | None
    as_is: frozenset[type]   # _as_is: values of these exact types need no check


def _plain(value: Any) -> Any:
    """A body value as JSON sees it: tuples as lists (so that bodies compare equal to the dicts
    they were), enums as their values."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Phase):
        return value.value
    return value


B = TypeVar("B", bound="Body")


@dataclass(frozen=True, slots=True, kw_only=True)
class Body:
    """A message body; a subclass per kind, registered with @kind."""

    KIND: ClassVar[MessageKind]
    _fields: ClassVar[tuple[_Field, ...]] = ()   # set by @kind

    def to_body(self) -> dict[str, Any]:
        """The JSON body: every field but the optional ones that are None."""
        return {f.name: _plain(getattr(self, f.name)) for f in self._fields
                if not (f.opt and getattr(self, f.name) is None)}

    @classmethod
    def from_body(cls: type[B], body: Mapping[str, Any]) -> B:
        """The body, checked (module docstring); raises FrameError with a one-line problem."""
        values: dict[str, Any] = {}
        for f in cls._fields:
            if f.name not in body:
                if f.default is MISSING:
                    raise FrameError(f"`{f.name}` is missing")
                continue
            raw = body[f.name]
            if type(raw) in f.as_is:
                values[f.name] = raw
                continue
            try:
                value = f.check(raw)
                if f.extra is not None and value is not None and not f.extra(value):
                    raise Problem(f.desc)
            except Problem:
                if f.lenient:
                    continue
                raise FrameError(f"`{f.name}` must be {f.desc}, not {raw!r:.60}") from None
            values[f.name] = value
        return cls(**values)


BODIES: dict[MessageKind, type[Body]] = {}


def kind(m: MessageKind) -> Callable[[type[B]], type[B]]:
    """Register a body class for `m` and build its field checks."""
    def register(cls: type[B]) -> type[B]:
        hints = typing.get_type_hints(cls)
        built = []
        for f in fields(cls):
            meta = f.metadata
            check, desc = _checker(hints[f.name], meta)
            built.append(_Field(name=f.name, check=check, desc=meta.get("what") or desc, default=f.default,
                                opt=bool(meta.get("opt")), lenient=bool(meta.get("lenient")), extra=meta.get("check"),
                                as_is=_as_is(hints[f.name], meta)))
        cls.KIND = m
        cls._fields = tuple(built)
        BODIES[m] = cls
        return cls
    return register


def parse(m: MessageKind, body: Mapping[str, Any]) -> Body:
    """The typed body of a decoded frame of kind `m`: the one check of a body at a boundary."""
    return BODIES[m].from_body(body)


def encode(msg: Body, *, seq: int, secret: bytes, envelope: Mapping[str, Any] | None = None) -> bytes:
    """`msg` as one frame (wire.encode), with the hop's envelope keys ({node, agent}) added."""
    body = msg.to_body()
    return wire.encode(msg.KIND, {**body, **envelope} if envelope else body, seq=seq, secret=secret)


def peer_addr(value: Any) -> bool:
    """host:port (the memory tier's replica listeners)."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    # at most 5 digits before int(): a port of thousands of digits is a refusal, not a ValueError
    return bool(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536


def _rank_sources(value: dict[str, Any]) -> bool:
    return all(k.isascii() and k.isdigit() and isinstance(v, list) and all(peer_addr(a) for a in v)
               for k, v in value.items())


# ==== rank → agent ================================================================================
NO_RANK = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class RankScoped(Body):
    """A rank's frame about itself: absent, its `rank` is the hello's (the agent fills it in;
    NO_RANK until then); present, it must be that rank."""

    rank: int = fld(default=NO_RANK, low=0)


@kind(MessageKind.HELLO)
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Body):
    rank: int = fld(low=0)
    local_rank: int = fld(default=0)
    world_size: int = fld(default=1)
    node: str = fld(default="")
    pid: int | None = fld(default=None, low=1)
    checkpoints: bool = fld(default=True)   # false: heartbeat-only hooks (no ckptsup checkpoints)
    # the rank's own disk schedule; junk reads as absent (interval_tuner.rank_schedule bounds it)
    save_every_steps: int | None = fld(opt=True, low=0, lenient=True)
    save_every_s: float | None = fld(opt=True, lenient=True, check=lambda v: v > 0)


@kind(MessageKind.STEP)
@dataclass(frozen=True, slots=True, kw_only=True)
class Step(RankScoped):
    step: int = fld(low=0)
    step_time_s: float | None = fld(default=None)
    loss_finite: bool = fld(default=True)
    compute_s: float | None = fld(opt=True)
    sdc_s: float | None = fld(opt=True)
    loss: float | None = fld(opt=True)


@kind(MessageKind.PHASE)
@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange(RankScoped):
    phase: Phase = fld()
    step: int | None = fld(default=None)


@kind(MessageKind.NAN)
@dataclass(frozen=True, slots=True, kw_only=True)
class Nan(RankScoped):
    step: int | None = fld(default=None)
    loss: str | float | None = fld(default=None)   # the loss as the rank printed it ("nan"); only shown


@kind(MessageKind.SDC)
@dataclass(frozen=True, slots=True, kw_only=True)
class Sdc(RankScoped):
    step: int = fld(low=0)
    copies: int = fld(low=1)
    disputed: tuple[int, ...] = fld(low=0)
    majority: bool = fld()
    fingerprint: str = fld(default="")   # the majority's (or the only) fingerprint, hex
    agreed_step: int | None = fld(opt=True, low=0)


@kind(MessageKind.EVENT)
@dataclass(frozen=True, slots=True, kw_only=True)
class EventRecord(Body):
    record: dict[str, Any] = fld()


@kind(MessageKind.BYE)
@dataclass(frozen=True, slots=True, kw_only=True)
class Bye(RankScoped):
    status: int = fld()   # an ExitStatus; another integer of a newer rank is kept as it is


# ==== agent → supervisor (the agent adds {node, agent}: the envelope, outside these types) ==========
@kind(MessageKind.HB)
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Body):
    ranks_alive: tuple[int, ...] | None = fld(default=None)
    last_step: int | None = fld(default=None)
    phase: Phase | None = fld(default=None)
    stopped_ranks: tuple[int, ...] = fld(default=())
    torchrun: bool | None = fld(default=None)
    dropped: int = fld(default=0)
    attempt: int | None = fld(default=None)
    # packed (pack_pids / pack_evidence, wire.WIRE_VERSION 2): parsed where they are read, not per beat
    pids: str | None = fld(default=None)       # "rank,pid,host_pid ..."
    evidence: str | None = fld(default=None)   # "rank,cpu_s,io_bytes,state,children,children_cpu_s ..."


# ---- the heartbeat's packed fields -----------------------------------------------------------------
# Every rank's pids and /proc evidence ride on each heartbeat. As JSON objects and lists they were
# most of the supervisor's work per beat (an 8-rank beat: 37 -> 9 us to decode, BENCHMARKS.md §Scale);
# as one string each they cost the decoder one string, and the supervisor parses the pids when they
# change and the evidence when a silence is judged (supervisor/job/node_evidence.py).
EvidenceRow = tuple[int, float, int, str, int, float]   # rank, cpu_s, io_bytes, state, children, children_cpu_s


def pack_pids(pids: Iterable[Mapping[str, int]]) -> str:
    """[{rank, pid, host_pid}] as the heartbeat's `pids`."""
    return " ".join(f"{int(p['rank'])},{int(p['pid'])},{int(p['host_pid'])}" for p in pids)


def unpack_pids(text: str) -> dict[int, dict[str, int]]:
    """rank -> {pid, host_pid}. A malformed record is skipped, never raised (a peer's junk costs it its entry)."""
    out: dict[int, dict[str, int]] = {}
    for record in text.split()[:MAX_LIST_ITEMS]:
        parts = record.split(",")
        if len(parts) == 3 and all(p.isascii() and p.isdigit() for p in parts):
            out[int(parts[0])] = {"pid": int(parts[1]), "host_pid": int(parts[2])}
    return out


def pack_evidence(rows: Iterable[Sequence[Any]]) -> str:
    """[[rank, cpu_s, io_bytes, state, children?, children_cpu_s?]] as the heartbeat's `evidence`; a
    state is one /proc letter (anything else is sent as `?`)."""
    out = []
    for row in rows:
        rank, cpu, io, state, *rest = row
        children, children_cpu = (rest[0], rest[1]) if len(rest) >= 2 else (0, 0.0)
        letter = state if isinstance(state, str) and len(state) == 1 and state.isalpha() else "?"
        out.append(f"{int(rank)},{float(cpu):.3f},{int(io)},{letter},{int(children)},{float(children_cpu):.3f}")
    return " ".join(out)


def unpack_evidence(text: str) -> list[EvidenceRow]:
    """The rows of a packed `evidence`; a malformed one (a non-finite or negative number, a field
    short) is skipped."""
    rows: list[EvidenceRow] = []
    for record in text.split()[:MAX_LIST_ITEMS]:
        parts = record.split(",")
        if len(parts) != 6 or not all(parts[i].isascii() and parts[i].isdigit() for i in (0, 2, 4)):
            continue
        try:
            cpu, children_cpu = float(parts[1]), float(parts[5])
        except ValueError:
            continue
        if not (math.isfinite(cpu) and math.isfinite(children_cpu)) or not parts[3]:
            continue
        rows.append((int(parts[0]), cpu, int(parts[2]), parts[3], int(parts[4]), children_cpu))
    return rows


@kind(MessageKind.LAUNCHED)
@dataclass(frozen=True, slots=True, kw_only=True)
class Launched(Body):
    attempt: int | None = fld(default=None)
    pid: int | None = fld(default=None)
    warm: bool = fld(default=False)


@kind(MessageKind.RANK_EXIT)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit(Body):
    rank: int | None = fld(default=None)
    rc: int | None = fld(default=None)
    pid: int | None = fld(default=None)
    step: int | None = fld(default=None)
    age_s: float | None = fld(default=0.0)
    detail: str = fld(default="")


@kind(MessageKind.TORCHRUN_EXIT)
@dataclass(frozen=True, slots=True, kw_only=True)
class TorchrunExit(Body):
    rc: int | None = fld(default=None)
    step: int | None = fld(default=None)
    stopped: bool | None = fld(opt=True)     # a stop (preemption, time limit) had reached the ranks
    preempted: bool | None = fld(opt=True)   # the agent itself got the preemption signal


@kind(MessageKind.KILLED)
@dataclass(frozen=True, slots=True, kw_only=True)
class Killed(Body):
    kill_s: float = fld(default=0.0)
    survivors: tuple[dict[str, Any], ...] | None = fld(opt=True)   # [{rank, pid, host_pid, wchan?, stack?}]


@kind(MessageKind.RESTARTED)
@dataclass(frozen=True, slots=True, kw_only=True)
class Restarted(Body):
    attempt: int | None = fld(default=None)
    kill_s: float = fld(default=0.0)


@kind(MessageKind.PREEMPT)
@dataclass(frozen=True, slots=True, kw_only=True)
class Preempt(Body):
    signal: int | None = fld(default=None)
    budget_s: float = fld(default=0.0)


@kind(MessageKind.PROGRESS)
@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(Body):
    rank: int = fld()
    step: int = fld()


@kind(MessageKind.OUTPUT)
@dataclass(frozen=True, slots=True, kw_only=True)
class Output(Body):
    lines: tuple[str, ...] = fld(default=())
    dropped: int = fld(default=0)


@kind(MessageKind.WARM_READY)
@dataclass(frozen=True, slots=True, kw_only=True)
class WarmReady(Body):
    interpreters: int | None = fld(default=None)


@kind(MessageKind.EXT_HASHED)
@dataclass(frozen=True, slots=True, kw_only=True)
class ExtHashed(Body):
    request: str | None = fld(default=None)
    part: int | None = fld(default=None)
    folder: str = fld(default="")
    files: tuple[Any, ...] = fld(default=())      # [{path, size, hash}]: each entry checked where it is used
    problems: tuple[Any, ...] = fld(default=())
    hash_s: float = fld(default=0.0)   # seconds the hashing took
    testload: dict[str, Any] | None = fld(opt=True)   # a test load's verdict {ok, detail, duration_s}


@kind(MessageKind.MEMORY_PEER)
@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPeer(Body):
    addr: str | None = fld(default=None)


@kind(MessageKind.MEMORY_REPLICATED)
@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReplicated(Body):
    step: int | None = fld(default=None)
    rank: int | None = fld(default=None)
    buddy: str | None = fld(default=None)
    ok: bool = fld(default=False)
    bytes: int = fld(default=0)
    replicate_s: float = fld(default=0.0)
    reason: str | None = fld(opt=True)


@kind(MessageKind.STACKS_TAKEN)
@dataclass(frozen=True, slots=True, kw_only=True)
class StacksTaken(Body):
    attempt: int | None = fld(default=None)
    stacks: tuple[Any, ...] = fld(default=())   # [[rank, text]]
    wchan: tuple[Any, ...] = fld(default=())    # [[rank, kernel wait channel]]
    children: tuple[Any, ...] = fld(default=())  # [[rank, pid, state, waiting in]]: each rank's live descendants


@kind(MessageKind.AGENT_HELLO)
@dataclass(frozen=True, slots=True, kw_only=True)
class AgentHello(Body):
    version: str = fld(check=lambda v: 0 < len(v) <= 64, what="a version string")    # the agent's ckptsup
    wire: int = fld(low=0, high=1 << 30)                 # its wire.WIRE_VERSION
    pid: int = fld(default=0, low=0, high=1 << 31)       # as the agent sees itself (1: the container's init)
    pid_ns: int = fld(default=0, low=0, high=1 << 63)    # inode of its pid namespace
    container: str = fld(default="", check=lambda v: len(v) <= 16, what="a runtime's name")
    node_from: str = fld(default="", check=lambda v: len(v) <= 32, what="how it found its node")
    shm_free: int = fld(default=0, low=0, high=1 << 62)  # bytes free in its /dev/shm
    age_s: float = fld(default=0.0, low=0, high=1e7)     # seconds since its process started (the container phase)


@kind(MessageKind.CLOUD_NOTICE)
@dataclass(frozen=True, slots=True, kw_only=True)
class CloudNotice(Body):
    cloud: str = fld(check=lambda v: v in ("aws", "gcp", "azure"), what="aws, gcp or azure")
    action: str = fld(check=lambda v: 0 < len(v) <= 32, what="a short action name")   # terminate, stop, hibernate, preempted, preempt
    deadline: str = fld(check=lambda v: len(v) <= 40, what="an ISO 8601 UTC time")    # when the cloud reclaims the node
    ahead_s: float = fld(low=0, high=7 * 86400, what="a number of seconds >= 0")     # deadline - now, at the agent
    detail: str = fld(default="", check=lambda v: len(v) <= 200, what="at most 200 characters")


# ---- the heartbeat tree (past [supervisor] relay_above_nodes; supervisor/node/relay.py, job/relays.py) ----
MAX_RELAY_CHILDREN = 4096   # a relay's children (√16,384 = 128 at the planned size; the bound is the frame's)
_HEX = frozenset("0123456789abcdef")


def _node_names(value: str) -> bool:
    return len(value.split()) <= MAX_RELAY_CHILDREN


def _hex(value: str) -> bool:
    return 0 < len(value) <= MAX_RELAY_CHILDREN // 4 + 1 and set(value) <= _HEX


@kind(MessageKind.RELAY_READY)
@dataclass(frozen=True, slots=True, kw_only=True)
class RelayReady(Body):
    generation: int = fld(low=0)                                  # the `relay` command it answers
    addr: str | None = fld(default=None, check=peer_addr, what="host:port")   # None: it could not listen


@kind(MessageKind.RELAY_SUMMARY)
@dataclass(frozen=True, slots=True, kw_only=True)
class RelaySummary(Body):
    """One relay's beat for some of its children (a relay with many changes sends several)."""

    children: str = fld(check=_node_names, what=f"at most {MAX_RELAY_CHILDREN} node names")   # space-separated, `heard`'s order
    heard: str = fld(check=_hex, what="a hex bitmap")   # pack_heard: bit i = children[i] was heard since the last summary
    low_step: int | None = fld(opt=True)     # the heard children's last_step, lowest and highest
    high_step: int | None = fld(opt=True)
    # node -> {agent, ranks_alive, pids, stopped_ranks}: a child whose state changed (or first heard); child_changes
    changed: dict[str, Any] | None = fld(opt=True)
    evidence: dict[str, str] | None = fld(opt=True)   # node -> its latest packed evidence, while asked for (a suspicion)
    dropped: int = fld(default=0)             # children's frames this relay refused (MAC, seq, not its child)

    def heard_nodes(self) -> list[str]:
        return unpack_heard(self.heard, self.children.split())

    def child_changes(self) -> dict[str, tuple[str, "Heartbeat"]]:
        """node -> (its agent instance, its state as a heartbeat); a malformed entry is skipped."""
        out: dict[str, tuple[str, Heartbeat]] = {}
        for node, entry in (self.changed or {}).items():
            if not isinstance(entry, dict) or not isinstance(entry.get("agent"), str):
                continue
            try:
                out[node] = (entry["agent"], Heartbeat.from_body(entry))
            except FrameError:
                continue
        return out


_BITS = bytes.maketrans(b"01", b"\x00\x01")


def pack_heard(flags: Sequence[bool]) -> str:
    """A bitmap in hex: bit i (of the integer) is flags[i]."""
    value = 0
    for i, flag in enumerate(flags):
        if flag:
            value |= 1 << i
    return format(value, "x")


def unpack_heard(heard: str, children: Sequence[str]) -> list[str]:
    """The children whose bit is set; every one without a walk when all are (the common beat)."""
    value = int(heard, 16)
    if value == (1 << len(children)) - 1:
        return list(children)
    # the bits as bytes 0/1, least significant first, picked in C (a relay's summary several times a
    # beat holds a slice of its children: a walk per bit in Python was most of its cost)
    return list(itertools.compress(children, format(value, "b")[::-1].encode().translate(_BITS)))


# ==== supervisor → agent (→ ranks); AgentSet.send adds the envelope's `nodes` =====================
@kind(MessageKind.STOP_AT)
@dataclass(frozen=True, slots=True, kw_only=True)
class StopAt(Body):
    reason: str = fld(default="")
    save: bool = fld(default=True)
    budget_s: float | None = fld(default=None)
    step: int | None = fld(opt=True, low=0)   # stop after this step (absent: the next agreed one)


@kind(MessageKind.SAVE_NOW)
@dataclass(frozen=True, slots=True, kw_only=True)
class SaveNow(Body):
    reason: str = fld(default="requested")


@kind(MessageKind.SET_INTERVAL)
@dataclass(frozen=True, slots=True, kw_only=True)
class SetInterval(Body):
    interval_s: float | None = fld(opt=True, low=0)
    save_every_steps: int | None = fld(opt=True, low=0)
    memory_every_steps: int | None = fld(opt=True, low=0)

    def merged(self, later: "SetInterval") -> "SetInterval":
        """Two changes that wait for the same agreed step: the later one's fields win."""
        return SetInterval(**{f.name: getattr(later, f.name) if getattr(later, f.name) is not None
                              else getattr(self, f.name) for f in self._fields})


@kind(MessageKind.SET_TIMEOUT)
@dataclass(frozen=True, slots=True, kw_only=True)
class SetTimeout(Body):
    collective_s: float = fld(low=0)


@kind(MessageKind.DUMP_FR)
@dataclass(frozen=True, slots=True, kw_only=True)
class DumpFr(Body):
    path: str = fld(default="")   # "": the rank's own flight-recorder directory


@kind(MessageKind.KILL)
@dataclass(frozen=True, slots=True, kw_only=True)
class Kill(Body):
    grace: float = fld(default=0.0, low=0, what="a number of seconds >= 0")
    report: bool | None = fld(opt=True)   # true: name the live rank processes in the answer first


@kind(MessageKind.RESTART)
@dataclass(frozen=True, slots=True, kw_only=True)
class Restart(Body):
    attempt: int = fld(low=0, what="an integer >= 0")
    spec: dict[str, Any] | str | None = fld(default=None, what="a launch spec or its path")
    env: dict[str, str] | None = fld(opt=True, what="an object mapping names to strings")


@kind(MessageKind.EXIT)
@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(Body):
    pass


@kind(MessageKind.EXT_HASH)
@dataclass(frozen=True, slots=True, kw_only=True)
class ExtHash(Body):
    # types here; the paths, names and algorithm are the hasher's to judge (external_agent.parse_request)
    request: str = fld()
    part: int = fld(low=0)
    dir: str = fld()
    folder: str = fld()
    files: tuple[str, ...] = fld()
    algorithm: str = fld()
    testload: str | None = fld(opt=True)   # the manifest to test-load the folder against


@kind(MessageKind.MEMORY_PEERS)
@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPeers(Body):
    buddies: tuple[str, ...] = fld(default=(), max_items=MAX_REPLICAS,
                                    check=lambda v: all(peer_addr(a) for a in v),
                                    what=f"a list of at most {MAX_REPLICAS} host:port")
    sources: dict[str, Any] | None = fld(default=None, check=_rank_sources, what="an object mapping ranks to lists of host:port")

    def rank_sources(self) -> dict[int, list[str]]:
        return {int(k): list(v) for k, v in (self.sources or {}).items()}


@kind(MessageKind.STACKS)
@dataclass(frozen=True, slots=True, kw_only=True)
class Stacks(Body):
    pass


@kind(MessageKind.RELAY)
@dataclass(frozen=True, slots=True, kw_only=True)
class Relay(Body):
    """A node's whole place in the heartbeat tree for `generation`: the children whose heartbeats it
    takes (empty: none), where its own heartbeats go (None: stdout, the direct path), and whether its
    summaries carry its children's evidence (asked while a silence is judged)."""

    generation: int = fld(low=0)
    children: tuple[str, ...] = fld(default=(), max_items=MAX_RELAY_CHILDREN)
    parent: str | None = fld(default=None, check=peer_addr, what="host:port")
    evidence: bool = fld(default=False)


assert set(BODIES) == set(MessageKind), set(MessageKind) - set(BODIES)
