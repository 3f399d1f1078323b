"""Typed message bodies (ckptsup/messages.py): every kind round-trips through the wire, bad
bodies are one FrameError naming the field, unknown fields are ignored, and docs/contracts.md's
table lists exactly each type's fields (optional ones with `?`)."""
from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

from ckptsup import config, messages, wire
from ckptsup.messages import BODIES, Body
from ckptsup.wire import FrameError, MessageKind, Phase

DOC = Path(__file__).resolve().parent.parent / "docs" / "contracts.md"
SECRET = b"s" * 32

# one body of each kind, as its sender builds it (every field set, optional ones too)
SAMPLES: dict[MessageKind, Body] = {
    MessageKind.HELLO: messages.Hello(rank=1, local_rank=1, world_size=4, node="n1", pid=42, checkpoints=False,
                                      save_every_steps=100, save_every_s=600.0),
    MessageKind.STEP: messages.Step(rank=1, step=7, step_time_s=0.25, loss_finite=True, compute_s=0.2, sdc_s=0.01,
                                    loss=2.5),
    MessageKind.PHASE: messages.PhaseChange(rank=1, phase=Phase.EVAL, step=7),
    MessageKind.NAN: messages.Nan(rank=1, step=7, loss="nan"),
    MessageKind.SDC: messages.Sdc(rank=1, step=7, copies=4, disputed=(2,), majority=True, fingerprint="ab12",
                                  agreed_step=5),
    MessageKind.EVENT: messages.EventRecord(record={"event": "checkpoint_committed", "step": 7}),
    MessageKind.BYE: messages.Bye(rank=1, status=0),
    MessageKind.HB: messages.Heartbeat(ranks_alive=(0, 1), last_step=7, phase=Phase.TRAIN, stopped_ranks=(1,),
                                       torchrun=True, dropped=2, attempt=3,
                                       pids=messages.pack_pids([{"rank": 0, "pid": 10, "host_pid": 10}]),
                                       evidence=messages.pack_evidence([[0, 1.5, 4096, "R"]])),
    MessageKind.LAUNCHED: messages.Launched(attempt=3, pid=99, warm=True),
    MessageKind.RANK_EXIT: messages.RankExit(rank=1, rc=-9, pid=10, step=7, age_s=0.5, detail="rank 1 died"),
    MessageKind.TORCHRUN_EXIT: messages.TorchrunExit(rc=1, step=7, stopped=True, preempted=True),
    MessageKind.KILLED: messages.Killed(kill_s=0.5, survivors=({"rank": 0, "pid": 10, "host_pid": 10, "wchan": "futex"},)),
    MessageKind.RESTARTED: messages.Restarted(attempt=4, kill_s=0.5),
    MessageKind.PREEMPT: messages.Preempt(signal=15, budget_s=30.0),
    MessageKind.PROGRESS: messages.Progress(rank=1, step=7),
    MessageKind.OUTPUT: messages.Output(lines=("a\n", "b"), dropped=3),
    MessageKind.WARM_READY: messages.WarmReady(interpreters=4),
    MessageKind.EXT_HASHED: messages.ExtHashed(request="r1", part=0, folder="step_7",
                                               files=({"path": "a.bin", "size": 3, "hash": "ff"},), problems=("x",),
                                               hash_s=0.1, testload={"ok": True}),
    MessageKind.MEMORY_PEER: messages.MemoryPeer(addr="10.0.0.1:4000"),
    MessageKind.MEMORY_REPLICATED: messages.MemoryReplicated(step=7, rank=1, buddy="h:1", ok=False, bytes=10,
                                                             replicate_s=0.1, reason="refused"),
    MessageKind.STACKS_TAKEN: messages.StacksTaken(attempt=3, stacks=([0, "Thread 1"],), wchan=([0, "futex"],)),
    MessageKind.AGENT_HELLO: messages.AgentHello(version="0.1.0", wire=1, pid=1, pid_ns=4026532451, container="oci",
                                                 node_from="container id", shm_free=64 << 20, age_s=0.4),
    MessageKind.CLOUD_NOTICE: messages.CloudNotice(cloud="aws", action="terminate", deadline="2026-05-01T10:02:00Z",
                                                   ahead_s=118.5, detail="spot instance-action terminate"),
    MessageKind.STOP_AT: messages.StopAt(reason="preempted", save=True, budget_s=30.0, step=9),
    MessageKind.SAVE_NOW: messages.SaveNow(reason="operator request 1"),
    MessageKind.SET_INTERVAL: messages.SetInterval(interval_s=60.0, save_every_steps=100, memory_every_steps=5),
    MessageKind.SET_TIMEOUT: messages.SetTimeout(collective_s=12.5),
    MessageKind.DUMP_FR: messages.DumpFr(path="/run/fr"),
    MessageKind.KILL: messages.Kill(grace=1.5, report=True),
    MessageKind.RESTART: messages.Restart(attempt=2, spec={"script": "x.py"}, env={"A": "1"}),
    MessageKind.EXIT: messages.Exit(),
    MessageKind.EXT_HASH: messages.ExtHash(request="r1", part=0, dir="/ckpt", folder="step_7", files=("a.bin",),
                                           algorithm="sha256", testload="/run/m.json"),
    MessageKind.MEMORY_PEERS: messages.MemoryPeers(buddies=("h:1",), sources={"0": ["h:2"]}),
    MessageKind.STACKS: messages.Stacks(),
    MessageKind.RELAY: messages.Relay(generation=2, children=("n2", "n3"), evidence=True),
    MessageKind.RELAY_READY: messages.RelayReady(generation=2, addr="10.0.0.1:40123"),
    MessageKind.RELAY_SUMMARY: messages.RelaySummary(children="n2 n3", heard="3", low_step=7, high_step=8,
                                                     changed={"n2": {"agent": "a1", "ranks_alive": [0], "pids": "0,5,5",
                                                                     "stopped_ranks": []}}),
}


