"""Supervisor cost at scale: N simulated agents (default 2,048) each send one heartbeat a second
(HMAC'd wire frames, as through srun, with the pids and evidence a real agent's carry) into the supervisor's real channel reader, attempt
tracker and detectors, run by the same loop code as `ckptsup launch` (AgentStep + AttemptTracker
.on_message/.check at the loop's tick). After a warm-up one simulated node falls silent; the run
reports the supervisor process's CPU (% of one core, excluding the simulator, which is a separate
process) and RSS, and the node-death detection latency against `node_silence_s`.

Each heartbeat carries its ranks' evidence (CPU time, I/O, state: supervisor/job/liveness.py) unless
--no-evidence, so the two can be compared in one sitting. Frames are wire version 2's (pids and evidence
packed: messages.pack_pids, pack_evidence). A node called dead that is not the silent one, or before it
fell silent, is printed as a FALSE node-down; a long --seconds is the false-positive run.
The baseline: the same command in a checkout of the code before (`git archive HEAD`), run alternately.

Past [supervisor] relay_above_nodes (2,048 by default; `--relay-above N` to choose, 0 = off) the
simulator plays the heartbeat tree as the agents would (supervisor/job/relays.plan): each relay's own
heartbeat and one summary a beat (supervisor/node/relay.summarise over its children's latest beats),
real frames on the real transport (HMAC'd, through the step's stdout); the dead node is a child, its
bit missing from its relay's summaries. The children -> relay leg (a frame each over TCP, checked by the
relay: RelayHub.take) runs on the relays' nodes, not here: its cost per child frame is measured by
bench/bench_heartbeat_frame.py --relay.

usage: python bench/bench_supervisor_scale.py [--agents 2048] [--seconds 30] [--ranks-per-node 1] [--no-evidence]
       [--fixed-rate] [--relay-above N]
"""
from __future__ import annotations

import argparse
import os
import queue
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptsup.config import SupervisorConfig  # noqa: E402
from ckptsup.supervisor.job.attempt import AttemptTracker  # noqa: E402
from ckptsup.supervisor.job.agent_step import AgentStep, CommandSender, Inbox  # noqa: E402
from ckptsup.supervisor.job.detection import at_scale  # noqa: E402
from ckptsup.supervisor.job.observations import FailureKind  # noqa: E402

