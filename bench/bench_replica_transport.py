"""Which way a memory replica should travel between two nodes: over TCP between the agents (the
memory channel, what ckptsup does) or over the ranks' own collectives (a gloo send/recv between
two rank processes) — measured side by side, same bytes, same run, beside a raw TCP socket.

    python bench/bench_replica_transport.py [--mb 256] [--repeats 5]

  raw_tcp     sendall of the bytes to a recv_into a preallocated buffer (the loopback's own rate)
  agent_tcp   ckptsup's replica put: an authenticated memory-channel session to a MemoryServer in
              another process, the bundle stored there and acknowledged (what PeerLinks sends)
  gloo        torch.distributed send/recv of a uint8 tensor between two processes into a fresh
              tensor each time (gloo over TCP: the collectives a CPU job's ranks have; NCCL's
              are a GPU check)
Every figure is the median of --repeats transfers on loopback; ratios are against raw_tcp.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = b"cd" * 32


def serve_store() -> None:
    """A replica store in its own process, as a buddy agent's."""
    from ckptsup.supervisor.node.memory_store import MemoryServer, MemoryStore, tcp_listener

    server = MemoryServer(tcp_listener("127.0.0.1"), secret=SECRET, store=MemoryStore(keep=1)).start()
    print(server.address, flush=True)
    sys.stdin.read()


def agent_tcp(payload: bytes, repeats: int) -> list[float]:
    from ckptsup.memory_wire import MemoryOp, Session

    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        host, _, port = proc.stdout.readline().strip().rpartition(":")
        times = []
        for step in range(repeats):
            start = time.perf_counter()
            with socket.create_connection((host, int(port))) as sock:
                session = Session.connect(sock, SECRET, role="replica:bench", max_payload=1 << 40)
                session.send(MemoryOp.PUT, {"step": step, "rank": 0, "checkpoint_id": f"c{step}", "manifest": "{}",
                                            "sizes": [len(payload)]}, payload)
                op, _, _ = session.recv()
            times.append(time.perf_counter() - start)
            assert op is MemoryOp.STORED, op
        return times
    finally:
        proc.stdin.close()
        proc.wait(10)


def raw_tcp(payload: bytes, repeats: int) -> list[float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = ("import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            f"buf=bytearray({len(payload)}); view=memoryview(buf)\n"
            f"for _ in range({repeats}):\n"
            f"    got=0\n"
            f"    while got<{len(payload)}: got+=s.recv_into(view[got:])\n"
            "    s.sendall(b'k')\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = listener.accept()
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            conn.sendall(payload)
            assert conn.recv(1) == b"k"
            times.append(time.perf_counter() - start)
    finally:
        conn.close()
        listener.close()
        proc.wait(10)
    return times


def _gloo_rank(rank: int, nbytes: int, repeats: int, port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tensor = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(torch.empty(1, dtype=torch.uint8), src=1)   # the ack, as the store's `stored`
        else:   # a fresh tensor each time, as a store keeps every replica it takes (no reused, faulted-in pages)
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            dist.recv(tensor, src=0)
            dist.send(torch.ones(1, dtype=torch.uint8), dst=0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def gloo(nbytes: int, repeats: int) -> list[float]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    mp.spawn(_gloo_rank, args=(nbytes, repeats, port, out), nprocs=2)
    times = json.loads(out.read_text())
    out.unlink()
    return times


def main() -> int:
    nbytes = ARGS.mb << 20
    payload = os.urandom(1 << 20) * ARGS.mb
    medians = {"raw_tcp": statistics.median(raw_tcp(payload, ARGS.repeats)),
               "agent_tcp": statistics.median(agent_tcp(payload, ARGS.repeats)),
               "gloo": statistics.median(gloo(nbytes, ARGS.repeats))}
    out = {"bytes": nbytes, "repeats": ARGS.repeats, "median_s": medians,
           "gbps": {k: nbytes / v / 1e9 for k, v in medians.items()},
           "vs_raw_tcp": {k: v / medians["raw_tcp"] for k, v in medians.items()}}
    print(json.dumps(out, indent=2))
    g = out["gbps"]
    faster = "agent_tcp" if medians["agent_tcp"] <= medians["gloo"] else "gloo"
    print(f"replica of {ARGS.mb} MiB: raw TCP {g['raw_tcp']:.2f} GB/s, agents' TCP {g['agent_tcp']:.2f} GB/s, "
          f"gloo send/recv {g['gloo']:.2f} GB/s; faster here: {faster} "
          f"(gloo/agent time = {medians['gloo'] / medians['agent_tcp']:.2f})")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve", action="store_true")
    ARGS = p.parse_args()
    if ARGS.serve:
        serve_store()
        sys.exit(0)
    sys.exit(main())
