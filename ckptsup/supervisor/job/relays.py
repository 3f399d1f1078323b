"""The heartbeat tree, the supervisor's side (docs/architecture.md §A heartbeat's path at 16,384 nodes).

Past [supervisor] relay_above_nodes an attempt's nodes are cut into contiguous blocks of ~√N; the
first node of each block is its relay, the others its children (`plan`). A relay is an ordinary
agent with one more duty (supervisor/node/relay.py): it takes its children's heartbeats over TCP and
sends one `relay_summary` a beat, so the supervisor folds in N/√N = √N frames a beat plus what
changed (AttemptTracker._on_relay_summary), not N.

The steps, each a `relay` command (the node's whole place in the tree for a generation):
  1. a new attempt's node set: each relay is told its children; it answers `relay_ready` with its
     listener's host:port (RelayTree.ready);
  2. then that relay's children are told to send it their heartbeats (until then, and whenever
     their link fails, they write to stdout: the direct path);
  3. a relay silent for SUSPECT_BEATS beats while others talk (`orphaned`): its children are told
     to write to stdout again and are excused the silence their relay caused
     (AttemptTracker.excuse) — the relay's own silence stays its own node's (silence_probe.py,
     detection.detect_node_down), and a child's silence its own, as before;
  4. while a silence is judged (the tracker watches the evidence), relays are asked to carry their
     children's evidence in their summaries; afterwards, not.
Decisions are pure functions; `RelayTree` carries them out through the AgentSet.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ... import console, messages


class Role(enum.StrEnum):
    DIRECT = "direct"   # heartbeats on stdout (every node of a job at or below the threshold)
    RELAY = "relay"     # takes its children's heartbeats; its own on stdout
    CHILD = "child"     # heartbeats to its relay


def plan(nodes: Sequence[str], above: int) -> dict[str, tuple[str, ...]]:
    """relay -> its children: contiguous blocks of ceil(√N) nodes, the first of each the relay.
    Empty (everyone direct) at or below `above` nodes, or when `above` is 0 (relays off). A block of
    one has no relay."""
    if above <= 0 or len(nodes) <= above:
        return {}
    size = math.ceil(math.sqrt(len(nodes)))
    blocks = [tuple(nodes[i:i + size]) for i in range(0, len(nodes), size)]
    return {block[0]: block[1:] for block in blocks if len(block) > 1}


def role(node: str, groups: dict[str, tuple[str, ...]], parent_of: dict[str, str]) -> Role:
    if node in groups:
        return Role.RELAY
    return Role.CHILD if node in parent_of else Role.DIRECT


def orphaned(groups: dict[str, tuple[str, ...]], silent: Sequence[str], given_up: set[str]) -> list[str]:
    """The relays to give up: silent ones (already past the suspect threshold while others talk)
    not given up yet. Their children go direct; the relay is judged like any silent node."""
    return [node for node in silent if node in groups and node not in given_up]


class Tracker(Protocol):
    """What RelayTree reads of the attempt (attempt.AttemptTracker)."""

    nodes: tuple[str, ...]
    evidence_watched: bool

    def silent_past(self, now: float, after_s: float) -> list[tuple[str, float, float]]: ...
    def excuse(self, nodes: Sequence[str], now: float) -> None: ...


class Agents(Protocol):
    def send(self, msg: messages.Body, *, nodes: Sequence[str] | None = None) -> bool: ...


@dataclass
class RelayTree:
    above: int                                             # [supervisor] relay_above_nodes
    generation: int = 0
    nodes: tuple[str, ...] = ()                            # the node set the plan is for
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ready_at: dict[str, str] = field(default_factory=dict)   # relay -> its listener (this generation)
    given_up: set[str] = field(default_factory=set)        # relays found silent: their children went direct
    evidence: bool = False

    @property
    def parent_of(self) -> dict[str, str]:
        return {c: r for r, children in self.groups.items() if r in self.ready_at and r not in self.given_up
                for c in children}

    def tick(self, now: float, tracker: Tracker, agents: Agents, suspect_s: float) -> None:
        """Once a loop tick: a new plan for a new node set, evidence asked for while a silence is
        judged, the children of silent relays sent direct."""
        if tracker.nodes is not self.nodes and tracker.nodes != self.nodes:   # a tick's cost: no 16,384-name compare
            self._replan(tracker.nodes, agents)
        if not self.groups:
            return
        if tracker.evidence_watched != self.evidence:
            self.evidence = tracker.evidence_watched
            for relay in self.ready_at:
                if relay not in self.given_up:
                    agents.send(self._relay_role(relay), nodes=[relay])
        silent = [node for node, _, _ in tracker.silent_past(now, suspect_s)]
        for relay in orphaned(self.groups, silent, self.given_up):
            self.given_up.add(relay)
            children = self.groups[relay]
            agents.send(messages.Relay(generation=self.generation), nodes=list(children))
            tracker.excuse(children, now)
            console.warning(f"ckptsup: heartbeat relay {relay} is silent: its {len(children)} children report "
                            f"straight to the supervisor again; {relay} is judged alone")

    def ready(self, node: str, body: messages.RelayReady, agents: Agents) -> None:
        """A relay's listener is up: its children send it their heartbeats from now on."""
        if body.generation != self.generation or node not in self.groups or node in self.given_up:
            return
        if body.addr is None:
            self.given_up.add(node)   # it could not listen: its children stay direct
            return
        self.ready_at[node] = body.addr
        agents.send(messages.Relay(generation=self.generation, parent=body.addr), nodes=list(self.groups[node]))

    def _relay_role(self, relay: str) -> messages.Relay:
        return messages.Relay(generation=self.generation, children=self.groups[relay], evidence=self.evidence)

    def _replan(self, nodes: tuple[str, ...], agents: Agents) -> None:
        old = set(self.groups) | {c for children in self.groups.values() for c in children}
        self.generation += 1
        self.nodes, self.groups = nodes, plan(nodes, self.above)   # the tracker's own tuple: `is` from now on
        self.ready_at, self.given_up, self.evidence = {}, set(), False
        # who had a place in the old tree and has none in the new one goes direct (a new relay's
        # children move when it is ready; until then their old link or stdout)
        new = set(self.groups) | {c for children in self.groups.values() for c in children}
        if old - new:
            agents.send(messages.Relay(generation=self.generation), nodes=sorted(old - new))
        for relay in self.groups:
            agents.send(self._relay_role(relay), nodes=[relay])
        if self.groups:
            console.info(f"ckptsup: {len(nodes)} nodes: heartbeats through {len(self.groups)} relays "
                         f"(supervisor.relay_above_nodes = {self.above})")
