"""Issue 39 parts 1-2, the heartbeat tree: relays that summarise their children's heartbeats. The pure
parts (the plan, the summary's encoding, re-parenting, blame), the relay's real TCP listener and a
child's link with real frames, and the attempt tracker fed summaries. The dev-cluster run with a child's
and a relay's death is tests/test_supervisor_slurm_relays.py; the costs bench/bench_supervisor_scale.py
(BENCHMARKS.md §Scale, relays that summarise)."""

from __future__ import annotations

import math
import selectors
import socket
import time

import pytest

from ckptsup import messages, wire
from ckptsup.config import SupervisorConfig
from ckptsup.supervisor.job.agent_step import Message
from ckptsup.supervisor.job.attempt import AttemptTracker
from ckptsup.supervisor.job.detection import at_scale, relayed
from ckptsup.supervisor.job.observations import FailureKind
from ckptsup.supervisor.job.relays import RelayTree, Role, orphaned, plan, role
from ckptsup.supervisor.node.relay import ChildLatest, ParentLink, RelayHub, summarise
from ckptsup.wire import MessageKind

SECRET = b"r" * 32


def beat(node: str, *, agent: str = "a1", seq: int = 1, step: int = 5, pids: str = "0,10,10",
         stopped: tuple[int, ...] = (), evidence: str | None = "0,1.000,0,R,0,0.000", secret: bytes = SECRET) -> bytes:
    hb = messages.Heartbeat(ranks_alive=(0,), last_step=step, stopped_ranks=stopped, pids=pids, evidence=evidence)
    return messages.encode(hb, seq=seq, secret=secret, envelope={"node": node, "agent": agent})


# ---- the plan ----------------------------------------------------------------------------------
def test_small_jobs_keep_the_direct_path_and_large_ones_get_sqrt_n_relays():
    nodes = [f"n{i}" for i in range(16384)]
    assert plan(nodes[:2048], 2048) == {} and plan(nodes, 0) == {}
    groups = plan(nodes, 2048)
    assert len(groups) == 128 and all(len(c) == 127 for c in groups.values())
    assert list(groups)[0] == "n0" and groups["n0"][:2] == ("n1", "n2")   # contiguous blocks, the first relays
    covered = [r for r in groups] + [c for children in groups.values() for c in children]
    assert sorted(covered) == sorted(nodes)   # every node once
    odd = plan(nodes[:10], 2)   # ceil(sqrt(10)) = 4: blocks of 4, 4, 2
    assert odd == {"n0": ("n1", "n2", "n3"), "n4": ("n5", "n6", "n7"), "n8": ("n9",)}
    assert plan(nodes[:5], 2) == {"n0": ("n1", "n2"), "n3": ("n4",)}
    assert plan(nodes[:4], 3) == {"n0": ("n1",), "n2": ("n3",)}
    assert len(plan(nodes[:2049], 2048)) == math.ceil(2049 / 46)


def test_roles_and_which_relays_are_given_up():
    groups = {"n0": ("n1", "n2"), "n3": ("n4",)}
    parents = {"n1": "n0", "n2": "n0", "n4": "n3"}
    assert [role(n, groups, parents) for n in ("n0", "n1", "n5")] == [Role.RELAY, Role.CHILD, Role.DIRECT]
    # a silent child is not a reason to give up its relay; a silent relay is, once
    assert orphaned(groups, ["n1", "n2"], set()) == []
    assert orphaned(groups, ["n0", "n1", "n2"], set()) == ["n0"]
    assert orphaned(groups, ["n0"], {"n0"}) == []


def test_with_relays_the_beat_no_longer_slows_down_with_the_allocation():
    cfg = SupervisorConfig()
    assert relayed(cfg, 16384) and relayed(cfg, 2048) and not relayed(cfg, 1024)
    assert at_scale(cfg, 16384) is cfg   # 1 s beat, node_silence_s 5 s
    off = SupervisorConfig(relay_above_nodes=0)
    assert at_scale(off, 16384).heartbeat_interval_s == 8.0 and at_scale(off, 16384).node_silence_s == 24.0


