"""The kill window: the commands that end an attempt's ranks, each followed by a bounded wait for
the agents' answers (docs/architecture.md §Every wait has an end) — `dump_fr` before a hung
attempt's kill, `stop_at` before a stop's kill, and the `kill` itself, whose acks double as a
liveness probe of every agent. `KillWindow.kill` is the one owner of the kill and its acks: every
kill the supervisor sends goes through it.

What is decided is pure (`ack_window_s`, `silent_nodes`, `flight_recorder_kept`); the sends and
the waits are the loop's (its AgentSet and its `_await`, which folds every message met on the way
into the attempt's view), handed in at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from ... import messages
from ...config import NcclConfig, SupervisorConfig
from ...events import Event
from .agent_set import AgentSet
from .agent_step import Message
from .attempt import AttemptTracker
from .observations import Failure, FailureKind
from .placement import Placement

KILL_ACK_S = 0.3        # live agents ack a kill in tens of ms; then the silent nodes' slurmd is asked
SLURMD_PROBE_S = 0.5    # a slurmd that does not accept a connection in this long: its node is dead
DUMP_WAIT_S = 2.0       # ranks' hooks thread writes the flight recorder; we do not wait longer than this
SURVIVOR_KEYS = ("rank", "pid", "host_pid", "wchan", "stack")   # what a `report` ack names of each process


class Await(Protocol):
    """The loop's wait (Supervisor._await): messages until `done` accepts one, `until()` holds or
    `deadline` (clock) passes."""

    def __call__(self, done: Callable[[Message], bool], deadline: float,
                 until: Callable[[], bool] = ...) -> bool: ...


@dataclass(kw_only=True)
class KillAcks:
    """What a kill's ack window found (KillWindow.kill)."""

    unacked: set[str]                                   # nodes whose agent has not acked
    unreachable: set[str] = field(default_factory=set)  # of them, those whose slurmd did not answer either
    survivors: list[dict[str, Any]] = field(default_factory=list)   # rank processes named by `report` acks


def ack_window_s(sup: SupervisorConfig) -> float:
    """How long a kill's acks are waited for: a live agent acks in tens of ms, but a loaded one
    misses a beat or two; never longer than the silence that declares its node down."""
    return min(sup.node_silence_s, max(2.0, 3 * sup.heartbeat_interval_s))


def silent_nodes(acks: KillAcks | None, active: Sequence[str]) -> tuple[list[str], list[str]]:
    """An attempt's kill read as a liveness probe: the nodes whose agent neither acked nor spoke,
    and those of them whose slurmd did not answer either. Nobody when no kill was sent or no agent
    answered: then the supervisor's own link is the suspect, not every node. Pure."""
    if acks is None or len(acks.unacked) == len(active):
        return [], []
    return sorted(acks.unacked), sorted(acks.unreachable & acks.unacked)


def flight_recorder_kept(nccl: NcclConfig, gpus_per_node: int) -> bool:
    """Whether hung ranks have a flight recorder to dump: NCCL keeps one (when configured to);
    gloo on CPU does not, so without GPUs there is nothing to wait for. Pure."""
    return bool(nccl.dump_on_timeout and nccl.flight_recorder_entries > 0 and gpus_per_node > 0)


