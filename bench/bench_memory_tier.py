"""Restore bandwidth of each source of the memory tier and the disk tiers, same state, same run;
the step-time cost of memory saves; and the modelled peer-memory : parallel-FS restore ratio.

    python bench/bench_memory_tier.py [--state-mb 256] [--repeats 3] [--overhead-s 60]

Restore = fetch + verify every byte against the manifest + deserialise into fresh tensors (what a
resume does), for one rank's state of --state-mb:
  memory       the rank's own agent store (a separate process) over its Unix socket
  peer_memory  the rank's agent lacks the bundle and fetches it from another agent's store over
               TCP on loopback (the memory channel, authenticated), then serves it
  shared       a ckptsup disk checkpoint of the same state (attach + sync save), page cache
               evicted first (posix_fadvise DONTNEED: drop_caches needs root), resumed by Run
  object       the same checkpoint fetched back from a real moto_server (when moto_server is
               installed) and resumed
beside raw dd of the shard file from a cold page cache (the device's own read rate).

Overhead: the same ~50 ms training step with a memory save every 10 s (stage + background
serialise + hand-over to the agent store) and without, interleaved A/B, median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_hash import evict as evict_file  # noqa: E402
from ckptsup.hooks.memory_tier import BundleReader, MemoryClient, memory_checkpoint_id, serialize  # noqa: E402

SECRET_HEX = "ab" * 32


def serve(kind: str, where: str, sources: str) -> None:
    """A memory store in its own process (an agent's, without the rest of the agent)."""
    from ckptsup.supervisor.memory_store import MemoryServer, MemoryStore, PeerLinks, tcp_listener, unix_listener

    secret = SECRET_HEX.encode()
    store = MemoryStore(keep=2)
    peers = PeerLinks(secret=secret, node="bench")
    if sources:
        peers.set(buddies=[], sources={1: [sources]})
    listener = unix_listener(where) if kind == "unix" else tcp_listener("127.0.0.1")
    server = MemoryServer(listener, secret=secret, store=store, peers=peers).start()
    print(server.address if kind == "tcp" else where, flush=True)
    sys.stdin.read()   # until the bench closes our stdin


def start_store(kind: str, where: str = "", sources: str = "") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, where or "-", sources or "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    return proc, line


def state_of(mb: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    n = mb * (1 << 20) // 4 // 8
    return {"model": {f"w{i}": torch.randn(n) for i in range(8)}}


def restore(bundle_fetch, like: dict) -> float:
    import torch.distributed.checkpoint as dcp

    from ckptsup.hooks.loader import _fresh_copy
    from ckptsup.hooks.reader import safe_load_planner

    start = time.perf_counter()
    bundle = bundle_fetch()
    reader = BundleReader(bundle)
    reader.read_metadata()
    targets = _fresh_copy(like)
    dcp.load(targets, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    return time.perf_counter() - start


def evict(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            evict_file(path)


def dd_read(path: Path) -> float:
    evict(path.parent)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    return time.perf_counter() - start


def disk_resume(ck: Path, like_seed: int) -> float:
    import ckptsup

    model = torch.nn.Module()
    for name, tensor in state_of(ARGS.state_mb, like_seed)["model"].items():
        model.register_buffer(name, tensor.clone())
    evict(ck)
    start = time.perf_counter()
    run = ckptsup.attach(model=model, checkpoint_dir=str(ck), save_every_s=3600, async_save=False)
    step = run.resume()
    elapsed = time.perf_counter() - start
    run.close(final_save=False)
    assert step == 1, step
    return elapsed


def disk_save(ck: Path) -> None:
    import ckptsup

    model = torch.nn.Module()
    for name, tensor in state_of(ARGS.state_mb)["model"].items():
        model.register_buffer(name, tensor)
    run = ckptsup.attach(model=model, checkpoint_dir=str(ck), save_every_s=3600, async_save=False)
    run.resume()
    run.step_done(0)
    run.save(blocking=True)
    run.close(final_save=False)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-", dir=ARGS.dir))
    os.chmod(tmp, 0o700)
    secret = tmp / "secret"
    secret.write_text(SECRET_HEX)
    secret.chmod(0o600)
    os.environ.update(CKPTSUP_SITE_CONFIG=str(tmp / "site.toml"))
    (tmp / "site.toml").write_text("[checkpoint]\nkeep_daily_days = 0\ntest_load_every = 0\n")
    size = ARGS.state_mb * (1 << 20)
    saved = state_of(ARGS.state_mb)
    t0 = time.perf_counter()
    bundle = serialize(saved, step=1, checkpoint_id=memory_checkpoint_id(job_id="b", attempt=0, epoch=0, step=1),
                       algorithm="xxh3-128", extra={"rank": 1, "world_size": 2})
    serialize_s = time.perf_counter() - t0

    own, own_path = start_store("unix", str(tmp / "own.sock"))
    peer, peer_addr = start_store("tcp")
    spare, spare_path = start_store("unix", str(tmp / "spare.sock"), sources=peer_addr)
    procs = [own, peer, spare]
    results: dict[str, list[float]] = {k: [] for k in ("memory", "peer_memory", "shared", "dd")}
    try:
        client = MemoryClient(socket_path=own_path, secret_file=str(secret), rank=1)
        t0 = time.perf_counter()
        client.put(bundle)
        put_s = time.perf_counter() - t0
        # the peer holds rank 1's replica (as a buddy would), put there over TCP by a peer link
        from ckptsup.supervisor.memory_store import Held, PeerLinks

        links = PeerLinks(secret=SECRET_HEX.encode(), node="own")
        names = [f.path for f in bundle.manifest.files]
        held = Held(step=1, rank=1, checkpoint_id=bundle.manifest.checkpoint_id, manifest=bundle.manifest.to_json(),
                    sizes=tuple(len(bundle.data[n]) for n in names), payload=b"".join(bundle.data[n] for n in names))
        links.set(buddies=[peer_addr], sources={})
        links.replicate(held)
        deadline = time.monotonic() + 120
        while not (notes := links.take()) and time.monotonic() < deadline:
            time.sleep(0.05)
        replicate_s = notes[0]["replicate_s"] if notes else float("nan")
        ck = tmp / "ck"
        disk_save(ck)
        shard = next(p for p in (ck / "step_1").glob("__*_0.distcp"))
        for i in range(ARGS.repeats):
            results["memory"].append(restore(lambda: client.get(1), saved))
            # a fresh spare store each time, so the fetch really goes to the peer
            spare.stdin.close()
            spare.wait(10)
            spare, spare_path = start_store("unix", str(tmp / f"spare{i}.sock"), sources=peer_addr)
            procs.append(spare)
            spare_client = MemoryClient(socket_path=spare_path, secret_file=str(secret), rank=1)
            results["peer_memory"].append(restore(lambda: spare_client.get(1), saved))
            results["shared"].append(disk_resume(ck, like_seed=1 + i))
            results["dd"].append(dd_read(shard))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(10)
    out = {"state_bytes": size, "serialize_s": serialize_s, "put_s": put_s, "replicate_s": replicate_s,
           "median_s": {k: statistics.median(v) for k, v in results.items()},
           "gbps": {k: size / statistics.median(v) / 1e9 for k, v in results.items()}}
    if ARGS.overhead_s > 0:
        out["overhead"] = overhead(tmp, secret)
    shared_bytes = shard.stat().st_size
    out["dd_bytes"] = shared_bytes
    out["gbps"]["dd"] = shared_bytes / out["median_s"]["dd"] / 1e9
    # the modelled ratio at a cluster's bandwidths: one node's share of a 1 TB checkpoint on 128 nodes
    per_node = 1e12 / 128
    out["model"] = {f"fs_{fs}GBps": {"peer_memory_s": per_node / 25e9, "parallel_fs_s": per_node / (fs * 1e9),
                                     "ratio": (per_node / (fs * 1e9)) / (per_node / 25e9)} for fs in (3, 10)}
    print(json.dumps(out, indent=2))
    g = out["gbps"]
    print(f"restore GB/s: memory {g['memory']:.2f}, peer_memory {g['peer_memory']:.2f} (loopback TCP), shared cold "
          f"{g['shared']:.2f}, raw dd cold {g['dd']:.2f}; memory/shared = {out['median_s']['shared'] / out['median_s']['memory']:.1f}x")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def overhead(tmp: Path, secret: Path) -> dict:
    """A ~50 ms step, memory saves every 10 s vs none, interleaved blocks of --overhead-s each."""
    from ckptsup.hooks.memory_tier import MemorySaver

    store, path = start_store("unix", str(tmp / "ovh.sock"))
    try:
        saver = MemorySaver(MemoryClient(socket_path=path, secret_file=str(secret), rank=0), algorithm="xxh3-128",
                            max_bytes=0, on_result=lambda r: None)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(256, 1024)

        def step() -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        def calibrate() -> int:
            start = time.perf_counter()
            step()
            return max(1, round(0.05 / (time.perf_counter() - start)))

        reps = calibrate()
        times = {"off": [], "on": []}
        saves = 0
        for block in range(4):
            mode = "on" if block % 2 else "off"
            end = time.perf_counter() + ARGS.overhead_s / 4
            last_save = time.perf_counter()
            n = 0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                for _ in range(reps):
                    step()
                if mode == "on" and time.perf_counter() - last_save >= 10.0:
                    last_save = time.perf_counter()
                    n += 1
                    saver.save(step=n, checkpoint_id=memory_checkpoint_id(job_id="o", attempt=0, epoch=0, step=n),
                               device_state={"model": model.state_dict()}, side_state={}, extra={})
                    saves += 1
                times[mode].append(time.perf_counter() - t0)
        saver.close()
    finally:
        store.stdin.close()
        store.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    return {"step_s_median": med, "step_s_mean": mean, "saves": saves,
            "state_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "overhead_median": med["on"] / med["off"] - 1, "overhead_mean": mean["on"] / mean["off"] - 1}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overhead-s", type=float, default=60.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--serve", nargs=3, default=None)
    ARGS = p.parse_args()
    if ARGS.serve:
        kind, where, sources = ARGS.serve
        serve(kind, "" if where == "-" else where, "" if sources == "-" else sources)
        sys.exit(0)
    sys.exit(main())