# ---- the summary -------------------------------------------------------------------------------
def test_the_heard_bitmap_round_trips():
    names = [f"n{i}" for i in range(130)]
    flags = [i % 3 != 0 for i in range(130)]
    assert messages.unpack_heard(messages.pack_heard(flags), names) == [n for n, f in zip(names, flags) if f]
    assert messages.unpack_heard(messages.pack_heard([True] * 130), names) == names
    assert messages.unpack_heard(messages.pack_heard([False] * 3), names[:3]) == []


def test_a_summary_says_who_was_heard_and_only_what_changed():
    latest = {c: ChildLatest() for c in ("n1", "n2", "n3")}
    hb = messages.Heartbeat(ranks_alive=(0, 1), last_step=7, pids="0,5,5 1,6,6", evidence="0,1.000,0,R,0,0.000")
    latest["n1"].beat("a1", hb)
    latest["n3"].beat("a3", messages.Heartbeat(ranks_alive=(2,), last_step=9, pids="2,7,7"))
    [first] = summarise(("n1", "n2", "n3"), latest, evidence=False)
    assert first.heard_nodes() == ["n1", "n3"] and (first.low_step, first.high_step) == (7, 9)
    assert set(first.child_changes()) == {"n1", "n3"} and first.evidence is None
    agent, state = first.child_changes()["n1"]
    assert agent == "a1" and state.pids == "0,5,5 1,6,6" and state.ranks_alive == (0, 1)
    # the next beat: the same state is not sent again; a stopped rank or a new agent is
    latest["n1"].beat("a1", hb)
    latest["n3"].beat("a9", messages.Heartbeat(ranks_alive=(2,), last_step=10, pids="2,7,7"))
    [second] = summarise(("n1", "n2", "n3"), latest, evidence=True)
    assert second.heard_nodes() == ["n1", "n3"] and set(second.child_changes()) == {"n3"}
    assert second.evidence == {"n1": "0,1.000,0,R,0,0.000"}   # asked for: each heard child's latest
    latest["n1"].beat("a1", messages.Heartbeat(ranks_alive=(0, 1), last_step=8, pids="0,5,5 1,6,6", stopped_ranks=(1,)))
    [third] = summarise(("n1", "n2", "n3"), latest, evidence=False)
    assert third.heard_nodes() == ["n1"] and third.child_changes()["n1"][1].stopped_ranks == (1,)
    # the frame is a real one: typed at the supervisor's boundary
    m, _, body = wire.decode(messages.encode(third, seq=1, secret=SECRET), secret=SECRET)
    assert messages.parse(m, body) == third


def test_a_summary_too_large_for_one_frame_is_cut_into_several():
    children = tuple(f"n{i}" for i in range(200))
    latest = {c: ChildLatest() for c in children}
    for c in children:
        latest[c].beat("a", messages.Heartbeat(ranks_alive=tuple(range(8)), pids=" ".join(f"{r},1{r},2{r}" for r in range(8)),
                                               evidence="x" * 300))
    parts = summarise(children, latest, evidence=True, budget=20_000)
    assert len(parts) > 1
    assert [n for p in parts for n in p.children.split()] == list(children)
    assert [n for p in parts for n in p.heard_nodes()] == list(children)
    for part in parts:
        messages.encode(part, seq=1, secret=SECRET)   # each fits a frame


