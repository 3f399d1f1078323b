"""The memory tier's parts against real sockets, real DCP and hostile input: the memory channel
(authentication, replay, bounds), the agent's store (keep, max_bytes; nothing a client sends stops
it) and the rank's bundles (a real model's state round-trips bit for bit; any flipped byte is a
ValidationError before torch sees it)."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
from pathlib import Path

import pytest
import torch

from hooks_helpers import private_dir

from ckptsup.errors import ValidationError
from ckptsup.hooks.dcp_errors import root_cause
from ckptsup.hooks.memory_tier import Bundle, BundleReader, MemoryClient, newest_common, serialize
from ckptsup.memory_wire import MemoryChannelError, MemoryOp, Session
from ckptsup.supervisor.node.memory_store import Held, MemoryServer, MemoryStore, PeerLinks, tcp_listener, unix_listener

SECRET = secrets.token_hex(32).encode()


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    return a, b


def handshake(secret_server: bytes = SECRET, secret_client: bytes = SECRET) -> tuple[Session, Session]:
    srv, cli = pair()
    box: dict = {}

    def serve() -> None:
        try:
            box["s"] = Session.accept(srv, secret_server, max_payload=1 << 20)[0]
        except MemoryChannelError as err:
            box["err"] = err

    t = threading.Thread(target=serve)
    t.start()
    client = Session.connect(cli, secret_client, role="rank0", max_payload=1 << 20)
    t.join(10)
    if "err" in box:
        raise box["err"]
    return box["s"], client


def test_a_session_carries_headers_and_payloads_both_ways() -> None:
    server, client = handshake()
    client.send(MemoryOp.LIST, {"rank": 3}, b"abc")
    op, body, payload = server.recv()
    assert (op, body["rank"], payload) == (MemoryOp.LIST, 3, b"abc")
    server.send(MemoryOp.HELD, {"rank": 3, "held": []}, [b"x" * 5, b"y"])
    op, body, payload = client.recv()
    assert op is MemoryOp.HELD and payload == b"xxxxxy"


def test_a_client_without_the_secret_is_refused_at_auth() -> None:
    with pytest.raises(MemoryChannelError, match="bad MAC"):
        handshake(secret_client=secrets.token_hex(32).encode())


def raw_message(server: Session) -> bytes:
    """The next message's bytes as they arrived at the server, undecoded."""
    from ckptsup.memory_wire import recv_exact

    head = recv_exact(server.sock, 4)
    return head + recv_exact(server.sock, int.from_bytes(head, "big"))


def test_a_header_replayed_in_its_session_or_another_is_refused() -> None:
    server, client = handshake()
    client.send(MemoryOp.LIST, {"rank": 0})
    recorded = raw_message(server)
    client.sock.sendall(recorded)           # the first time it is good
    assert server.recv()[0] is MemoryOp.LIST
    client.sock.sendall(recorded)           # the same bytes again, same session
    with pytest.raises(MemoryChannelError, match="replayed"):
        server.recv()
    other, other_client = handshake()        # another session: another nonce, so the MAC fails
    other_client.sock.sendall(recorded)
    with pytest.raises(MemoryChannelError, match="bad MAC"):
        other.recv()


@pytest.mark.parametrize("frame, expected", [
    ((1 << 30).to_bytes(4, "big"), "header of"),                       # a 1 GiB header announced
    ((5).to_bytes(4, "big") + b"[[[[[", "memory-channel header"),       # not JSON
    ((2).to_bytes(4, "big") + b"{}", "malformed"),                      # no fields
])
def test_bad_headers_are_one_error(frame: bytes, expected: str) -> None:
    server, client = handshake()
    client.sock.sendall(frame)
    with pytest.raises(MemoryChannelError, match=expected):
        server.recv()


def test_a_payload_over_the_limit_is_refused_before_it_is_read() -> None:
    server, client = handshake()
    client.max_payload = 1 << 30
    body = {"rank": 0, "length": (1 << 20) + 1}
    import hmac as _hmac

    from ckptsup import memory_wire

    body_json = json.dumps(body, separators=(",", ":"), sort_keys=True)
    seq = client._sent + 1
    mac = memory_wire._mac(SECRET, client.nonce, "list", seq, body_json)
    client._send_line({"op": "list", "seq": seq, "body": body, "mac": mac})
    assert _hmac  # the MAC is right: only the length is wrong
    with pytest.raises(MemoryChannelError, match="payload of"):
        server.recv()


