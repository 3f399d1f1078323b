"""The memory tier's placement, supervisor side (docs/training.md §The memory tier): where each
agent's store takes replicas (its `memory_peer` note), each active node's buddies (the nodes its
ranks' bundles are replicated to), and, when a launch moves a rank to another node, which agents
may hold that rank's bundles. `memory_peers` commands carry both to every agent, before the
launch's ranks start. `domain_of`, `buddies`, `shortfall` and `ranks_of` are pure.

Failure domains: `[memory] domain_pattern` names a node's domain from its name (a rack, an NVLink
domain); without one each node is its own (the dev cluster's nodes are). A node's buddies are in
other domains than its own, in distinct ones while there are enough; with one replica and no
pattern they are the ring: node i's buddy is node i+1 of the launch. A node lost together with
all its buddies leaves no memory copy of its ranks: the resume then falls back to disk.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from ...config import MAX_REPLICAS
from ... import messages

MAX_HOLDERS = 2 * (1 + MAX_REPLICAS)   # nodes remembered per rank: its node and buddies over the last two launches

Domain = Callable[[str], str]   # node name -> its failure domain's name


def domain_of(node: str, pattern: str = "") -> str:
    """The node's failure domain: what `pattern`, searched in its name, captures in its group (or
    matches, without one); the node itself without a pattern, or when it matches nothing."""
    found = re.search(pattern, node) if pattern else None
    name = (found.group(1) if found.re.groups else found.group(0)) if found else None
    return name or node   # an empty or unset group says no more than no match


def buddies(nodes: Sequence[str], replicas: int = 1, domain: Domain = domain_of) -> dict[str, list[str]]:
    """Each node's buddies, up to `replicas`: the domains after its own around the ring of domains
    (in the order their first node comes in the launch), one node of each in turn, then a second
    round over them when there are fewer domains than replicas; none in its own domain. A domain's
    nodes take their turns round robin, so its nodes hold about as many replicas each."""
    members: dict[str, list[str]] = {}
    for node in nodes:
        members.setdefault(domain(node), []).append(node)
    order = list(members)
    place = {d: i for i, d in enumerate(order)}
    turn = dict.fromkeys(order, 0)
    out: dict[str, list[str]] = {}
    for node in nodes:
        own = domain(node)
        want = min(replicas, len(nodes) - len(members[own]))
        picked: list[str] = []
        while len(picked) < want:   # each round picks one more at least: `want` counts the nodes there are
            for k in range(1, len(order)):
                other = order[(place[own] + k) % len(order)]
                pick = _next_turn(members[other], turn, other, picked)
                if pick is not None:
                    picked.append(pick)
                if len(picked) == want:
                    break
        out[node] = picked
    return out


def _next_turn(nodes: list[str], turn: dict[str, int], name: str, taken: list[str]) -> str | None:
    """The domain's next node in its round robin that is not already taken, else None."""
    for _ in nodes:
        node = nodes[turn[name] % len(nodes)]
        turn[name] += 1
        if node not in taken:
            return node
    return None


def shortfall(placed: Mapping[str, list[str]], replicas: int, domain: Domain = domain_of) -> str | None:
    """One line when a launch's domains cannot give every node `replicas` buddies in distinct
    other domains, else None."""
    if len(placed) < 2:
        return None   # a single node has no peer to ask for: nothing a site could fix, no warning
    short = [n for n, b in placed.items() if len(b) < replicas]
    shared = [n for n, b in placed.items() if len({domain(x) for x in b}) < len(b)]
    if not short and not shared:
        return None
    problems = []
    if short:
        fewest = min(len(placed[n]) for n in short)
        problems.append(f"{len(short)} node(s) get only {fewest} buddy node(s) in other domains")
    if shared:
        problems.append(f"{len(shared)} node(s) have buddies that share a domain")
    domains = len({domain(n) for n in placed})
    return (f"[memory] replicas = {replicas}, but the launch's {len(placed)} node(s) are in {domains} failure "
            f"domain(s): {'; '.join(problems)}; losing a node with its buddies sends its ranks to disk")


def ranks_of(nodes: Sequence[str], nproc_per_node: int) -> dict[str, list[int]]:
    """The static rendezvous's placement: node i runs ranks i·n … i·n + n − 1."""
    return {n: list(range(i * nproc_per_node, (i + 1) * nproc_per_node)) for i, n in enumerate(nodes)}


