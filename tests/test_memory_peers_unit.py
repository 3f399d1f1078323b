"""The memory tier's placement (supervisor/job/memory_peers.py), pure: failure domains from node names,
buddies in other domains, the warning when the domains are too few, the holders a node path
launch leaves, and when a step counts as replicated."""

from __future__ import annotations

import functools

import pytest

from ckptsup.messages import MemoryReplicated

from ckptsup.supervisor.job.memory_peers import MAX_HOLDERS, MemoryPeers, buddies, domain_of, shortfall

RACKS = r"^(rack\d+)-"


def by(pattern: str):
    return functools.partial(domain_of, pattern=pattern)


@pytest.mark.parametrize("node, pattern, domain", [
    ("rack3-n07", RACKS, "rack3"),                 # the group
    ("nvl12gpu4", r"^nvl\d+", "nvl12"),            # no group: the whole match
    ("gpu-a-17", r"-(\w)-", "a"),                  # searched, not anchored
    ("login1", RACKS, "login1"),                   # no match: a domain of its own
    ("rack3-n07", "", "rack3-n07"),                # no pattern: every node its own domain
    ("n1", r"^(x)?", "n1"),                        # a group that took no part, or an empty match, says nothing
])
def test_a_nodes_domain_comes_from_its_name(node: str, pattern: str, domain: str) -> None:
    assert domain_of(node, pattern) == domain


def test_without_a_pattern_one_replica_is_the_ring() -> None:
    nodes = [f"n{i}" for i in range(5)]
    assert buddies(nodes) == {n: [nodes[(i + 1) % 5]] for i, n in enumerate(nodes)}
    assert buddies(nodes, replicas=1, domain=by("")) == buddies(nodes)
    assert buddies(["n0", "n1"]) == {"n0": ["n1"], "n1": ["n0"]}
    assert buddies(["solo"]) == {"solo": []}


@pytest.mark.parametrize("replicas", [0, 1, 2, 3])
def test_each_node_gets_its_replicas_around_the_ring(replicas: int) -> None:
    nodes = [f"n{i}" for i in range(5)]
    placed = buddies(nodes, replicas)
    assert placed == {n: [nodes[(i + k) % 5] for k in range(1, replicas + 1)] for i, n in enumerate(nodes)}
    assert shortfall(placed, replicas) is None


def test_buddies_are_in_other_domains_and_shared_out_within_a_domain() -> None:
    nodes = ["rack1-a", "rack1-b", "rack2-a", "rack2-b"]
    placed = buddies(nodes, 1, by(RACKS))
    # the ring would pair rack1-a with rack1-b, in its own rack; each rack2 node takes one replica
    assert placed == {"rack1-a": ["rack2-a"], "rack1-b": ["rack2-b"], "rack2-a": ["rack1-a"], "rack2-b": ["rack1-b"]}
    assert shortfall(placed, 1, by(RACKS)) is None


def test_more_replicas_go_to_distinct_domains_first() -> None:
    nodes = ["rack1-a", "rack1-b", "rack2-a", "rack3-a"]
    placed = buddies(nodes, 2, by(RACKS))
    assert placed["rack1-a"] == ["rack2-a", "rack3-a"] and placed["rack2-a"] == ["rack3-a", "rack1-a"]
    assert all(len({domain_of(b, RACKS) for b in bs}) == 2 and domain_of(n, RACKS) not in map(by(RACKS), bs)
               for n, bs in placed.items())


def test_too_few_domains_give_fewer_or_shared_buddies_and_one_warning_line() -> None:
    one_rack = ["rack1-a", "rack1-b", "rack1-c"]
    placed = buddies(one_rack, 1, by(RACKS))
    assert placed == {n: [] for n in one_rack}          # never a buddy in its own domain
    warning = shortfall(placed, 1, by(RACKS))
    assert warning is not None and "1 failure domain(s)" in warning and "3 node(s) get only 0" in warning
    assert "\n" not in warning
    two_racks = ["rack1-a", "rack2-a", "rack2-b"]
    placed = buddies(two_racks, 3, by(RACKS))
    assert placed == {"rack1-a": ["rack2-a", "rack2-b"], "rack2-a": ["rack1-a"], "rack2-b": ["rack1-a"]}
    warning = shortfall(placed, 3, by(RACKS))
    assert "3 node(s) get only 1 buddy" in warning and "1 node(s) have buddies that share a domain" in warning
    assert shortfall(buddies(["n0", "n1"], 3), 3) is not None   # 2 nodes, each its own domain: 1 buddy each


