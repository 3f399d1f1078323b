"""Overhead of run.step_done() on steps that do not save, against the same loop without hooks,
for a 50 ms step (target <= 1%).

    python bench/bench_step_overhead.py [--steps 200] [--step-ms 50] [--world 1 2]

Each configuration runs the same loop twice in one process: without hooks, then with attach() +
step_done() every step (saves far away). A "step" is a real small forward/backward/AdamW update
plus a sleep that pads it to --step-ms, so the baseline is stable on a shared machine. With world 2
(torch.multiprocessing, gloo) step_done includes the control all-reduce (about once a second);
with a fake agent (a separate process draining the socket) it also includes the heartbeat frame. Printed: the mean wall time of a step with and
without hooks, the mean time spent inside step_done itself (the direct cost, which on a loaded
machine includes being descheduled), and step_done called back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def drain(conn: socket.socket) -> None:
        while conn.recv(65536):
            pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def fake_agent(base: Path) -> tuple[dict[str, str], object]:
    """A separate process (as the real agent is) that accepts rank connections and drains them."""
    import multiprocessing

    secret = base / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    path = base / "ranks.sock"
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(str(path),), daemon=True)
    proc.start()
    while not path.exists():
        time.sleep(0.01)
    return {"CKPTSUP_RANK_SOCKET": str(path), "CKPTSUP_SECRET_FILE": str(secret)}, proc


def worker(rank: int, world: int, args: argparse.Namespace, base: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import ckptsup

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    step_s = args.step_ms / 1000

    def one_step() -> torch.Tensor:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rest = step_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return loss.detach()

    def loop(run) -> tuple[float, float]:
        inside = []
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            loss = one_step()
            if run is not None:
                t0 = time.perf_counter()
                run.step_done(step, loss=loss)
                inside.append(time.perf_counter() - t0)
        total = (time.perf_counter() - start) / args.steps
        return total, (statistics.mean(inside) if inside else 0.0)

    for _ in range(5):
        one_step()
    base_step, _ = loop(None)
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=os.path.join(base, "ck"),
                         save_every_steps=0, save_every_s=1e9, jitter_s=0, allow_stateless_dataloader=True)
    hooked_step, inside = loop(run)
    # the same calls back to back (no sleeping step between them to be descheduled in)
    loss = one_step()
    tight_start = time.perf_counter()
    for step in range(args.steps, args.steps + 2000):
        run.step_done(step, loss=loss)
    tight = (time.perf_counter() - tight_start) / 2000
    run.close(final_save=False)
    if rank == 0:
        Path(out).write_text(json.dumps({"base_step_s": base_step, "hooked_step_s": hooked_step, "step_done_s": inside,
                                         "tight_step_done_s": tight}))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace, supervised: bool) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        for key in [k for k in os.environ if k.startswith("CKPTSUP_")]:
            del os.environ[key]
        agent = None
        if supervised:
            agent_env, agent = fake_agent(Path(tmp))
            os.environ.update(agent_env)
        out = os.path.join(tmp, "result.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if world == 1:
            worker(0, 1, args, tmp, port, out)
        else:
            mp.spawn(worker, args=(world, args, tmp, port, out), nprocs=world, join=True)
        for key in ("CKPTSUP_RANK_SOCKET", "CKPTSUP_SECRET_FILE"):
            os.environ.pop(key, None)
        if agent is not None:
            agent.terminate()
            agent.join()
        return json.loads(Path(out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for world in args.world:
        for supervised in (False, True):
            r = measure(world, args, supervised)
            r.update(world=world, supervised=supervised,
                     overhead_pct=100 * (r["hooked_step_s"] - r["base_step_s"]) / r["base_step_s"],
                     direct_pct=100 * r["step_done_s"] / r["base_step_s"])
            rows.append(r)
            if not args.json:
                print(f"world {world} {'with agent socket' if supervised else 'no supervisor   '}: step "
                      f"{r['base_step_s'] * 1e3:.2f} ms -> {r['hooked_step_s'] * 1e3:.2f} ms "
                      f"({r['overhead_pct']:+.2f}%), inside step_done {r['step_done_s'] * 1e6:.0f} us "
                      f"= {r['direct_pct']:.2f}% of a step (target <= 1%); back to back "
                      f"{r['tight_step_done_s'] * 1e6:.0f} us", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
