"""The memory tier's next source for one rank: its agent's copy refused (a flipped bit), the same
bundle from a peer agent's store over the real TCP replica channel (`get` with `from: peers`),
and the fault injection the dev-cluster tests use to get there (CKPTSUP_TEST_FLIP_MEMORY)."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_memory_tier import CID, SECRET, load, same, secret_file, state

from hooks_helpers import private_dir

from ckptsup.errors import ValidationError
from ckptsup.hooks.dcp_errors import failure_errors, root_cause
from ckptsup.hooks.memory_tier import MemoryClient, serialize
from ckptsup.supervisor.node.memory_store import (FlipMode, Held, MemoryServer, MemoryStore, PeerLinks, tcp_listener,
                                              unix_listener)


def test_the_flip_modes_say_which_copies_they_spoil() -> None:
    assert FlipMode.parse("") is None
    assert FlipMode.parse("own").applies(replica=False) and not FlipMode.parse("own").applies(replica=True)
    assert FlipMode.parse("replica").applies(replica=True) and not FlipMode.parse("replica").applies(replica=False)
    assert FlipMode.parse("1").applies(replica=True) and FlipMode.parse("1").applies(replica=False)
    with pytest.raises(ValueError, match="use 1, own or replica"):
        FlipMode.parse("yes")


def test_a_replica_store_flips_only_what_its_mode_names() -> None:
    store = MemoryStore(keep=2, flip=FlipMode.REPLICA)
    store.put(Held(step=1, rank=0, checkpoint_id="a", manifest="{}", sizes=(4,), payload=b"abcd"))
    store.put(Held(step=1, rank=1, checkpoint_id="a", manifest="{}", sizes=(4,), payload=b"abcd"), replica=True)
    assert store.get(1, 0).payload == b"abcd" and store.get(1, 1).payload != b"abcd"


def test_a_refused_own_copy_is_replaced_by_the_peers_copy_of_the_same_bundle(tmp_path: Path) -> None:
    saved = state(0)
    bundle = serialize(saved, step=7, checkpoint_id=CID[7], algorithm="xxh3-128", extra={"rank": 1, "world_size": 2})
    peer_store = MemoryStore(keep=2)
    peer = MemoryServer(tcp_listener("127.0.0.1"), secret=SECRET, store=peer_store).start()
    links = PeerLinks(secret=SECRET, node="n1")
    own = MemoryServer(unix_listener(private_dir(tmp_path / "sock") / "memory.sock"), secret=SECRET,
                       store=MemoryStore(keep=2, flip=FlipMode.OWN), peers=links).start()
    try:
        client = MemoryClient(socket_path=str(own.path), secret_file=secret_file(tmp_path), rank=1)
        client.put(bundle)                               # the own store flips a bit of it
        names = [f.path for f in bundle.manifest.files]
        peer_store.put(Held(step=7, rank=1, checkpoint_id=CID[7], manifest=bundle.manifest.to_json(),
                            sizes=tuple(len(bundle.data[n]) for n in names),
                            payload=b"".join(bytes(bundle.data[n]) for n in names)), replica=True)
        links.set(buddies=[], sources={1: [peer.address]})
        with pytest.raises(failure_errors()) as refused:
            load(client.get(7), state(1))
        assert isinstance(root_cause(refused.value), ValidationError)
        fetched = client.get(7, from_peers=True)
        assert fetched.source == "peer_memory" and same(load(fetched, state(1)), saved)
        again = client.get(7)                            # the peer's copy is this store's copy now
        assert again.source == "memory" and same(load(again, state(1)), saved)
        peer.close()
        with pytest.raises(ValidationError, match="no memory bundle of step 7"):
            client.get(7, from_peers=True)               # no peer left: the disk decides
    finally:
        own.close()


def test_a_source_that_dies_mid_bundle_fails_the_rank_s_fetch_and_the_store_goes_on(tmp_path: Path) -> None:
    # the bundle goes on to the rank while it arrives: a source lost half-way can only fail the
    # rank's receive (its load falls back whole), never hand it a short or mixed bundle
    import socket
    import threading

    from ckptsup.memory_wire import MemoryChannelError, MemoryOp, Session

    listener = socket.create_server(("127.0.0.1", 0))
    size = 3 << 20

    def half_a_bundle() -> None:
        conn, _ = listener.accept()
        with conn:
            session, _ = Session.accept(conn, SECRET, max_payload=1 << 30)
            session.recv()   # the get
            session.send_header(MemoryOp.BUNDLE, {"step": 7, "rank": 1, "checkpoint_id": CID[7], "manifest": "{}",
                                                  "sizes": [size]}, length=size)
            conn.sendall(b"\0" * (size // 2))

    threading.Thread(target=half_a_bundle, daemon=True).start()
    links = PeerLinks(secret=SECRET, node="n1")
    links.set(buddies=[], sources={1: [f"127.0.0.1:{listener.getsockname()[1]}"]})
    store = MemoryStore(keep=2)
    own = MemoryServer(unix_listener(private_dir(tmp_path / "sock") / "memory.sock"), secret=SECRET, store=store,
                       peers=links).start()
    try:
        client = MemoryClient(socket_path=str(own.path), secret_file=secret_file(tmp_path), rank=1)
        with pytest.raises(MemoryChannelError, match="closed the memory channel after"):
            client.get(7)
        assert store.get(7, 1) is None                   # nothing half-received is kept
        listener.close()                                 # (a source that takes no connection answers at once)
        assert client.held() == []                       # the store still serves
    finally:
        own.close()
        listener.close()


class _TwoRanks:
    """The collective seam of two in-process ranks (threads): reduce_max over both."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2)
        self.slots: list[list[int]] = [[], []]

    def reduce_max(self, rank: int, values: list[int]) -> list[int]:
        self.slots[rank] = values
        self.barrier.wait()
        out = [max(a, b) for a, b in zip(*self.slots)]
        self.barrier.wait()   # both have read before either writes again
        return out


