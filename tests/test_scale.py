"""Issue 39, the control plane at scale: the heartbeat's packed fields, evidence parsed only when a
silence is judged, the node table of `ckptsup status` by state, the status cadence, the report without
per-node notes. Behaviour only; the costs are in bench/bench_supervisor_scale.py, bench_heartbeat_frame.py
and bench_scale_ops.py (BENCHMARKS.md §Scale)."""

import io
import json
import os
import queue

import pytest

from ckptsup import messages, wire
from ckptsup.config import SupervisorConfig
from ckptsup.events import EVENTS_FILE
from ckptsup.supervisor.job import status
from ckptsup.supervisor.job.agent_step import AgentStep, Inbox, Message
from ckptsup.supervisor.job.attempt import AttemptTracker
from ckptsup.supervisor.job.liveness import RankEvidence
from ckptsup.supervisor.job.node_evidence import RECENT_S, NodeEvidence
from ckptsup.supervisor.ops import node_table
from ckptsup.wire import MessageKind

SECRET = b"s" * 32


def test_wire_version_2_packs_pids_and_evidence_and_reads_them_back():
    assert wire.WIRE_VERSION >= 2   # 3: the relays' kinds (test_relays.py)
    pids = [{"rank": 8, "pid": 12, "host_pid": 4012}, {"rank": 9, "pid": 13, "host_pid": 4013}]
    assert messages.unpack_pids(messages.pack_pids(pids)) == {8: {"pid": 12, "host_pid": 4012},
                                                               9: {"pid": 13, "host_pid": 4013}}
    rows = messages.unpack_evidence(messages.pack_evidence([[0, 1.25, 4096, "R", 2, 0.5], [1, 3.0, 0, "S"]]))
    assert rows == [(0, 1.25, 4096, "R", 2, 0.5), (1, 3.0, 0, "S", 0, 0.0)]
    assert messages.pack_evidence([[0, 1.0, 0, "not a letter"]]).split(",")[3] == "?"
    # a heartbeat's body types them as strings: the frame's JSON holds no object or list per rank
    beat = messages.Heartbeat(ranks_alive=(0, 1), pids=messages.pack_pids(pids), evidence="0,1.000,0,R,0,0.000")
    frame = messages.encode(beat, seq=1, secret=SECRET, envelope={"node": "n1", "agent": "a"})
    m, _, body = wire.decode(frame, secret=SECRET)
    assert messages.parse(m, body) == beat and frame.count(b"{") == 2


@pytest.mark.parametrize("junk", ["1,2", "a,2,3", "1,2,3,4", "-1,2,3", "1,2,nan"])
def test_malformed_pid_records_are_skipped_not_raised(junk):
    assert messages.unpack_pids(f"{junk} 5,6,7") == {5: {"pid": 6, "host_pid": 7}}


@pytest.mark.parametrize("junk", ["0,nan,1,R,0,0", "0,1.0,1,R,0,inf", "0,1.0,-1,R,0,0", "0,1.0,1,R,0", "x,1,1,R,0,0",
                                  "0,1.0,1,,0,0"])
def test_malformed_evidence_rows_are_skipped_not_raised(junk):
    assert messages.unpack_evidence(f"{junk} 1,2.0,3,S,0,0") == [(1, 2.0, 3, "S", 0, 0.0)]


def test_a_heartbeat_with_pids_or_evidence_as_lists_is_refused():
    """Wire version 1's shape: an agent of another version is refused at its hello; a frame of it is dropped."""
    for field in ("pids", "evidence"):
        with pytest.raises(wire.FrameError, match=field):
            messages.parse(MessageKind.HB, {field: [[0, 1.0, 0, "R"]]})


def tracker(nodes=("n1", "n2"), per=2):
    return AttemptTracker(attempt=0, nodes=nodes, nproc_per_node=per, config=SupervisorConfig(), started=0.0,
                          expect_hello=False)


def beat(t, node, **body):
    return Message.received(recv=t, m=MessageKind.HB, body={"node": node, **body}, step_id=1)


