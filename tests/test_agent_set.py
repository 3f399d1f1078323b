"""The job's agents (supervisor/job/agent_set.py): which node's agent is live, which messages count,
how commands are addressed (a real spare's agent: tests/test_spare_agent.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptsup import messages
from ckptsup.supervisor.job.agent_set import AgentSet
from ckptsup.supervisor.job.agent_step import Message, StepSignal
from ckptsup.wire import MessageKind


@dataclass
class Sent:
    step_id: int
    nodes: tuple[str, ...]
    running: bool = True
    log: list[tuple[MessageKind, Any]] = field(default_factory=list)

    def send(self, msg, *, nodes=None) -> bool:
        self.log.append((msg.KIND, nodes))
        return self.running

    def alive(self) -> bool:
        return self.running

    closed_with: float | None = None

    def close(self, grace: float) -> int | None:
        self.closed_with = grace
        self.running = False
        return 0


def msg(step_id: int, node: str, m=MessageKind.HB) -> Message:
    return Message.received(recv=0.0, m=m, body={"node": node}, step_id=step_id)


def test_only_live_agents_of_current_steps_count():
    agents = AgentSet()
    big, own = Sent(1, ("n1", "n2", "n3")), Sent(2, ("n2",))
    agents.add(big)
    assert agents.current(msg(1, "n2")) and not agents.current(msg(9, "n2"))   # a replaced step's
    agents.add(own)   # n2's agent died and got a step of its own: the big step's n2 is stale
    assert agents.current(msg(2, "n2")) and not agents.current(msg(1, "n2"))
    agents.lose("n3")
    assert not agents.current(msg(1, "n3")) and not agents.has_agent("n3")
    assert agents.current(Message.received(recv=0.0, m=StepSignal.EOF, body={}, step_id=1))
    assert agents.ended(1) == ("n1",) and not agents.has_agent("n1") and agents.has_agent("n2")
    assert agents.ended(1) == ()


def test_commands_reach_exactly_the_agents_meant_one_frame_per_step():
    agents = AgentSet()
    big, own = Sent(1, ("n1", "n2", "n3")), Sent(2, ("n4",))
    agents.add(big)
    agents.add(own)
    assert agents.send(messages.Kill())
    assert big.log == [(MessageKind.KILL, None)] and own.log == [(MessageKind.KILL, None)]
    assert agents.send(messages.Restart(attempt=1), nodes=["n1", "n3", "n4"])
    assert big.log[-1] == (MessageKind.RESTART, ["n1", "n3"]) and own.log[-1] == (MessageKind.RESTART, None)
    agents.lose("n2")
    agents.send(messages.SetInterval())
    assert big.log[-1] == (MessageKind.SET_INTERVAL, ["n1", "n3"])   # not to the agent we let go
    assert not agents.send(messages.Kill(), nodes=["n9"])   # nobody there to hear it
    own.running = False
    assert not agents.send(messages.Kill()) and agents.alive() and not agents.has_agent("n4")
    agents.close(0)
    assert not agents.alive() and not big.running


def test_a_node_lost_while_its_step_runs_is_kept_for_the_jobs_end_once():
    """step_completion.py: Slurm finishes a step that lost a node a minute late; the job's end waits for it."""
    agents = AgentSet()
    big, own = Sent(1, ("n1", "n2", "n3")), Sent(2, ("n4",))
    agents.add(big)
    agents.add(own)
    agents.lose("n3")
    agents.lose("n3")          # told twice: still one
    agents.lose("n9")          # never had an agent: nothing to wait for
    own.running = False        # n4's own step has ended already: nothing of it left in Slurm to wait for
    agents.lose("n4")
    assert agents.take_lost() == {"n3": 3} and agents.take_lost() == {}


def test_close_tells_every_agent_to_exit_before_waiting_for_any_srun_within_one_grace():
    agents = AgentSet()
    steps = [Sent(1, ("n1", "n2")), Sent(2, ("n3",)), Sent(3, ("n4",))]
    for step in steps:
        agents.add(step)
    now = [0.0]

    def clock() -> float:
        now[0] += 4.0        # each close takes 4 s of the 10 s grace
        return now[0]

    agents.close(10.0, clock=clock)
    assert all(step.log == [(MessageKind.EXIT, None)] for step in steps)
    assert [step.closed_with for step in steps] == [6.0, 2.0, 0.0]
    assert not agents.alive() and agents.steps == {}
