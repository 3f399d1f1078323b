"""Messages between ranks, agents and the supervisor (docs/architecture.md §Message hops; docs/contracts.md §Wire frames).

Transport:
- ranks → agent: a node-local Unix *stream* socket (path in CKPTSUP_RANK_SOCKET, inside a 0700
  directory). One connection per rank; newline-delimited frames; the agent answers commands on the
  same connection. Every frame carries an HMAC-SHA256 over its body with the per-job secret and a
  strictly increasing `seq` per sender (replays and forgeries are dropped and counted).
- agent → supervisor: JSON lines on the agent's stdout through `srun -u` (Slurm authenticates and
  forwards it; no port). Frames are the same format, so one decoder serves both.
- agent → relay agent (past [supervisor] relay_above_nodes): a child's heartbeat frames, unchanged,
  over TCP to its relay's listener on the relay node's own address (supervisor/node/relay.py); the
  relay checks their MAC and seq per child and sends the supervisor one `relay_summary` a beat.
- supervisor → agents: JSON lines on the agents' stdin (`srun --input=all`), same format.

Frame: {"m": <type>, "seq": <int>, "body": {...}, "mac": <hex>}

Message kinds (m) are `MessageKind`; which hop carries each is `HOPS`; the body of each is a
frozen dataclass in messages.py, and docs/contracts.md lists the same table (tests hold them
together). A rank's `phase` is a `Phase`.
"""

from __future__ import annotations

import enum
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import CkptsupError
from .safe_io import loads_json

# The frame format's version: an agent whose ckptsup speaks another one (an image's older or newer
# ckptsup) is refused at its hello with one line naming both versions. Bump it when a change makes
# this version's frames unreadable to the last one, or the other way round.
WIRE_VERSION = 3   # 2: a heartbeat's pids and evidence packed in strings (messages.pack_pids, pack_evidence); 3: relays
MAX_FRAME_BYTES = 64 * 1024
MAX_FRAME_DEPTH = 16   # frame → body → record → a field's value: a few levels; bounded before json.loads
_MAC = re.compile(r"[0-9a-f]{64}")


class Hop(enum.StrEnum):
    RANK_TO_AGENT = "rank → agent"            # forwarded to the supervisor with {node, agent} added
    AGENT_TO_SUPERVISOR = "agent → supervisor"
    COMMAND = "supervisor → agent"            # FORWARDED_COMMANDS go on to every rank of the node