def test_evidence_stays_packed_until_a_suspicion_then_gives_what_a_fold_per_beat_gave():
    eager: dict[int, RankEvidence] = {}
    t = tracker(nodes=("n1",))
    for second in range(30):
        rows = [[0, 1.0 + 0.5 * second, 100 * second, "R"], [1, 2.0, 0, "S"]]
        t.on_message(beat(float(second), "n1", ranks_alive=[0, 1], evidence=messages.pack_evidence(rows)))
        for rank, cpu, io, state in rows:
            eager.setdefault(rank, RankEvidence(rank=rank, node="n1")).add(float(second), cpu, io, state)
    assert t.evidence == {}   # nothing parsed while no silence is judged
    held = t.node_evidence["n1"]
    assert len(held.recent) <= RECENT_S + 1
    held.watch(t.evidence)
    for rank in (0, 1):
        assert t.evidence[rank].rates(29.0) == eager[rank].rates(29.0)
        assert t.evidence[rank].state == eager[rank].state
    t.on_message(beat(30.0, "n1", ranks_alive=[0], evidence="0,16.000,3000,R,0,0.000"))   # watched: folded at once
    assert t.evidence[0].samples[-1][0] == 30.0 and t.evidence[1].stale(30.0 + 3.5)


def test_ranks_that_left_long_ago_stay_known_as_stale_when_a_suspicion_comes():
    held, into = NodeEvidence(node="n1"), {}
    held.add(0.0, "0,1.000,0,R,0,0.000", into)
    for second in range(1, 60):
        held.add(float(second), "", into)   # the ranks are gone; the agent beats on
    held.watch(into)
    assert set(into) == {0} and into[0].stale(60.0)


