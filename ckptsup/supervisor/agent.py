"""The agent: one per usable node (an srun task, or a child process in local mode). A spare's
agent (its node outside the launch spec) starts in standby, warms up, and waits for a restart.

It runs torchrun for its node, serves a node-local Unix socket (0700 directory) where the ranks
send HMAC'd frames, relays them up as frames on stdout (with `node` added) plus a heartbeat, and
reads the supervisor's commands as frames on stdin. One thread, one selector: the rank sockets,
stdin and a short tick for heartbeats and process checks.

Crash detection happens here: a rank whose connection drops without `bye` is reported at once
(no waiting for torchrun's monitor), and a stopped rank process (state T) is flagged in the
heartbeat so the supervisor can blame it when the hang timeout fires.

The rank socket is a boundary (docs/contracts.md §Wire frames): a connection is a rank only once
it sent an authenticated `hello` (good MAC, well-typed body, a fresh sequence number for that
rank and pid); until then its frames are dropped, and its end is logged (one line per
UNAUTH_LOG_EVERY_S, with a count) and reported to nobody. Replays are refused per rank identity,
across connections. Every relayed body is checked for the types the supervisor relies on; a
frame that is not a rank's to send (an agent's or a command kind) is dropped. Whatever arrives,
the agent goes on; only a rank that said hello can, by leaving, make a crash report.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, TypeGuard

import psutil

from .. import step_lines, wire
from ..config import MAX_REPLICAS
from ..errors import CkptsupError
from ..wire import Hop, MessageKind, Phase
from ..env import (RANK_MODULE_FLAG, cold_rank_argv, MEMORY_SOCKET, TEST_FLIP_MEMORY, NODE, PREEMPT_BUDGET_S, PYTHONUNBUFFERED, RANK_SOCKET, RUN_DIR, SECRET_FILE, WARM_DIR,
                   TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, ExitStatus, node_name)
from ..rundir import read_secret
from .. import console
from .spec import LaunchSpec
from .torchrun_args import installed_torchrun_has
from .rank_output import RankOutput
from .standby import Standby
from .external_agent import ExternalHasher, ExternalRequestError
from .memory_store import FlipMode, MemoryServer, MemoryStore, PeerLinks, tcp_listener, unix_listener
from .warm_pool import WarmPool
from . import evidence
from ..stack_dump import stack_file
from .processes import GONE, RUNNING, describe_exit, is_stopped, pid_views, terminate, where, zombie_status

TICK_S = 0.1
STANDBY_DELAY_S = 30.0
EXIT_CONFIRM_S = 0.3  # a dropped rank connection becomes a crash report unless torchrun exits 0 by then
CLEAN_GONE_S = 2.0    # a worker reaped unseen, while torchrun and another rank carry on this long: it exited 0
RANK_LINE_PREFIX = "[rank${rank}]: "   # torchrun --tee: the global rank on every line (progress.RANK_PREFIX)
OUTPUT_READ_BYTES = 1 << 16  # per wake-up: a flooding rank cannot starve the rank sockets
HELLO_TIMEOUT_S = 10.0   # a connection without an authenticated hello by then is closed (ranks say it at once)
MAX_UNAUTHENTICATED = 64  # connections waiting for their hello; beyond, the oldest is closed
UNAUTH_LOG_EVERY_S = 10.0


SOCKET_DIR_PREFIX = "ckptsup-agent-"


def socket_dir_prefix(host: str | None = None, pid: int | None = None, pidns: str | None = None) -> str:
    """`ckptsup-agent-<host>-<pid namespace>-<pid>-`: whose directory it is, so that the next agent
    on this host can remove those of killed agents (a SIGKILL skips our cleanup). The pid namespace
    is part of the name because a pid means something only inside its own: two dev clusters on one
    machine both have a node "n1" sharing /tmp, and their agents must not sweep each other's."""
    return f"{_host_prefix(host, pidns)}{pid or os.getpid()}-"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _host_prefix(host: str | None, pidns: str | None = None) -> str:
    # a long FQDN is cut: the socket's whole path must stay within AF_UNIX's 108 bytes
    return f"{SOCKET_DIR_PREFIX}{(host or socket.gethostname())[:40]}-{pidns or _pid_namespace()}-"


def sweep_stale_socket_dirs(tmp: Path | None = None, host: str | None = None,
                            alive: Callable[[int], bool] = psutil.pid_exists, pidns: str | None = None) -> list[Path]:
    """Remove this host's agent socket directories whose agent is gone. Only our own uid's, only
    this host's (nodes may share /tmp while their pid numbers are their own), never one whose pid
    is alive (a reused pid keeps a stale directory, the safe side)."""
    tmp = tmp or Path(tempfile.gettempdir())
    prefix = _host_prefix(host, pidns)
    removed = []
    for path in tmp.glob(f"{prefix}*"):
        # exactly <pid>-<mkdtemp's 8 characters>: host "n1" must not claim host "n1-2"'s directories
        match = re.fullmatch(r"(\d+)-[a-z0-9_]{8}", path.name[len(prefix):])
        try:
            if not match or path.is_symlink() or path.lstat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass(kw_only=True)
