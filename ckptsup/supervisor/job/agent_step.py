"""Supervisor side of the agent channel: one `AgentStep` per srun step (or per local agent child).

Agents write frames on stdout (srun merges every task's stdout into one pipe: a long frame comes
in pieces, step_lines.py); one reader thread per step joins and decodes them, drops forged or
replayed ones, types the body (messages.py: the supervisor's one check of what an agent says; a
bad body is dropped and counted like a forged frame), and queues a `Message`.
Commands go down as frames on the step's stdin (srun --input=all hands them to every task; a
`nodes` list in the body addresses a subset).
"""

from __future__ import annotations

import enum
import os
import queue
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ... import messages, step_lines, wire
from ...wire import MessageKind
from ..processes import terminate


READ_BYTES = 1 << 16                       # one read of the step's stdout: ~100 heartbeats of 8 ranks
MAX_REST_BYTES = 4 * wire.MAX_FRAME_BYTES  # a line longer than any frame's pieces is not ours


class StepSignal(enum.StrEnum):
    """What the supervisor's reader of an agent step queues besides frames (never on the wire)."""

    EOF = "step_eof"   # StepEof: the step's stdout closed; every agent of it is gone


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEof(messages.Body):
    """StepSignal.EOF's body (not a wire kind, so not in messages.BODIES)."""

    rc: int | None = None
    log: str = ""        # the step's stderr file (agents.log): why agents that never spoke could not start


@dataclass(frozen=True, kw_only=True)
class Message:
    recv: float          # supervisor monotonic time of receipt
    m: MessageKind | StepSignal
    body: messages.Body
    step_id: int         # which AgentStep it came from (messages of a replaced step are stale)
    node: str = "?"      # the envelope: which agent sent it
    agent: str = ""

    @classmethod
    def received(cls, *, recv: float, m: MessageKind | StepSignal, body: Mapping[str, Any], step_id: int) -> "Message":
        """A message from the body as it came (a decoded frame's, with its envelope {node, agent}).
        Raises wire.FrameError for a body its kind's type refuses."""
        node, agent = body.get("node", "?"), body.get("agent", "")
        typed = StepEof(rc=body.get("rc")) if m is StepSignal.EOF else messages.parse(MessageKind(m), body)
        return cls(recv=recv, m=m, body=typed, step_id=step_id, node=node if isinstance(node, str) else str(node),
                   agent=agent if isinstance(agent, str) else str(agent))


class Inbox:
    """The supervisor's queue of agent messages: one consumer (the loop), any number of readers. A
    reader hands over what one read of its step decoded as one batch, so the loop's thread wakes once
    a batch, not once a frame: at 2,048 agents the thread hand-over per frame cost as much as the
    frame (BENCHMARKS.md §Scale). The queue's interface: `get(timeout=)`, `get_nowait()` (raising
    queue.Empty), `put`, `qsize`."""

    def __init__(self) -> None:
        self._batches: "queue.SimpleQueue[list[Message]]" = queue.SimpleQueue()
        self._taken: deque[Message] = deque()   # the consumer's: the rest of the batch it took

    def put(self, msg: Message) -> None:
        self._batches.put([msg])

    def put_batch(self, msgs: list[Message]) -> None:
        if msgs:
            self._batches.put(msgs)

    def get(self, block: bool = True, timeout: float | None = None) -> Message:
        while not self._taken:
            self._taken.extend(self._batches.get(block, timeout))   # raises queue.Empty
        return self._taken.popleft()

    def get_nowait(self) -> Message:
        return self.get(False)

    def qsize(self) -> int:
        """Batches waiting plus the messages left of the one taken (a bound, for a backlog warning)."""
        return self._batches.qsize() + len(self._taken)


class CommandSender:
    """Monotonic sequence numbers for every command this supervisor sends, across steps."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.seq = int(time.time() * 1000)  # a later supervisor of the same run starts higher
        self.lock = threading.Lock()

    def frame(self, m: MessageKind, body: dict[str, Any]) -> bytes:
        with self.lock:
            self.seq += 1
            return wire.encode(m, body, seq=self.seq, secret=self.secret)


class AgentStep:
    """A running set of agents behind one process (srun, or a local `ckptsup agent`)."""

    _ids = 0

    def __init__(self, *, argv: Sequence[str], env: dict[str, str], nodes: Sequence[str], secret: bytes,
                 sender: CommandSender, inbox: Inbox, log_path: Path) -> None:
        AgentStep._ids += 1
        self.step_id = AgentStep._ids
        self.nodes = tuple(nodes)
        self.secret = secret
        self.sender = sender
        self.inbox = inbox
        self.dropped = 0
        self.started = time.monotonic()
        self.log_path = log_path
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=fd, env=env, start_new_session=True)
        finally:
            os.close(fd)
        self.guard = wire.ReplayGuard()
        self.joiner = step_lines.Joiner(max_bytes=wire.MAX_FRAME_BYTES)   # pieces it could not join: joiner.dropped
        self.reader = threading.Thread(target=self._read, name=f"agent-step-{self.step_id}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for lines, recv in self._reads(self.proc.stdout.fileno()):
            batch = []
            for piece in lines:
                line = self.joiner.feed(piece)
                if line is None or not line.strip():
                    continue
                try:
                    m, seq, body = wire.decode(line, secret=self.secret)
                    msg = Message.received(recv=recv, m=m, body=body, step_id=self.step_id)
                except wire.FrameError:
                    self.dropped += 1  # stray output, a forgery or a body of the wrong types: never acted on
                    continue
                if not self.guard.accept(f"{msg.node}/{msg.agent}", seq):
                    self.dropped += 1
                    continue
                batch.append(msg)
            self.inbox.put_batch(batch)   # one hand-over a read
        self.inbox.put(Message(recv=time.monotonic(), m=StepSignal.EOF, body=StepEof(rc=self.proc.wait(),
                                                                                    log=str(self.log_path)),
                               step_id=self.step_id))

    def _reads(self, fd: int) -> Iterator[tuple[list[bytes], float]]:
        """The step's lines, those each read completed with its time of receipt, read READ_BYTES at a
        time (at 2,048 agents a read a line cost a syscall each). An unterminated rest past
        MAX_REST_BYTES (not a peer of ours) is dropped and counted."""
        rest = b""
        while True:
            try:
                data = os.read(fd, READ_BYTES)
            except InterruptedError:
                continue
            if not data:
                break
            recv = time.monotonic()
            *lines, rest = (rest + data).split(b"\n")
            if len(rest) > MAX_REST_BYTES:
                rest = b""
                self.dropped += 1
            yield [line + b"\n" for line in lines], recv
        if rest:
            yield [rest], time.monotonic()

    def send(self, msg: messages.Body, *, nodes: Sequence[str] | None = None) -> bool:
        """The transport: one frame of the command `msg`, with the envelope's `nodes` when it is
        meant for some of this step's agents only."""
        body = msg.to_body()
        if nodes is not None:
            body["nodes"] = list(nodes)
        data = self.sender.frame(msg.KIND, body)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, grace: float) -> int | None:
        """Ask the agents to exit (they kill their ranks), then terminate the step."""
        self.send(messages.Exit())
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return terminate(self.proc, 1.0)
