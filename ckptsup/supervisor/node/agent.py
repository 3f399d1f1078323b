"""The agent: one per usable node (an srun task, or a child process in local mode). A spare's
agent (its node outside the launch spec) starts in standby, warms up, and waits for a restart.

It runs torchrun for its node, relays what its ranks send on their socket up as frames on stdout
(with `node` added) plus a heartbeat, and reads the supervisor's commands as frames on stdin.
One thread, one selector (each key's data is the callable that serves it): the rank sockets,
torchrun's output, stdin, and a short tick for heartbeats and process checks.

The agent is the loop and the decisions of a node; its parts are separate objects, each made
once in the constructor:
  ranks     the ranks' socket and its connections, a boundary (rank_socket.py)
  procs     the ranks as processes: who is which rank, crashes and clean exits (rank_processes.py)
  output    torchrun's output: progress lines and rank 0's console (rank_output.py)
  memory    the memory tier's store and its replicas (memory_store.py), when on
  zygote    one pre-imported interpreter that forks the next launch's torchrun and warm ranks
            (zygote.py; its children are the agent's: forked.py)
  pool      warm rank interpreters for the next launch (warm_pool.py)
  external  hashes of a framework's own checkpoints (external_agent.py)

Crash detection happens here: a rank whose connection drops without `bye` is reported at once
(no waiting for torchrun's monitor), and a stopped rank process (state T) is flagged in the
heartbeat so the supervisor can blame it when the hang timeout fires.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, BinaryIO, Sequence

from ... import messages, step_lines, wire
from ...errors import CkptsupError, ConfigError
from ...wire import Hop, MessageKind, Phase
from ...env import (RANK_MODULE_FLAG, cold_rank_argv, MEMORY_SOCKET, TEST_FLIP_MEMORY, NODE, PREEMPT_BUDGET_S, PYTHONUNBUFFERED, RANK_SOCKET, RUN_DIR, SECRET_FILE, WARM_DIR,
                   TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, TTY_COMPATIBLE, ExitStatus)
from ...rundir import read_secret
from ... import console
from ..spec import LaunchSpec
from ..torchrun_args import installed_torchrun_has
from .rank_output import OutputPipe, RankOutput
from .rank_processes import RankProcesses
from .rank_socket import RankConn, RankSocket
from .forked import ForkedChild, reap_orphans
from .standby import start_cold
from .external_agent import ExternalHasher, ExternalRequestError
from . import cloud_notice, identity
from ...container import CONTAINER_ENV
from ..._version import __version__
from .memory_store import FlipMode, NodeMemory
from .relay import SUMMARIES_PER_BEAT, ParentLink, RelayHub
from .warm_pool import WarmPool
from .zygote import Zygote
from ..processes import terminate

TICK_S = 0.1
STANDBY_DELAY_S = 30.0
MAX_ZYGOTE_FAILURES = 2   # zygotes that died before they were ready: then every launch starts cold
FIRST_LAUNCH_WAIT_S = 60.0   # the first launch waits this long at most for its zygote and warm ranks, then starts cold (a slow
                             # import would be as slow in every cold rank: this is for a zygote that is stuck)
RANK_LINE_PREFIX = "[rank${rank}]: "   # torchrun --tee: the global rank on every line (progress.RANK_PREFIX)
# torchrun's worker on a warm launch, run as a file (the agent never imports rankside/)
WARM_PROXY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "rankside", "warm_proxy.py")



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
        self.dropped = 0                        # frames dropped, from ranks or on stdin (the heartbeat says how many)
        self.sel = selectors.DefaultSelector()
        self.stdin_reader = wire.FrameReader(secret=secret, sender="supervisor", on_drop=self._count_drop)
        os.set_blocking(inp.fileno(), False)
        self.sel.register(inp, selectors.EVENT_READ, self._read_stdin)
        self.ranks = RankSocket(secret=secret, sel=self.sel, on_frame=self._rank_frame, on_lost=self._rank_lost,
                                on_drop=self._count_drop)
        self.procs = RankProcesses()
        self.output: OutputPipe | None = None
        self.torchrun: subprocess.Popen | ForkedChild | None = None
        self.torchrun_reported = True
        self.launched_at: float | None = None
        self.first_launch_by: float | None = None   # the first launch is due (from the zygote) by then
        self.last_step: int | None = None
        self.phase = Phase.INIT
        self.stopped_ranks: set[int] = set()
        self.stop_sent = False                  # a stop (preemption, time limit) reached this attempt's ranks
        self.term_signal: int | None = None
        self.exit_requested = False
        self.last_hb = 0.0
        self.last_summary = 0.0
        self.zygote: Zygote | None = None       # forks the next launch's torchrun and warm ranks
        self.zygote_failures = 0                # zygotes that died before they were ready
        self.zygote_watched = False             # its control socket is in the selector until its first line
        self.adopting = False                   # a subreaper since its first zygote: orphans come to it
        self.warming = False                    # the next launch's processes are to be prepared now
        self.pool: WarmPool | None = None       # warm rank interpreters for the next launch
        self.warm = False                       # this attempt's ranks run in warm interpreters
        self.warm_told = False                  # the supervisor heard that the pool is ready
        self.external = ExternalHasher()        # hashes of external step folders (supervisor/node/external_agent.py)
        self.memory = NodeMemory(keep=spec.memory_keep, max_bytes=spec.memory_max_bytes, secret=secret, node=node,
                                 directory=self.ranks.dir, addr=spec.memory_addrs.get(node) or "127.0.0.1",
                                 flip=FlipMode.parse(os.environ.get(TEST_FLIP_MEMORY, ""))) \
            if spec.memory_keep > 0 else None
        self.cloud: cloud_notice.NoticeWatch | None = None   # the cloud's preemption notices (node/cloud_notice.py)
        self.node_from = NODE                   # how the node's name was found (identity.py)
        self.relay: RelayHub | None = None      # this agent takes its children's heartbeats (relay.py)
        self.parent: ParentLink | None = None   # its heartbeats go to its relay, not stdout (relay.py)
        self.parent_sock: Any = None            # the link's socket as registered (a failed send closes it first)

    # ---- output -------------------------------------------------------------------------------
    def send(self, msg: messages.Body) -> None:
        frame = self._frame(msg)
        if frame is not None:
            self._write(frame)

    def _frame(self, msg: messages.Body) -> bytes | None:
        try:
            frame = messages.encode(msg, seq=self.seq + 1, secret=self.secret,
                                    envelope={"node": self.node, "agent": self.instance})
        except wire.FrameError:
            self._count_drop()  # a rank's frame too large once {node, agent} is added
            return None
        self.seq += 1
        return frame

    def _write(self, frame: bytes) -> None:
        try:
            # srun merges every agent's stdout: a long frame goes in pieces that name this agent
            self.out.write(step_lines.pieces(frame, f"{self.node}/{self.instance}".encode()))
            self.out.flush()
        except BrokenPipeError:
            self.exit_requested = True  # the supervisor is gone

    def _count_drop(self) -> None:
        self.dropped += 1

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
            # a file under -S, not `-m`: site's work is ~60 ms of each proxy's start (rankside/warm_proxy.py)
            return ["--no-python", sys.executable, "-S", WARM_PROXY,
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
            self.pool = WarmPool(directory=self.ranks.dir, size=spec.nproc_per_node, cwd=spec.cwd)
        return self.pool

    def _zygote_env(self) -> dict[str, str]:
        """What torch is imported with: the ranks' environment when ranks are forked from it (some
        variables, OMP_NUM_THREADS among them, are read at import), else the agent's own."""
        if self._pool_for() is None:
            return dict(os.environ)
        return WarmPool.rank_env(self.rank_env({}), self.spec.nproc_per_node)

    def _ready_zygote(self) -> Zygote | None:
        """The zygote, if it can fork now; a dead, stopped or failed one is discarded (the next
        launch starts cold, the loop starts another)."""
        if self.zygote is not None and self.zygote.dead():
            if not self.zygote.is_ready:
                self.zygote_failures += 1
            self._replace_zygote(None)
        return self.zygote if self.zygote is not None and self.zygote.ready() else None

    def _tend_zygote(self) -> None:
        """While warming: a zygote with the current environment, then the pool forked from it."""
        if not self.warming:
            return
        env = self._zygote_env()
        if self.zygote is not None and not self.zygote.imported_with(env, per_attempt=self.spec.env):
            self._replace_zygote(None)   # what torch reads at import changed: it must be imported anew
        zygote = self._ready_zygote()
        if zygote is None:
            if self.zygote is None and self.zygote_failures < MAX_ZYGOTE_FAILURES:
                self.adopting = True
                self._replace_zygote(Zygote.start(env=env, cwd=self.spec.cwd))
                if self.zygote is None:
                    self.zygote_failures = MAX_ZYGOTE_FAILURES   # no subreaper here: every launch is cold
            return
        pool = self._pool_for()
        if pool is not None:
            pool.start(zygote)   # the next launch's warm interpreters
        self.warming = False

    def _replace_zygote(self, zygote: Zygote | None) -> None:
        """The one place the agent's zygote changes: the old one closed; the new one's control socket
        watched until its first line (`ready`, or its end), so a loop that waits for it sleeps in the
        selector instead of ticking."""
        if self.zygote is not None:
            self._unwatch_zygote()
            self.zygote.close()
        self.zygote = zygote
        if zygote is not None:
            self.sel.register(zygote.control, selectors.EVENT_READ, self._unwatch_zygote)
            self.zygote_watched = True

    def _unwatch_zygote(self) -> None:
        """It spoke (or closed): _ready_zygote reads the line in this pass of the loop."""
        if self.zygote_watched and self.zygote is not None:
            self.sel.unregister(self.zygote.control)
        self.zygote_watched = False

    def rank_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.spec.env)
        env.update(extra)
        env[RANK_SOCKET] = str(self.ranks.path)
        if self.memory is not None:
            env[MEMORY_SOCKET] = str(self.memory.ranks.path)
        env[NODE] = self.node
        env[PYTHONUNBUFFERED] = "1"
        # rich draws nothing to a pipe: Lightning's default bar (RichProgressBar, as rich is installed)
        # would leave a script without progress lines; the user's own setting wins
        env.setdefault(TTY_COMPATIBLE, "1")
        env[TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE] = RANK_LINE_PREFIX
        return env

    def _prepared(self) -> bool:
        """The zygote and its warm ranks are ready for the first launch, or will not be (it starts
        cold: no zygote can start here, or its warm ranks failed)."""
        if self.zygote is None and self.zygote_failures >= MAX_ZYGOTE_FAILURES:
            return True
        if self.warming:
            return False   # _tend_zygote: the zygote is still importing
        pool = self.pool if self._ready_zygote() is not None else None
        return pool is None or not pool.procs or pool.ready()

    def _first_launch(self) -> None:
        """The first launch too starts from the zygote: the node imports torch once, not once per rank
        plus torchrun's; a zygote that is not ready by FIRST_LAUNCH_WAIT_S holds it up no longer."""
        if self.first_launch_by is not None and (self._prepared() or time.monotonic() >= self.first_launch_by):
            self.start_torchrun({})

    def start_torchrun(self, extra_env: dict[str, str]) -> None:
        self.first_launch_by = None
        log = os.path.join(self.spec.log_dir, f"ranks-{self.node}.log")
        pool = self._pool_for()
        self.warm = pool is not None and pool.hand_out()
        env = self.rank_env(extra_env)
        if self.warm and pool is not None:
            env[WARM_DIR] = str(pool.in_use_dir)
        argv = self.torchrun_argv(warm=self.warm)
        # a stopped or stuck zygote would never start torchrun: the restart would wait for nothing
        zygote = self._ready_zygote()
        forked = zygote.fork_torchrun(argv=argv, env=env, cwd=self.spec.cwd) if zygote is not None else None
        self.torchrun = forked or start_cold(argv=argv, env=env, cwd=self.spec.cwd)
        self.procs.reset()
        self.stop_sent = False
        self._open_output(log)
        self.torchrun_reported = False
        self.phase = Phase.INIT
        self.last_step = None
        self.stopped_ranks = set()
        self.send(messages.Launched(attempt=self.attempt, pid=self.torchrun.pid, warm=self.warm))
        self.launched_at = time.monotonic()  # _warm_standby: the next launch's processes from then

    def kill_torchrun(self, grace: float) -> float:
        t0 = time.monotonic()
        self.first_launch_by = None   # killed before it started: the supervisor decides what runs next
        if self.pool is not None and grace <= 0:
            self.pool.signal_in_use(signal.SIGKILL)   # their exits overlap torchrun's: the kill ack comes sooner
        if self.torchrun is not None:
            terminate(self.torchrun, grace)
            self.torchrun = None
        if self.pool is not None:
            self.pool.kill_in_use()
        self._close_output()
        self.ranks.drop_all()
        self.torchrun_reported = True
        self.procs.clear_lost()
        return time.monotonic() - t0

    # ---- rank output (supervisor/node/rank_output.py) ----------------------------------------------
    def _open_output(self, log: str) -> None:
        self._close_output()
        assert self.torchrun is not None and self.torchrun.stdout is not None
        output = RankOutput.open(log, pattern=self.spec.progress_pattern, tee=self.spec.tee,
                                 nproc_per_node=self.spec.nproc_per_node,
                                 console_local_ranks=self.spec.console_local_ranks,
                                 hooked=lambda rank: rank in self.procs.hooked, clock=time.monotonic)
        self.output = OutputPipe(self.torchrun.stdout, output, self.sel)

    def _flush_output(self) -> None:
        if self.output is None:
            return
        for rank, step in sorted(self.output.output.take_progress().items()):
            if rank not in self.procs.hooked:
                self.last_step = step if self.last_step is None else max(self.last_step, step)
                self.phase = Phase.TRAIN
                self.send(messages.Progress(rank=rank, step=step))
        while (console := self.output.output.take_console()) is not None:
            lines, dropped = console
            self.send(messages.Output(lines=tuple(lines), dropped=dropped))

    def _close_output(self) -> None:
        if self.output is not None:
            self.output.close()
            self._flush_output()
            self.output.output.close()
            self.output = None

    # ---- what the ranks send (supervisor/node/rank_socket.py) --------------------------------------
    def _rank_frame(self, conn: RankConn, msg: messages.Body) -> None:
        """A rank's frame, authenticated and typed: what it says of the attempt, then relayed up."""
        if isinstance(msg, messages.Hello):
            self.procs.said_hello(msg.rank, msg.pid)
        elif isinstance(msg, messages.Step):
            if self.last_step is None or msg.step > self.last_step:
                self.last_step = msg.step
            self.phase = Phase.TRAIN
        elif isinstance(msg, messages.PhaseChange):
            self.phase = msg.phase
        self.send(msg)

    def _rank_lost(self, conn: RankConn) -> None:
        # A rank that finished without `bye` looks the same for a moment: confirm unless torchrun
        # exits cleanly within rank_processes.EXIT_CONFIRM_S.
        if self.torchrun is not None:
            self.procs.lost(conn.rank, conn.pid, time.monotonic())

    def _warm_in_use(self) -> Sequence[ForkedChild]:
        """The warm interpreters this attempt's ranks run in (none on a cold launch)."""
        return self.pool.in_use if self.warm and self.pool is not None else ()

    def _signal_unhooked(self, signum: int) -> None:
        self.procs.signal_unhooked(signum, self.torchrun.pid if self.torchrun is not None else None,
                                   self._warm_in_use())

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
        targets = body.get("nodes")   # the envelope: which agents it is for (all when absent)
        if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise BadCommand(f"`nodes` must be a list of node names, not {type(targets).__name__}")
        if targets is not None and self.node not in targets:
            return
        if wire.HOPS.get(m) is not Hop.COMMAND:
            raise BadCommand("not a command kind")
        try:
            cmd = messages.parse(m, body)
        except wire.FrameError as err:
            raise BadCommand(str(err)) from None
        if isinstance(cmd, messages.Kill):
            survivors = self.procs.survivors() if cmd.report is True else None
            kill_s = self.kill_torchrun(float(cmd.grace))
            self.send(messages.Killed(kill_s=kill_s, survivors=None if survivors is None else tuple(survivors)))
        elif isinstance(cmd, messages.Restart):
            attempt, spec, env = _restart_args(cmd, self.spec)  # checked before anything is killed
            if self.node not in spec.node_addrs:
                raise BadCommand(f"{self.node} is not a node of that launch (a spare stays in standby)")
            kill_s = self.kill_torchrun(0) if self.torchrun is not None else 0.0
            self.attempt, self.spec = attempt, spec
            self.start_torchrun(env)
            self.send(messages.Restarted(attempt=self.attempt, kill_s=kill_s))
        elif isinstance(cmd, messages.Exit):
            self.exit_requested = True
        elif isinstance(cmd, messages.MemoryPeers):
            self._memory_peers(cmd)
        elif isinstance(cmd, messages.Relay):
            self._relay(cmd)
        elif isinstance(cmd, messages.Stacks):
            self.send(self.procs.stacks(self.spec.env.get(RUN_DIR), self.attempt))
        elif isinstance(cmd, messages.ExtHash):
            try:
                self.external.request(cmd)
            except ExternalRequestError as err:
                raise BadCommand(str(err)) from None
        elif m in wire.FORWARDED_COMMANDS:
            self.ranks.send(cmd)   # re-encoded from its type: without the envelope's `nodes`
            if isinstance(cmd, messages.StopAt) and not self.stop_sent:
                self.stop_sent = True
                self._signal_unhooked(signal.SIGTERM)

    # ---- periodic -----------------------------------------------------------------------------
    def _warm_standby(self) -> None:
        """Prepare the next launch's processes. From a zygote that imported torch with this
        environment they are forks (milliseconds): at once, so an attempt that fails before its
        first step restarts warm too. A torch import still to do waits until the attempt steps (or
        STANDBY_DELAY_S): on a busy node it would slow the ranks' start."""
        if self.launched_at is None:
            return
        if (self._forks_only() or self.last_step is not None
                or time.monotonic() - self.launched_at > STANDBY_DELAY_S):
            self.warming = True   # _tend_zygote: the zygote, then the warm interpreters it forks
            self.launched_at = None

    def _forks_only(self) -> bool:
        """The zygote can fork the next launch's processes without importing anything again."""
        zygote = self._ready_zygote()
        return zygote is not None and zygote.imported_with(self._zygote_env(), per_attempt=self.spec.env)

    def _prewarm(self) -> None:
        """Warm up at once: nothing runs here yet to compete with. The first launch starts from what
        this prepares (_first_launch); a spare's agent (its node is not in the launch) keeps it for the
        launch that takes this node over."""
        self.warming = True
        self._tend_zygote()

    def _check_processes(self) -> None:
        self._tend_zygote()
        if self.pool is not None:
            self.pool.reap()
            ready = self.pool.ready()
            if ready and not self.warm_told:
                self.send(messages.WarmReady(interpreters=self.pool.size))
            self.warm_told = ready
        rc = self.torchrun.poll() if self.torchrun is not None else None
        now = time.monotonic()
        for crash in self.procs.confirm(rc, now, self.last_step, self._warm_in_use()):
            self.send(crash)
        if self.torchrun is not None and not self.torchrun_reported and rc is not None:
            self.torchrun_reported = True
            if self.output is not None:
                self.output.drain()
            self._flush_output()
            self.send(messages.TorchrunExit(rc=rc, step=self.last_step, stopped=self.stop_sent))
        self.stopped_ranks = self.ranks.stopped()
        if self.torchrun is not None and rc is None:
            if len(self.procs.rank_pids) < self.spec.nproc_per_node:
                # until every worker was seen once, every tick (not each heartbeat): a short script's
                # rank may finish within a second, and one never seen can never be known to have
                # exited 0 while a peer hangs in its teardown (a false hang and a needless restart)
                self.procs.scan(self.torchrun.pid, self._warm_in_use())
            for clean in self.procs.clean_exits(now, self.last_step, self._warm_in_use()):
                self.send(clean)
        self.ranks.expire(now)

    def heartbeat(self) -> None:
        # ranks without hello, seen as processes; one /proc read a rank a heartbeat
        workers = self.procs.scan(self.torchrun.pid if self.torchrun is not None else None, self._warm_in_use())
        pids, samples, stopped = self.procs.evidence(workers)
        self.stopped_ranks |= stopped
        # a rank is alive if it talks to us (hooks) or its real process runs (no hooks: a worker
        # or the warm interpreter it became)
        ranks = sorted(self.ranks.ranks() | {p["rank"] for p in pids})
        running = self.torchrun is not None and self.torchrun.poll() is None
        self._beat(messages.Heartbeat(ranks_alive=tuple(ranks), last_step=self.last_step, phase=self.phase,
                                     stopped_ranks=tuple(sorted(self.stopped_ranks)), torchrun=running,
                                     dropped=self.dropped, attempt=self.attempt, pids=messages.pack_pids(pids),
                                     # each live rank's CPU time, I/O and state (supervisor/job/liveness.py: busy or hung)
                                     evidence=messages.pack_evidence([rank, *got.to_wire()] for rank, got in samples.items())))
        if self.adopting:
            reap_orphans(self._own_children())   # a subreaper adopts its descendants' orphans

    # ---- the heartbeat tree (relay.py) ----------------------------------------------------------
    def _beat(self, hb: messages.Heartbeat) -> None:
        """A heartbeat to this node's relay when it has one; to stdout otherwise, and at once when
        the relay does not take it (the link is dropped: the direct path until the next `relay`)."""
        frame = self._frame(hb)
        if frame is None:
            return
        if self.parent is not None:
            if self.parent.send(frame):
                return
            self._drop_parent()
        self._write(frame)

    def _relay(self, cmd: messages.Relay) -> None:
        """This node's place in the tree: the children it takes (a listener on its own address, told
        to the supervisor), and where its own heartbeats go."""
        if cmd.children:
            if self.relay is None:
                addr = self.spec.node_addrs.get(self.node) or self.spec.memory_addrs.get(self.node) or "127.0.0.1"
                try:
                    self.relay = RelayHub(addr=addr, secret=self.secret, sel=self.sel, generation=cmd.generation,
                                          children=cmd.children, evidence=cmd.evidence)
                except (OSError, ValueError) as err:
                    console.warning(f"ckptsup agent: {self.node} cannot take heartbeats on {addr}: {err}", err=True)
                    self.send(messages.RelayReady(generation=cmd.generation, addr=None))
                    return
                console.info(f"ckptsup agent: {self.node} takes the heartbeats of {len(cmd.children)} nodes on "
                             f"{self.relay.address}", err=True)
            else:
                self.relay.set_children(cmd.children, generation=cmd.generation, evidence=cmd.evidence)
            self.send(messages.RelayReady(generation=cmd.generation, addr=self.relay.address))
        elif self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.parent is not None and self.parent.addr != cmd.parent:
            self._drop_parent()
        if cmd.parent is not None and self.parent is None:
            try:
                self.parent = ParentLink(cmd.parent)
            except (OSError, ValueError) as err:
                console.warning(f"ckptsup agent: {self.node} cannot reach its relay {cmd.parent} ({err}): "
                                "its heartbeats stay on stdout", err=True)
                return   # its relay is not there: the direct path
            console.info(f"ckptsup agent: {self.node} sends its heartbeats to its relay {cmd.parent}", err=True)
            # the relay never writes: readable means it closed (or died with a reset)
            self.parent_sock = self.parent.sock
            self.sel.register(self.parent_sock, selectors.EVENT_READ, self._drop_parent)

    def _drop_parent(self) -> None:
        if self.parent_sock is not None:
            try:
                self.sel.unregister(self.parent_sock)   # found by identity when already closed
            except (KeyError, ValueError):
                pass
            self.parent_sock = None
        if self.parent is not None:
            console.info(f"ckptsup agent: {self.node} lost its relay {self.parent.addr}: heartbeats on stdout", err=True)
            self.parent.close()
        self.parent = None

    def _own_children(self) -> set[int]:
        """The children a handle of ours waits on (and reads the exit status of)."""
        own = {p.pid for p in (*self.pool.procs, *self.pool.in_use)} if self.pool is not None else set()
        for proc in (self.torchrun, self.zygote.proc if self.zygote is not None else None):
            if proc is not None:
                own.add(proc.pid)
        return own

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.term_signal = signum  # handled in the loop

    def _preempted(self) -> int:
        """SIGTERM: Slurm preempts (every step process got it). Ask ranks to stop and save if
        the budget allows, wait for torchrun up to its shutdown timeout, report, exit."""
        budget = float(self.spec.env.get(PREEMPT_BUDGET_S, "0") or 0)
        self.send(messages.Preempt(signal=self.term_signal, budget_s=budget))
        self.ranks.send(messages.StopAt(reason="preempted", save=True, budget_s=budget))
        if not self.stop_sent:
            self.stop_sent = True
            self._signal_unhooked(signal.SIGTERM)
        deadline = time.monotonic() + max(budget, 1.0)
        while self.torchrun is not None and self.torchrun.poll() is None and time.monotonic() < deadline:
            self._pump(0.1)
            self._flush_output()
        rc = self.torchrun.poll() if self.torchrun is not None else None
        if self.output is not None:
            self.output.drain()
        self.kill_torchrun(0)
        self.send(messages.TorchrunExit(rc=rc, step=self.last_step, preempted=True))
        return ExitStatus.PREEMPTED

    def _pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            key.data()   # what registered the file serves it: stdin, torchrun's output, the rank sockets

    def hello(self) -> None:
        """The agent's first frame: what the supervisor checks before anything else (versions) and
        what it records (the container, the pid namespace, the container phase's length)."""
        container = os.environ.get(CONTAINER_ENV, "")
        free = identity.shm_free()
        warning = identity.shm_warning(self.node, container, free)
        if warning:
            console.warning(warning, err=True)
        self.send(messages.AgentHello(version=__version__, wire=wire.WIRE_VERSION, pid=os.getpid(),
                                      pid_ns=identity.pid_namespace(), container=container[:16],
                                      node_from=self.node_from[:32], shm_free=free,
                                      age_s=round(identity.process_age_s(), 3)))

    def run(self, *, launch: bool = True) -> int:
        # a hangup stops like a preemption; USR1 too (Slurm's time-limit warning, when a site sends
        # it to the steps and not to the batch shell): as the container's PID 1, the agent gets only
        # the signals it handles, and without a handler USR1 would kill it everywhere else
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(signum, self.on_signal)
        if os.getpid() == 1:
            self.adopting = True   # a container's init: every orphan inside is ours to reap
        try:
            self.hello()
            if self.memory is not None:
                self.send(messages.MemoryPeer(addr=self.memory.replicas.address))
            self.heartbeat()
            # its own thread polls the metadata service: the loop only takes what it found
            self.cloud = cloud_notice.watch(self.spec.cloud_notice, self.spec.cloud_endpoints, self.node)
            self._prewarm()   # a spare's agent for a later launch, or the zygote for this one
            if launch:
                self.first_launch_by = time.monotonic() + FIRST_LAUNCH_WAIT_S
            while not self.exit_requested:
                if self.term_signal is not None:
                    return self._preempted()
                # ticks of 5 ms while a lost rank awaits its verdict or the first launch its warm ranks
                # (files); the zygote's import ends in the selector (its `ready` line wakes the loop)
                waiting = self.first_launch_by is not None and not self.zygote_watched
                self._pump(0.005 if self.procs.pending or waiting else TICK_S)
                self._flush_output()
                self._check_processes()
                self._first_launch()
                self._warm_standby()
                for answer in self.external.take():
                    self.send(answer)
                for note in self.memory.peers.take() if self.memory is not None else ():
                    self.send(note)
                self._cloud_notices()
                now = time.monotonic()
                if now - self.last_hb >= self.spec.heartbeat_interval_s:
                    self.last_hb = now
                    self.heartbeat()
                if self.relay is not None and now - self.last_summary >= self.spec.heartbeat_interval_s / SUMMARIES_PER_BEAT:
                    self.last_summary = now
                    for summary in self.relay.summaries():   # what its children said since the last ones
                        self.send(summary)
            return ExitStatus.DONE
        finally:
            self.shutdown()

    def _memory_peers(self, cmd: messages.MemoryPeers) -> None:
        """memory_peers: the buddies to replicate to and, per rank, the agents that may hold it."""
        if self.memory is None:
            raise BadCommand("memory_peers, but this agent has no memory store ([memory] enabled is false)")
        self.memory.peers.set(buddies=list(dict.fromkeys(cmd.buddies)), sources=cmd.rank_sources())

    def _cloud_notices(self) -> None:
        """The cloud announced this node's reclaim: up to the supervisor, which decides (docs/cloud.md)."""
        for notice in self.cloud.take() if self.cloud is not None else ():
            ahead = notice.ahead_s(time.time())
            console.warning(f"ckptsup agent: {notice.cloud.value} will {notice.action} {self.node} at "
                            f"{notice.deadline_iso()} ({ahead:.0f}s from now): {notice.detail}", err=True)
            self.send(messages.CloudNotice(cloud=notice.cloud.value, action=notice.action[:32],
                                           deadline=notice.deadline_iso(), ahead_s=round(ahead, 3),
                                           detail=notice.detail[:200]))

    def shutdown(self) -> None:
        if self.cloud is not None:
            self.cloud.close()
        self.kill_torchrun(0)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._replace_zygote(None)
        if self.memory is not None:
            self.memory.close()
        if self.relay is not None:
            self.relay.close()
        self._drop_parent()
        self.ranks.close()