def test_every_kind_has_one_body_type_and_a_sample() -> None:
    assert set(BODIES) == set(MessageKind) == set(SAMPLES)
    assert all(BODIES[m].KIND is m and type(SAMPLES[m]) is BODIES[m] for m in MessageKind)
    assert len(set(BODIES.values())) == len(MessageKind)


@pytest.mark.parametrize("m", list(MessageKind))
def test_every_kind_round_trips_through_a_frame(m: MessageKind) -> None:
    sent = SAMPLES[m]
    frame = messages.encode(sent, seq=5, secret=SECRET, envelope={"node": "n1", "agent": "abc"})
    got_m, seq, raw = wire.decode(frame, secret=SECRET)
    assert (got_m, seq) == (m, 5)
    assert messages.parse(got_m, raw) == sent                      # the envelope's keys are ignored
    assert messages.parse(m, sent.to_body()).to_body() == sent.to_body()


@pytest.mark.parametrize("m", list(MessageKind))
def test_a_body_is_frozen(m: MessageKind) -> None:
    body = SAMPLES[m]
    for f in fields(body):
        with pytest.raises(FrozenInstanceError):
            setattr(body, f.name, None)


def test_optional_fields_are_left_out_while_none_and_the_rest_always_sent() -> None:
    assert messages.Step(rank=0, step=3).to_body() == {"rank": 0, "step": 3, "step_time_s": None, "loss_finite": True}
    assert messages.Kill(grace=0).to_body() == {"grace": 0}
    assert messages.Kill(grace=0, report=True).to_body() == {"grace": 0, "report": True}
    assert messages.SetInterval(memory_every_steps=4).to_body() == {"memory_every_steps": 4}
    assert messages.Exit().to_body() == {}


def test_missing_optional_fields_take_the_defaults_the_readers_assumed() -> None:
    step = messages.parse(MessageKind.STEP, {"step": 3})
    assert step == messages.Step(rank=messages.NO_RANK, step=3, step_time_s=None, loss_finite=True)
    hello = messages.parse(MessageKind.HELLO, {"rank": 0})
    assert hello.checkpoints is True and hello.pid is None      # absent checkpoints reads as true
    assert messages.parse(MessageKind.SAVE_NOW, {}) == messages.SaveNow(reason="requested")
    assert messages.parse(MessageKind.HB, {}).ranks_alive is None   # absent: keep what was known


