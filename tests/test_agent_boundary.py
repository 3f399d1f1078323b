"""The agent's rank socket is a boundary: nothing counts as a rank until an authenticated `hello`,
nothing anyone sends can make the agent report a rank exit, restart training or die, and a frame
replayed on a new connection is dropped (the replay guard is keyed by the rank's identity, not by
the connection). In-process agent, no torchrun: the selector is pumped by hand."""
from __future__ import annotations

import json
import os
import random
import socket
import time

import pytest

from ckptsup import wire
from ckptsup.supervisor.node import rank_processes, rank_socket
from ckptsup.supervisor.node.agent import Agent, LaunchSpec

SECRET = b"k" * 64
BIG = 3_000_000_007  # a pid no process has (pid_max is at most 2**22)


class FakeTorchrun:
    """A torchrun that keeps running: a dropped rank connection would be reported as a crash."""

    pid = 3_999_999_999  # no such process: nothing here may ever signal a real one

    def poll(self):
        return None


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_processes, "EXIT_CONFIRM_S", 0.05)  # the crash confirmation, shortened
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    spec = LaunchSpec(script="x.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="127.0.0.1:1",
                      rdzv_id="t", node_addrs={"n1": "127.0.0.1"}, env={}, log_dir=str(tmp_path))
    a = Agent(spec=spec, node="n1", secret=SECRET, out=os.fdopen(out_w, "wb"), inp=os.fdopen(in_r, "rb"), attempt=0)
    a.test_out = os.fdopen(out_r, "rb")
    a.test_in = os.fdopen(in_w, "wb")
    os.set_blocking(out_r, False)
    a.torchrun = FakeTorchrun()
    yield a
    a.torchrun = None
    for conn in a.ranks.conns.values():
        conn.pid = None  # whatever a test made it claim, the teardown signals no process
    a.shutdown()


def pump(agent, rounds: int = 3, timeout: float = 0.02) -> None:
    for _ in range(rounds):
        agent._pump(timeout)
        agent._check_processes()


def relayed(agent) -> list[tuple[str, dict]]:
    pump(agent)
    data = agent.test_out.read() or b""
    frames = [wire.decode(line, secret=SECRET) for line in data.splitlines() if line.strip()]
    return [(m, body) for m, _, body in frames]


def settle(agent) -> list[tuple[str, dict]]:
    """Everything relayed once every dropped connection had the time to become a crash report."""
    out = relayed(agent)
    time.sleep(rank_processes.EXIT_CONFIRM_S + 0.1)
    return out + relayed(agent)


def connect(agent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(agent.ranks.path))
    agent._pump(0.05)  # accept
    return sock


def blast(agent, sock: socket.socket, data: bytes) -> None:
    """Send `data` while pumping the agent (its reads make room), until it is sent or the agent
    closes the connection."""
    sock.setblocking(False)
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view[:65536]):]
        except BlockingIOError:
            agent._pump(0.01)
        except (BrokenPipeError, ConnectionResetError):
            return
    agent._pump(0.01)


def hello(rank: int = 0, pid: int = 3_000_999_999, seq: int = 1) -> bytes:
    return wire.encode("hello", {"rank": rank, "local_rank": rank, "world_size": 2, "node": "n1", "pid": pid},
                       seq=seq, secret=SECRET)


def exits(frames) -> list[dict]:
    return [body for m, body in frames if m == "rank_exit"]


def test_connections_that_close_without_an_authenticated_hello_are_no_rank_and_change_nothing(agent, capsys):
    for _ in range(20):                               # more than max_restarts' worth of "crashes"
        connect(agent).close()
    flood = connect(agent)
    blast(agent, flood, b"x" * (1 << 20))            # a 1 MB line without a newline
    flood.close()
    forged = connect(agent)
    forged.sendall(wire.encode("hello", {"rank": 0, "pid": BIG}, seq=1, secret=b"wrong" * 8))
    forged.close()
    frames = settle(agent)
    assert exits(frames) == [], exits(frames)
    assert agent.ranks.conns == {} and not agent.exit_requested
    logged = [line for line in capsys.readouterr().err.splitlines() if "rank socket" in line]
    assert len(logged) == 1 and "without an authenticated hello" in logged[0], logged  # rate-limited: one line
    agent.ranks.unauth_log.last = -1e9                      # the next window: the count since the first line
    connect(agent).close()
    settle(agent)
    logged = [line for line in capsys.readouterr().err.splitlines() if "rank socket" in line]
    assert len(logged) == 1 and "22 connection" in logged[0], logged