def test_one_rank_s_refused_copy_takes_a_second_round_and_the_other_rank_keeps_what_it_received(tmp_path: Path) -> None:
    """loader.load_memory across two ranks: rank 1's agent flips its bundle, so rank 1 fetches the
    peer's copy; rank 0 loads the same step from the bundle it already received, asking its agent
    once, and both end bit-identical to what was saved."""
    import threading
    from types import SimpleNamespace

    import torch

    from ckptsup.hooks.loader import load_memory
    from ckptsup.hooks.state import TrainingState

    def training_state(rank: int, seed: int) -> TrainingState:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        return TrainingState(model=model, optimizer=opt, rank=rank, world_size=2)

    class CountingStore(MemoryStore):
        gets = 0

        def get(self, step: int, rank: int):
            CountingStore.gets += 1
            return super().get(step, rank)

    cid = CID[7]
    saved = [training_state(r, seed=r) for r in (0, 1)]
    bundles = [serialize({**s.model_optim_state(), **s.side_state(step=7, meta={}, with_globals=True)}, step=7,
                         checkpoint_id=cid, algorithm="xxh3-128", extra={"rank": r, "world_size": 2})
               for r, s in enumerate(saved)]
    peer_store = MemoryStore(keep=2)
    peer = MemoryServer(tcp_listener("127.0.0.1"), secret=SECRET, store=peer_store).start()
    links = PeerLinks(secret=SECRET, node="n2")
    agents = [MemoryServer(unix_listener(private_dir(tmp_path / "a0") / "memory.sock"), secret=SECRET,
                           store=CountingStore(keep=2)).start(),
              MemoryServer(unix_listener(private_dir(tmp_path / "a1") / "memory.sock"), secret=SECRET,
                           store=MemoryStore(keep=2, flip=FlipMode.OWN), peers=links).start()]
    try:
        clients = [MemoryClient(socket_path=str(a.path), secret_file=secret_file(tmp_path), rank=r)
                   for r, a in enumerate(agents)]
        for client, bundle in zip(clients, bundles):
            client.put(bundle)
        names = [f.path for f in bundles[1].manifest.files]
        peer_store.put(Held(step=7, rank=1, checkpoint_id=cid, manifest=bundles[1].manifest.to_json(),
                            sizes=tuple(len(bundles[1].data[n]) for n in names),
                            payload=b"".join(bytes(bundles[1].data[n]) for n in names)), replica=True)
        links.set(buddies=[], sources={1: [peer.address]})
        group = _TwoRanks()
        results: list = [None, None]   # each rank's Loaded, or the exception it raised
        runs = [SimpleNamespace(rank=r, world_size=2, state=training_state(r, seed=10 + r),
                                memory=SimpleNamespace(client=clients[r]),
                                reduce_max=(lambda values, r=r: group.reduce_max(r, values)))
                for r in (0, 1)]
        CountingStore.gets = 0

        def load(r: int) -> None:
            try:
                results[r] = load_memory(runs[r], 7)
            except BaseException as exc:   # handed to the assertion below, not lost in the thread
                results[r] = exc

        threads = [threading.Thread(target=load, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [getattr(r, "step", r) for r in results] == [7, 7], results
        assert CountingStore.gets == 1   # rank 0's bundle crossed its socket once
        assert results[0].tiers == {"memory_files": 1, "peer_memory_files": 0}
        assert results[1].tiers == {"memory_files": 0, "peer_memory_files": 1}
        for run, want in zip(runs, saved):
            assert same(run.state.model_optim_state(), want.model_optim_state())
    finally:
        for server in (*agents, peer):
            server.close()
