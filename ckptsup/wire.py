"""Messages between ranks, agents and the supervisor (DESIGN §1).

Transport:
- ranks → agent: a node-local Unix *stream* socket (path in CKPTSUP_RANK_SOCKET, inside a 0700
  directory). One connection per rank; newline-delimited frames; the agent answers commands on the
  same connection. Every frame carries an HMAC-SHA256 over its body with the per-job secret and a
  strictly increasing `seq` per sender (replays and forgeries are dropped and counted).
- agent → supervisor: JSON lines on the agent's stdout through `srun -u` (Slurm authenticates and
  forwards it; no port). Frames are the same format, so one decoder serves both.
- supervisor → agents: JSON lines on the agents' stdin (`srun --input=all`), same format.

Frame: {"m": <type>, "seq": <int>, "body": {...}, "mac": <hex>}

Message types (m):
  rank → agent:  hello {rank, local_rank, world_size, node, pid}
                 step {rank, step, step_time_s, loss_finite: bool}
                 phase {rank, phase: init|load|train|save|stopping, step}
                 nan {rank, step, loss}
                 event {record}          # an events.jsonl record for the supervisor to append
                 bye {rank, status}
  agent → supervisor: hb {node, ranks_alive, last_step, phase}, rank_exit {node, rank, rc},
                 torchrun_exit {node, rc}, and every rank message forwarded with {node} added
  supervisor → agent → ranks (commands):
                 stop_at {step, reason, save: bool, budget_s}   # agreed stop step (preemption)
                 save_now {reason}
                 set_interval {interval_s, save_every_steps}
                 dump_fr {path}
                 kill {}                  # agent only: kill torchrun and ranks now
                 restart {attempt, resume_from, env}   # agent only: fast path relaunch
                 exit {}
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_FRAME_BYTES = 64 * 1024


class FrameError(ValueError):
    """A frame that is malformed, too large, forged or replayed."""


def _mac(secret: bytes, m: str, seq: int, body_json: str) -> str:
    return hmac.new(secret, f"{m}\n{seq}\n{body_json}".encode(), hashlib.sha256).hexdigest()


def encode(m: str, body: dict[str, Any], *, seq: int, secret: bytes) -> bytes:
    body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
    frame = {"m": m, "seq": seq, "body": body, "mac": _mac(secret, m, seq, body_json)}
    data = (json.dumps(frame, separators=(",", ":"), sort_keys=True, default=str) + "\n").encode()
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"frame {m} is {len(data)} bytes; limit {MAX_FRAME_BYTES}")
    return data


def decode(line: bytes | str, *, secret: bytes) -> tuple[str, int, dict[str, Any]]:
    """→ (m, seq, body). Raises FrameError; never anything else."""
    if isinstance(line, str):
        line = line.encode()
    if len(line) > MAX_FRAME_BYTES:
        raise FrameError("frame too large")
    try:
        frame = json.loads(line)
        m, seq, body, mac = frame["m"], frame["seq"], frame["body"], frame["mac"]
    except (ValueError, KeyError, TypeError) as err:
        raise FrameError(f"malformed frame: {err}") from None
    if not (isinstance(m, str) and isinstance(seq, int) and isinstance(body, dict) and isinstance(mac, str)):
        raise FrameError("malformed frame: wrong field types")
    body_json = json.dumps(body, separators=(",", ":"), sort_keys=True, default=str)
    if not hmac.compare_digest(mac, _mac(secret, m, seq, body_json)):
        raise FrameError("bad MAC (wrong secret or tampered frame)")
    return m, seq, body


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
    good MAC and a fresh `seq` from `sender`; everything else is dropped and counted."""

    secret: bytes
    sender: str
    on_drop: Callable[[], None] = lambda: None
    guard: ReplayGuard = field(default_factory=ReplayGuard)
    _buf: bytes = b""

    def feed(self, data: bytes) -> list[tuple[str, dict[str, Any]]]:
        """→ the accepted (m, body) frames completed by `data`. Raises FrameError when the
        unterminated rest grows past a few frames (a flood, not a peer of ours)."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > 4 * MAX_FRAME_BYTES:
            self.on_drop()
            raise FrameError("unterminated frame flood")
        return [frame for frame in map(self.accept, lines) if frame is not None]

    def accept(self, line: bytes) -> tuple[str, dict[str, Any]] | None:
        if not line.strip():
            return None
        try:
            m, seq, body = decode(line, secret=self.secret)
        except FrameError:
            self.on_drop()
            return None
        if not self.guard.accept(self.sender, seq):
            self.on_drop()
            return None
        return m, body