@pytest.mark.parametrize("m, body, problem", [
    (MessageKind.HELLO, {"pid": 5}, "`rank` is missing"),
    (MessageKind.HELLO, {"rank": -1}, "`rank` must be an integer >= 0, not -1"),
    (MessageKind.HELLO, {"rank": True}, "`rank` must be an integer >= 0, not True"),
    (MessageKind.HELLO, {"rank": 0, "pid": 0}, "`pid` must be an integer >= 1 or null, not 0"),
    (MessageKind.HELLO, {"rank": 0, "checkpoints": None}, "`checkpoints` must be a bool"),
    (MessageKind.STEP, {"step": "3"}, "`step` must be an integer >= 0, not '3'"),
    (MessageKind.STEP, {"step": 3, "step_time_s": "fast"}, "`step_time_s` must be a number or null"),
    (MessageKind.STEP, {"step": 3, "loss": float("inf")}, "`loss` must be a number or null"),
    (MessageKind.PHASE, {"phase": []}, "`phase` must be a phase name"),
    (MessageKind.SDC, {"step": 1, "copies": 0, "disputed": [], "majority": True}, "`copies` must be an integer >= 1"),
    (MessageKind.SDC, {"step": 1, "copies": 2, "disputed": [-1], "majority": True}, "`disputed` must be a list"),
    (MessageKind.SDC, {"step": 1, "copies": 2, "disputed": list(range(70_000)), "majority": True}, "`disputed` must be"),
    (MessageKind.EVENT, {"record": [1]}, "`record` must be an object"),
    (MessageKind.BYE, {"status": None}, "`status` must be an integer"),
    # the fast path (exact types kept as they are) keeps these refusals: a bool is no integer
    (MessageKind.BYE, {"status": True}, "`status` must be an integer"),
    (MessageKind.HB, {"last_step": False}, "`last_step` must be an integer or null"),
    (MessageKind.HB, {"ranks_alive": [0, True]}, "`ranks_alive` must be a list"),
    (MessageKind.HB, {"ranks_alive": [0, "1"]}, "`ranks_alive` must be a list"),
    (MessageKind.KILL, {"grace": "soon"}, "`grace` must be a number of seconds >= 0, not 'soon'"),
    (MessageKind.KILL, {"grace": -1}, "`grace` must be a number of seconds >= 0"),
    (MessageKind.RESTART, {}, "`attempt` is missing"),
    (MessageKind.RESTART, {"attempt": 1, "spec": 7}, "`spec` must be a launch spec or its path, not 7"),
    (MessageKind.RESTART, {"attempt": 1, "env": {"A": 1}}, "`env` must be an object mapping names to strings"),
    (MessageKind.MEMORY_PEERS, {"buddies": ["h:1", "h:2", "h:3", "h:4"]}, "`buddies` must be a list of at most 3 host:port"),
    (MessageKind.MEMORY_PEERS, {"buddies": ["nohost"]}, "`buddies` must be a list of at most 3 host:port"),
    (MessageKind.MEMORY_PEERS, {"sources": {"x": ["h:1"]}}, "`sources` must be an object mapping ranks"),
    (MessageKind.SET_TIMEOUT, {"collective_s": "x"}, "`collective_s` must be a number >= 0"),
    (MessageKind.EXT_HASH, {"request": "r", "part": 0, "dir": "/d", "folder": "f", "files": [1], "algorithm": "a"},
     "`files` must be a list"),
])
def test_a_bad_body_is_one_frame_error_naming_the_field(m: MessageKind, body: dict, problem: str) -> None:
    with pytest.raises(FrameError) as err:
        messages.parse(m, body)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_unknown_fields_are_ignored_and_not_relayed() -> None:
    """Forward compatible: a newer peer may say more; the envelope keys share the object."""
    bye = messages.parse(MessageKind.BYE, {"rank": 0, "status": 0, "node": "n1", "agent": "a", "future": [1]})
    assert bye == messages.Bye(rank=0, status=0) and bye.to_body() == {"rank": 0, "status": 0}


