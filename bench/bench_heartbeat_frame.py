"""The supervisor's work per node heartbeat, by frame design (issue 39 part 1): what chose the design.
One thread, no pipe, process CPU time over --beats pre-encoded beats of --ranks-per-node ranks with
their pids and evidence, each beat taken the way the supervisor takes it (step_lines joiner, MAC, JSON,
typing, replay guard, AttemptTracker.on_message):

- v1 (the baseline, in this run): wire version 1's body, pids as objects and evidence as lists, every
  rank's evidence parsed into a sample at every beat (the code before this change, reproduced here);
- v2 (wire version 2, what ships): pids and evidence packed in a string each, the evidence parsed only
  when a silence is judged (supervisor/job/node_evidence.py), pids only when they change;
- batch of G (a relay tree's supervisor side, not built: one frame and one MAC for G nodes' v2 bodies;
  the per-node typing and fold remain);
- relay summaries (ships past [supervisor] relay_above_nodes: supervisor/node/relay.py): blocks of
  ceil(√N) nodes, each relay's summaries (SUMMARIES_PER_BEAT a beat, a child in one of them) as the
  supervisor takes them, per node-beat; and, on a relay's own node, RelayHub.take of one child's frame
  (MAC, seq, typing, its latest kept): what a relay of 128 children pays a beat.

Each row says µs per node-beat and what 2,048 and 16,384 beats a second would cost of one core at that
price (the real loop adds its threads' hand-over, ~2x: bench_supervisor_scale.py measures that).

usage: python bench/bench_heartbeat_frame.py [--beats 16384] [--ranks-per-node 8] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptsup import messages, step_lines, wire  # noqa: E402
from ckptsup.config import SupervisorConfig  # noqa: E402
from ckptsup.supervisor.job.agent_step import Message  # noqa: E402
from ckptsup.supervisor.job.attempt import AttemptTracker  # noqa: E402
from ckptsup.supervisor.job.liveness import RankEvidence  # noqa: E402
from ckptsup.wire import MessageKind  # noqa: E402

SECRET = os.urandom(32)


def body(i: int, tick: int, per: int, packed: bool) -> dict[str, Any]:
    ranks = list(range(i * per, (i + 1) * per))
    pids = [{"rank": r, "pid": 1000 + r % per, "host_pid": 50000 + r} for r in ranks]
    evidence = [[r, round(10.0 + 0.9 * tick, 3), 1000 * tick, "R", 0, 0.0] for r in ranks]
    return {"node": f"n{i}", "agent": "a1b2c3d4e5f6", "ranks_alive": ranks, "last_step": tick, "phase": "train",
            "stopped_ranks": [], "torchrun": True, "dropped": 0, "attempt": 0,
            "pids": messages.pack_pids(pids) if packed else pids,
            "evidence": messages.pack_evidence(evidence) if packed else evidence}


def v1_fold(tracker: AttemptTracker, raw: dict[str, Any], now: float, evidence: dict[int, RankEvidence]) -> None:
    """What the tracker did with a v1 heartbeat's pids and evidence (attempt.py before this change)."""
    node = raw["node"]
    known = {}
    for entry in raw["pids"]:
        if isinstance(entry, dict):
            rank, pid, host_pid = entry.get("rank"), entry.get("pid"), entry.get("host_pid")
            if type(rank) is int and type(pid) is int and type(host_pid) is int:
                known[rank] = {"pid": pid, "host_pid": host_pid}
    tracker.node_pids[node] = known
    for entry in raw["evidence"]:
        if not (isinstance(entry, list) and len(entry) in (4, 6) and isinstance(entry[0], int)
                and isinstance(entry[1], (int, float)) and isinstance(entry[2], int) and isinstance(entry[3], str)):
            continue
        children, children_cpu = (entry[4], entry[5]) if len(entry) == 6 else (0, 0.0)
        ev = evidence.get(entry[0])
        if ev is None or ev.node != node:
            ev = evidence[entry[0]] = RankEvidence(rank=entry[0], node=node)
        ev.add(now, float(entry[1]), entry[2], entry[3], children, float(children_cpu))