def test_a_large_payload_arrives_in_private_memory_a_forked_child_cannot_write_to() -> None:
    """Restored tensors live in the received buffer: a worker forked after the resume gets
    copy-on-write pages (a shared anonymous mapping would carry its writes back to the rank)."""
    import os

    from ckptsup.memory_wire import LARGE_BYTES

    server, client = handshake()
    client.send(MemoryOp.PUT, {"rank": 0}, b"a" * LARGE_BYTES)
    _, _, payload = server.recv()
    assert len(payload) == LARGE_BYTES and payload[:1] == b"a"
    pid = os.fork()
    if pid == 0:
        payload[0] = ord("b")
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert payload[:1] == b"a"


# ---- the store -------------------------------------------------------------------------------------

CID = {step: str(__import__("uuid").uuid4()) for step in range(30)}


def held(step: int, rank: int = 0, size: int = 10) -> Held:
    return Held(step=step, rank=rank, checkpoint_id=f"c{step}", manifest="{}", sizes=(size,), payload=b"x" * size)


def test_the_store_keeps_the_newest_bundles_per_rank_and_refuses_oversized_ones() -> None:
    store = MemoryStore(keep=2, max_bytes=100)
    for step in (5, 10, 15):
        assert store.put(held(step)) is None
    store.put(held(10, rank=1))
    assert store.held(0) == [(10, "c10"), (15, "c15")] and store.held(1) == [(10, "c10")]
    assert "max_bytes" in store.put(held(20, size=101))
    assert store.get(5, 0) is None and store.get(15, 0).payload == b"x" * 10


@pytest.fixture
def server(tmp_path: Path):
    path = private_dir(tmp_path / "sock") / "memory.sock"
    srv = MemoryServer(unix_listener(path), secret=SECRET, store=MemoryStore(keep=2)).start()
    yield srv
    srv.close()


def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra/side": torch.arange(5)}


