"""The memory tier's placement, supervisor side (docs/training.md §The memory tier): where each
agent's store takes replicas (its `memory_peer` note), each active node's buddy (the node its
ranks' bundles are replicated to), and, when a launch moves a rank to another node, which agents
may hold that rank's bundles. `memory_peers` commands carry both to every agent, before the
launch's ranks start. `buddies` and `ranks_of` are pure.

Failure domains: each node is its own (the dev cluster's nodes are); the ring pairs node i with
node i+1 of the launch, so a node and its buddy are never the same node. A node and its buddy
lost together leave no memory copy of the first one's ranks: the resume then falls back to disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

MAX_HOLDERS = 4   # nodes remembered per rank (its node and buddy over the last launches)


def buddies(nodes: Sequence[str]) -> dict[str, str | None]:
    """Each node's buddy: the next node of the launch, around the ring; none for a single node."""
    if len(nodes) < 2:
        return {n: None for n in nodes}
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)}


def ranks_of(nodes: Sequence[str], nproc_per_node: int) -> dict[str, list[int]]:
    """The static rendezvous's placement: node i runs ranks i·n … i·n + n − 1."""
    return {n: list(range(i * nproc_per_node, (i + 1) * nproc_per_node)) for i, n in enumerate(nodes)}


@dataclass
class MemoryPeers:
    addrs: dict[str, str] = field(default_factory=dict)          # node -> its store's replica address
    holders: dict[int, list[str]] = field(default_factory=dict)  # rank -> nodes that may hold its bundles
    layout: tuple[str, ...] = ()                                 # the launched nodes, in rank order
    nproc_per_node: int = 1
    replicated: dict[int, set[int]] = field(default_factory=dict)  # step -> ranks whose replica is stored

    def on_peer(self, node: str, addr: Any) -> bool:
        """A memory_peer note; True when the address is new (the peers need telling)."""
        if not isinstance(addr, str) or self.addrs.get(node) == addr:
            return False
        self.addrs[node] = addr
        return True

    def launch(self, nodes: Sequence[str], nproc_per_node: int) -> None:
        """A launch on `nodes`: every rank's holders gain the node that ran it and that node's buddy."""
        ring = buddies(self.layout)
        for node, ranks in ranks_of(self.layout, self.nproc_per_node).items():
            for rank in ranks:
                seen = [node, *([ring[node]] if ring.get(node) else []), *self.holders.get(rank, [])]
                self.holders[rank] = list(dict.fromkeys(seen))[:MAX_HOLDERS]
        self.layout, self.nproc_per_node = tuple(nodes), nproc_per_node
        self.replicated.clear()

    def commands(self, alive: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The memory_peers body for each launched node: its buddy's address, and for each of its
        ranks the live agents other than itself that may hold that rank."""
        live = set(alive)
        ring = buddies(self.layout)
        out: dict[str, dict[str, Any]] = {}
        for node, ranks in ranks_of(self.layout, self.nproc_per_node).items():
            buddy = ring.get(node)
            sources = {str(r): [self.addrs[h] for h in self.holders.get(r, []) if h != node and h in live and h in self.addrs]
                       for r in ranks}
            out[node] = {"buddy": self.addrs.get(buddy, "") if buddy else "",
                         "sources": {r: a for r, a in sources.items() if a}}
        return out

    def on_replicated(self, body: dict[str, Any], world_size: int) -> int | None:
        """A replica stored on a buddy; the step when every rank's replica of it is, else None."""
        step, rank = body.get("step"), body.get("rank")
        if type(step) is not int or type(rank) is not int or body.get("ok") is not True:
            return None
        ranks = self.replicated.setdefault(step, set())
        ranks.add(rank)
        if len(ranks) == world_size:
            for old in [s for s in self.replicated if s <= step]:
                del self.replicated[old]
            return step
        return None