def cpu(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.process_time()
    n = fn()
    return time.process_time() - t, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--beats", type=int, default=16384)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    per, n = a.ranks_per_node, a.beats
    nodes = tuple(f"n{i}" for i in range(n))

    def tracker() -> AttemptTracker:
        t = AttemptTracker(attempt=0, nodes=nodes, nproc_per_node=per, config=SupervisorConfig(), started=0.0)
        return t

    def frames(packed: bool, tick: int) -> list[bytes]:
        return [step_lines.pieces(wire.encode(MessageKind.HB, body(i, tick, per, packed), seq=tick, secret=SECRET),
                                  f"n{i}/a".encode()) for i in range(n)]

    def per_frame(lines: list[bytes], t: AttemptTracker, fold: Callable[[Message, dict[str, Any]], None] | None) -> int:
        joiner, guard = step_lines.Joiner(max_bytes=wire.MAX_FRAME_BYTES), wire.ReplayGuard()
        done = 0
        for data in lines:
            for piece in data.splitlines(keepends=True):
                line = joiner.feed(piece)
                if line is None:
                    continue
                m, seq, raw = wire.decode(line, secret=SECRET)
                if fold is None:
                    msg = Message.received(recv=time.monotonic(), m=m, body=raw, step_id=1)
                else:   # v1: typed as now, its lists of pids and evidence kept as they were (messages.py before)
                    msg = Message.received(recv=time.monotonic(), m=m, step_id=1,
                                           body={k: v for k, v in raw.items() if k not in ("pids", "evidence")})
                guard.accept(f"{msg.node}/{msg.agent}", seq)
                t.on_message(msg)
                if fold is not None:
                    fold(msg, raw)
                done += 1
        return done

    rows: list[tuple[str, float]] = []
    # v1, the baseline: warm once (the pid tables), then the measured tick
    t1, ev1 = tracker(), {}  # type: ignore[var-annotated]
    fold1 = lambda msg, raw: v1_fold(t1, raw, msg.recv, ev1)   # noqa: E731
    per_frame(frames(False, 1), t1, fold1)
    v1_lines = frames(False, 2)
    spent, done = cpu(lambda: per_frame(v1_lines, t1, fold1))
    rows.append(("v1: objects and lists, evidence parsed every beat (baseline)", spent / done))
    # v2
    t2 = tracker()
    per_frame(frames(True, 1), t2, None)
    v2_lines = frames(True, 2)
    spent, done = cpu(lambda: per_frame(v2_lines, t2, None))
    rows.append(("v2: pids and evidence packed (ships)", spent / done))
    # a relay's batch of G v2 bodies under one MAC (prototype of the supervisor's side)
    tb = tracker()
    groups = [list(range(g, min(g + a.batch, n))) for g in range(0, n, a.batch)]

    def batches(tick: int) -> list[bytes]:
        return [wire.encode(MessageKind.HB, {"beats": [body(i, tick, per, True) for i in group]}, seq=tick,
                            secret=SECRET) for group in groups]

    def per_batch(lines: list[bytes]) -> int:
        done = 0
        for line in lines:
            _, _, raw = wire.decode(line, secret=SECRET)
            now = time.monotonic()
            for beat in raw["beats"]:
                tb.on_message(Message.received(recv=now, m=MessageKind.HB, body=beat, step_id=1))
                done += 1
        return done
    per_batch(batches(1))
    b_lines = batches(2)
    spent, done = cpu(lambda: per_batch(b_lines))
    rows.append((f"batch of {a.batch} v2 bodies, one MAC (relay tree, not built)", spent / done))

    # relay summaries: what ships past relay_above_nodes
    from ckptsup.supervisor.job.relays import plan
    from ckptsup.supervisor.node.relay import SUMMARIES_PER_BEAT, ChildLatest, RelayHub, summarise
    tr = tracker()
    tree = plan(nodes, 1)

    def summaries(tick: int) -> list[bytes]:
        out = []
        for relay, children in tree.items():
            held = {c: ChildLatest() for c in children}
            for q in range(SUMMARIES_PER_BEAT):
                for j, c in enumerate(children):
                    if j * SUMMARIES_PER_BEAT // len(children) == q:
                        held[c].beat("a", messages.Heartbeat.from_body(body(int(c[1:]), tick, per, True)))
                for summary in summarise(children, held, evidence=False):
                    if tick > 1:   # a steady beat: nothing changed
                        summary = messages.RelaySummary(children=summary.children, heard=summary.heard,
                                                        low_step=summary.low_step, high_step=summary.high_step)
                    out.append(step_lines.pieces(messages.encode(summary, seq=tick * 10 + q, secret=SECRET,
                                                                 envelope={"node": relay, "agent": "a"}),
                                                 f"{relay}/a".encode()))
        return out

    def per_summary(lines: list[bytes]) -> int:
        per_frame(lines, tr, None)
        return n - len(tree)   # the node-beats they carry
    per_summary(summaries(1))
    r_lines = summaries(2)
    spent, done = cpu(lambda: per_summary(r_lines))
    rows.append((f"relay summaries, {len(tree)} relays x {SUMMARIES_PER_BEAT} a beat (ships)", spent / done))
    import selectors
    hub = RelayHub(addr="127.0.0.1", secret=SECRET, sel=selectors.DefaultSelector(), generation=1,
                   children=nodes[:128], evidence=False)
    child_frames = [wire.decode(wire.encode(MessageKind.HB, body(i % 128, i, per, True), seq=i + 1, secret=SECRET),
                                secret=SECRET) for i in range(min(n, 4096))]
    raw_frames = [wire.encode(MessageKind.HB, body(i % 128, i, per, True), seq=i + 1, secret=SECRET)
                  for i in range(min(n, 4096))]

    def relay_side() -> int:
        for line in raw_frames:
            frame = wire.decode(line, secret=SECRET)
            hub.take(*frame)
        return len(raw_frames)
    del child_frames
    spent_relay, done_relay = cpu(relay_side)
    hub.close()

    base = rows[0][1]
    print(f"{n} node-beats of {per} ranks each, one thread, process CPU")
    print(f"{'frame design':64}{'us/beat':>9}{'ratio':>7}{'2,048/s':>9}{'16,384/s':>10}")
    for name, s in rows:
        print(f"{name:64}{s * 1e6:9.1f}{s / base:7.2f}{100 * s * 2048:8.1f}%{100 * s * 16384:9.1f}%")
    each = spent_relay / done_relay
    print(f"on a relay's node: {each * 1e6:.1f} us per child frame (RelayHub.take with its MAC check): 128 children "
          f"at one beat a second = {100 * each * 128:.2f}% of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