SIMULATOR = r'''
import sys, time
sys.path.insert(0, sys.argv[4])
from ckptsup import messages, step_lines, wire
n, silent_after, secret = int(sys.argv[1]), float(sys.argv[2]), bytes.fromhex(sys.argv[3])
per, with_evidence, interval = int(sys.argv[5]), sys.argv[6] == "1", float(sys.argv[7])
relay_above = int(sys.argv[8]) if len(sys.argv) > 8 else 0
out = sys.stdout.buffer
seq = [0] * n
start = time.monotonic()
tick = 0
if relay_above:
    from ckptsup.supervisor.job.relays import plan
    from ckptsup.supervisor.node.relay import ChildLatest, summarise
    groups = plan([f"n{i}" for i in range(n)], relay_above)
if relay_above and groups:
    latest = {r: {c: ChildLatest() for c in children} for r, children in groups.items()}
    pids = {f"n{i}": messages.pack_pids({"rank": r, "pid": 1000 + r % per, "host_pid": 50000 + r}
                                        for r in range(i * per, (i + 1) * per)) for i in range(n)}
    alive = {f"n{i}": tuple(range(i * per, (i + 1) * per)) for i in range(n)}
    dead = f"n{n - 1}"
    from ckptsup.supervisor.node.relay import SUMMARIES_PER_BEAT as parts
    # a child's beat reaches its relay at the child's own phase in the period (index / children); the
    # relay sends what it took `parts` times a period: the tree's latency as it is, not hidden
    while True:
        tick += 1
        began = time.monotonic()
        if tick > 1 and began - start > (tick - 1) * interval + 2 * interval:   # behind its own schedule
            print(f"simulator: beat {tick} starts {began - start - (tick - 1) * interval:.1f}s late", file=sys.stderr, flush=True)
        for q in range(parts):
            for k, (relay, children) in enumerate(groups.items()):
                ev = messages.pack_evidence([r, 10.0 + 0.9 * tick, 1000 * tick, "R", 0, 0.0] for r in alive[relay]) if with_evidence else None
                held = latest[relay]
                now = time.monotonic() - start
                for j, child in enumerate(children):
                    if j * parts // len(children) != q:
                        continue
                    if child == dead and now > silent_after:
                        continue
                    held[child].beat("a1b2c3d4e5f6", messages.Heartbeat(ranks_alive=alive[child], last_step=tick, phase="train",
                                                                         torchrun=True, attempt=0, pids=pids[child], evidence=ev))
                i = int(relay[1:])
                frames = summarise(children, held, evidence=False)
                if q == 0:
                    frames.insert(0, messages.Heartbeat(ranks_alive=alive[relay], last_step=tick, phase="train", torchrun=True,
                                                        attempt=0, pids=pids[relay], evidence=ev))
                for body in frames:
                    seq[i] += 1
                    frame = messages.encode(body, seq=seq[i], secret=secret, envelope={"node": relay, "agent": "a1b2c3d4e5f6"})
                    out.write(step_lines.pieces(frame, f"{relay}/a".encode()))
                if k % 8 == 7:
                    out.flush()
                    time.sleep(interval / parts / (len(groups) / 8) * 0.9)
            out.flush()
            time.sleep(max(0.0, start + (tick - 1 + (q + 1) / parts) * interval - time.monotonic()))

while True:
    tick += 1
    for i in range(n):
        if i == n - 1 and time.monotonic() - start > silent_after:
            continue  # this node died
        seq[i] += 1
        ranks = list(range(i * per, (i + 1) * per))
        # what Agent.heartbeat sends (supervisor/node/agent.py): the pids too (an O(nodes) bookkeeping
        # of them made a heartbeat cost 5 ms at 16,384 nodes, hidden while the bench left them out)
        body = {"node": f"n{i}", "agent": "a1b2c3d4e5f6", "ranks_alive": ranks, "last_step": tick,
                "phase": "train", "stopped_ranks": [], "torchrun": True, "dropped": 0, "attempt": 0,
                "pids": messages.pack_pids({"rank": r, "pid": 1000 + r % per, "host_pid": 50000 + r} for r in ranks)}
        if with_evidence:
            body["evidence"] = messages.pack_evidence([r, 10.0 + 0.9 * tick, 1000 * tick, "R", 0, 0.0] for r in ranks)
        out.write(step_lines.pieces(wire.encode("hb", body, seq=seq[i], secret=secret), f"n{i}/a".encode()))
        if i % 256 == 255:
            out.flush()
            time.sleep(interval / (n / 256) * 0.9)
    out.flush()
    time.sleep(max(0.0, start + tick * interval - time.monotonic()))
'''


def relays_above(chosen: int | None) -> int | None:
    """The relay threshold this checkout knows (None: a checkout before relays)."""
    if "relay_above_nodes" not in SupervisorConfig.__dataclass_fields__:
        return None
    return SupervisorConfig().relay_above_nodes if chosen is None else chosen