class BadCommand(CkptsupError):
    """A well-signed command whose body the agent cannot carry out: ignored, the agent goes on."""


def _restart_args(cmd: messages.Restart, current: LaunchSpec) -> tuple[int, LaunchSpec, dict[str, str]]:
    attempt, env, spec = cmd.attempt, dict(cmd.env or {}), cmd.spec
    if not spec:
        return attempt, current, env
    try:
        new = LaunchSpec.from_json(spec, source="restart frame") if isinstance(spec, dict) else LaunchSpec.read(spec)
    except CkptsupError as err:  # from_json and read check every field and never raise anything else
        raise BadCommand(f"unusable launch spec ({str(err)[:120]})") from None
    return attempt, new, env



def run_agent(*, spec_path: str, attempt: int, launch: bool = True) -> int:
    spec = LaunchSpec.read(spec_path)
    secret_file = spec.env.get(SECRET_FILE) or os.environ.get(SECRET_FILE)
    if not secret_file:
        raise ConfigError(f"the agent needs {SECRET_FILE}; it is started by `ckptsup launch`, not by hand")
    node, node_from = identity.this_node()
    missing = identity.torch_missing(os.environ.get(CONTAINER_ENV, ""), python=sys.executable)
    if missing:
        raise ConfigError(missing)   # one line in the agents' log: the supervisor ends the run with it
    os.environ[NODE] = node   # a container's agent found its node another way: everything after reads this
    agent = Agent(spec=spec, node=node, secret=read_secret(secret_file), out=sys.stdout.buffer,
                  inp=sys.stdin.buffer, attempt=attempt)
    agent.node_from = node_from
    # one srun step runs an agent on every usable node: those outside the launch are spares
    return agent.run(launch=launch and node in spec.node_addrs)