class RankConn:
    sock: socket.socket
    reader: wire.FrameReader
    opened: float = 0.0
    peer_pid: int | None = None   # the kernel's word (SO_PEERCRED), not the hello's
    rank: int | None = None       # set by an authenticated hello only: until then, no rank
    pid: int | None = None
    said_bye: bool = False

    @property
    def sender(self) -> str:
        """The replay guard's key: the rank's identity, the same on every connection it opens."""
        return f"rank {self.rank} pid {self.pid}"


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    except (AttributeError, OSError, struct.error):
        return None
    return pid if pid > 0 else None


@dataclass(kw_only=True)
class RateLimitedLog:
    """One stderr line per `every_s` at most, with how many things happened since the last one."""

    every_s: float
    clock: Callable[[], float] = time.monotonic
    last: float = -math.inf
    pending: int = 0

    def note(self, what: Callable[[int], str]) -> None:
        self.pending += 1
        self.flush(what)

    def flush(self, what: Callable[[int], str]) -> None:
        now = self.clock()
        if self.pending and now - self.last >= self.every_s:
            console.warning(f"ckptsup agent: {what(self.pending)}", err=True)
            self.last, self.pending = now, 0


def _unauth_line(count: int) -> str:
    return (f"{count} connection(s) to the rank socket ended without an authenticated hello; ignored "
            f"(not ranks of this job; at most one such line per {UNAUTH_LOG_EVERY_S:g}s)")


def _is_int(value: Any, *, low: int | None = None) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


RANK_SCOPED = frozenset({MessageKind.STEP, MessageKind.PHASE, MessageKind.NAN, MessageKind.SDC, MessageKind.BYE})


def _rank_body_ok(m: MessageKind, body: dict[str, Any]) -> bool:
    """Whether a rank frame's body has the types the agent and the supervisor rely on."""
    if m == MessageKind.STEP:
        return (_is_int(body.get("step"), low=0)
                and (body.get("step_time_s") is None or _is_number(body["step_time_s"]))
                and (body.get("compute_s") is None or _is_number(body["compute_s"]))
                and (body.get("sdc_s") is None or _is_number(body["sdc_s"]))
                and (body.get("loss") is None or _is_number(body["loss"]))
                and body.get("loss_finite", True) in (True, False))
    if m == MessageKind.PHASE:
        return isinstance(body.get("phase"), str) and (body.get("step") is None or _is_int(body["step"]))
    if m == MessageKind.NAN:
        return body.get("step") is None or _is_int(body["step"])
    if m == MessageKind.SDC:
        disputed = body.get("disputed")
        return (_is_int(body.get("step"), low=0) and _is_int(body.get("copies"), low=1)
                and isinstance(disputed, list) and len(disputed) <= 1 << 16 and all(_is_int(r, low=0) for r in disputed)
                and body.get("majority") in (True, False)
                and (body.get("agreed_step") is None or _is_int(body["agreed_step"], low=0)))
    if m == MessageKind.EVENT:
        return isinstance(body.get("record"), dict)
    if m == MessageKind.BYE:
        return _is_int(body.get("status"))
    return False


