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
from ckptsup.supervisor.memory_store import (FlipMode, Held, MemoryServer, MemoryStore, PeerLinks, tcp_listener,
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