def test_an_authenticated_rank_that_drops_its_connection_is_still_reported(agent):
    sock = connect(agent)
    sock.sendall(hello(rank=1, pid=3_000_999_999))
    relayed(agent)
    sock.close()
    [report] = exits(settle(agent))
    assert report["rank"] == 1 and report["pid"] == 3_000_999_999 and report["rc"] is None


def test_frames_before_the_hello_are_dropped(agent):
    sock = connect(agent)
    sock.sendall(wire.encode("step", {"rank": 0, "step": 3}, seq=1, secret=SECRET))
    sock.sendall(wire.encode("bye", {"rank": 0, "status": 0}, seq=2, secret=SECRET))
    assert relayed(agent) == [] and agent.dropped == 2 and agent.last_step is None
    sock.sendall(hello(rank=0, seq=3) + wire.encode("step", {"rank": 0, "step": 4}, seq=4, secret=SECRET))
    assert [m for m, _ in relayed(agent)] == ["hello", "step"] and agent.last_step == 4


def test_a_valid_frame_replayed_on_a_new_connection_is_dropped(agent):
    first = connect(agent)
    sent = hello(rank=0, pid=3_000_999_999, seq=10) + wire.encode("step", {"rank": 0, "step": 7}, seq=11, secret=SECRET)
    first.sendall(sent)
    assert [m for m, _ in relayed(agent)] == ["hello", "step"]
    dropped = agent.dropped
    again = connect(agent)
    again.sendall(sent)                               # the same bytes, captured and replayed
    assert relayed(agent) == []
    assert agent.dropped == dropped + 2
    again.close()
    assert exits(settle(agent)) == []                 # the replayer never became rank 0
    first.sendall(wire.encode("step", {"rank": 0, "step": 8}, seq=12, secret=SECRET))
    assert [body["step"] for m, body in relayed(agent)] == [8]   # the real rank goes on


def test_a_restarted_rank_is_a_new_sender_with_its_own_sequence(agent):
    """A new process of the same rank (another pid) starts its own sequence: not a replay."""
    old = connect(agent)
    old.sendall(hello(rank=0, pid=3_000_001_001, seq=50))
    relayed(agent)
    new = connect(agent)
    new.sendall(hello(rank=0, pid=3_000_001_002, seq=1))
    assert [(m, body["pid"]) for m, body in relayed(agent)] == [("hello", 3_000_001_002)]


def test_deep_brackets_without_a_mac_do_not_reach_the_json_parser(agent):
    sock = connect(agent)
    sock.sendall(b"[" * 2000 + b"\n")               # json.loads would raise RecursionError
    sock.sendall(b'{"m":"hello","seq":1,"body":' + b"[" * 5000 + b"]" * 5000 + b',"mac":"00"}\n')
    assert relayed(agent) == [] and agent.dropped == 2


def test_decode_bounds_the_nesting_and_the_length_before_parsing() -> None:
    with pytest.raises(wire.FrameError, match="nests deeper"):
        wire.decode(b"[" * 30_000 + b"]" * 30_000, secret=SECRET)  # within the length limit
    with pytest.raises(wire.FrameError, match="too large"):
        wire.decode(b"[" * (wire.MAX_FRAME_BYTES + 1), secret=SECRET)
    for junk in (b'{"m":"hello","seq":1,"body":{},"mac":"\xc3\xa9"}',      # a non-ASCII MAC
                 json.dumps({"m": "hello", "seq": 1, "body": {}, "mac": "é"}).encode(),
                 b'{"m":"hello","seq":true,"body":{},"mac":"00"}',         # a bool is no sequence number
                 b'{"m":"step","seq":1,"body":{"x":NaN},"mac":"00"}',      # no NaN on the wire
                 b"\xff\xfe\x00garbage"):
        with pytest.raises(wire.FrameError):
            wire.decode(junk, secret=SECRET)
    body = '{"rank":0,"step_time_s":NaN}'  # what a peer that is not ours could sign (ours sends null)
    nan = ('{"body":%s,"m":"step","mac":"%s","seq":1}' % (body, wire._mac(SECRET, "step", 1, body))).encode()
    with pytest.raises(wire.FrameError, match="NaN is not a number JSON allows"):
        wire.decode(nan, secret=SECRET)               # well signed, but not a number JSON allows


