"""A torch-free stand-in for a training rank, for supervisor/agent tests: it speaks the wire
protocol over CKPTSUP_RANK_SOCKET (hello, phase, step, nan, bye) the way the hooks do, and can
crash, hang or report NaN on command. Progress persists in <out>/rank<R>.step so a restart resumes.

usage: wire_rank.py --steps N [--step-s S] [--crash-at K] [--hang-at K] [--nan-at K] [--once]
                    [--crash-attempt A] [--hang-attempt A] [--nan-attempt A]
                    [--intrude-at K] [--until FILE] --out DIR

--crash-attempt/--hang-attempt/--nan-attempt A: that fault only in attempt A (chained faults in one
run: each attempt meets its own); without one, --once (attempt 0 only) or every attempt.

--intrude-at K: at step K of the first attempt, rank 0 also plays an intruder on its agent's rank
socket (connections that close without a frame, a 1 MB line, deep brackets, forged and replayed
frames, well-signed frames with wrong body types); none of it may cost a restart.
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
    p.add_argument("--crash-attempt", type=int, default=-1, help="the crash only in this attempt")
    p.add_argument("--hang-attempt", type=int, default=-1, help="the hang only in this attempt")
    p.add_argument("--nan-attempt", type=int, default=-1, help="the NaN only in this attempt")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--abort-at-exit", action="store_true", help="rank --fault-rank aborts (SIGABRT) after its bye")
    p.add_argument("--commit-every", type=int, default=0, help="report a checkpoint_committed event every K steps")
    p.add_argument("--intrude-at", type=int, default=-1, help="rank 0 attacks its agent's rank socket at step K (attempt 0)")
    p.add_argument("--until", default="", help="go on stepping past --steps until this file exists")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("CKPTSUP_ATTEMPT", "0"))
    secret = read_secret(os.environ["CKPTSUP_SECRET_FILE"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["CKPTSUP_RANK_SOCKET"])
    seq = [0]
    sent: list[bytes] = []  # what this rank said, for the intruder to replay

    def send(m, body):
        seq[0] += 1
        frame = wire.encode(m, body, seq=seq[0], secret=secret)
        sent.append(frame)
        try:
            sock.sendall(frame)
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

    def faulty_for(only_attempt: int) -> bool:
        return rank == a.fault_rank and attempt == only_attempt if only_attempt >= 0 else faulty
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

    def steps():
        step = start
        while step < a.steps or (a.until and not os.path.exists(a.until)):
            yield step
            step += 1

    for step in steps():
        if rank == 0 and step == a.intrude_at and attempt == 0:
            intrude(os.environ["CKPTSUP_RANK_SOCKET"], secret, sent[:3])
        peers_at(step)
        t0 = time.monotonic()
        if faulty_for(a.crash_attempt) and step == a.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty_for(a.hang_attempt) and step == a.hang_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(a.step_s)
        if a.nan_attempt >= 0:
            finite = not (faulty_for(a.nan_attempt) and step == a.nan_at)
        else:
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


def intrude(path: str, secret: bytes, replay: list[bytes]) -> None:
    """Everything an intruder (or a confused process of ours) can send the agent's rank socket."""
    def session(*payloads: bytes) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            for payload in payloads:
                s.sendall(payload)
        except OSError:
            pass  # the agent may close a flood before it is all sent
        finally:
            s.close()

    for _ in range(15):
        session()                                            # connect, say nothing, leave
    session(b"x" * (1 << 20))                                # 1 MB without a newline
    session(b"[" * 2048 + b"\n")                             # deep brackets, no MAC
    session(wire.encode("hello", {"rank": 0, "pid": os.getpid()}, seq=1, secret=b"guess" * 8))
    session(b"".join(replay))                                # this rank's own frames, replayed
    session(wire.encode("hello", {"rank": "x", "pid": os.getpid()}, seq=2, secret=secret),  # no identity
            wire.encode("step", {"rank": 0, "step": []}, seq=3, secret=secret),
            wire.encode("rank_exit", {"rank": 0, "rc": 9}, seq=4, secret=secret),
            wire.encode("phase", {"rank": 0, "phase": [], "step": {}}, seq=5, secret=secret))


if __name__ == "__main__":
    sys.exit(main())