def load(bundle: Bundle, like: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    from ckptsup.hooks.loader import _fresh_copy
    from ckptsup.hooks.reader import safe_load_planner

    reader = BundleReader(bundle)
    reader.read_metadata()   # as loader.load_memory: the .metadata checks come before DCP's load
    targets = _fresh_copy(like)
    dcp.load(targets, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    return targets


def same(a: dict, b: dict) -> bool:
    from torch.utils._pytree import tree_flatten

    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def test_a_bundle_goes_to_the_agent_and_comes_back_bit_identical(tmp_path: Path, server) -> None:
    saved = state(0)
    bundle = serialize(saved, step=7, checkpoint_id=CID[7], algorithm="xxh3-128", extra={"rank": 1, "world_size": 2})
    client = MemoryClient(socket_path=str(server.path), secret_file=secret_file(tmp_path), rank=1)
    client.put(bundle)
    assert client.held() == [(7, CID[7])]
    back = client.get(7)
    assert back.manifest.extra == {"memory": True, "rank": 1, "world_size": 2}
    assert same(load(back, state(1)), saved)
    with pytest.raises(ValidationError, match="no memory bundle of step 8"):
        client.get(8)


def test_any_flipped_byte_of_a_bundle_is_refused_before_torch_reads_it() -> None:
    saved = state(0)
    bundle = serialize(saved, step=3, checkpoint_id=CID[3], algorithm="xxh3-128", extra={})
    for name in bundle.data:
        data = bytearray(bundle.data[name])
        data[len(data) // 2] ^= 0x01
        bad = Bundle(manifest=bundle.manifest, data={**bundle.data, name: bytes(data)})
        with pytest.raises(BaseException) as err:   # DCP wraps what its reader raises
            load(bad, state(1))
        assert isinstance(root_cause(err.value), ValidationError), err.value
    short = Bundle(manifest=bundle.manifest, data={k: v[:-1] for k, v in bundle.data.items()})
    with pytest.raises(ValidationError, match="bytes, its manifest says"):
        BundleReader(short)


def test_nothing_a_client_sends_stops_the_store(tmp_path: Path, server) -> None:
    garbage = [b"", b"\x00\x00\x00\x05hello", (1 << 31).to_bytes(4, "big"), secrets.token_bytes(4096)]
    for data in garbage:
        with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):   # the store may hang up first
            s.connect(str(server.path))
            s.sendall(data)
    # a client with the secret that lies about its payload, then one that asks for ops only the store sends
    for op, body, payload in ((MemoryOp.PUT, {"step": 1, "rank": 0, "checkpoint_id": "c", "manifest": "{}",
                                              "sizes": [99]}, b"x"), (MemoryOp.BUNDLE, {}, b"")):
        with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):
            s.connect(str(server.path))
            session = Session.connect(s, SECRET, role="rank0", max_payload=1 << 20)
            session.send(op, body, payload)
            s.settimeout(10)
            assert s.recv(1) == b""   # the store closed this session
    client = MemoryClient(socket_path=str(server.path), secret_file=secret_file(tmp_path), rank=0)
    assert client.held() == []   # still serving, and nothing was stored
    client.put(serialize(state(0), step=2, checkpoint_id=CID[2], algorithm="xxh3-128", extra={}))
    assert client.held() == [(2, CID[2])]


def test_the_ranks_agree_on_the_newest_step_all_hold_with_the_same_id() -> None:
    assert newest_common([[(5, "a"), (10, "b")], [(5, "a"), (10, "b")]]) == (10, "b")
    assert newest_common([[(5, "a"), (10, "b")], [(5, "a")]]) == (5, "a")
    assert newest_common([[(10, "b")], [(10, "other")]]) is None      # a mix of versions is never loaded
    assert newest_common([]) is None and newest_common([[], [(1, "a")]]) is None


# ---- peer replicas ---------------------------------------------------------------------------------

def test_a_bundle_is_replicated_to_every_buddy_and_fetched_from_the_one_left(tmp_path: Path) -> None:
    import time

    links = PeerLinks(secret=SECRET, node="own")
    servers = [MemoryServer(tcp_listener("127.0.0.1"), secret=SECRET, store=MemoryStore(keep=2),
                            peers=links if i == 0 else None).start() for i in range(3)]
    own, first, second = servers
    buddies = [first.address, second.address]
    try:
        links.set(buddies=buddies, sources={})
        bundle = held(4, rank=1, size=1000)
        host, port = own.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:   # as a rank puts it in its agent
            session = Session.connect(sock, SECRET, role="rank1", max_payload=1 << 20)
            session.send(MemoryOp.PUT, {"step": 4, "rank": 1, "checkpoint_id": "c4", "manifest": "{}",
                                        "sizes": [1000]}, bundle.payload)
            assert session.recv()[0] is MemoryOp.STORED
        notes: list = []
        deadline = time.monotonic() + 30
        while len(notes) < 2 and time.monotonic() < deadline:
            notes += links.take()
            time.sleep(0.02)
        assert sorted((n.buddy, n.ok, n.step, n.rank) for n in notes) == [(b, True, 4, 1) for b in sorted(buddies)]
        assert first.store.get(4, 1) == bundle and second.store.get(4, 1) == bundle
        first.close()   # one buddy's node is lost: a spare's agent finds the bundle on the other
        spare = PeerLinks(secret=SECRET, node="spare", connect_timeout_s=2)
        spare.set(buddies=[], sources={1: buddies})
        assert spare.held(1) == {(4, "c4")}
        assert spare.fetch(4, 1) == bundle
    finally:
        for server in (own, second):
            server.close()


def test_auto_max_bytes_shares_half_the_nodes_memory_among_every_copy(tmp_path: Path) -> None:
    from ckptsup.hooks.memory_tier import fit_budget
    from ckptsup.memory_left import meminfo_available as available_bytes

    # 2 kept + 1 arriving, for 4 ranks, on this node and 1 buddy: 24 copies share half of 48 GiB
    assert fit_budget(48 << 30, keep=2, local_ranks=4, replicas=1) == (24 << 30) // 24
    assert fit_budget(48 << 30, keep=2, local_ranks=4, replicas=0) == (24 << 30) // 12
    assert fit_budget(1 << 30, keep=1, local_ranks=0, replicas=0) == (1 << 29) // 2   # 0 ranks read as 1
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n")
    assert available_bytes(str(meminfo)) == 12000000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_bytes(str(meminfo)) == 0   # nothing fits: the tier turns off rather than guess
    assert available_bytes(str(tmp_path / "absent")) == 0
    assert available_bytes() > 0   # this machine's


def test_a_bundle_past_the_fit_turns_the_tier_off_for_the_rank_with_one_warning(tmp_path: Path, server, caplog) -> None:
    from ckptsup.hooks.memory_tier import MemorySaver

    results, asked = [], []

    def fit() -> tuple[int, str]:
        asked.append(1)
        return 64, "what fits (test)"

    saver = MemorySaver(MemoryClient(socket_path=str(server.path), secret_file=secret_file(tmp_path), rank=0),
                        algorithm="xxh3-128", max_bytes=fit, on_result=results.append)
    for step in (1, 2, 3):
        saved = saver.save(step=step, checkpoint_id=f"c{step}", device_state=state(0), side_state={}, extra={})
        saver.wait()
        assert saved is (step == 1)
    saver.close()
    assert len(asked) == 1 and len(results) == 1 and not results[0].ok
    assert "over what fits (test): the memory tier is off for this rank; set [memory] max_bytes" in results[0].reason
    assert server.store.held(0) == []   # nothing half-kept
    roomy = MemorySaver(MemoryClient(socket_path=str(server.path), secret_file=secret_file(tmp_path), rank=0),
                        algorithm="xxh3-128", max_bytes=0, on_result=results.append)
    assert roomy.save(step=4, checkpoint_id="c4", device_state=state(0), side_state={}, extra={})
    roomy.close()
    assert results[-1].ok and server.store.held(0) == [(4, "c4")]
    # a restart's fit check counts what the agent already holds as free (it is not the job's memory)
    client = MemoryClient(socket_path=str(server.path), secret_file=secret_file(tmp_path), rank=3)
    assert client.stored_bytes() == server.store.total_bytes() == results[-1].bytes > 0
    assert MemoryClient(socket_path=str(tmp_path / "gone.sock"), secret_file=secret_file(tmp_path),
                        rank=0).stored_bytes() == 0


def test_an_agent_that_goes_away_before_answering_a_get_fails_it_with_the_channel_error(tmp_path: Path) -> None:
    # a clean-clone run saw BrokenPipeError escape `get` (the agent had answered and closed before the
    # request's empty payload was written): the rank's load expects the channel's one-line error
    path = private_dir(tmp_path / "sock") / "memory.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def hang_up_after_auth() -> None:
        conn, _ = listener.accept()
        with conn:
            Session.accept(conn, SECRET, max_payload=1 << 20)

    agent = threading.Thread(target=hang_up_after_auth, daemon=True)
    agent.start()
    client = MemoryClient(socket_path=str(path), secret_file=secret_file(tmp_path), rank=0)
    try:
        with pytest.raises(MemoryChannelError, match="closed the memory channel"):
            client.get(3)
    finally:
        agent.join(5)
        listener.close()


def test_a_message_without_a_payload_writes_only_its_header() -> None:
    # an empty payload costs no system call that a peer's close could fail
    ours, theirs = socket.socketpair()
    with ours, theirs:
        session = Session(sock=ours, secret=SECRET, nonce="n" * 32)
        session.send(MemoryOp.LIST, {"rank": 0})
        theirs.shutdown(socket.SHUT_RDWR)
        sent = []
        ours_sendall = ours.sendall
        try:
            session.sock = type("Counting", (), {"sendall": lambda self, data: sent.append(bytes(data)) or ours_sendall(data)})()
            with contextlib.suppress(OSError):
                session.send(MemoryOp.LIST, {"rank": 0})
        finally:
            session.sock = ours
        assert len(sent) == 1 and json.loads(sent[0][4:])["op"] == MemoryOp.LIST