class MessageKind(enum.StrEnum):
    """Every frame type. StrEnum, so a member formats, hashes and compares as its value. The body
    of each is a frozen dataclass in messages.py (its fields, defaults and checks)."""

    # rank → agent
    HELLO = "hello"                 # messages.Hello
    STEP = "step"                   # messages.Step
    PHASE = "phase"                 # messages.PhaseChange: the phase the rank is already in again: a heartbeat in it
    NAN = "nan"                     # messages.Nan
    SDC = "sdc"                     # messages.Sdc: replicas disagree (docs/sdc.md)
    EVENT = "event"                 # messages.EventRecord: an events.jsonl record for the supervisor to append
    BYE = "bye"                     # messages.Bye
    # agent → supervisor (every body also carries {node, agent})
    AGENT_HELLO = "agent_hello"     # messages.AgentHello: an agent's first frame: versions, container, pid namespace
    HB = "hb"                       # messages.Heartbeat
    LAUNCHED = "launched"           # messages.Launched: torchrun started (its pid, to reap if the agent dies)
    RANK_EXIT = "rank_exit"         # messages.RankExit: rc 0: a rank without hooks exited cleanly
    TORCHRUN_EXIT = "torchrun_exit"  # messages.TorchrunExit
    KILLED = "killed"               # messages.Killed: answer to kill
    RESTARTED = "restarted"         # messages.Restarted: answer to restart
    PREEMPT = "preempt"             # messages.Preempt: the agent itself got SIGTERM
    PROGRESS = "progress"           # messages.Progress: a progress line of a rank that did not say hello
    OUTPUT = "output"               # messages.Output: rank output for the supervisor's console (rate-limited)
    WARM_READY = "warm_ready"       # messages.WarmReady: the next launch's warm rank interpreters are ready
    EXT_HASHED = "ext_hashed"       # messages.ExtHashed: answer to ext_hash
    MEMORY_PEER = "memory_peer"     # messages.MemoryPeer: where this agent's memory store takes replicas (host:port)
    MEMORY_REPLICATED = "memory_replicated"  # messages.MemoryReplicated
    STACKS_TAKEN = "stacks_taken"   # messages.StacksTaken: answer to stacks
    CLOUD_NOTICE = "cloud_notice"   # messages.CloudNotice: the node's cloud announced its reclaim (docs/cloud.md)
    RELAY_READY = "relay_ready"     # messages.RelayReady: this agent's relay listener (host:port) for its children's heartbeats
    RELAY_SUMMARY = "relay_summary"  # messages.RelaySummary: a relay's beat: which children it heard, what changed
    # supervisor → agent (→ ranks)
    STOP_AT = "stop_at"             # messages.StopAt: stop at an agreed step (preemption)
    SAVE_NOW = "save_now"           # messages.SaveNow
    SET_INTERVAL = "set_interval"   # messages.SetInterval
    SET_TIMEOUT = "set_timeout"     # messages.SetTimeout: the steady collective timeout, once steps are measured
    DUMP_FR = "dump_fr"             # messages.DumpFr
    KILL = "kill"                   # messages.Kill: agent only: kill torchrun and the ranks now (report: name the live ones first)
    RESTART = "restart"             # messages.Restart: agent only: fast-path relaunch
    EXIT = "exit"                   # messages.Exit: agent only: kill the ranks and exit
    EXT_HASH = "ext_hash"           # messages.ExtHash: agent only: hash these files of an external step folder
    MEMORY_PEERS = "memory_peers"   # messages.MemoryPeers: agent only: the memory tier's peers
    STACKS = "stacks"               # messages.Stacks: agent only: every rank's Python stacks (a suspected hang's evidence)
    RELAY = "relay"                 # messages.Relay: agent only: its place in the heartbeat tree (children, parent)




HOPS: dict[MessageKind, Hop] = {
    **{k: Hop.RANK_TO_AGENT for k in (MessageKind.HELLO, MessageKind.STEP, MessageKind.PHASE,
                                       MessageKind.NAN, MessageKind.SDC, MessageKind.EVENT, MessageKind.BYE)},
    **{k: Hop.AGENT_TO_SUPERVISOR for k in (MessageKind.AGENT_HELLO, MessageKind.HB, MessageKind.LAUNCHED, MessageKind.RANK_EXIT,
                                             MessageKind.TORCHRUN_EXIT, MessageKind.KILLED,
                                             MessageKind.RESTARTED, MessageKind.PREEMPT, MessageKind.PROGRESS,
                                             MessageKind.OUTPUT, MessageKind.WARM_READY, MessageKind.EXT_HASHED,
                                             MessageKind.MEMORY_PEER, MessageKind.MEMORY_REPLICATED,
                                             MessageKind.STACKS_TAKEN, MessageKind.CLOUD_NOTICE,
                                             MessageKind.RELAY_READY, MessageKind.RELAY_SUMMARY)},
    **{k: Hop.COMMAND for k in (MessageKind.STOP_AT, MessageKind.SAVE_NOW, MessageKind.SET_INTERVAL,
                                 MessageKind.SET_TIMEOUT, MessageKind.DUMP_FR, MessageKind.KILL, MessageKind.RESTART, MessageKind.EXIT,
                                 MessageKind.EXT_HASH, MessageKind.MEMORY_PEERS, MessageKind.STACKS, MessageKind.RELAY)},
}
FORWARDED_COMMANDS = frozenset({MessageKind.STOP_AT, MessageKind.SAVE_NOW, MessageKind.SET_INTERVAL,
                                MessageKind.SET_TIMEOUT, MessageKind.DUMP_FR})