@pytest.mark.parametrize("body", [
    {"rank": "x", "pid": BIG}, {"rank": -1, "pid": BIG}, {"rank": True, "pid": BIG}, {"rank": [], "pid": BIG},
    {"rank": 0, "pid": "me"}, {"rank": 0, "pid": 0}, {"rank": 0, "pid": -2}, {"rank": 0, "pid": [1]},
    {"pid": BIG}, {"rank": 1.5, "pid": BIG},
    {"rank": 0, "pid": BIG, "checkpoints": "no"}, {"rank": 0, "pid": BIG, "checkpoints": 0},
    {"rank": 0, "pid": BIG, "checkpoints": None},
])
def test_a_well_signed_hello_with_a_wrong_body_is_no_rank(agent, body):
    sock = connect(agent)
    sock.sendall(wire.encode("hello", body, seq=1, secret=SECRET))
    assert relayed(agent) == [] and agent.dropped == 1
    sock.close()
    assert exits(settle(agent)) == []


@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_hello_that_says_whether_ckptsup_keeps_checkpoints_is_relayed_with_it(agent, checkpoints):
    """checkpoints=false: heartbeat-only hooks (ckptsup.heartbeat); the supervisor reads the field."""
    body = {"rank": 0, "local_rank": 0, "world_size": 1, "node": "n1", "pid": 3_000_999_999, "checkpoints": checkpoints}
    sock = connect(agent)
    sock.sendall(wire.encode("hello", body, seq=1, secret=SECRET)
                 + wire.encode("step", {"rank": 0, "step": 0, "step_time_s": None, "loss_finite": True}, seq=2, secret=SECRET))
    [(m, relayed_hello), (step, _)] = relayed(agent)
    assert (m, step) == ("hello", "step") and agent.dropped == 0
    assert relayed_hello["checkpoints"] is checkpoints and relayed_hello["rank"] == 0


@pytest.mark.parametrize("m, body", [
    ("step", {"rank": 0, "step": []}), ("step", {"rank": 0, "step": "3"}), ("step", {"rank": 0, "step": True}),
    ("step", {"rank": 0, "step": 3, "step_time_s": "fast"}), ("step", {"rank": 0, "step": 3, "step_time_s": [1]}),
    ("step", {"rank": 0, "step": 3, "loss_finite": "no"}), ("step", {"rank": "x", "step": 3}),
    ("step", {"rank": 5, "step": 3}),                        # another rank's identity
    ("phase", {"rank": 0, "phase": [], "step": 1}), ("phase", {"rank": 0, "phase": "train", "step": {}}),
    ("nan", {"rank": 0, "step": "x"}), ("event", {"record": "x"}), ("event", {"record": [1]}),
    ("bye", {"rank": 0, "status": "done"}), ("bye", {"rank": 0, "status": None}),
    ("rank_exit", {"rank": 0, "rc": 9}),                     # not a rank's frame: the agent's own
    ("torchrun_exit", {"rc": 1}), ("preempt", {"signal": 15}), ("kill", {}), ("hello", {"rank": 1, "pid": BIG}),
])
def test_a_well_signed_rank_frame_with_a_wrong_body_is_dropped_not_relayed(agent, m, body):
    sock = connect(agent)
    sock.sendall(hello(rank=0, seq=1))
    assert [x for x, _ in relayed(agent)] == ["hello"]
    sock.sendall(wire.encode(m, body, seq=2, secret=SECRET))
    assert relayed(agent) == [] and agent.dropped == 1
    agent.heartbeat()
    [(hb, beat)] = relayed(agent)
    assert hb == "hb" and beat["ranks_alive"] == [0]


def test_a_rank_frame_too_large_to_relay_is_dropped(agent):
    sock = connect(agent)
    sock.sendall(hello(rank=0, seq=1))
    relayed(agent)
    def frame_of(pad: int) -> bytes:
        return wire.encode("event", {"record": {"event": "checkpoint_committed", "pad": "x" * pad}}, seq=2,
                           secret=SECRET)

    pad = wire.MAX_FRAME_BYTES - len(frame_of(0)) - 4
    frame = frame_of(pad)
    assert wire.MAX_FRAME_BYTES - 8 < len(frame) <= wire.MAX_FRAME_BYTES
    sock.sendall(frame)                               # fits; with {node, agent} added it would not
    assert relayed(agent) == [] and agent.dropped == 1


@pytest.mark.parametrize("body", [
    {"grace": "soon"}, {"grace": [1]}, {"nodes": 5}, {"nodes": "n1"}, {"nodes": [["n1"]]},
])
def test_a_well_signed_command_with_a_wrong_body_does_not_kill_the_agent(agent, body):
    agent.test_in.write(wire.encode("kill", body, seq=1, secret=SECRET))
    for seq, (m, extra) in enumerate((("restart", {"attempt": "x"}), ("restart", {"attempt": 1, "spec": {"bogus": 1}}),
                                      ("restart", {"attempt": 1, "spec": 7}), ("restart", {}),
                                      ("restart", {"attempt": 1, "env": 3}), ("dump_fr", {"nodes": 3})), start=2):
        agent.test_in.write(wire.encode(m, extra, seq=seq, secret=SECRET))
    agent.test_in.flush()
    relayed(agent)
    assert not agent.exit_requested and agent.torchrun is not None


