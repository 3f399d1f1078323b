"""The heartbeat tree, an agent's side (docs/architecture.md §A heartbeat's path at 16,384 nodes).

Past [supervisor] relay_above_nodes the supervisor makes about √N agents relays (supervisor/job/
relays.py). A child sends its heartbeat frames, unchanged (its MAC, its seq), over TCP to its relay
(`ParentLink`) instead of stdout. The relay (`RelayHub`) checks each frame as the supervisor would
(MAC with the job secret, a strictly increasing seq per child agent, a node it was given), keeps each
child's latest state, and SUMMARIES_PER_BEAT times a beat sends the supervisor a summary (`summarise`): which children it
heard, their step range, the state of those whose state changed, and their evidence only while the
supervisor asks for it. So the supervisor folds in one frame per relay a beat, not one per node.

The listener is bound to the relay node's own address (never 0.0.0.0), a port the kernel picks, as
the memory tier's (memory_store.tcp_listener). Every socket is non-blocking: a child whose relay stops
taking bytes drops its link and writes to stdout again (the direct path) at once.
"""

from __future__ import annotations

import selectors
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ... import messages, wire
from ...wire import MessageKind
from .memory_store import tcp_listener

# summaries a heartbeat period: a child's beat waits at most period / this at its relay, so a relay
# adds <= 0.5 s at a 1 s beat to the age of what the supervisor last heard of a child (4 a beat: 0.25 s but
# 9-12 % of a core instead of 7.5 % at 16,384 nodes, BENCHMARKS.md §Scale); a child is in one of them a beat
SUMMARIES_PER_BEAT = 2
SUMMARY_BUDGET = 40_000     # bytes of changes and evidence per summary frame (a frame is at most 64 KiB)
CONNECT_TIMEOUT_S = 0.5     # a child's connect to its relay (once per `relay` command)
READ_BYTES = 1 << 16


@dataclass(kw_only=True)
class ChildLatest:
    """What a relay holds of one child: its latest beat, and what the next summary owes."""

    agent: str = ""
    state: tuple[Any, ...] = ()      # what the supervisor acts on (ranks_alive, pids, stopped_ranks)
    last_step: int | None = None
    evidence: str | None = None
    heard: bool = False              # since the last summary
    changed: bool = False            # its state is not in a summary yet

    def beat(self, agent: str, hb: messages.Heartbeat) -> None:
        state = (hb.ranks_alive, hb.pids, hb.stopped_ranks)
        if agent != self.agent or state != self.state:
            self.agent, self.state, self.changed = agent, state, True
        self.last_step, self.evidence, self.heard = hb.last_step, hb.evidence, True

    def change(self) -> dict[str, Any]:
        ranks_alive, pids, stopped = self.state
        return {"agent": self.agent, "ranks_alive": None if ranks_alive is None else list(ranks_alive), "pids": pids,
                "stopped_ranks": list(stopped)}


def summarise(children: Sequence[str], latest: dict[str, ChildLatest], *, evidence: bool, dropped: int = 0,
              budget: int = SUMMARY_BUDGET) -> list[messages.RelaySummary]:
    """This beat's summaries of `children` (in order): one frame unless the changes and evidence
    outgrow `budget`, then one per slice. Clears what it reported (heard, changed). Pure."""
    out: list[messages.RelaySummary] = []
    start, size = 0, 0
    for i, child in enumerate(children):
        held = latest.get(child)
        cost = len(child) + 1
        if held is not None and held.heard:
            cost += (120 + len(held.state[1] or "") if held.changed else 0) + (len(held.evidence or "") if evidence else 0)
        if size + cost > budget and i > start:
            out.append(_summary(children[start:i], latest, evidence=evidence, dropped=dropped if not out else 0))
            start, size = i, 0
        size += cost
    if start < len(children) or not out:
        out.append(_summary(children[start:], latest, evidence=evidence, dropped=dropped if not out else 0))
    return out