class KillWindow:
    """The loop's kills, stops and flight-recorder dumps, with their bounded waits."""

    def __init__(self, *, agents: AgentSet, await_answers: Await, clock: Callable[[], float],
                 sup: SupervisorConfig, nccl: NcclConfig, placement: Placement) -> None:
        self.agents = agents
        self.await_answers = await_answers
        self.clock = clock
        self.sup = sup
        self.nccl = nccl
        self.placement = placement             # in_slurm, gpus_per_node; slurmd_down asked at call time
        self.torchrun_pids: set[int] = set()   # local mode: launchers to reap if the agent dies

    def kill(self, send_to: Sequence[str], *, wait_for: Sequence[str], report: bool = False,
             probe: bool = False) -> KillAcks | None:
        """`kill` to the agents of `send_to`, then the acks of `wait_for` within the ack window
        (`ack_window_s`), with the survivors each names when `report`. With `probe`, the nodes
        still silent KILL_ACK_S after the kill have their slurmd asked and an unanswering one is not
        waited for. None when no kill could be sent (the agents are gone: their orphans are killed
        here instead)."""
        agents = self.agents
        acks = KillAcks(unacked=set(wait_for))
        if not agents.alive() or not agents.send(messages.Kill(grace=0, report=report), nodes=list(send_to)):
            self.kill_orphans()
            return None

        def acked(msg: Message) -> bool:
            if isinstance(msg.body, messages.Killed) and msg.node in acks.unacked:
                acks.unacked.discard(msg.node)
                acks.survivors += [{"node": msg.node, **{k: entry[k] for k in SURVIVOR_KEYS if k in entry}}
                                   for entry in msg.body.survivors or ()]
            return False

        def gone() -> bool:
            return not any(agents.has_agent(n) for n in acks.unacked - acks.unreachable)

        deadline = self.clock() + ack_window_s(self.sup)
        if probe:
            self.await_answers(acked, min(self.clock() + KILL_ACK_S, deadline), until=gone)
            if acks.unacked and not gone():
                acks.unreachable = self.placement.slurmd_down(sorted(acks.unacked), SLURMD_PROBE_S)
        self.await_answers(acked, deadline, until=gone)
        return acks

    def kill_attempt(self, active: Sequence[str], failure: Failure) -> tuple[list[str], list[str]]:
        """SIGKILL every rank of the attempt; the acks double as a liveness probe: returns the nodes
        whose agent neither acked nor spoke (a rank's crash is often the first symptom of a dead
        peer node), and those of them whose slurmd did not answer either. Live agents ack within
        tens of milliseconds; a silent node whose slurmd does not answer is dead now — no wait for
        an ack that cannot come (it cost the node path 2 s); one whose slurmd answers may just be
        slow and gets the whole window (`kill`)."""
        dead = {failure.node} if failure.kind is FailureKind.NODE_DOWN else set()
        acks = self.kill(active, wait_for=[n for n in active if n not in dead], probe=True)
        return silent_nodes(acks, active)

    def kill_orphans(self) -> None:
        """Local mode, agent gone: its torchrun (own session) and ranks would live on. Slurm
        cleans a step's processes itself; here the supervisor kills the trees it was told of."""
        if self.placement.in_slurm:
            return
        from ..processes import terminate

        for pid in self.torchrun_pids:
            terminate(pid, 0)
        self.torchrun_pids.clear()

    def dump_flight_recorder(self, path: Callable[[], Path], ranks: Iterable[int]) -> None:
        """Before killing hung ranks, ask their hooks thread to dump the flight recorder into
        `path()` (called only when there is one to dump: it makes the attempt's directory). Waits
        for every rank's `fr_dumped` or DUMP_WAIT_S, whichever comes first."""
        if not flight_recorder_kept(self.nccl, self.placement.gpus_per_node):
            return
        self.agents.send(messages.DumpFr(path=str(path())))
        waiting = set(ranks)

        def dumped(msg: Message) -> bool:
            record = msg.body.record if isinstance(msg.body, messages.EventRecord) else None
            if record is not None and record.get("event") == Event.FR_DUMPED:
                waiting.discard(record.get("rank"))
            return False

        self.await_answers(dumped, self.clock() + DUMP_WAIT_S, until=lambda: not waiting)

    def stop_ranks(self, *, active: Sequence[str], tracker: AttemptTracker | None, reason: str, save: bool,
                   budget_s: float) -> int | None:
        """Ask the ranks to agree on a stop step (and save if `save`); wait (bounded) for every
        node's torchrun to exit; then kill what is left. Returns the last step the nodes saw."""
        agents = self.agents
        last = tracker.last_step if tracker is not None else None
        if not agents.alive():
            return last
        agents.send(messages.StopAt(reason=reason, save=save, budget_s=budget_s))
        waiting = set(active) - (tracker.done_nodes if tracker else set())
        steps = [last] if last is not None else []

        def exited(msg: Message) -> bool:
            if isinstance(msg.body, messages.TorchrunExit):
                waiting.discard(msg.node)
                if msg.body.step is not None:
                    steps.append(msg.body.step)
            return False

        self.await_answers(exited, self.clock() + budget_s + self.sup.kill_grace_s,
                           until=lambda: not waiting or not any(agents.has_agent(n) for n in waiting))
        agents.send(messages.Kill(grace=0))
        return max(steps) if steps else None