class Agent:
    def __init__(self, *, spec: LaunchSpec, node: str, secret: bytes, out: BinaryIO, inp: BinaryIO,
                 attempt: int) -> None:
        self.spec = spec
        self.node = node
        self.secret = secret
        self.out = out
        self.inp = inp
        self.attempt = attempt
        self.instance = uuid.uuid4().hex[:12]
        self.seq = 0
        self.stdin_reader = wire.FrameReader(secret=secret, sender="supervisor", on_drop=self._count_drop)
        self.rank_guard = wire.ReplayGuard()   # keyed by rank identity, across connections
        self.unauth_log = RateLimitedLog(every_s=UNAUTH_LOG_EVERY_S)
        self.sel = selectors.DefaultSelector()
        sweep_stale_socket_dirs()
        self.sock_dir = Path(tempfile.mkdtemp(prefix=socket_dir_prefix()))  # 0700
        self.sock_path = self.sock_dir / "ranks.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        self.server.listen(256)
        self.server.setblocking(False)
        self.sel.register(self.server, selectors.EVENT_READ, "accept")
        os.set_blocking(inp.fileno(), False)
        self.sel.register(inp, selectors.EVENT_READ, "stdin")
        self.conns: dict[socket.socket, RankConn] = {}
        self.torchrun: subprocess.Popen | None = None
        self.torchrun_reported = True
        self.standby: Standby | None = None
        self.last_step: int | None = None
        self.phase = Phase.INIT
        self.dropped = 0
        self.term_signal: int | None = None
        self.exit_requested = False
        self.last_hb = 0.0
        self.stopped_ranks: set[int] = set()
        self.pending_exits: list[tuple[float, int | None, int | None]] = []
        self.launched_at: float | None = None
        self.output: RankOutput | None = None
        self.output_pipe: IO[bytes] | None = None
        self.hooked_ranks: set[int] = set()     # ranks that said hello this attempt: their steps come as frames
        self.workers: dict[int, int] = {}       # pid -> global rank of torchrun's workers (from their environment)
        self.rank_pids: dict[int, int] = {}     # global rank -> its process (hello pid, else the worker or its warm interpreter)
        self.host_pids: dict[int, int] = {}     # pid here -> pid in the outermost namespace /proc shows
        self.exits_seen: dict[int, float] = {}  # rank without hooks -> when its process was first seen gone
        self.exits_sent: set[int] = set()       # ranks whose clean exit went up as rank_exit rc 0
        self.stop_sent = False                  # a stop (preemption, time limit) reached this attempt's ranks
        self.pool: WarmPool | None = None       # warm rank interpreters for the next launch
        self.warm = False                       # this attempt's ranks run in warm interpreters
        self.warm_told = False                  # the supervisor heard that the pool is ready
        self.external = ExternalHasher()        # hashes of external step folders (supervisor/external_agent.py)
        # the memory tier: the ranks' bundles live in this process, so a rank crash loses none; one
        # store for the agent's life (a restart's ranks resume from it), replicated to a buddy
        # node's agent over TCP (memory_store.py)
        self.memory: MemoryServer | None = None
        self.replicas: MemoryServer | None = None
        self.peers: PeerLinks | None = None
        if spec.memory_keep > 0:
            store = MemoryStore(keep=spec.memory_keep, max_bytes=spec.memory_max_bytes,
                                flip=FlipMode.parse(os.environ.get(TEST_FLIP_MEMORY, "")))
            self.peers = PeerLinks(secret=secret, node=node)
            self.memory = MemoryServer(unix_listener(self.sock_dir / "memory.sock"), secret=secret, store=store,
                                       peers=self.peers).start()
            self.replicas = MemoryServer(tcp_listener(spec.memory_addrs.get(node) or "127.0.0.1"), secret=secret,
                                         store=store).start()

    # ---- output -------------------------------------------------------------------------------
    def send(self, m: MessageKind, body: dict[str, Any]) -> None:
        body = {**body, "node": self.node, "agent": self.instance}
        try:
            frame = wire.encode(m, body, seq=self.seq + 1, secret=self.secret)
        except wire.FrameError:
            self._count_drop()  # a rank's frame too large once {node, agent} is added
            return
        self.seq += 1
        try:
            # srun merges every agent's stdout: a long frame goes in pieces that name this agent
            self.out.write(step_lines.pieces(frame, f"{self.node}/{self.instance}".encode()))
            self.out.flush()
        except BrokenPipeError:
            self.exit_requested = True  # the supervisor is gone

    def to_ranks(self, m: MessageKind, body: dict[str, Any]) -> None:
        for conn in list(self.conns.values()):
            if conn.rank is None:
                continue  # commands go to ranks, not to whoever connected
            self.seq += 1
            try:
                conn.sock.sendall(wire.encode(m, body, seq=self.seq, secret=self.secret))
            except (OSError, wire.FrameError):
                pass  # that rank is going away; its EOF is handled by the reader

    # ---- torchrun -----------------------------------------------------------------------------
    def torchrun_argv(self, *, warm: bool = False) -> list[str]:
        """torchrun's argv. `warm`: every worker is warm_proxy, handing its rank to a warm
        interpreter (rankside/warm_rank.py) instead of starting python."""
        spec = self.spec
        addr = spec.node_addrs.get(self.node, "127.0.0.1")
        host, _, port = spec.rdzv_endpoint.rpartition(":")
        if spec.rdzv_backend == "static":
            # the supervisor fixes the node set, so node ranks need no negotiation (~40 ms to
            # workers instead of c10d's rounds)
            rdzv = ["--rdzv-backend", "static", "--master-addr", host, "--master-port", port,
                    "--node-rank", str(list(spec.node_addrs).index(self.node))]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint, "--rdzv-id", spec.rdzv_id]
        # --tee 3, whatever the launch line's -r/-t: every rank's stdout and stderr reach torchrun's
        # (our pipe) with RANK_LINE_PREFIX; torchrun also keeps a file per rank under --log-dir
        log_dir = spec.torchrun_log_dir or os.path.join(spec.log_dir, f"torchrun-{self.node}")
        # torch < 2.13's torchrun has no --shutdown-timeout (it waits its fixed 30 s); ckptsup's own
        # stop of the tree still gives the ranks kill_grace_s
        shutdown = (["--shutdown-timeout", str(int(spec.shutdown_timeout_s))]
                    if installed_torchrun_has("--shutdown-timeout") else [])
        return ["--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node), *rdzv,
                "--local-addr", addr, "--max-restarts", "0", "--monitor-interval", f"{spec.monitor_interval_s:g}",
                *shutdown, *spec.torchrun_options, "--tee", "3",
                "--log-dir", log_dir, *self._entrypoint(warm), *spec.script_args]

    def _entrypoint(self, warm: bool) -> list[str]:
        spec = self.spec
        if warm:
            return ["--no-python", sys.executable, "-m", "ckptsup.rankside.warm_proxy",
                    *([RANK_MODULE_FLAG] if spec.module else []), spec.script]
        if spec.no_python:
            return ["--no-python", spec.script]
        # a cold rank installs the stack dump before its script runs (rankside/cold_rank.py)
        return ["--no-python", *cold_rank_argv(sys.executable, [spec.script], module=spec.module)]

    def _pool_for(self) -> WarmPool | None:
        """The warm pool matching the current spec (None: warm restarts off, or a binary)."""
        spec = self.spec
        if not spec.warm_ranks or spec.no_python:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            return None
        if self.pool is not None and self.pool.size != spec.nproc_per_node:
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = WarmPool(directory=self.sock_dir, size=spec.nproc_per_node, cwd=spec.cwd,
                                 env=WarmPool.rank_env(self.rank_env({}), spec.nproc_per_node))
        return self.pool

    def rank_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.spec.env)
        env.update(extra)
        env[RANK_SOCKET] = str(self.sock_path)
        if self.memory is not None:
            env[MEMORY_SOCKET] = str(self.memory.path)
        env[NODE] = self.node
        env[PYTHONUNBUFFERED] = "1"
        env[TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE] = RANK_LINE_PREFIX
        return env

    def start_torchrun(self, extra_env: dict[str, str]) -> None:
        if self.standby is not None and is_stopped(self.standby.proc.pid):
            self.standby.discard()   # a stopped launcher would never start torchrun: the restart would wait for nothing
            self.standby = None
        standby = self.standby or Standby()
        self.standby = None
        log = os.path.join(self.spec.log_dir, f"ranks-{self.node}.log")
        pool = self._pool_for()
        self.warm = pool is not None and pool.hand_out()
        env = self.rank_env(extra_env)
        if self.warm and pool is not None:
            env[WARM_DIR] = str(pool.in_use_dir)
        self.torchrun = standby.launch(argv=self.torchrun_argv(warm=self.warm), env=env, cwd=self.spec.cwd)
        self.hooked_ranks, self.workers, self.stop_sent = set(), {}, False
        self.rank_pids, self.exits_seen, self.exits_sent = {}, {}, set()
        self._open_output(log)
        self.torchrun_reported = False
        self.phase = Phase.INIT
        self.last_step = None
        self.stopped_ranks = set()
        self.send(MessageKind.LAUNCHED, {"attempt": self.attempt, "pid": self.torchrun.pid, "warm": self.warm})
        self.launched_at = time.monotonic()  # the next standby warms up once this attempt steps

    def kill_torchrun(self, grace: float) -> float:
        t0 = time.monotonic()
        if self.torchrun is not None:
            terminate(self.torchrun, grace)
            self.torchrun = None
        if self.pool is not None:
            self.pool.kill_in_use()
        self._close_output()
        for conn in list(self.conns.values()):
            if conn.rank is not None and conn.pid is not None and conn.pid == conn.peer_pid != os.getpid():
                terminate(conn.pid, 0)  # a rank that escaped the tree: only the process at the other end
            self._close(conn, report=False)
        self.torchrun_reported = True
        self.pending_exits = []
        return time.monotonic() - t0

    # ---- rank output (supervisor/rank_output.py) ----------------------------------------------
    def _open_output(self, log: str) -> None:
        self._close_output()
        assert self.torchrun is not None and self.torchrun.stdout is not None
        self.output_pipe = self.torchrun.stdout
        os.set_blocking(self.output_pipe.fileno(), False)
        self.output = RankOutput.open(log, pattern=self.spec.progress_pattern, tee=self.spec.tee,
                                      nproc_per_node=self.spec.nproc_per_node,
                                      console_local_ranks=self.spec.console_local_ranks,
                                      hooked=lambda rank: rank in self.hooked_ranks, clock=time.monotonic)
        self.sel.register(self.output_pipe, selectors.EVENT_READ, "output")

    def _read_output(self) -> int:
        """Read what the ranks wrote (bounded): bytes read, 0 when nothing is waiting, -1 at EOF
        (torchrun and every worker holding the pipe are gone)."""
        if self.output_pipe is None or self.output is None:
            return -1
        try:
            data = os.read(self.output_pipe.fileno(), OUTPUT_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(self.output_pipe)
            self.output_pipe.close()
            self.output_pipe = None
            self.output.finish()
            return -1
        self.output.feed(data)
        return len(data)

    def _drain_output(self) -> None:
        """Everything torchrun wrote before it exited (bounded): its last lines are often the error."""
        for _ in range(64):
            if self._read_output() <= 0:
                break

    def _flush_output(self) -> None:
        if self.output is None:
            return
        for rank, step in sorted(self.output.take_progress().items()):
            if rank not in self.hooked_ranks:
                self.last_step = step if self.last_step is None else max(self.last_step, step)
                self.phase = Phase.TRAIN
                self.send(MessageKind.PROGRESS, {"rank": rank, "step": step})
        while (console := self.output.take_console()) is not None:
            lines, dropped = console
            self.send(MessageKind.OUTPUT, {"lines": lines, "dropped": dropped})

    def _close_output(self) -> None:
        if self.output_pipe is not None:
            try:
                self.sel.unregister(self.output_pipe)
            except (KeyError, ValueError):
                pass
            self.output_pipe.close()
            self.output_pipe = None
        if self.output is not None:
            self._flush_output()
            self.output.close()
            self.output = None

    # ---- torchrun's workers, seen as processes (ranks that never say hello) -------------------
    def _scan_workers(self) -> dict[int, int]:
        """pid -> global rank of torchrun's live workers (their RANK variable; read once per pid)."""
        if self.torchrun is None:
            return {}
        try:
            children = psutil.Process(self.torchrun.pid).children()
        except psutil.Error:
            return {}
        found = {}
        warm = self.pool.in_use if self.warm and self.pool is not None else []
        for child in children:
            pid, rank = child.pid, self.workers.get(child.pid)
            if rank is None:
                try:
                    env = child.environ()
                    rank, local_rank = int(env.get("RANK", "")), int(env.get("LOCAL_RANK", "-1"))
                except (psutil.Error, ValueError, OSError):
                    continue
                if 0 <= local_rank < len(warm):
                    pid = warm[local_rank].pid   # the proxy stands in for its warm interpreter: watch that
            found[pid] = rank
            if rank not in self.hooked_ranks:
                self.rank_pids.setdefault(rank, pid)
        self.workers = found
        return found

    def _signal_unhooked(self, signum: int) -> None:
        """Pass a stop to ranks that cannot hear stop_at: the script's own SIGTERM handler (its
        checkpoint-and-exit) runs, as under Slurm without ckptsup."""
        for pid, rank in self._scan_workers().items():
            if rank not in self.hooked_ranks:
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass

    # ---- rank sockets -------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:  # out of descriptors: the next tick tries again
            console.warning(f"ckptsup agent: cannot accept a rank connection: {err.strerror or err}", err=True)
            return
        sock.setblocking(False)
        waiting = sorted((c for c in self.conns.values() if c.rank is None), key=lambda c: c.opened)
        for stale in waiting[:max(0, len(waiting) - MAX_UNAUTHENTICATED + 1)]:
            self._close(stale, report=True)  # many connections that never say hello: drop the oldest
        self.conns[sock] = RankConn(sock=sock, opened=time.monotonic(), peer_pid=_peer_pid(sock),
                                    reader=wire.FrameReader(secret=self.secret, sender="rank", on_drop=self._count_drop))
        self.sel.register(sock, selectors.EVENT_READ, "rank")

    def _close(self, conn: RankConn, *, report: bool) -> None:
        if self.conns.pop(conn.sock, None) is None:
            return
        self.sel.unregister(conn.sock)
        conn.sock.close()
        if conn.rank is None:
            if report:
                self.unauth_log.note(_unauth_line)  # anyone may connect and leave: no rank, no report
            return
        if report and not conn.said_bye and self.torchrun is not None:
            # A rank that finished without `bye` looks the same for a moment: confirm unless
            # torchrun exits cleanly within EXIT_CONFIRM_S.
            self.pending_exits.append((time.monotonic(), conn.rank, conn.pid))

    def _read_rank(self, conn: RankConn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn, report=True)
            return
        try:
            lines = conn.reader.lines(data)
        except wire.FrameError:
            self._close(conn, report=True)  # a flood is not a rank of ours
            return
        for line in lines:
            if conn.sock not in self.conns:
                return
            frame = conn.reader.verified(line)
            if frame is not None:
                self._rank_frame(conn, *frame)

    def _count_drop(self) -> None:
        self.dropped += 1

    def _hello(self, conn: RankConn, seq: int, body: dict[str, Any]) -> None:
        """An authenticated hello makes the connection a rank: a well-typed body, and a sequence
        number fresh for that rank and pid (a replayed hello on a new connection is refused).
        `checkpoints` (false: heartbeat-only hooks, ckptsup keeps no checkpoints of this rank) is
        relayed as it is; the supervisor relies on it being a bool when present."""
        rank, pid = body.get("rank"), body.get("pid")
        if not (_is_int(rank, low=0) and (pid is None or _is_int(pid, low=1))
                and isinstance(body.get("checkpoints", True), bool)):
            self._count_drop()
            return
        conn.rank, conn.pid = rank, pid
        if not self.rank_guard.accept(conn.sender, seq):
            conn.rank = conn.pid = None
            self._count_drop()
            return
        self.hooked_ranks.add(rank)
        if pid is not None:
            self.rank_pids[rank] = pid
        self.send(MessageKind.HELLO, body)

    def _rank_frame(self, conn: RankConn, m: MessageKind, seq: int, body: dict[str, Any]) -> None:
        if wire.HOPS.get(m) is not Hop.RANK_TO_AGENT:
            self._count_drop()  # an agent's or the supervisor's kind: not a rank's to send
            return
        if conn.rank is None:
            if m == MessageKind.HELLO:
                self._hello(conn, seq, body)
            else:
                self._count_drop()  # nothing counts before an authenticated hello
            return
        if m == MessageKind.HELLO or not self.rank_guard.accept(conn.sender, seq):
            self._count_drop()  # a second hello, or a replay
            return
        if m in RANK_SCOPED:
            rank = body.setdefault("rank", conn.rank)
            if not _is_int(rank) or rank != conn.rank:
                self._count_drop()  # another rank's identity
                return
        if not _rank_body_ok(m, body):
            self._count_drop()
            return
        if m == MessageKind.STEP:
            step = body["step"]
            if self.last_step is None or step > self.last_step:
                self.last_step = step
            self.phase = Phase.TRAIN
        elif m == MessageKind.PHASE:
            self.phase = Phase.parse(body["phase"])
        elif m == MessageKind.BYE:
            conn.said_bye = True
        self.send(m, body)

    def _expire_unauthenticated(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.rank is None and now - c.opened > HELLO_TIMEOUT_S]:
            self._close(conn, report=True)
        self.unauth_log.flush(_unauth_line)

    # ---- supervisor commands ------------------------------------------------------------------
    def _read_stdin(self) -> None:
        try:
            data = os.read(self.inp.fileno(), 65536)
        except BlockingIOError:
            return
        if not data:
            # The supervisor (or the srun client) is gone: leave no rank behind.
            self.sel.unregister(self.inp)
            self.exit_requested = True
            return
        try:
            frames = self.stdin_reader.feed(data)
        except wire.FrameError:
            return  # garbage without newlines on stdin: counted, dropped, the agent goes on
        for m, body in frames:
            try:
                self._command(m, body)
            except BadCommand as err:
                self._count_drop()
                console.warning(f"ckptsup agent: ignored a {m.value} command: {err}", err=True)

    def _command(self, m: MessageKind, body: dict[str, Any]) -> None:
        targets = body.get("nodes")
        if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise BadCommand(f"`nodes` must be a list of node names, not {type(targets).__name__}")
        if targets is not None and self.node not in targets:
            return
        if wire.HOPS.get(m) is not Hop.COMMAND:
            raise BadCommand("not a command kind")
        if m == MessageKind.KILL:
            grace = body.get("grace", 0)
            if not _is_number(grace) or grace < 0:
                raise BadCommand(f"`grace` must be a number of seconds >= 0, not {grace!r:.40}")
            survivors = self.survivors() if body.get("report") is True else None
            kill_s = self.kill_torchrun(float(grace))
            self.send(MessageKind.KILLED, {"kill_s": kill_s, **({"survivors": survivors} if survivors is not None else {})})
        elif m == MessageKind.RESTART:
            attempt, spec, env = _restart_args(body, self.spec)  # checked before anything is killed
            if self.node not in spec.node_addrs:
                raise BadCommand(f"{self.node} is not a node of that launch (a spare stays in standby)")
            kill_s = self.kill_torchrun(0) if self.torchrun is not None else 0.0
            self.attempt, self.spec = attempt, spec
            self.start_torchrun(env)
            self.send(MessageKind.RESTARTED, {"attempt": self.attempt, "kill_s": kill_s})
        elif m == MessageKind.EXIT:
            self.exit_requested = True
        elif m == MessageKind.MEMORY_PEERS:
            self._memory_peers(body)
        elif m == MessageKind.STACKS:
            self._stacks()
        elif m == MessageKind.EXT_HASH:
            try:
                self.external.request(body)
            except ExternalRequestError as err:
                raise BadCommand(str(err)) from None
        elif m in wire.FORWARDED_COMMANDS:
            self.to_ranks(m, {k: v for k, v in body.items() if k != "nodes"})
            if m == MessageKind.STOP_AT and not self.stop_sent:
                self.stop_sent = True
                self._signal_unhooked(signal.SIGTERM)

    # ---- periodic -----------------------------------------------------------------------------
    def _warm_standby(self) -> None:
        """Start the next pre-imported launcher, but not while the ranks start: on a busy node its
        torch import would slow theirs. Once the attempt steps (or after STANDBY_DELAY_S)."""
        if self.launched_at is None:
            return
        if self.last_step is not None or time.monotonic() - self.launched_at > STANDBY_DELAY_S:
            if self.standby is None:
                self.standby = Standby()
            pool = self._pool_for()
            if pool is not None:
                pool.start()   # the next launch's warm interpreters, once these ranks step
            self.launched_at = None

    def _prewarm(self) -> None:
        """A spare's agent (its node is not in the launch): warm up at once, nothing here to
        compete with, so that the launch that takes this node over starts warm."""
        self.standby = Standby()
        pool = self._pool_for()
        if pool is not None:
            pool.start()

    def _check_processes(self) -> None:
        if self.pool is not None:
            self.pool.reap()
            ready = self.pool.ready()
            if ready and not self.warm_told:
                self.send(MessageKind.WARM_READY, {"interpreters": self.pool.size})
            self.warm_told = ready
        rc = self.torchrun.poll() if self.torchrun is not None else None
        now = time.monotonic()
        if rc == 0:
            self.pending_exits = []
        keep = []
        for seen, rank, pid in self.pending_exits:
            status = zombie_status(pid) if pid is not None else GONE
            if status is RUNNING and now - seen < EXIT_CONFIRM_S:
                keep.append((seen, rank, pid))  # still exiting (fds close before the zombie appears)
            elif status is RUNNING:
                continue  # it closed its channel but lives on: not a crash (hang detection watches it)
            elif status == 0:
                continue  # a clean exit without `bye`
            elif status is GONE and now - seen < EXIT_CONFIRM_S and rc is None:
                keep.append((seen, rank, pid))  # reaped already: wait for torchrun's verdict
            else:
                code = status if isinstance(status, int) else None   # GONE: reaped, no status left
                what = "died without saying goodbye" if code is None else describe_exit(code)
                self.send(MessageKind.RANK_EXIT, {"rank": rank, "rc": code, "pid": pid, "step": self.last_step,
                                        "age_s": now - seen, "detail": f"rank {rank} (pid {pid}) {what}"})
        self.pending_exits = keep
        if self.torchrun is not None and not self.torchrun_reported and rc is not None:
            self.torchrun_reported = True
            self._drain_output()
            self._flush_output()
            self.send(MessageKind.TORCHRUN_EXIT, {"rc": rc, "step": self.last_step, "stopped": self.stop_sent})
        stopped = set()
        for conn in self.conns.values():
            if conn.pid is None or conn.rank is None:
                continue
            try:
                if psutil.Process(conn.pid).status() == psutil.STATUS_STOPPED:
                    stopped.add(conn.rank)
            except (psutil.Error, ValueError, OverflowError):
                pass
        self.stopped_ranks = stopped
        self._watch_clean_exits(rc, now)
        self._expire_unauthenticated(now)

    def heartbeat(self) -> None:
        workers = self._scan_workers()   # ranks without hello: seen as processes
        pids = self.pid_list()
        samples = {entry["rank"]: got for entry in pids if (got := evidence.sample(entry["pid"])) is not None}
        for pid, rank in workers.items():
            if rank in self.hooked_ranks:
                continue
            # one /proc read a rank a heartbeat: the evidence's state says stopped (T) too
            got = samples.get(rank) if self.rank_pids.get(rank) == pid else evidence.sample(pid)
            if got is not None and got.state == "T":
                self.stopped_ranks.add(rank)
        # a rank is alive if it talks to us (hooks) or its real process runs (no hooks: a worker
        # or the warm interpreter it became)
        ranks = sorted({c.rank for c in self.conns.values() if c.rank is not None} | {p["rank"] for p in pids})
        running = self.torchrun is not None and self.torchrun.poll() is None
        self.send(MessageKind.HB, {"ranks_alive": ranks, "last_step": self.last_step, "phase": self.phase,
                         "stopped_ranks": sorted(self.stopped_ranks), "torchrun": running,
                         "dropped": self.dropped, "attempt": self.attempt, "pids": pids,
                         # each live rank's CPU time, I/O and state (supervisor/liveness.py: busy or hung)
                         "evidence": [[rank, *got.to_wire()] for rank, got in samples.items()]})

    def _stacks(self) -> None:
        """Every local rank's Python stacks, for a suspected hang (stack_dump.py)."""
        run_dir = self.spec.env.get(RUN_DIR)
        pids = {rank: pid for rank, pid in self.rank_pids.items() if zombie_status(pid) is RUNNING}
        files = {rank: stack_file(run_dir, self.attempt, rank) for rank in pids} if run_dir else {}
        taken = evidence.take_stacks(pids, files)
        wchan = {rank: w for rank, pid in pids.items() if (w := where(pid).get("wchan"))}
        self.send(MessageKind.STACKS_TAKEN, {"attempt": self.attempt, "stacks": [[r, t] for r, t in sorted(taken.items())],
                                             "wchan": [[r, w] for r, w in sorted(wchan.items())]})

    def _host_pid(self, pid: int) -> int:
        if pid not in self.host_pids:
            self.host_pids[pid] = pid_views(pid)[1]
        return self.host_pids[pid]

    def pid_list(self) -> list[dict[str, int]]:
        """Every known rank's process, as this node sees it and as the outermost namespace does
        (`ckptsup status`: whom to signal or py-spy)."""
        return [{"rank": rank, "pid": pid, "host_pid": self._host_pid(pid)}
                for rank, pid in sorted(self.rank_pids.items()) if zombie_status(pid) is RUNNING]

    def survivors(self) -> list[dict[str, Any]]:
        """The rank processes still alive (a kill is about to end them), with where they wait."""
        return [{**entry, **where(entry["pid"])} for entry in self.pid_list()]

    def _watch_clean_exits(self, rc: int | None, now: float) -> None:
        """Ranks without hooks say no bye: report each one's clean exit (rank_exit rc 0), which
        starts the supervisor's exit_grace_s for the ranks left. A worker is torchrun's child and
        may be reaped before its status is read; gone while torchrun and another rank carry on
        for CLEAN_GONE_S means it exited 0 (a failed worker makes torchrun SIGTERM them all)."""
        if self.torchrun is None or rc is not None:
            return
        warm = {p.pid: p for p in self.pool.in_use} if self.warm and self.pool is not None else {}
        for rank, pid in self.rank_pids.items():
            if rank in self.hooked_ranks or rank in self.exits_sent:
                continue
            status = warm[pid].poll() if pid in warm else zombie_status(pid)
            if status is None or status is RUNNING:
                continue
            if status is GONE:
                seen = self.exits_seen.setdefault(rank, now)
                others = [p for r, p in self.rank_pids.items() if r != rank and zombie_status(p) is RUNNING]
                if now - seen < CLEAN_GONE_S or not others:
                    continue
                status = 0
                what = f"rank {rank} (pid {pid}) was gone while torchrun and the other ranks carried on: a clean exit"
            else:
                what = f"rank {rank} (pid {pid}) exited with status {status}"
            self.exits_sent.add(rank)   # a failure's status is torchrun's to report; read once either way
            if status == 0:
                self.send(MessageKind.RANK_EXIT, {"rank": rank, "rc": 0, "pid": pid, "step": self.last_step,
                                                  "age_s": 0.0, "detail": what})

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.term_signal = signum  # handled in the loop

    def _preempted(self) -> int:
        """SIGTERM: Slurm preempts (every step process got it). Ask ranks to stop and save if
        the budget allows, wait for torchrun up to its shutdown timeout, report, exit."""
        budget = float(self.spec.env.get(PREEMPT_BUDGET_S, "0") or 0)
        self.send(MessageKind.PREEMPT, {"signal": self.term_signal, "budget_s": budget})
        self.to_ranks(MessageKind.STOP_AT, {"reason": "preempted", "save": True, "budget_s": budget})
        if not self.stop_sent:
            self.stop_sent = True
            self._signal_unhooked(signal.SIGTERM)
        deadline = time.monotonic() + max(budget, 1.0)
        while self.torchrun is not None and self.torchrun.poll() is None and time.monotonic() < deadline:
            self._pump(0.1)
            self._flush_output()
        rc = self.torchrun.poll() if self.torchrun is not None else None
        self._drain_output()
        self.kill_torchrun(0)
        self.send(MessageKind.TORCHRUN_EXIT, {"rc": rc, "step": self.last_step, "preempted": True})
        return ExitStatus.PREEMPTED

    def _pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.data == "accept":
                self._accept()
            elif key.data == "output":
                self._read_output()
            elif key.data == "stdin":
                self._read_stdin()
            else:
                conn = self.conns.get(key.fileobj)  # type: ignore[call-overload]  # a socket, registered by us
                if conn is not None:
                    self._read_rank(conn)

    def run(self, *, launch: bool = True) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a hangup stops like a preemption
            signal.signal(signum, self.on_signal)
        try:
            if self.replicas is not None:
                self.send(MessageKind.MEMORY_PEER, {"addr": self.replicas.address})
            self.heartbeat()
            if launch:
                self.start_torchrun({})
            else:
                self._prewarm()
            while not self.exit_requested:
                if self.term_signal is not None:
                    return self._preempted()
                self._pump(0.005 if self.pending_exits else TICK_S)
                self._flush_output()
                self._check_processes()
                self._warm_standby()
                for answer in self.external.take():
                    self.send(MessageKind.EXT_HASHED, answer)
                for note in self.peers.take() if self.peers is not None else ():
                    self.send(MessageKind.MEMORY_REPLICATED, note)
                now = time.monotonic()
                if now - self.last_hb >= self.spec.heartbeat_interval_s:
                    self.last_hb = now
                    self.heartbeat()
            return ExitStatus.DONE
        finally:
            self.shutdown()

    def _memory_peers(self, body: dict[str, Any]) -> None:
        """memory_peers: the buddies to replicate to and, per rank, the agents that may hold it."""
        if self.peers is None:
            raise BadCommand("memory_peers, but this agent has no memory store ([memory] enabled is false)")
        buddies, sources = body.get("buddies", []), body.get("sources", {})
        if not (isinstance(buddies, list) and len(buddies) <= MAX_REPLICAS and all(_peer_addr(a) for a in buddies)):
            raise BadCommand(f"`buddies` must be a list of at most {MAX_REPLICAS} host:port, not {buddies!r:.60}")
        if not (isinstance(sources, dict) and all(isinstance(k, str) and k.isascii() and k.isdigit() and isinstance(v, list)
                                                  and all(_peer_addr(a) for a in v) for k, v in sources.items())):
            raise BadCommand("`sources` must map ranks to lists of host:port")
        self.peers.set(buddies=list(dict.fromkeys(buddies)), sources={int(k): list(v) for k, v in sources.items()})

    def shutdown(self) -> None:
        self.kill_torchrun(0)
        if self.standby is not None:
            self.standby.discard()
            self.standby = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.server.close()
        for server in (self.memory, self.replicas):
            if server is not None:
                server.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def _peer_addr(value: Any) -> bool:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    # at most 5 digits before int(): a port of thousands of digits is a ValueError, not a refusal
    return bool(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536


class BadCommand(CkptsupError):
    """A well-signed command whose body the agent cannot carry out: ignored, the agent goes on."""


def _restart_args(body: dict[str, Any], current: LaunchSpec) -> tuple[int, LaunchSpec, dict[str, str]]:
    attempt = body.get("attempt")
    if not _is_int(attempt, low=0):
        raise BadCommand(f"`attempt` must be an integer >= 0, not {attempt!r:.40}")
    env = body.get("env") or {}
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise BadCommand("`env` must map names to strings")
    spec = body.get("spec")
    if not spec:
        return attempt, current, dict(env)
    if not isinstance(spec, (dict, str)):
        raise BadCommand(f"`spec` must be a launch spec or its path, not {type(spec).__name__}")
    try:
        new = LaunchSpec.from_json(spec, source="restart frame") if isinstance(spec, dict) else LaunchSpec.read(spec)
    except CkptsupError as err:  # from_json and read check every field and never raise anything else
        raise BadCommand(f"unusable launch spec ({str(err)[:120]})") from None
    return attempt, new, dict(env)



def run_agent(*, spec_path: str, attempt: int, launch: bool = True) -> int:
    spec = LaunchSpec.read(spec_path)
    secret_file = spec.env.get(SECRET_FILE) or os.environ.get(SECRET_FILE)
    if not secret_file:
        from ..errors import ConfigError

        raise ConfigError(f"the agent needs {SECRET_FILE}; it is started by `ckptsup launch`, not by hand")
    node = node_name()
    agent = Agent(spec=spec, node=node, secret=read_secret(secret_file), out=sys.stdout.buffer,
                  inp=sys.stdin.buffer, attempt=attempt)
    # one srun step runs an agent on every usable node: those outside the launch are spares
    return agent.run(launch=launch and node in spec.node_addrs)