def heard_rate(tracker: AttemptTracker, since: float, end: float) -> float:
    """Nodes heard within the last 1.5 beats at the end, per beat period: how many node-beats a
    second reached the tracker (through relays or directly)."""
    period = tracker.config.heartbeat_interval_s
    recent = sum(1 for v in tracker.node_views.values() if end - v.last_heard <= 1.5 * period)
    return recent / period


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--silence-s", type=float, default=5.0)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--no-evidence", action="store_true")
    p.add_argument("--fixed-rate", action="store_true", help="1 heartbeat a second whatever the node count (before at_scale)")
    p.add_argument("--relay-above", type=int, default=None, help="[supervisor] relay_above_nodes (default: the config's)")
    a = p.parse_args()
    relays = relays_above(a.relay_above)
    secret = os.urandom(32)
    nodes = tuple(f"n{i}" for i in range(a.agents))
    # what `ckptsup launch` does with this many nodes: beyond 2,048 the agents beat less often
    # the simulated ranks never say hello: no init deadline (at 300 s it was a hang blamed on the first node)
    base = SupervisorConfig(node_silence_s=a.silence_s, init_timeout_s=7 * 86400.0,
                            **({"relay_above_nodes": relays} if relays is not None else {}))
    config = base if a.fixed_rate else at_scale(base, a.agents)
    inbox = Inbox()
    silent_after = a.seconds * 0.6
    print(f"heartbeat every {config.heartbeat_interval_s:g}s, node_silence_s {config.node_silence_s:g}, "
          f"relays: {'past ' + str(relays) + ' nodes' if relays else 'none (this code has none, or off)'}")
    work = Path(tempfile.mkdtemp(prefix="ckptsup-scale-"))
    launched = time.monotonic()
    step = AgentStep(argv=[sys.executable, "-c", SIMULATOR, str(a.agents), str(silent_after), secret.hex(),
                           str(Path(__file__).resolve().parents[1]), str(a.ranks_per_node),
                           "0" if a.no_evidence else "1", str(config.heartbeat_interval_s), str(relays or 0)],
                     env=dict(os.environ), nodes=nodes, secret=secret, sender=CommandSender(secret), inbox=inbox,
                     log_path=work / "sim.log")
    first = inbox.get(timeout=120)   # the attempt starts with the agents' first frame (the simulator's start-up
    start = time.monotonic()         # builds the tree: seconds on a loaded box, not the supervisor's silence)
    silent_after -= start - launched
    tracker = AttemptTracker(attempt=0, nodes=nodes, nproc_per_node=a.ranks_per_node, config=config, started=start)
    tracker.on_message(first)
    cpu0 = time.process_time()
    frames = 0
    detected = None
    warm = start + 5.0
    cpu_warm = None
    last_recv, pause = start, (0.0, 0.0)   # the longest pause of the frame stream (start, length): a starved simulator
    while time.monotonic() - start < a.seconds + config.node_silence_s * 2:
        try:
            msg = inbox.get(timeout=0.05)
            if msg.recv - last_recv > pause[1]:
                pause = (last_recv - start, msg.recv - last_recv)
            last_recv = msg.recv
            tracker.on_message(msg)
            frames += 1
            drain_until = time.monotonic() + 0.2   # a supervisor that cannot keep up still checks (backlog below)
            while time.monotonic() < drain_until:
                msg = inbox.get_nowait()
                tracker.on_message(msg)
                frames += 1
        except queue.Empty:
            pass
        now = time.monotonic()
        if cpu_warm is None and now >= warm:
            cpu_warm, frames_warm, t_warm = time.process_time(), frames, now
        failure = tracker.check(now)
        if failure is not None and failure.kind is FailureKind.NODE_DOWN and detected is None:
            detected = (failure.node, now - (start + silent_after))
            break
    end = time.monotonic()
    cpu = time.process_time() - (cpu_warm if cpu_warm is not None else cpu0)
    span = end - (t_warm if cpu_warm is not None else start)
    step.close(0.0)   # the simulator: stdin closed, then killed
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rate = (frames - (frames_warm if cpu_warm is not None else 0)) / span
    print(f"agents {a.agents} x {a.ranks_per_node} ranks, evidence {'off' if a.no_evidence else 'on'}: "
          f"{rate:.0f} frames/s received ({heard_rate(tracker, t_warm if cpu_warm is not None else start, end):.0f} "
          f"node-beats/s heard), {step.dropped} dropped, {inbox.qsize()} still queued at the end"
          + (" (a backlog: the supervisor did not keep up)" if inbox.qsize() > a.agents // 10 else ""))
    print(f"supervisor CPU {100 * cpu / span:.1f}% of one core (target <= 10%), max RSS {rss_mb:.0f} MB")
    silent_node = nodes[-1]
    if detected and (detected[0] != silent_node or detected[1] < 0):
        late = [line for line in (work / "sim.log").read_text().splitlines() if "late" in line]
        print(f"the simulator fell behind {len(late)} times; the last: {late[-1] if late else '-'}")
        print(f"the frame stream's longest pause: {pause[1]:.2f}s from {pause[0]:.0f}s (a simulator starved by the box "
              f"stops every frame; a supervisor fault would not)")
        print(f"FALSE node-down: {detected[0]} called dead {detected[1]:.2f}s after {silent_node} fell silent "
              f"(1 false node-down in {detected[1] + silent_after:.0f}s)")
    elif detected:
        print(f"0 false node-downs in the {silent_after:.0f}s before {silent_node} fell silent")
        print(f"node death: {detected[0]} detected {detected[1]:.2f}s after it fell silent (node_silence_s = "
              f"{config.node_silence_s:g}, counted from its last heartbeat, up to one period earlier); compare with "
              f"--agents 8 for the latency without load")
    else:
        print("node death NOT detected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