class Phase(enum.StrEnum):
    """What a rank is doing (`phase` frames). INIT → LOAD? → TRAIN ⇄ SAVE | EVAL → STOPPING | DONE.
    EVAL is the script's own word (`ckptsup.phase("eval")`, the framework callbacks' validation,
    test and predict loops): no step progress is expected in it, it has its own allowance."""

    INIT = "init"
    LOAD = "load"
    TRAIN = "train"
    EVAL = "eval"
    SAVE = "save"
    STOPPING = "stopping"
    DONE = "done"

    @classmethod
    def parse(cls, value: Any) -> "Phase":
        """Lenient: an unknown phase from a newer rank counts as training (hang-checked). A dict
        lookup, not cls(value): every heartbeat carries a phase (BENCHMARKS.md §Supervisor cost)."""
        try:
            return cls._value2member_map_.get(value, cls.TRAIN)   # type: ignore[return-value]
        except TypeError:   # an unhashable value
            return cls.TRAIN


class FrameError(CkptsupError, ValueError):
    """A frame that is malformed, too large, forged or replayed."""


def _mac(secret: bytes, m: str, seq: int, body_json: str) -> str:
    # surrogatepass: a received `m` may hold a lone surrogate (a \ud800 escape); it gets a MAC that
    # matches nothing instead of a UnicodeEncodeError (every real frame encodes the same either way)
    return hmac.digest(secret, f"{m}\n{seq}\n{body_json}".encode("utf-8", "surrogatepass"), "sha256").hex()


