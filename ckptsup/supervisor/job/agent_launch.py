"""A launch's hop to the agents: the agents that outlived the last attempt (survivors, warm
spares) take the new spec as a `restart`; the nodes without a live agent get a new agent step (the
first launch also brings up the spares' agents, in standby and pre-warmed). With the memory tier,
every launched node's buddies and each rank's possible holders (`memory_peers`) go first, so the
restarted ranks can ask their agents for a peer's copy at once; they go again whenever an agent's
store reports a new address.

The loop builds the spec and the attempt's tracker; this sends. The order of the checks and the
sends is the loop's old one: whether a node has a live agent is asked as late as it matters (an
agent step may die at any moment; a failed send means it just died, and its step's EOF is the
next failure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from ... import console, messages
from ...config import SupervisorConfig
from .agent_set import AgentSet
from .memory_peers import MemoryPeers
from ..spec import LaunchSpec


class AgentLaunch:
    def __init__(self, *, agents: AgentSet, memory_peers: MemoryPeers | None, allocation: Sequence[str],
                 sup: SupervisorConfig, start_agents: Callable[[tuple[str, ...], Path], None]) -> None:
        self.agents = agents
        self.memory_peers = memory_peers   # None: the memory tier is off
        self.allocation = tuple(allocation)   # every node of the allocation (a peer may be any of them)
        self.sup = sup   # its nproc_per_node is a number by the first launch
        self.start_agents = start_agents   # the loop's: one new agent step on these nodes, with this spec

    def launch(self, nodes: tuple[str, ...], *, spares: Sequence[str], spec: LaunchSpec, spec_path: Path,
               attempt: int) -> list[str]:
        """Launch `attempt` on `nodes`; returns the nodes that had no live agent (a new step's)."""
        present = [n for n in nodes if self.agents.has_agent(n)]
        if self.memory_peers is not None:   # before the restart: the ranks ask their agents at once
            too_few = self.memory_peers.launch(nodes, int(self.sup.nproc_per_node))
            if too_few is not None:
                console.warning(f"ckptsup: {too_few}")
            self.send_memory_peers()
        if present:
            # the agents that outlived the failure take the new spec; a failed send means they just
            # died: their step's EOF is the next failure
            self.agents.send(messages.Restart(attempt=attempt, spec=spec.to_json()), nodes=present)
        missing = [n for n in nodes if n not in present]
        if missing:
            # the first launch brings up the spares' agents with the rest (standby, pre-warmed)
            start = [*missing, *(s for s in spares if not self.agents.has_agent(s))] if not present else missing
            self.start_agents(tuple(start), spec_path)
        return missing

    def peer_address(self, node: str, addr: object) -> None:
        """`node`'s memory store reported its replica address: every agent hears a new one."""
        if self.memory_peers is not None and self.memory_peers.on_peer(node, addr):
            self.send_memory_peers()

    def send_memory_peers(self) -> None:
        """Every launched node's buddies and sources (memory_peers.py), to the agents that are up."""
        assert self.memory_peers is not None
        alive = [n for n in self.allocation if self.agents.has_agent(n)]
        for node, body in self.memory_peers.commands(alive).items():
            if self.agents.has_agent(node):
                self.agents.send(body, nodes=[node])