def _summary(children: Sequence[str], latest: dict[str, ChildLatest], *, evidence: bool,
             dropped: int) -> messages.RelaySummary:
    flags, steps = [], []
    changed: dict[str, Any] = {}
    kept: dict[str, str] = {}
    for child in children:
        held = latest.get(child)
        heard = held is not None and held.heard
        flags.append(heard)
        if held is None or not heard:
            continue
        if held.last_step is not None:
            steps.append(held.last_step)
        if held.changed:
            changed[child] = held.change()
        if evidence and held.evidence is not None:
            kept[child] = held.evidence
        held.heard = held.changed = False
    return messages.RelaySummary(children=" ".join(children), heard=messages.pack_heard(flags),
                                 low_step=min(steps) if steps else None, high_step=max(steps) if steps else None,
                                 changed=changed or None, evidence=kept if evidence else None, dropped=dropped)


class RelayHub:
    """A relay's listener and its children's connections, served by the agent's selector."""

    def __init__(self, *, addr: str, secret: bytes, sel: selectors.BaseSelector, generation: int,
                 children: Sequence[str], evidence: bool) -> None:
        self.secret = secret
        self.sel = sel
        self.generation = generation
        self.children: tuple[str, ...] = ()
        self.evidence = evidence
        self.latest: dict[str, ChildLatest] = {}
        self.guard = wire.ReplayGuard()      # per child agent ("node/agent"), as the supervisor's
        self.dropped = 0
        self.conns: dict[socket.socket, wire.FrameReader] = {}
        self.listener = tcp_listener(addr)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, self._accept)
        self.set_children(children, generation=generation, evidence=evidence)

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def set_children(self, children: Sequence[str], *, generation: int, evidence: bool) -> None:
        self.children, self.generation, self.evidence = tuple(children), generation, evidence
        self.latest = {c: self.latest.get(c) or ChildLatest() for c in self.children}

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if len(self.conns) >= 2 * len(self.children) + 8:   # more than its children could open: not ours
            conn.close()
            return
        conn.setblocking(False)
        self.conns[conn] = wire.FrameReader(secret=self.secret, sender="child", on_drop=self._count_drop)
        self.sel.register(conn, selectors.EVENT_READ, self._reader(conn))

    def _reader(self, conn: socket.socket) -> Callable[[], None]:
        return lambda: self._read(conn)

    def _count_drop(self) -> None:
        self.dropped += 1

    def _read(self, conn: socket.socket) -> None:
        reader = self.conns.get(conn)
        if reader is None:
            return
        try:
            data = conn.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        try:
            lines = reader.lines(data)
        except wire.FrameError:
            self._close(conn)   # a flood without newlines: not a child of ours
            return
        for line in lines:
            frame = reader.verified(line)
            if frame is not None:
                self.take(*frame)

    def take(self, m: MessageKind, seq: int, body: dict[str, Any]) -> None:
        """One authenticated frame from a child: a heartbeat of one of its children, fresh, is kept."""
        node, agent = body.get("node"), body.get("agent")
        if m is not MessageKind.HB or not isinstance(node, str) or not isinstance(agent, str) or node not in self.latest:
            self.dropped += 1
            return
        if not self.guard.accept(f"{node}/{agent}", seq):
            self.dropped += 1
            return
        try:
            hb = messages.parse(m, body)
        except wire.FrameError:
            self.dropped += 1
            return
        assert isinstance(hb, messages.Heartbeat)
        self.latest[node].beat(agent, hb)

    def summaries(self) -> list[messages.RelaySummary]:
        """What to send now: nothing when no child was heard or refused since the last ones."""
        dropped, self.dropped = self.dropped, 0
        return [s for s in summarise(self.children, self.latest, evidence=self.evidence, dropped=dropped)
                if s.heard != "0" or s.changed or s.dropped]

    def _close(self, conn: socket.socket) -> None:
        self.conns.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        for conn in list(self.conns):
            self._close(conn)
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()


class ParentLink:
    """A child's connection to its relay. `send` never blocks: a frame that does not go in whole
    (the relay stopped reading, or is gone) ends the link, and the caller writes to stdout."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        host, _, port = addr.rpartition(":")
        self.sock: socket.socket | None = socket.create_connection((host.strip("[]"), int(port)),
                                                                   timeout=CONNECT_TIMEOUT_S)
        self.sock.setblocking(False)

    def send(self, frame: bytes) -> bool:
        if self.sock is None:
            return False
        try:
            if self.sock.send(frame) == len(frame):
                return True
        except OSError:
            pass
        self.close()   # a piece may have gone: the relay drops the unterminated rest with the connection
        return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    @property
    def up(self) -> bool:
        return self.sock is not None