# ---- the relay's transport: a real listener, real frames ------------------------------------------
def pump(sel: selectors.BaseSelector, until, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until():
        for key, _ in sel.select(0.05):
            key.data()
    assert until()


def test_a_relay_takes_its_childrens_authenticated_frames_and_refuses_the_rest():
    sel = selectors.DefaultSelector()
    hub = RelayHub(addr="127.0.0.1", secret=SECRET, sel=sel, generation=1, children=("n1", "n2"), evidence=False)
    try:
        host, port = hub.address.rsplit(":", 1)
        assert host == "127.0.0.1" and hub.listener.getsockname()[0] != "0.0.0.0"
        link = ParentLink(hub.address)
        assert link.send(beat("n1", seq=3)) and link.send(beat("n2", agent="b", seq=1, step=4))
        assert link.send(beat("n1", seq=3))                          # a replay
        assert link.send(beat("n9", seq=4))                          # not its child
        assert link.send(beat("n2", agent="b", seq=2, secret=b"x" * 32))   # a forgery
        assert link.send(messages.encode(messages.Progress(rank=0, step=1), seq=9, secret=SECRET,
                                         envelope={"node": "n1", "agent": "a1"}))   # not a heartbeat
        pump(sel, lambda: hub.dropped >= 4)
        [summary] = hub.summaries()
        assert summary.heard_nodes() == ["n1", "n2"] and summary.dropped == 4
        assert summary.low_step == 4 and summary.high_step == 5
        assert hub.summaries() == []   # nothing heard since: nothing sent
        link.close()
    finally:
        hub.close()


def test_a_childs_link_fails_at_once_when_its_relay_is_gone():
    sel = selectors.DefaultSelector()
    hub = RelayHub(addr="127.0.0.1", secret=SECRET, sel=sel, generation=1, children=("n1",), evidence=False)
    link = ParentLink(hub.address)
    pump(sel, lambda: bool(hub.conns))
    hub.close()   # the relay's agent died: its connections closed
    deadline = time.monotonic() + 5
    while link.send(beat("n1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not link.up   # the caller writes to stdout from now on
    with pytest.raises(OSError):
        ParentLink(f"127.0.0.1:{_free_port()}")   # nothing listens: the child stays direct


def test_the_relay_listener_never_binds_every_address():
    with pytest.raises(ValueError):
        RelayHub(addr="0.0.0.0", secret=SECRET, sel=selectors.DefaultSelector(), generation=1, children=("n1",),
                 evidence=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the supervisor's side ---------------------------------------------------------------------
def tracker(nodes=("r0", "c1", "c2", "r3", "c4"), silence=5.0) -> AttemptTracker:
    return AttemptTracker(attempt=0, nodes=nodes, nproc_per_node=1, config=SupervisorConfig(node_silence_s=silence),
                          started=0.0)


def msg(node: str, body: messages.Body, recv: float, agent: str = "a") -> Message:
    return Message(recv=recv, m=body.KIND, body=body, step_id=1, node=node, agent=agent)


def summary(children: tuple[str, ...], heard: tuple[str, ...], **kw) -> messages.RelaySummary:
    return messages.RelaySummary(children=" ".join(children), heard=messages.pack_heard([c in heard for c in children]), **kw)


def test_a_silent_child_is_blamed_on_itself_while_its_relay_reports():
    t = tracker()
    for now in range(1, 9):
        for relay, children in (("r0", ("c1", "c2")), ("r3", ("c4",))):
            t.on_message(msg(relay, messages.Heartbeat(), now))
            alive = tuple(c for c in children if not (c == "c2" and now > 2))
            t.on_message(msg(relay, summary(children, alive), now))
    down = t.check(8.5)
    assert down is not None and down.kind is FailureKind.NODE_DOWN and down.node == "c2" and down.suspects == ("c2",)
    assert [n for n, _, _ in t.silent_past(8.5, 2.0)] == ["c2"]   # its slurmd is the one asked (silence_probe.py)


def test_a_relayed_childs_silence_is_judged_from_its_relays_window_start_never_later_than_node_silence():
    """A summary says a child was heard in the relay's last half beat, not when: taken at the window's
    start, a dead child is found node_silence_s after its last beat at most (<= 5 s at relayed scale),
    never node_silence_s plus the summary's half beat (BENCHMARKS.md §Relays that summarise)."""
    t = tracker()
    for now in (1.0, 1.5, 2.0, 2.5, 3.0):   # c2's last beat reached r0 in (2.5, 3.0]
        t.on_message(msg("r0", summary(("c1", "c2"), ("c1", "c2")), now))
    for now in (3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5):
        for relay, children in (("r0", ("c1", "c2")), ("r3", ("c4",))):
            t.on_message(msg(relay, messages.Heartbeat(), now))
            t.on_message(msg(relay, summary(children, tuple(c for c in children if c != "c2")), now))
        t.on_message(msg("c1", messages.Heartbeat(), now))
    assert t.node_views["c2"].last_heard == 2.5
    assert t.check(7.5) is None   # silent for node_silence_s exactly: not yet
    down = t.check(7.51)   # past 2.5 + 5: at most 5 s after its last beat, which came at 2.5 or later
    assert down is not None and down.kind is FailureKind.NODE_DOWN and down.node == "c2"


def test_a_summary_folds_in_a_childs_changes_and_its_evidence_only_when_sent():
    t = tracker()
    changed = {"c1": {"agent": "a", "ranks_alive": [0], "pids": "0,10,10", "stopped_ranks": [0]}}
    t.on_message(msg("r0", summary(("c1", "c2"), ("c1", "c2"), changed=changed), 1.0))
    assert t.node_pids["c1"] == {0: {"pid": 10, "host_pid": 10}} and "c1" in t.stopped_nodes
    assert t.node_views["c1"].ranks_alive == (0,) and "c1" not in t.node_evidence
    t.on_message(msg("r0", summary(("c1", "c2"), ("c1",), evidence={"c1": "0,1.000,0,R,0,0.000"}), 2.0))
    assert t.node_evidence["c1"].recent[-1] == (2.0, "0,1.000,0,R,0,0.000")
    # heard at the start of the relay's window (half a beat before its summary): the earliest it can have been
    assert t.node_views["c1"].last_heard == 1.5 and t.node_views["c2"].last_heard == 0.5


def test_a_replaced_agents_word_through_a_relay_is_not_taken():
    t = tracker()
    t.on_message(msg("c1", messages.Heartbeat(), 1.0, agent="new"))   # the node's current agent, heard directly
    stale = {"c1": {"agent": "old", "ranks_alive": [0], "pids": "0,99,99", "stopped_ranks": []}}
    t.on_message(msg("r0", summary(("c1",), ("c1",), changed=stale), 3.0))
    assert t.node_views["c1"].last_heard == 1.0 and "c1" not in t.node_pids


class Agents:
    def __init__(self) -> None:
        self.sent: list[tuple[messages.Body, list[str] | None]] = []

    def send(self, msg: messages.Body, *, nodes=None) -> bool:
        self.sent.append((msg, None if nodes is None else list(nodes)))
        return True


def test_the_tree_is_told_to_the_agents_and_a_silent_relays_children_go_direct_unblamed():
    t = tracker()
    tree, agents = RelayTree(above=2), Agents()
    tree.tick(0.0, t, agents, 2.0)   # 5 nodes: blocks of 3, the first relays
    assert tree.groups == {"r0": ("c1", "c2"), "r3": ("c4",)}
    assert [(m.children, nodes) for m, nodes in agents.sent] == [(("c1", "c2"), ["r0"]), (("c4",), ["r3"])]
    agents.sent.clear()
    tree.ready("r0", messages.RelayReady(generation=tree.generation, addr="10.0.0.1:4000"), agents)
    tree.ready("r3", messages.RelayReady(generation=tree.generation - 1, addr="10.0.0.3:4000"), agents)   # stale: ignored
    assert [(m.parent, nodes) for m, nodes in agents.sent] == [("10.0.0.1:4000", ["c1", "c2"])]
    assert tree.parent_of == {"c1": "r0", "c2": "r0"}
    agents.sent.clear()
    # r0 dies at 3: neither it nor (through it) its children are heard; r3 and c4 talk on
    for now in range(1, 7):
        t.on_message(msg("r3", messages.Heartbeat(), now))
        t.on_message(msg("r3", summary(("c4",), ("c4",)), now))
        if now <= 3:
            t.on_message(msg("r0", messages.Heartbeat(), now))
            t.on_message(msg("r0", summary(("c1", "c2"), ("c1", "c2")), now))
        tree.tick(now + 0.5, t, agents, 2.0)
        if now >= 4:   # after the re-parent the children write to stdout: heard directly
            for child in ("c1", "c2"):
                t.on_message(msg(child, messages.Heartbeat(), now + 0.6))
    assert tree.given_up == {"r0"}
    [(direct, nodes)] = agents.sent
    assert direct.parent is None and direct.children == () and nodes == ["c1", "c2"]
    down = t.check(9.0)
    assert down is not None and down.node == "r0" and down.suspects == ("r0",)   # the relay's node alone
    assert [n for n, _, _ in t.silent_past(7.0, 2.0)] == ["r0"]   # its slurmd is the one asked


def test_evidence_is_asked_of_the_relays_only_while_a_silence_is_judged():
    t = tracker()
    tree, agents = RelayTree(above=2), Agents()
    tree.tick(0.0, t, agents, 2.0)
    tree.ready("r0", messages.RelayReady(generation=1, addr="10.0.0.1:4000"), agents)
    agents.sent.clear()
    t.evidence_watched = True
    tree.tick(0.1, t, agents, 2.0)
    assert [(m.evidence, nodes) for m, nodes in agents.sent] == [(True, ["r0"])]
    agents.sent.clear()
    t.evidence_watched = False
    tree.tick(0.2, t, agents, 2.0)
    assert [(m.evidence, nodes) for m, nodes in agents.sent] == [(False, ["r0"])]


def test_a_new_node_set_gets_a_new_tree_and_who_left_it_goes_direct():
    tree, agents = RelayTree(above=2), Agents()
    tree.tick(0.0, tracker(), agents, 2.0)
    agents.sent.clear()
    tree.tick(1.0, tracker(("c1", "c2", "r3", "c4")), agents, 2.0)   # r0 excluded
    assert tree.generation == 2 and tree.groups == {"c1": ("c2",), "r3": ("c4",)}
    first, *rest = agents.sent
    assert first[0].children == () and first[0].parent is None and first[1] == ["r0"]
    assert [(m.children, n) for m, n in rest] == [(("c2",), ["c1"]), (("c4",), ["r3"])]
    small, agents2 = RelayTree(above=2048), Agents()
    small.tick(0.0, tracker(), agents2, 2.0)
    assert agents2.sent == [] and small.groups == {}   # every existing job: the direct path, no command


def test_a_suspicion_that_starts_with_the_childrens_evidence_at_their_relays_waits_for_it():
    """Relayed nodes' evidence comes only once a silence is judged: no rank is judged idle (hung)
    before its rates window could fill from the summaries."""
    t = tracker(nodes=("r0", "c1"))
    t.on_message(msg("r0", messages.Hello(rank=0), 0.5))
    t.on_message(msg("c1", messages.Hello(rank=1), 0.5))
    for now in (1.0, 2.0):
        t.on_message(msg("r0", messages.Step(rank=0, step=int(now)), now))
        t.on_message(msg("c1", messages.Step(rank=1, step=int(now)), now))
    for now in range(3, 14):
        t.on_message(msg("r0", messages.Heartbeat(evidence="0,1.000,0,S,0,0.000"), now))
        t.on_message(msg("r0", summary(("c1",), ("c1",)), now))
    assert t.check(14.0) is None and t.evidence_watched   # suspect: evidence asked of the relays, stacks first
    assert t.evidence_thin_until == 14.0 + 5.0
    t.asked_for_stacks(14.0, {"r0", "c1"})
    for now in range(14, 19):
        t.on_message(msg("r0", messages.StacksTaken(stacks=()), now)) if now == 14 else None
        t.on_message(msg("c1", messages.StacksTaken(stacks=()), now)) if now == 14 else None
        t.on_message(msg("r0", messages.Heartbeat(evidence="0,1.000,0,S,0,0.000"), now))
        t.on_message(msg("r0", summary(("c1",), ("c1",), evidence={"c1": "1,1.000,0,S,0,0.000"}), now))
        assert t.check(now + 0.5) is None   # the window is filling
    hang = t.check(19.5)
    assert hang is not None and hang.kind is FailureKind.HANG
