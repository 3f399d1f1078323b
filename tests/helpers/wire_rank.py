"""A torch-free stand-in for a training rank, for supervisor/agent tests: it speaks the wire
protocol over CKPTSUP_RANK_SOCKET (hello, phase, step, nan, bye) the way the hooks do, and can
crash, hang or report NaN on command. Progress persists in <out>/rank<R>.step so a restart resumes.

usage: wire_rank.py --steps N [--step-s S] [--crash-at K] [--hang-at K] [--nan-at K] [--once] --out DIR
"""
import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ckptsup import wire  # noqa: E402
from ckptsup.rundir import read_secret  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--once", action="store_true", help="inject the fault only on the first attempt")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--abort-at-exit", action="store_true", help="rank --fault-rank aborts (SIGABRT) after its bye")
    p.add_argument("--commit-every", type=int, default=0, help="report a checkpoint_committed event every K steps")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("CKPTSUP_ATTEMPT", "0"))
    secret = read_secret(os.environ["CKPTSUP_SECRET_FILE"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["CKPTSUP_RANK_SOCKET"])
    seq = [0]

    def send(m, body):
        seq[0] += 1
        try:
            sock.sendall(wire.encode(m, body, seq=seq[0], secret=secret))
        except OSError:
            pass  # like the hooks: a lost agent channel does not stop training

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / f"rank{rank}.step"
    start = int(marker.read_text()) if marker.exists() else 0
    send("hello", {"rank": rank, "local_rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                   "node": os.environ.get("CKPTSUP_NODE"), "pid": os.getpid()})
    send("phase", {"rank": rank, "phase": "load" if start else "train", "step": start})
    if start:
        send("phase", {"rank": rank, "phase": "train", "step": start})
    faulty = rank == a.fault_rank and (not a.once or attempt == 0)
    sock.settimeout(0.001)
    commands = out / f"rank{rank}.commands"

    def read_commands():
        try:
            data = sock.recv(65536)
        except (BlockingIOError, socket.timeout):
            return
        for line in data.splitlines():
            try:
                m, _, body = wire.decode(line, secret=secret)
            except wire.FrameError:
                continue
            with open(commands, "a") as fh:
                fh.write(json.dumps({"m": m, "body": body}) + "\n")
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def peers_at(step):  # like an all-reduce: nobody runs ahead of the slowest rank
        while True:
            done = []
            for r in range(world):
                try:
                    done.append(int((out / f"rank{r}.step").read_text() or 0))
                except (FileNotFoundError, ValueError):
                    done.append(0)
            if min(done) >= step:
                return
            time.sleep(0.005)

    for step in range(start, a.steps):
        peers_at(step)
        t0 = time.monotonic()
        if faulty and step == a.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and step == a.hang_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(a.step_s)
        finite = not (faulty and step == a.nan_at) and not (a.nan_at == step and not a.once and rank == a.fault_rank)
        if not finite:
            send("nan", {"rank": rank, "step": step, "loss": "nan"})
            time.sleep(30)
            return 6
        tmp = marker.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(step + 1))
        os.replace(tmp, marker)  # a rank killed mid-write must not leave an empty marker
        read_commands()
        if rank == 0 and a.commit_every and (step + 1) % a.commit_every == 0:
            send("event", {"record": {"event": "checkpoint_committed", "ts": "x", "mono": 0, "job_id": "local",
                                      "attempt": attempt, "step": step + 1, "stall_s": 2.0, "write_s": 0.5,
                                      "bytes": 1000}})
        send("step", {"rank": rank, "step": step, "step_time_s": time.monotonic() - t0, "loss_finite": True})
    send("bye", {"rank": rank, "status": 0})
    (out / f"rank{rank}.done").write_text(json.dumps({"attempt": attempt}))
    if a.abort_at_exit and rank == a.fault_rank:
        time.sleep(0.5)  # the bye reaches the supervisor first, as it does after a real close()
        os.abort()  # like a C++ std::terminate in interpreter teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
