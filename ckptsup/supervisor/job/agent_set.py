"""The job's agents as the loop sees them: which steps run them, and which node's agent is live.

Inside Slurm one srun step, started with the first launch, runs an agent on every usable node —
spares too, in standby (agent.py) — with `--no-kill`: a node's death ends only that node's task,
so the other agents, their warm interpreters and whatever they hold outlive it, and a node-path
restart is a `restart` command to the agents of the new node set. A node whose agent is gone
while the node is still wanted gets a step of its own (`srun -N1 -w NODE`). One srun client for
the whole job keeps the batch host's cost flat with the node count (BENCHMARKS.md §Supervisor
cost: one client per node would cost ~4 MB of memory each). Local mode: one step, one agent.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from ... import messages
from ...messages import Body
from .agent_step import Message, StepSignal


class Step(Protocol):
    """What the set needs of one running step of agents (agent_step.AgentStep; a fake in tests)."""

    step_id: int
    nodes: tuple[str, ...]

    def send(self, msg: Body, *, nodes: Sequence[str] | None = None) -> bool: ...
    def alive(self) -> bool: ...
    def close(self, grace: float) -> int | None: ...


StepFactory = Callable[..., Step]   # keywords: argv, env, nodes, secret, sender, inbox, log_path


class AgentSet:
    def __init__(self) -> None:
        self.steps: dict[int, Step] = {}
        self.node_step: dict[str, int] = {}   # node -> the step whose agent there is live
        # node -> the node count of the step it was lost under: Slurm finishes that step only after
        # a minute's wait for the node's report (step_completion.py)
        self.lost_under_step: dict[str, int] = {}

    def add(self, step: Step) -> None:
        self.steps[step.step_id] = step
        for node in step.nodes:
            self.node_step[node] = step.step_id

    def current(self, msg: Message) -> bool:
        """A message from a live agent of ours (not a replaced step's, not a lost node's)."""
        if msg.m is StepSignal.EOF:
            return msg.step_id in self.steps
        return self.node_step.get(msg.node) == msg.step_id

    def started(self, step_id: int) -> float | None:
        """When the step's srun started (monotonic); None for a step gone or one that does not say."""
        return getattr(self.steps.get(step_id), "started", None)

    def has_agent(self, node: str) -> bool:
        step = self.steps.get(self.node_step.get(node, -1))
        return step is not None and step.alive()

    def ended(self, step_id: int) -> tuple[str, ...]:
        """A step's output closed: every agent of it is gone. Returns the nodes that lost theirs."""
        step = self.steps.pop(step_id, None)
        if step is None:
            return ()
        lost = tuple(n for n in step.nodes if self.node_step.get(n) == step_id)
        for node in lost:
            del self.node_step[node]
        return lost

    def lose(self, node: str) -> None:
        """`node`'s agent is dead or was told to exit: nothing it says counts any more. A node lost
        while its step runs is remembered for the job's end (take_lost)."""
        step = self.steps.get(self.node_step.pop(node, -1))
        if step is not None and step.alive():
            self.lost_under_step[node] = len(step.nodes)

    def take_lost(self) -> dict[str, int]:
        """The nodes lost under a running step since the last call, with their step's node count."""
        lost, self.lost_under_step = self.lost_under_step, {}
        return lost

    def alive(self) -> bool:
        return any(self.has_agent(n) for n in self.node_step)

    def send(self, msg: Body, *, nodes: Sequence[str] | None = None) -> bool:
        """Send the command `msg` to the agents of `nodes` (None: every live agent); False if a
        step's pipe is gone. Each step gets one frame, addressed when it reaches more agents than meant."""
        targets = list(self.node_step) if nodes is None else [n for n in nodes if n in self.node_step]
        by_step: dict[int, list[str]] = {}
        for node in targets:
            by_step.setdefault(self.node_step[node], []).append(node)
        ok = bool(by_step)
        for step_id, wanted in by_step.items():
            step = self.steps[step_id]
            ok = step.send(msg, nodes=None if set(wanted) == set(step.nodes) else wanted) and ok
        return ok

    def close(self, grace: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Every agent told to exit at once, then each step's srun given what is left of `grace` to
        end on its own (a killed srun has slurmstepd kill its tasks: step_completion.py)."""
        steps = list(self.steps.values())
        for step in steps:
            step.send(messages.Exit())
        deadline = clock() + grace
        for step in steps:
            step.close(max(0.0, deadline - clock()))
        self.steps.clear()
        self.node_step.clear()
