"""A DDP script as users write it, whose data comes from DataLoader worker processes
(`num_workers=2`, a DistributedSampler, a new set of workers each epoch). It knows nothing of the
supervisor it runs under (progress lines only: rank 0 prints `step N`). It saves its own state at
the end of each epoch (atomically) and resumes from it.

    torchrun --nproc-per-node 2 data_ddp.py --epochs 5 --ckpt-dir D --out final.pt
             [--cpu-stall E[:R]] [--io-stall E[:R]] [--stall-s 40] [--forever E[:R]] [--dead-worker E[:R]]

Each fault comes from the worker that loads the first batch of epoch E on rank R (every rank
without R), once per run (a marker file in --ckpt-dir), and never changes the data:
--cpu-stall: the worker computes for --stall-s seconds first (a shard decoded, an expensive
  worker __init__, a tokenizer warming up);
--io-stall: the worker reads its batch from a TCP socket whose server (a thread of the rank's
  main process) answers --stall-s seconds later: a stalled network read (a remote dataset);
--forever: the same read, never answered (a dead data source);
--dead-worker: the worker kills itself (SIGKILL): the loader's own error in the rank.
data_ddp_hooks.py runs the same with ckptsup's hooks (the hooks level).
"""
import argparse
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SAMPLES = 64
BATCH = 4


def once(ckpt_dir, what):
    try:
        os.close(os.open(os.path.join(ckpt_dir, f".once-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def slow_server(delay_s):
    """A local data source that answers each request `delay_s` seconds late (never: None)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve():
        while True:
            conn, _ = server.accept()
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn):
        conn.recv(64)
        if delay_s is None:
            threading.Event().wait()
        time.sleep(delay_s)
        conn.sendall(b"ok")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def fault_of(text):
    if not text:
        return None
    epoch, _, rank = text.partition(":")
    return int(epoch), (int(rank) if rank else None)


class Samples(Dataset):
    def __init__(self, args, rank, port_slow, port_never):
        self.args, self.rank, self.epoch = args, rank, 0
        self.port_slow, self.port_never = port_slow, port_never

    def __len__(self):
        return SAMPLES

    def _due(self, fault, name):
        return (fault is not None and fault[0] == self.epoch and fault[1] in (None, self.rank)
                and once(self.args.ckpt_dir, f"{name}-{self.epoch}-rank{self.rank}"))

    def __getitem__(self, i):
        if i == self.first:
            args = self.args
            if self._due(fault_of(args.cpu_stall), "cpu"):
                a, end = torch.randn(64, 64), time.monotonic() + args.stall_s
                while time.monotonic() < end:
                    a = torch.tanh(a @ a)
            if self._due(fault_of(args.io_stall), "io"):
                with socket.create_connection(("127.0.0.1", self.port_slow)) as conn:
                    conn.sendall(b"get\n")
                    conn.recv(64)
            if self._due(fault_of(args.forever), "forever"):
                with socket.create_connection(("127.0.0.1", self.port_never)) as conn:
                    conn.sendall(b"get\n")
                    conn.recv(64)
            if self._due(fault_of(args.dead_worker), "dead"):
                os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, x.sum(dim=0, keepdim=True)


def main(hooks=None):
    """`hooks`: the ckptsup module (data_ddp_hooks.py): attach and step_done each step."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-stall", default="")
    ap.add_argument("--io-stall", default="")
    ap.add_argument("--forever", default="")
    ap.add_argument("--dead-worker", default="")
    ap.add_argument("--stall-s", type=float, default=40.0)
    ap.add_argument("--step-s", type=float, default=0.05)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    path = os.path.join(args.ckpt_dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"]
        if rank == 0:
            print(f"resumed at epoch {start}", flush=True)
    # the hooks without their resume: the script's own epoch state is what it resumes from (ckptsup's
    # step checkpoints, taken mid-epoch, would not match its epoch-based data order)
    run = hooks.attach(model=model, optimizer=opt) if hooks is not None else None
    data = Samples(args, rank, slow_server(args.stall_s), slow_server(None))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    step = start * (SAMPLES // 2 // BATCH)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        data.epoch = epoch
        data.first = next(iter(sampler))   # the index the epoch's first batch starts with
        for x, y in loader:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_s)
            if run is not None:
                run.step_done(step, loss=loss.detach())
            step += 1
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "opt": opt.state_dict()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
    if run is not None:
        run.close()
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