@dataclass
class MemoryPeers:
    replicas: int = 1                                            # [memory] replicas
    domain_pattern: str = ""                                     # [memory] domain_pattern
    addrs: dict[str, str] = field(default_factory=dict)          # node -> its store's replica address
    holders: dict[int, list[str]] = field(default_factory=dict)  # rank -> nodes that may hold its bundles
    layout: tuple[str, ...] = ()                                 # the launched nodes, in rank order
    nproc_per_node: int = 1
    placed: dict[str, list[str]] = field(default_factory=dict)   # the launched nodes' buddies
    replicated: dict[int, dict[int, set[str]]] = field(default_factory=dict)  # step -> rank -> buddy addresses storing it
    full: dict[int, set[int]] = field(default_factory=dict)      # step -> ranks with all their replicas stored

    def on_peer(self, node: str, addr: Any) -> bool:
        """A memory_peer note; True when the address is new (the peers need telling)."""
        if not isinstance(addr, str) or self.addrs.get(node) == addr:
            return False
        self.addrs[node] = addr
        return True

    def launch(self, nodes: Sequence[str], nproc_per_node: int) -> str | None:
        """A launch on `nodes`: every rank's holders gain the node that ran it and that node's
        buddies. The one-line warning when the new launch's domains are too few, else None."""
        for node, ranks in ranks_of(self.layout, self.nproc_per_node).items():
            for rank in ranks:
                seen = [node, *self.placed.get(node, []), *self.holders.get(rank, [])]
                self.holders[rank] = list(dict.fromkeys(seen))[:MAX_HOLDERS]
        self.layout, self.nproc_per_node = tuple(nodes), nproc_per_node
        domain = functools.partial(domain_of, pattern=self.domain_pattern)
        self.placed = buddies(self.layout, self.replicas, domain)
        self.replicated.clear()
        self.full.clear()
        return shortfall(self.placed, self.replicas, domain)

    def commands(self, alive: Iterable[str]) -> dict[str, messages.MemoryPeers]:
        """The memory_peers body for each launched node: its buddies' addresses (those known), and
        for each of its ranks the live agents other than itself that may hold that rank."""
        live = set(alive)
        out: dict[str, messages.MemoryPeers] = {}
        for node, ranks in ranks_of(self.layout, self.nproc_per_node).items():
            sources = {str(r): [self.addrs[h] for h in self.holders.get(r, []) if h != node and h in live and h in self.addrs]
                       for r in ranks}
            out[node] = messages.MemoryPeers(buddies=tuple(self._buddy_addrs(node)), sources={r: a for r, a in sources.items() if a})
        return out

    def _buddy_addrs(self, node: str) -> list[str]:
        return [self.addrs[b] for b in self.placed.get(node, []) if b in self.addrs]

    def on_replicated(self, body: messages.MemoryReplicated, world_size: int) -> int | None:
        """A replica stored on a buddy; the step once every rank has one on each of its node's
        buddies (min(replicas, the buddies its domains allow)), else None."""
        step, rank, buddy = body.step, body.rank, body.buddy
        if step is None or rank is None or body.ok is not True or buddy is None:
            return None
        index = rank // max(self.nproc_per_node, 1)
        if not 0 <= index < len(self.layout):
            return None
        wanted = self._buddy_addrs(self.layout[index])
        if buddy not in wanted:   # a buddy of an earlier launch, or an address since replaced
            return None
        stored = self.replicated.setdefault(step, {}).setdefault(rank, set())
        stored.add(buddy)
        if len(stored) == len(wanted):
            full = self.full.setdefault(step, set())
            full.add(rank)
            if len(full) == world_size:
                for old in [s for s in self.replicated if s <= step]:
                    del self.replicated[old]
                    self.full.pop(old, None)
                return step
        return None

    def replicated_event(self, node: str, note: messages.MemoryReplicated, world_size: int) -> dict[str, Any] | None:
        """The memory_replicated event's fields for `node`'s replica note: every failed replica
        (ok=False, with its reason), and a step once every rank's replicas are stored; else None."""
        if note.ok is not True:
            return dict(ok=False, node=node, step=note.step, rank=note.rank, buddy=note.buddy,
                        reason=(note.reason or "")[:300])
        step = self.on_replicated(note, world_size)
        return None if step is None else dict(ok=True, step=step, ranks=world_size)