def test_a_junk_schedule_in_a_hello_reads_as_unsaid_not_as_a_bad_hello() -> None:
    """interval_tuner.rank_schedule dropped junk values and kept the hello: still so."""
    hello = messages.parse(MessageKind.HELLO, {"rank": 0, "save_every_steps": "x", "save_every_s": -5})
    assert hello.save_every_steps is None and hello.save_every_s is None


def test_an_unknown_phase_reads_as_training() -> None:
    assert messages.parse(MessageKind.PHASE, {"phase": "compiling"}).phase is Phase.TRAIN


def test_interval_changes_that_wait_for_the_same_step_merge() -> None:
    a = messages.SetInterval(interval_s=60.0)
    b = messages.SetInterval(memory_every_steps=4)
    assert a.merged(b) == messages.SetInterval(interval_s=60.0, memory_every_steps=4)
    assert a.merged(messages.SetInterval(interval_s=30.0)).interval_s == 30.0


def test_the_replica_bound_is_configs() -> None:
    assert messages.MAX_REPLICAS == config.MAX_REPLICAS


# ---- docs/contracts.md's table, against the types -------------------------------------------------
def _top_level_split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def documented_fields() -> dict[str, dict[str, bool]]:
    """kind -> {field: optional} from the table's `{...}` of each row."""
    out = {}
    hops = {h.value for h in wire.Hop}
    for kind, hop, rest in re.findall(r"^\| `(\w+)` \| ([^|]+?) \| (.*)$", DOC.read_text(), flags=re.M):
        if hop.split(" (")[0] not in hops:
            continue   # another table's row (an event of the same name)
        assert rest.startswith("{"), kind
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch in "{[(" and 1 or 0
            depth -= ch in "}])" and 1 or 0
            if depth == 0:
                break
        names = {}
        for item in _top_level_split(rest[1:end]):
            name = re.match(r"(\w+)(\??)", item)
            assert name, (kind, item)
            names[name[1]] = bool(name[2])
        out[kind] = names
    return out


def test_the_contracts_table_lists_each_types_fields_and_which_are_optional() -> None:
    documented = documented_fields()
    assert set(documented) == {k.value for k in MessageKind}
    for m, cls in BODIES.items():
        typed = {f.name: f.opt for f in cls._fields}
        assert documented[m.value] == typed, f"docs/contracts.md's {m.value} row and messages.{cls.__name__} differ"


def test_wire_kinds_point_at_the_types_instead_of_listing_fields() -> None:
    source = Path(wire.__file__).read_text()
    assert "messages.py" in source


def test_the_supervisors_reader_types_each_body_and_drops_a_mistyped_one_like_a_forged_one(tmp_path: Path) -> None:
    """AgentStep's reader is the supervisor's one boundary: a real child writes a good heartbeat,
    a well-signed one with a wrong body and a forged one; only the first is queued, typed."""
    import sys

    from ckptsup.supervisor.job.agent_step import AgentStep, CommandSender, Inbox, StepEof, StepSignal

    good = messages.Heartbeat(ranks_alive=(0,), last_step=4, attempt=1)
    env = {"node": "n1", "agent": "a1"}
    lines = [wire.encode(MessageKind.HB, {**good.to_body(), **env}, seq=1, secret=SECRET),
             wire.encode(MessageKind.HB, {"ranks_alive": "all", **env}, seq=2, secret=SECRET),
             wire.encode(MessageKind.HB, {**good.to_body(), **env}, seq=3, secret=b"forged" * 6)]
    script = "import sys; sys.stdout.buffer.write(bytes.fromhex(sys.argv[1]))"
    inbox = Inbox()
    step = AgentStep(argv=[sys.executable, "-c", script, b"".join(lines).hex()], env={}, nodes=("n1",), secret=SECRET,
                     sender=CommandSender(SECRET), inbox=inbox, log_path=tmp_path / "agents.log")
    first, end = inbox.get(timeout=30), inbox.get(timeout=30)
    assert (first.m, first.node, first.agent, first.body) == (MessageKind.HB, "n1", "a1", good)
    assert end.m is StepSignal.EOF and end.body == StepEof(rc=0, log=str(tmp_path / "agents.log"))
    step.reader.join(timeout=30)
    assert step.dropped == 2