def test_the_agent_survives_whatever_anyone_sends(agent):
    """A little fuzzing: random bytes, deep brackets, huge lines, well-signed frames with bodies of
    every wrong type, on many connections, authenticated or not. Nothing kills the agent, nothing
    unauthenticated is relayed, nothing is reported as a rank exit, and what is relayed is typed."""
    rnd = random.Random(1234)
    values = [None, True, 0, -1, 2**70, 1.5, "x", "", [], [1, "a"], {}, {"a": {"b": []}}, "train", "é" * 3]
    kinds = [k.value for k in wire.MessageKind] + ["nope"]
    authenticated = []
    seq = 100
    for round_ in range(60):
        sock = connect(agent)
        choice = rnd.randrange(6)
        if choice == 0:
            sock.sendall(bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 3000))))
        elif choice == 1:
            sock.sendall(b"[{" * rnd.randrange(100, 3000) + b"\n")
        elif choice == 2:
            blast(agent, sock, b"y" * rnd.randrange(wire.MAX_FRAME_BYTES, 5 * wire.MAX_FRAME_BYTES) + b"\n")
        elif choice == 3:
            sock.sendall(wire.encode(rnd.choice(kinds), {k: rnd.choice(values) for k in
                                                          rnd.sample(["rank", "pid", "step", "phase", "status", "record"], 3)},
                                     seq=rnd.randrange(1, 5), secret=b"not the secret" * 4))
        else:
            seq += 1
            rank = round_ % 4
            sock.sendall(hello(rank=rank, pid=3_000_000_000 + round_, seq=seq))
            for _ in range(rnd.randrange(1, 8)):
                seq += 1
                body = {k: rnd.choice(values) for k in rnd.sample(["rank", "step", "phase", "status", "record",
                                                                     "step_time_s", "loss_finite", "nodes"], 4)}
                if rnd.random() < 0.5:
                    body["rank"] = rank
                sock.sendall(wire.encode(rnd.choice(kinds), body, seq=seq, secret=SECRET))
            authenticated.append(sock)
        pump(agent, rounds=1, timeout=0.001)
        if choice < 4 or rnd.random() < 0.3:
            sock.close()
    frames = settle(agent)
    for m, body in frames:
        if m == "rank_exit":
            assert isinstance(body["rank"], int) and body["pid"] >= 3_000_000_000, body
        elif m in ("step", "phase", "nan", "bye"):
            assert isinstance(body.get("rank"), int) and not isinstance(body.get("rank"), bool), (m, body)
        if m == "step":
            assert isinstance(body["step"], int) and not isinstance(body["step"], bool), body
        if m == "event":
            assert isinstance(body["record"], dict), body
        assert m in {k.value for k in wire.MessageKind}
    agent.heartbeat()
    beat = [body for m, body in relayed(agent) if m == "hb"][-1]
    assert all(isinstance(r, int) for r in beat["ranks_alive"])
    assert agent.last_step is None or isinstance(agent.last_step, int)
    for sock in authenticated:
        sock.close()
    settle(agent)
    assert agent.ranks.conns == {}


def test_a_hello_cannot_make_the_agent_signal_another_process(agent):
    """At a kill the agent terminates a rank's pid only when it is the process at the other end of
    the socket: a well-signed hello naming someone else's pid gets nobody killed."""
    import subprocess
    import sys

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sock = connect(agent)
        sock.sendall(hello(rank=0, pid=bystander.pid))
        assert [m for m, _ in relayed(agent)] == ["hello"]
        agent.torchrun = None
        agent.kill_torchrun(0)
        time.sleep(0.2)
        assert bystander.poll() is None, "the agent killed a process that only a hello named"
    finally:
        bystander.kill()
        bystander.wait()


def test_connections_that_never_say_hello_are_closed_and_bounded(agent, monkeypatch):
    monkeypatch.setattr(rank_socket, "MAX_UNAUTHENTICATED", 4)
    socks = [connect(agent) for _ in range(10)]
    assert len(agent.ranks.conns) == 4                      # the oldest were closed to make room
    monkeypatch.setattr(rank_socket, "HELLO_TIMEOUT_S", 0.0)
    time.sleep(0.01)
    assert exits(settle(agent)) == [] and agent.ranks.conns == {}
    for sock in socks:
        sock.close()