def test_a_stopped_rank_is_flagged_and_cleared_by_its_nodes_heartbeats():
    t = tracker()
    for rank, node in ((0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")):
        t.on_message(Message.received(recv=0.5, m=MessageKind.PROGRESS, body={"node": node, "rank": rank, "step": 1},
                                      step_id=1))
    t.on_message(beat(1.0, "n1", stopped_ranks=[1]))
    assert [r for r, v in t.ranks.items() if v.stopped] == [1] and t.ranks[1].stopped_since == 1.0
    t.on_message(beat(2.0, "n2"))   # another node's beat leaves n1's flag alone
    t.on_message(beat(2.0, "n1", stopped_ranks=[1]))
    assert t.ranks[1].stopped and t.ranks[1].stopped_since == 1.0
    t.on_message(beat(3.0, "n1"))
    assert not t.ranks[1].stopped and t.ranks[1].stopped_since is None


def test_pids_are_read_again_only_when_they_change():
    t = tracker()
    t.on_message(beat(1.0, "n1", pids="0,10,100 1,11,101"))
    first = t.node_pids["n1"]
    t.on_message(beat(2.0, "n1", pids="0,10,100 1,11,101"))
    assert t.node_pids["n1"] is first
    t.on_message(beat(3.0, "n1", pids="0,10,100"))
    assert t.node_pids["n1"] == {0: {"pid": 10, "host_pid": 100}}
    assert t.pids == {0: {"node": "n1", "pid": 10, "host_pid": 100}}


def test_the_status_cadence_stretches_only_when_a_publish_is_costly():
    assert status.next_publish_s(0.001) == status.STATUS_EVERY_S
    assert status.next_publish_s(0.5) == pytest.approx(0.5 / status.STATUS_CPU_SHARE)


def rows(n):
    out = {}
    for i in range(n):
        out[f"gpu-{i:03d}"] = {"role": "active", "agent": True, "heartbeat_age_s": 0.4, "step": 100 + i % 3,
                               "step_p99_s": 1.0 + (0.5 if i == 7 else 0.0), "warm": True, "ranks_alive": [0]}
    out["gpu-010"].update(heartbeat_age_s=9.0)
    out["gpu-011"].update(agent=False)
    out["spare-0"] = {"role": "spare", "agent": True, "heartbeat_age_s": 0.2, "warm": True}
    return out


def test_nodes_group_by_state_worst_first_with_the_stalest_as_examples():
    groups = node_table.by_state(rows(40), heartbeat_interval_s=1.0)
    assert [(g.state, g.count) for g in groups] == [
        (node_table.NodeState.GONE, 1), (node_table.NodeState.LATE, 1), (node_table.NodeState.UP, 38),
        (node_table.NodeState.SPARE, 1)]
    late = groups[1]
    assert late.examples == ["gpu-010"] and late.max_age_s == 9.0
    assert (groups[2].min_step, groups[2].max_step) == (100, 102)
    # a longer beat (detection.at_scale) makes the same age on time
    assert node_table.NodeState.LATE not in [g.state for g in node_table.by_state(rows(40), heartbeat_interval_s=4.0)]


def test_the_slowest_nodes_and_a_pattern_pick_rows():
    assert list(node_table.slowest(rows(40), 2)) == ["gpu-007", "gpu-000"]
    assert list(node_table.matching(rows(40), "gpu-00[1-3], spare-*")) == ["gpu-001", "gpu-002", "gpu-003", "spare-0"]
    assert node_table.matching(rows(40), " , ") == {}


def render(st, pattern=None):
    from rich.console import Console

    from ckptsup.supervisor.ops.cli_status import render as render_status
    out = io.StringIO()
    Console(file=out, width=200).print(render_status(st, pattern))
    return out.getvalue()


def test_ckptsup_status_prints_a_row_per_state_past_16_nodes_and_rows_for_a_pattern():
    st = {"job_id": "J", "attempt": 0, "epoch": 1, "status": "running", "nodes": rows(40), "heartbeat_interval_s": 1.0}
    text = render(st)
    assert "active, heartbeat late" in text and "gpu-010" in text and "slowest 5 of 41 nodes" in text
    assert "gpu-020" not in text   # an ordinary node is only counted
    detail = render(st, "gpu-02*")
    assert "gpu-020" in detail and "gpu-029" in detail and "gpu-030" not in detail and "slowest" not in detail
    assert "no node matches 'x*' (of 41)" in render(st, "x*")
    small = {**st, "nodes": dict(list(rows(40).items())[:3])}
    assert "gpu-002" in render(small) and "slowest" not in render(small)   # a small job: a row each, as before


def test_the_report_reads_past_per_node_notes(tmp_path):
    from test_accounting import faulted_run

    from ckptsup.planning import goodput_report as rp
    events = faulted_run()
    noisy = events[:3] + [{**events[2], "event": "warm_ready", "node": f"n{i}", "interpreters": 8} for i in range(50)] \
        + [{**events[2], "event": "agent_started", "node": f"n{i}"} for i in range(50)] + events[3:]
    for name, evs in (("plain", events), ("noisy", noisy)):
        (tmp_path / name).mkdir()
        (tmp_path / name / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in evs))
    reports = [rp.build_report(rp.read_run(tmp_path / n), price_per_gpu_hour=1.0, gpu_mtbf_hours=1e4)
               for n in ("plain", "noisy")]
    assert reports[0]["useful_device_hours"] == reports[1]["useful_device_hours"]
    assert reports[0]["badput_device_hours"] == reports[1]["badput_device_hours"]


def test_the_agent_step_reader_joins_lines_across_reads_and_drops_a_flood(tmp_path, monkeypatch):
    from ckptsup.supervisor.job import agent_step
    monkeypatch.setattr(agent_step, "READ_BYTES", 97)   # every frame comes in several reads
    step = object.__new__(AgentStep)
    step.dropped = 0
    frame = messages.encode(messages.Heartbeat(ranks_alive=(0,)), seq=1, secret=SECRET, envelope={"node": "n1"})
    out = tmp_path / "stdout"
    out.write_bytes(frame + frame + b"x" * (5 * wire.MAX_FRAME_BYTES) + b"\nlast")
    fd = os.open(out, os.O_RDONLY)
    try:
        got = [line for lines, _ in step._reads(fd) for line in lines]
    finally:
        os.close(fd)
    assert got[:2] == [frame, frame] and got[-1] == b"last"
    assert step.dropped == 1 and all(len(line) <= 4 * wire.MAX_FRAME_BYTES + 1 for line in got)


def test_the_inbox_hands_over_batches_and_gives_their_messages_one_at_a_time_in_order():
    inbox = Inbox()
    msgs = [beat(float(i), "n1") for i in range(5)]
    inbox.put_batch(msgs[:3])
    inbox.put_batch([])
    inbox.put(msgs[3])
    inbox.put_batch(msgs[4:])
    assert inbox.qsize() == 3
    assert [inbox.get(timeout=1).recv for _ in range(4)] + [inbox.get_nowait().recv] == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(queue.Empty):
        inbox.get_nowait()
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.01)