def test_a_single_node_launch_has_no_buddy_and_no_warning() -> None:
    assert buddies(["n0"], 1) == {"n0": []} and shortfall(buddies(["n0"], 1), 1) is None


def test_no_replicas_is_no_buddies_and_no_warning() -> None:
    placed = buddies(["n0", "n1", "n2"], 0)
    assert placed == {"n0": [], "n1": [], "n2": []} and shortfall(placed, 0) is None


def peers(replicas: int = 1, pattern: str = "", nodes: tuple[str, ...] = ("n0", "n1", "n2")) -> MemoryPeers:
    mp = MemoryPeers(replicas=replicas, domain_pattern=pattern)
    for i, node in enumerate(nodes):
        mp.on_peer(node, f"10.0.0.{i}:700{i}")
    return mp


def test_commands_carry_every_buddys_address() -> None:
    mp = peers(replicas=2)
    assert mp.launch(["n0", "n1", "n2"], 1) is None
    sent = {node: cmd.to_body() for node, cmd in mp.commands(["n0", "n1", "n2"]).items()}
    assert sent["n0"] == {"buddies": ["10.0.0.1:7001", "10.0.0.2:7002"], "sources": {}}
    assert sent["n2"]["buddies"] == ["10.0.0.0:7000", "10.0.0.1:7001"]


def test_a_launch_with_too_few_domains_returns_its_warning() -> None:
    mp = peers(replicas=1, pattern=r"^(n)", nodes=("n0", "n1"))
    assert "1 failure domain(s)" in mp.launch(["n0", "n1"], 1)
    assert mp.commands(["n0", "n1"])["n0"].buddies == ()


def test_after_a_node_path_launch_a_rank_is_sourced_from_its_old_node_and_all_its_buddies() -> None:
    mp = peers(replicas=2, nodes=("n0", "n1", "n2", "spare"))
    mp.launch(["n0", "n1", "n2"], 2)
    mp.launch(["spare", "n1", "n2"], 2)   # n0 died: the spare runs ranks 0 and 1
    assert mp.holders[0] == ["n0", "n1", "n2"] and mp.holders[2] == ["n1", "n2", "n0"]
    sent = {node: cmd.to_body() for node, cmd in mp.commands(["spare", "n1", "n2"]).items()}   # n0's agent is gone
    assert sent["spare"]["sources"] == {"0": ["10.0.0.1:7001", "10.0.0.2:7002"], "1": ["10.0.0.1:7001", "10.0.0.2:7002"]}
    assert sent["n1"]["sources"] == {"2": ["10.0.0.2:7002"], "3": ["10.0.0.2:7002"]}   # its own rank, from its buddy
    for _ in range(5):   # many launches later a rank remembers at most MAX_HOLDERS nodes
        mp.launch(["n2", "spare", "n1"], 2)
        mp.launch(["spare", "n1", "n2"], 2)
    assert all(len(h) <= MAX_HOLDERS for h in mp.holders.values())


def note(step: int, rank: int, buddy: str, ok: bool = True) -> MemoryReplicated:
    return MemoryReplicated(step=step, rank=rank, buddy=buddy, ok=ok)


def test_a_step_is_replicated_once_every_rank_is_stored_on_each_of_its_buddies() -> None:
    mp = peers(replicas=2)
    mp.launch(["n0", "n1", "n2"], 1)
    addr = {n: mp.addrs[n] for n in ("n0", "n1", "n2")}
    assert mp.on_replicated(note(5, 0, addr["n1"]), 3) is None
    assert mp.on_replicated(note(5, 0, addr["n1"]), 3) is None        # the same buddy twice counts once
    assert mp.on_replicated(note(5, 0, addr["n0"]), 3) is None        # not a buddy of rank 0's node
    assert mp.on_replicated(note(5, 1, addr["n2"], ok=False), 3) is None
    for rank, buddy in ((0, "n2"), (1, "n2"), (1, "n0"), (2, "n0")):
        assert mp.on_replicated(note(5, rank, addr[buddy]), 3) is None
    assert mp.on_replicated(note(5, 2, addr["n1"]), 3) == 5
    assert mp.replicated == {} and mp.full == {}


def test_a_rank_with_fewer_buddies_than_replicas_is_done_with_those_it_has() -> None:
    mp = peers(replicas=3, nodes=("n0", "n1"))
    assert mp.launch(["n0", "n1"], 1) is not None   # two nodes: one buddy each, and a warning
    assert mp.on_replicated(note(1, 0, mp.addrs["n1"]), 2) is None
    assert mp.on_replicated(note(1, 1, mp.addrs["n0"]), 2) == 1