def _finite(value: Any) -> Any:
    """`value` with every NaN / infinity replaced by None (the decoder refuses them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode(m: MessageKind, body: dict[str, Any], *, seq: int, secret: bytes) -> bytes:
    """One frame. A non-finite number (a NaN step time, say) is sent as null: strict JSON, so
    that the decoder, which refuses NaN, never drops a frame of ours for it."""
    try:
        body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str, allow_nan=False)
    except ValueError:
        body = _finite(body)
        body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
    frame = {"m": m, "seq": seq, "body": body, "mac": _mac(secret, m, seq, body_json)}
    data = (json.dumps(frame, separators=(",", ":"), sort_keys=True, default=str) + "\n").encode()
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"frame {m} is {len(data)} bytes; limit {MAX_FRAME_BYTES}")
    return data


def decode(line: bytes | str, *, secret: bytes) -> tuple[MessageKind, int, dict[str, Any]]:
    """→ (m, seq, body). Raises FrameError; never anything else. The length and the nesting are
    bounded before the JSON parser sees the line (it recurses), NaN and Infinity are refused, and
    the MAC is checked before anything of the body is believed."""
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogatepass")
    if len(line) > MAX_FRAME_BYTES:
        raise FrameError("frame too large")
    fast = _decode_ours(line, secret)
    if fast is not None:
        return fast
    frame = loads_json(line, what="frame", error=FrameError, max_depth=MAX_FRAME_DEPTH)
    try:
        m, seq, body, mac = frame["m"], frame["seq"], frame["body"], frame["mac"]
    except (KeyError, TypeError) as err:
        raise FrameError(f"malformed frame: no field {str(err)[:40]}") from None
    if not (isinstance(m, str) and isinstance(seq, int) and not isinstance(seq, bool) and isinstance(body, dict)
            and isinstance(mac, str) and _MAC.fullmatch(mac)):
        raise FrameError("malformed frame: wrong field types")
    body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
    if not hmac.compare_digest(mac, _mac(secret, m, seq, body_json)):
        raise FrameError("bad MAC (wrong secret or tampered frame)")
    try:
        return MessageKind(m), seq, body
    except ValueError:
        raise FrameError(f"unknown message kind {m[:40]!r}") from None


# A frame as `encode` writes it (keys sorted, compact): the body's bytes are the ones its MAC
# covers, so the MAC is checked on them before they are parsed, and parsed once (a heartbeat of 8
# ranks: 80 -> 25 us; at 16,384 nodes that is the supervisor's budget, bench_supervisor_scale.py)
_OURS_HEAD = b'{"body":'
_OURS_TAIL = re.compile(rb',"m":"([a-z_]{1,40})","mac":"([0-9a-f]{64})","seq":(0|[1-9][0-9]{0,18})\}\r?\n?\Z')


def _decode_ours(line: bytes, secret: bytes) -> tuple[MessageKind, int, dict[str, Any]] | None:
    """(m, seq, body) of a frame in our own encoding with a good MAC; None when the line is not
    in that form (the general path decides). Raises FrameError for a bad MAC or body."""
    if not line.startswith(_OURS_HEAD) or (tail := _OURS_TAIL.search(line)) is None:
        return None
    body_json = line[len(_OURS_HEAD):tail.start()]
    m, mac, seq = tail[1].decode(), tail[2].decode(), int(tail[3])
    expected = hmac.digest(secret, f"{m}\n{seq}\n".encode() + body_json, "sha256").hex()   # one-shot: the C path
    if not hmac.compare_digest(mac, expected):
        return None   # perhaps a body whose own text ends like a frame: the general path decides
    body = loads_json(body_json, what="frame body", error=FrameError, max_depth=MAX_FRAME_DEPTH - 1)
    if not isinstance(body, dict):
        raise FrameError("malformed frame: wrong field types")
    try:
        return MessageKind(m), seq, body
    except ValueError:
        raise FrameError(f"unknown message kind {m[:40]!r}") from None


@dataclass
class ReplayGuard:
    """Per-sender strictly increasing sequence numbers."""

    last: dict[str, int] = field(default_factory=dict)

    def accept(self, sender: str, seq: int) -> bool:
        if seq <= self.last.get(sender, -1):
            return False
        self.last[sender] = seq
        return True


@dataclass
class FrameReader:
    """One receiving end of a byte stream: splits it into frames and keeps only those with a
    good MAC and a fresh `seq` from `sender`; everything else is dropped and counted.

    A receiver that learns who sends only from an authenticated frame (the agent: a rank's
    identity is its `hello`) splits with `lines` and decodes with `verified`, then keeps its own
    ReplayGuard keyed by that identity."""

    secret: bytes
    sender: str
    on_drop: Callable[[], None] = lambda: None
    guard: ReplayGuard = field(default_factory=ReplayGuard)
    _buf: bytes = b""

    def lines(self, data: bytes) -> list[bytes]:
        """The complete lines `data` ends. Raises FrameError when the unterminated rest grows past
        a few frames (a flood, not a peer of ours): at most 4 × MAX_FRAME_BYTES are ever held."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > 4 * MAX_FRAME_BYTES:
            self._buf = b""
            self.on_drop()
            raise FrameError("unterminated frame flood")
        return lines

    def feed(self, data: bytes) -> list[tuple[MessageKind, dict[str, Any]]]:
        """→ the accepted (m, body) frames completed by `data`. Raises FrameError on a flood
        (see `lines`)."""
        return [frame for frame in map(self.accept, self.lines(data)) if frame is not None]

    def verified(self, line: bytes) -> tuple[MessageKind, int, dict[str, Any]] | None:
        """(m, seq, body) of a well-formed frame with a good MAC, else None (counted; a blank
        line is nothing). No replay check: the caller's."""
        if not line.strip():
            return None
        try:
            return decode(line, secret=self.secret)
        except FrameError:
            self.on_drop()
            return None

    def accept(self, line: bytes) -> tuple[MessageKind, dict[str, Any]] | None:
        frame = self.verified(line)
        if frame is None:
            return None
        m, seq, body = frame
        if not self.guard.accept(self.sender, seq):
            self.on_drop()
            return None
        return m, body
