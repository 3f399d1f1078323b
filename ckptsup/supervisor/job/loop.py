"""The supervisor loop: launch agents, fold their messages into the attempt's view, detect, ask
the pure policy (`decide`), carry the action out. Owns the run dir's state, events and lease.

Recovery, in order: failure_detected → dump the flight recorder (hang) → kill the attempt's
ranks (SIGKILL: their state is in the last checkpoint; a stopped rank would never see SIGTERM),
which doubles as a liveness probe of every agent → decide (it may first ask for health checks on
suspects) → exclude blamed nodes → the newest checkpoint that validates (levels 1-2; a bad one is
quarantined) → fast path (restart torchrun inside the agents), node path (new agent step on
healthy nodes and spares), requeue or give up → restart_done with the phase breakdown at the
first step after resume. docs/architecture.md tells the whole story.
"""

from __future__ import annotations

import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ... import messages, stack_dump
from ...config import AUTO, CLOUDS, Resolved, set_explicitly, write_config_json
from ...env import ExitStatus
from ...errors import CkptsupError, ConfigError
from ...events import Event, EventWriter, read_events
from ...rundir import RunDir, RunState, RunStatus
from ... import console
from ...wire import MessageKind
from . import control, recovery
from ..spec import LaunchSpec
from . import agent_start
from .agent_set import AgentSet, StepFactory
from .agent_step import AgentStep, CommandSender, Inbox, Message, StepEof, StepSignal
from .operating import Operator, PendingReplace
from .external_resume import ExternalResume
from .external_watch import ExternalCheckpoints, resolve_dir
from .hf_resume import HfCheckpoints
from .memory_peers import MemoryPeers
from .notify import Notifier
from .script_checkpoint import ScriptCheckpoints
from .silence_probe import SilenceProbe, suspect_after_s
from .attempt import AttemptTracker, Marks
from . import restore_check
from .interval_tuner import SCHEDULE_KEYS, IntervalChange, IntervalTuner
from .nccl import Timeouts
from .observations import (AttemptResult, Failure, FailureKind, History, Observation, Outcome, RecoveryPath, ShrinkCosts,
                           SupervisionLevel)
from .detection import HEARTBEATS_PER_S, at_scale
from .placement import Placement
from ..node.rank_output import print_console
from .sdc import sdc_cost, sdc_fields
from ..spec import MONITOR_INTERVAL_S
from ..torchrun_args import TorchrunLine
from .unhooked import level_detail, progress_dir_newer
from .shrinking import queue_time_s, shrink_costs
from .policy import Action, CheckHealth, Continue, GiveUp, Requeue, RestartInAllocation, ShrinkChoice, attributed, blamed, decide
from .preemption import NoticePlan, NoticeWay, StopKind, plan_notice, plan_stop, stop_kind
from .requeue import RequeueRefused, RequeueRequest, RequeueResult, requeue_job

TICK_S = 0.05
STEP_PROGRESS_EVERY_S = 5.0
DUMP_WAIT_S = 2.0       # ranks' hooks thread writes the flight recorder; we do not wait longer than this
STEP_TIMES_KEPT = 64    # step times carried across restarts and requeues (state.json) for the timeouts
STEADY_AFTER_STEPS = 10  # steps measured before a launch that knew none gets its steady collective timeout
OWN_EVENTS = frozenset({Event.FIRST_STEP, Event.STEP_PROGRESS, Event.RUN_COMPLETE})


@dataclass(kw_only=True)
class Job:
    script: str            # a file's absolute path; the module name with `module`
    script_args: list[str]
    cwd: str
    nodes_needed: int
    expects_hello: bool = True   # the script uses ckptsup's hooks (recovery.uses_hooks): no hello in time is a hang
    module: bool = False   # torchrun -m
    no_python: bool = False  # torchrun --no-python: `script` is an executable
    torchrun: TorchrunLine = field(default_factory=TorchrunLine)   # torchrun's other options (torchrun_args.py)


def load_by_source(load_s: Any, files: dict[str, Any]) -> dict[str, float]:
    """The restart's load phase split by where its files came from, in proportion to the files
    read from each source (checkpoint_loaded's files_by_source); {} without a load. Pure."""
    counts = {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, (int, float)) and v > 0}
    total = sum(counts.values())
    if not isinstance(load_s, (int, float)) or not total:
        return {}
    return {k: round(load_s * v / total, 4) for k, v in sorted(counts.items())}


KILL_ACK_S = 0.3        # live agents ack a kill in tens of ms; then the silent nodes' slurmd is asked
SLURMD_PROBE_S = 0.5    # a slurmd that does not accept a connection in this long: its node is dead


@dataclass(kw_only=True)
class KillAcks:
    """What a kill's ack window found (Supervisor._kill)."""

    unacked: set[str]                                   # nodes whose agent has not acked
    unreachable: set[str] = field(default_factory=set)  # of them, those whose slurmd did not answer either
    survivors: list[dict[str, Any]] = field(default_factory=list)   # rank processes named by `report` acks


class Supervisor:
    def __init__(self, *, resolved: Resolved, job: Job, run_dir: RunDir, placement: Placement,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 step_factory: StepFactory = AgentStep,
                 health_checker: recovery.HealthChecker | None = None,
                 requeue: Callable[[RequeueRequest], RequeueResult] | None = None) -> None:
        self.resolved = resolved
        # beyond 2,048 nodes the agents beat less often (detection.at_scale): one config for all
        scaled = at_scale(resolved.config.supervisor, len(placement.nodes),
                          interval_chosen=set_explicitly(resolved.provenance, "supervisor.heartbeat_interval_s"))
        self.config = resolved.config if scaled is resolved.config.supervisor else \
            replace(resolved.config, supervisor=scaled)
        self.sup = self.config.supervisor
        self.job = job
        self.run_dir = run_dir
        self.placement = placement
        self.clock = clock
        self.sleep = sleep
        self.step_factory = step_factory
        self.requeue = requeue or self._requeue_in_slurm   # injected by the loop's tests
        self.health_checker = health_checker or recovery.health_checker(
            self.config, run_dir=run_dir.path, job_id=placement.job_id, in_slurm=placement.in_slurm,
            gpus_per_node=placement.gpus_per_node)
        self.secret = run_dir.read_secret()
        self.sender = CommandSender(self.secret)
        self.inbox = Inbox()   # the agent steps' readers hand over a batch a read (agent_step.py)
        self.state: RunState = run_dir.load_state()
        self.writer: EventWriter | None = None
        self.agents = AgentSet()
        self.tracker: AttemptTracker | None = None
        self.losses: dict[int, float] = {}   # rank 0's, across attempts (restore_check.py)
        self.history: list[AttemptResult] = [AttemptResult.from_record(r) for r in self.state.failures
                                             if isinstance(r, dict)]
        self.active: tuple[str, ...] = ()
        self.restart: dict[str, Any] | None = None   # pending restart_done fields
        self.loaded_files: dict[str, Any] = {}        # the attempt's checkpoint_loaded files_by_source
        self.torchrun_pids: set[int] = set()          # local mode: launchers to reap if the agent dies
        self.stop_signal: int | None = None
        self.notices: list[tuple[str, messages.CloudNotice, float]] = []   # (node, notice, recv) to decide on (docs/cloud.md)
        self.agents_heard = False          # an agent of this supervisor said hello: the agents can start at all
        # a silent agent's node asked through its slurmd (dead nodes found in ~2 s; silence_probe.py)
        self.silence = SilenceProbe(down=self.placement.slurmd_down) if self.placement.in_slurm else None
        self.awaiting_agents: set[str] = set()   # a launch's new agents in containers, until each says hello
        self.versions_noted: set[str] = set()   # agents' other ckptsup versions, warned about once each
        self.reclaimed: set[str] = set()             # nodes a cloud takes back: excluded, never drained
        self.notice_stop: tuple[float, float] | None = None   # (recv, ahead_s) of the notice that stops the run
        self.lease_stop = threading.Event()
        self.last_progress_event = 0.0
        self.ckpt_dir = recovery.checkpoint_dir(self.config, run_dir.path, placement.job_id)
        self.timeouts: Timeouts | None = None   # the current attempt's collective timeouts
        self.steady_pending = False             # launched before any step was measured
        self.interval = IntervalTuner(self.config, gpus_per_node=placement.gpus_per_node,
                                      provenance=resolved.provenance)
        self.attempt_wall_start = time.time()   # wall clock of the current launch (progress_dir mtimes)
        self.started_at = clock()               # this supervisor's start: an allocation's start-up is measured from it
        self.first_attempt = self.state.attempt  # set again in _start
        self.operator = Operator(config=self.config, run_dir=run_dir, job_id=placement.job_id, agents=self.agents,
                                 interval=self.interval, emit=self.emit, clock=clock,
                                 run_state=lambda: self.state, spares=self._spares)
        self.interval.grace_time_s = placement.grace_time_s
        self.memory_peers = MemoryPeers(replicas=self.config.memory.replicas,   # the memory tier's placement
                                        domain_pattern=self.config.memory.domain_pattern) if self.config.memory.enabled else None
        external_dir = resolve_dir(self.config, job.cwd)   # [checkpoint] external_dir: a framework's own step folders
        self.external = None if external_dir is None else ExternalCheckpoints(
            config=self.config, directory=external_dir, run_dir=run_dir.path, emit=self.emit, clock=clock)
        self.external_resume = None if self.external is None else ExternalResume(
            watch=self.external, agents=self.agents, run_dir=run_dir.path, job_id=placement.job_id,
            nproc_per_node=int(self.sup.nproc_per_node), load_timeout_s=self.sup.load_timeout_s, clock=clock,
            emit=self.emit, await_answers=self._await)
        # [checkpoint] hf_output_dir: HF's own checkpoint-N folders (auto: the script's --output_dir), checked before each launch
        self.hf_ckpt = HfCheckpoints.from_config(self.config, cwd=job.cwd, script_args=job.script_args, emit=self.emit)
        # [supervisor] script_checkpoint: the script's own checkpoint files, kept and checked before each launch
        self.script_ckpt = ScriptCheckpoints.from_config(self.config, cwd=job.cwd, run_dir=run_dir.path, emit=self.emit)
        self.notifier = Notifier.from_config(self.config.notify, run_dir=str(run_dir.path))   # [notify]: off the loop

    # ---- bookkeeping --------------------------------------------------------------------------
    def emit(self, name: Event, **fields: Any) -> None:
        assert self.writer is not None
        self.writer.attempt, self.writer.epoch = self.state.attempt, self.state.epoch
        record = self.writer.emit(name, **fields)
        self.notifier.offer(record)   # never blocks: the events a person must know (notify.py)
        for change in self.interval.observe(record):
            self._set_interval(change)

    def _save_state(self) -> None:
        if self.tracker is not None and self.tracker.step_window.samples:
            self.state.measured["step_times"] = [round(x, 6) for x in
                                                 self.tracker.step_window.samples[-STEP_TIMES_KEPT:]]
        self.run_dir.save_state(self.state)

    def _step_times(self) -> list[float]:
        """Measured step times: this attempt's, else the last ones kept (also across requeues)."""
        if self.tracker is not None and self.tracker.step_window.samples:
            return list(self.tracker.step_window.samples)
        kept = self.state.measured.get("step_times")
        return [float(x) for x in kept if isinstance(x, (int, float))] if isinstance(kept, list) else []

    def _lease_loop(self) -> None:
        host = socket.gethostname()
        while not self.lease_stop.is_set():
            try:
                self.run_dir.renew_lease(epoch=self.state.epoch, host=host)
            except OSError as err:  # a full or flaky FS: the watchdog will see a stale lease
                console.warning(f"ckptsup: lease renewal failed: {err}")
            self.lease_stop.wait(self.sup.lease_interval_s)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum  # acted on in the loop

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> ExitStatus:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
        try:
            self._start()
            return self._run()
        except CkptsupError as err:
            self._stopped_by(err)  # a problem for a human (an untrusted checkpoint dir, …): say so, then exit with it
            raise
        finally:
            self.lease_stop.set()
            if self.script_ckpt is not None:
                self.script_ckpt.close()
            self.operator.publish_status(active=self.active, tracker=self.tracker, force=True)
            self.agents.close(self.sup.kill_grace_s)
            self.notifier.close()   # the last notice (run_complete, give_up, requeue) leaves, bounded
            if self.silence is not None:
                self.silence.close()
            if self.writer is not None:
                self.writer.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stopped_by(self, err: CkptsupError) -> None:
        if self.writer is not None:
            self.emit(Event.GIVE_UP, reason=str(err))
        self.state.status = RunStatus.GAVE_UP
        self._save_state()
        console.error(f"ckptsup: stopping: {err}")

    def _start(self) -> None:
        first = not self.run_dir.state_path.exists()
        earlier = [] if first else read_events(self.run_dir.path)
        self.state.epoch += 1
        if not first:
            self.state.attempt += 1
        self.state.status = RunStatus.RUNNING
        self.first_attempt = self.state.attempt
        self.run_dir.save_state(self.state)
        write_config_json(self.resolved, self.run_dir.config_json_path)
        self.interval.learn_schedule({key: self.state.measured.get(kept) for key, kept in SCHEDULE_KEYS.items()})
        self.interval.seed(earlier)
        self.writer = EventWriter(run_dir=self.run_dir.path, job_id=self.placement.job_id,
                                  attempt=self.state.attempt, epoch=self.state.epoch)
        threading.Thread(target=self._lease_loop, name="lease", daemon=True).start()
        queued = queue_time_s(earlier, time.time())
        if queued is not None:   # a requeue's time in the queue: prices fewer nodes against the next one
            self.state.measured["queue_s"] = round(queued, 3)
            self.run_dir.save_state(self.state)
        usable = [n for n in self.placement.nodes if n not in self.state.excluded_nodes]
        self.emit(Event.SUPERVISOR_START, script=self.job.script, resumed=not first,
                  in_slurm=self.placement.in_slurm, excluded=sorted(self.state.excluded_nodes))
        self.emit(Event.ALLOCATION, nodes=len(self.placement.nodes), node_names=list(self.placement.nodes),
                  gpus_per_node=self.placement.gpus_per_node,
                  spares=max(0, len(usable) - self.job.nodes_needed), ranks_per_node=self.sup.nproc_per_node,
                  active=self.job.nodes_needed)
        if self.sup is not self.resolved.config.supervisor:
            console.info(f"ckptsup: {len(self.placement.nodes)} nodes: agents beat every {self.sup.heartbeat_interval_s:g}s and "
                f"a node silent {self.sup.node_silence_s:g}s is down (one supervisor core folds in "
                f"{HEARTBEATS_PER_S} heartbeats a second; set supervisor.heartbeat_interval_s to choose)")

    def _node_order(self) -> tuple[str, ...]:
        """The allocation's nodes in the order they are picked to train: Slurm's, or with
        [supervisor] batch_host_spare the batch host last (a spare while another one is left)."""
        nodes, here = self.placement.nodes, self.placement.here
        if not (self.sup.batch_host_spare and self.placement.in_slurm and here in nodes):
            return nodes
        return (*(n for n in nodes if n != here), here)

    def _cancel(self, request: control.ControlRequest) -> ExitStatus:
        """An operator's stop: the ranks agree on a stop step and save unless told not to (within
        save_timeout_s), then the run ends CANCELLED: no requeue, by the template or anyone."""
        step = self._stop_ranks(reason="cancelled", save=request.save, budget_s=self.sup.save_timeout_s)
        self.emit(Event.RUN_CANCELLED, step=step, saved=request.save, request=request.id,
                  **sdc_cost(self.tracker.sdc_s if self.tracker is not None else None))
        self.state.status = RunStatus.CANCELLED
        self._save_state()
        console.info(f"ckptsup: stopped on request {request.id} at step {step}; not requeueing")
        return ExitStatus.CANCELLED

    def _spares(self, active: tuple[str, ...] | None = None) -> tuple[str, ...]:
        """The nodes that can replace an active one (of `active`, default this attempt's), in pick order."""
        busy = set(self.active if active is None else active)   # a set: 16,384 active nodes were 0.27 G comparisons
        return tuple(n for n in self._node_order() if n not in busy and n not in self.state.excluded_nodes)

    def _run(self) -> ExitStatus:
        usable = tuple(n for n in self._node_order() if n not in self.state.excluded_nodes)
        status = self._carry_out(self._decide(self._observe(None, starting=True, spares=usable)))
        if status is not None:
            return status
        while True:
            failure = self._pump()
            tracker = self.tracker
            assert tracker is not None
            self._poll_external()
            if self.script_ckpt is not None:   # the versions its thread kept, with the last progress step
                self.script_ckpt.tick(step=tracker.last_step)
            self._report_level(tracker)
            self.operator.publish_status(active=self.active, tracker=tracker)
            stop = self.operator.take_control(tracker, self.active)
            if stop is not None:
                return self._cancel(stop)
            if failure is None and self.stop_signal is None and self.notices:
                failure = self._take_notices(tracker)
            if failure is None and self.stop_signal is None and not tracker.complete:
                failure = self._end_teardown(tracker)
            if failure is None and tracker.complete and self.stop_signal is None:
                hooked = tracker.hooked or tracker.expect_hello
                self.emit(Event.RUN_COMPLETE, step=tracker.last_step if tracker.last_step is not None
                          else (tracker.resume_step - 1 if hooked else None), **sdc_cost(tracker.sdc_s))
                self.state.status = RunStatus.DONE
                self._save_state()
                return ExitStatus.DONE
            if failure is None and self.stop_signal is not None:
                failure = Failure(kind=FailureKind.PREEMPTED, step=tracker.current_step(),
                                  detail=f"signal {signal.Signals(self.stop_signal).name}")
            if failure is None:
                failure = self.operator.due_replace(tracker.current_step())
            if failure is None:
                failure = tracker.check(self.clock())
                self._report_level(tracker)
                self._carry_out_tracker_news(tracker)
            if failure is None and self.silence is not None:
                failure = self._probe_silence(tracker)
            if failure is None:
                continue
            status = self._recover(failure)
            if status is not None:
                return status

    def _probe_silence(self, tracker: AttemptTracker) -> Failure | None:
        """Agents silent SUSPECT_BEATS heartbeats have their node's slurmd asked (off the loop); a
        node_down once one does not answer (silence_probe.py)."""
        assert self.silence is not None
        now = self.clock()
        self.silence.offer(tracker.silent_past(now, suspect_after_s(self.sup.heartbeat_interval_s)))
        return self.silence.take(now, step=tracker.current_step(),
                                 still_silent=lambda node, heard: node in tracker.node_views
                                 and tracker.node_views[node].last_heard <= heard)

    def _carry_out_tracker_news(self, tracker: AttemptTracker) -> None:
        """What the tracker's verdicts ask for: the ranks' stacks from their agents (liveness.py),
        a `restore_loss_jump` warning (restore_check.py), a `busy` event when ranks work without
        progress (not a hang)."""
        if tracker.want_stacks:
            nodes = {n for n in tracker.nodes if n not in tracker.done_nodes}
            self.agents.send(messages.Stacks(), nodes=sorted(nodes))
            tracker.asked_for_stacks(self.clock(), nodes)
        while tracker.restore_news:
            jump = tracker.restore_news.pop(0)
            self.emit(Event.RESTORE_LOSS_JUMP, step=jump.step, loss=jump.loss, before=jump.before, basis=jump.basis,
                      detail=jump.detail)
            console.warning(f"ckptsup: warning: {jump.detail}")
        while tracker.busy_news:
            news = tracker.busy_news.pop(0)
            self.emit(Event.BUSY, ranks=list(news.ranks), detail=news.detail,
                      silent_s=None if tracker.busy_quiet_since is None else round(self.clock() - tracker.busy_quiet_since, 3))
            console.warning(f"ckptsup: no progress past the hang timeout, but the ranks work: busy, not hung ({news.detail}; "
                            f"killed only after supervisor.busy_limit_s={self.sup.busy_limit_s:g}s)")
        while tracker.busy_over_news:
            ranks, busy_s = tracker.busy_over_news.pop(0)
            self.emit(Event.BUSY_OVER, ranks=list(ranks), busy_s=round(busy_s, 3))

    def _pump(self) -> Failure | None:
        """Fold in every queued message (waiting up to one tick); the first failure wins."""
        try:
            msg = self.inbox.get(timeout=TICK_S)
        except queue.Empty:
            return None
        failure = None
        while True:
            found = self._handle(msg)
            failure = failure or found
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return failure

    def _await(self, done: Callable[[Message], bool], deadline: float,
               until: Callable[[], bool] = lambda: False) -> bool:
        """Wait for a message of the current step that `done` accepts (or for `until()`), at most
        until `deadline`. Every wait forwards ranks' events to the restart log on the way."""
        while self.clock() < deadline:
            if until():
                return True
            try:
                msg = self.inbox.get(timeout=TICK_S)
            except queue.Empty:
                continue
            if not self.agents.current(msg):
                continue
            if msg.m is StepSignal.EOF:
                if self.tracker is not None:
                    self._step_ended(self.tracker, msg)   # active ones stay silent: the caller's probe sees it
                else:
                    self.agents.ended(msg.step_id)
                continue
            self.operator.heard_from(msg.node, msg.recv)
            self._note(msg)
            if done(msg):
                return True
        return until()

    def _handle(self, msg: Message) -> Failure | None:
        tracker = self.tracker
        if tracker is None or not self.agents.current(msg):
            return None  # a message from a replaced step, or from an agent we let go
        if msg.m is StepSignal.EOF:
            return self._step_ended(tracker, msg)
        self.operator.heard_from(msg.node, msg.recv)
        if self._note(msg):
            return None
        body = msg.body
        if isinstance(body, messages.Launched):
            self.operator.set_warm(msg.node, False)   # its warm interpreters (if any) now run these ranks
        if isinstance(body, messages.Launched) and body.pid is not None:
            self.torchrun_pids.add(body.pid)
            if self.restart is not None and msg.node in tracker.node_views:   # the attempt's nodes (self.active), by dict
                # restart_done says how the ranks started: warm only if every node's did
                self.restart["warm"] = self.restart.get("warm", True) and body.warm is True
        had_first = tracker.first_step is not None
        failure = tracker.on_message(msg)
        while tracker.straggler_flags:
            self.operator.straggler(tracker, tracker.straggler_flags.pop(0), self.active)
        while tracker.teardown_errors:
            error = tracker.teardown_errors.pop(0)
            console.warning(f"ckptsup: every rank on {error['node']} finished, then torchrun exited rc={error['rc']}: "
                "a crash in process teardown; nothing is lost, not restarting")
            self.emit(Event.TEARDOWN_ERROR, **error)
        if isinstance(body, (messages.Step, messages.Progress)):
            self._on_step(tracker, had_first, msg)
        elif isinstance(body, messages.Hello):
            self._on_hello(tracker, body)
        return failure

    def _on_hello(self, tracker: AttemptTracker, hello: messages.Hello) -> None:
        """A rank's hello says its own disk schedule, the memory saves' cap (interval_tuner.py).
        Retuned at the last rank's hello: a set_interval sent earlier misses the ranks not yet
        connected, and the ranks apply one only once every rank holds it."""
        self.state.measured.update(self.interval.learn_schedule(
            {"save_every_steps": hello.save_every_steps, "save_every_s": hello.save_every_s}))
        if tracker.hellos == tracker.world_size:
            for change in self.interval.retune("hello"):
                self._set_interval(change)

    def _note(self, msg: Message) -> bool:
        """What is only recorded, in the loop and during every wait: ranks' events, their console
        lines, a node's warm interpreters. True when `msg` was one of those."""
        body = msg.body
        if isinstance(body, messages.EventRecord):
            self._forward_event(body.record)
        elif isinstance(body, messages.Output):
            print_console(body)
        elif isinstance(body, messages.WarmReady):
            self.operator.set_warm(msg.node, True)
            self.emit(Event.WARM_READY, node=msg.node, interpreters=body.interpreters)
        elif isinstance(body, messages.ExtHashed):
            if self.external is not None:
                self.external.on_answer(msg.node, body)
        elif isinstance(body, messages.MemoryPeer):
            if self.memory_peers is not None and self.memory_peers.on_peer(msg.node, body.addr):
                self._send_memory_peers()
        elif isinstance(body, messages.MemoryReplicated):
            self._memory_replicated(msg.node, body)
        elif isinstance(body, messages.CloudNotice):
            self.notices.append((msg.node, body, msg.recv))   # decided on in the loop (_take_notices)
        elif isinstance(body, messages.AgentHello):
            self._agent_hello(msg, body)
        else:
            return False
        return True

    def _agent_hello(self, msg: Message, hello: messages.AgentHello) -> None:
        """An agent's first frame: an agent of another wire ends the run in one line (agent_start.py);
        otherwise it is recorded with its container phase: the step's srun to the agent's process."""
        problem = agent_start.hello_problem(msg.node, hello)
        if problem is not None:
            raise ConfigError(problem)
        note = agent_start.version_note(msg.node, hello)
        if note is not None and hello.version not in self.versions_noted:
            self.versions_noted.add(hello.version)
            console.warning(note)
        self.agents_heard = True
        if msg.node in self.awaiting_agents:
            self.awaiting_agents.discard(msg.node)
            if not self.awaiting_agents and self.tracker is not None:
                self.tracker.marks.agents_up = msg.recv
        started = self.agents.started(msg.step_id)
        python_s = round(hello.age_s, 3)
        container_s = None if started is None else round(max(msg.recv - started - hello.age_s, 0.0), 3)
        self.emit(Event.AGENT_STARTED, node=msg.node, version=hello.version, container=hello.container,
                  pid=hello.pid, pid_ns=hello.pid_ns, node_from=hello.node_from, shm_free=hello.shm_free,
                  container_s=container_s, python_s=python_s)

    def _step_ended(self, tracker: AttemptTracker, msg: Message) -> Failure | None:
        """A step's agents are all gone. A spare's is only noted (a launch that needs the node
        starts it a new one); an active node's is the attempt's failure."""
        lost = self.agents.ended(msg.step_id)
        active = tuple(n for n in self.active if n in lost)
        rc = msg.body.rc if isinstance(msg.body, StepEof) else None
        if not self.agents_heard and isinstance(msg.body, StepEof) and msg.body.log:
            # no agent of this supervisor ever spoke: if their log says why (no ckptsup in the image,
            # no such interpreter, the runtime refused), every node would fail the same (agent_start.py)
            why = agent_start.read_start_failure(Path(msg.body.log))
            if why is not None:
                raise ConfigError(f"the agents could not start (rc={rc}; {msg.body.log}): {why}")
        if not active:
            if lost:
                self.emit(Event.AGENT_LOST, nodes=list(lost), rc=rc)
            return None
        if tracker.complete or tracker.preempted:
            return None
        if not self.placement.in_slurm:
            return Failure(kind=FailureKind.CRASH, node=self.active[0], step=tracker.current_step(),
                           detail=f"the agent died (rc={rc})")
        # the agents' srun ended under them (a dead batch host's network, scancel of the step):
        # health checks find whether a node is to blame
        return Failure(kind=FailureKind.NODE_DOWN, node=None, step=tracker.current_step(), suspects=active,
                       detail=f"agent step on {', '.join(active)} ended unexpectedly (rc={rc})")

    def _report_level(self, tracker: AttemptTracker) -> None:
        """The supervision_level event when the attempt's level becomes known; the progress_stale
        warning when a script without hooks shows no progress line for progress_warn_s."""
        level = tracker.take_level()
        if level is not None:
            self.emit(Event.SUPERVISION_LEVEL, level=level, detail=level_detail(level, self.sup))
            if level is SupervisionLevel.PROCESS:
                console.info(f"ckptsup: attempt {self.state.attempt}: {level_detail(level, self.sup)}")
        stale = tracker.progress_stale(self.clock(), self.sup.progress_warn_s)
        if stale is not None:
            self.emit(Event.PROGRESS_STALE, since_launch_s=round(stale, 1), pattern=self.sup.progress_pattern)

    def _on_step(self, tracker: AttemptTracker, had_first: bool, msg: Message) -> None:
        if not had_first and tracker.first_step is not None:
            self.emit(Event.FIRST_STEP, step=tracker.first_step,
                      since_launch_s=round(msg.recv - (tracker.marks.launch_sent or tracker.started), 4))
            if self.restart is not None:
                restart, self.restart = self.restart, None
                restart_s = msg.recv - restart.pop("detect")
                phases = tracker.marks.phases()
                self.emit(Event.RESTART_DONE, restart_s=round(restart_s, 4), resume_step=tracker.first_step,
                          phases=phases, load_by_source=load_by_source(phases.get("load_s"), self.loaded_files),
                          **restart)
                self.state.measured["restart_s"] = round(restart_s, 4)
            elif tracker.attempt == self.first_attempt:   # this allocation's first launch
                self.state.measured["startup_s"] = round(msg.recv - self.started_at, 4)
        if self.steady_pending and len(tracker.step_window.samples) >= STEADY_AFTER_STEPS:
            self._set_steady_timeout(tracker)
        now = msg.recv
        if now - self.last_progress_event >= STEP_PROGRESS_EVERY_S:
            self.last_progress_event = now
            p99 = tracker.step_window.p99()
            st = msg.body.step_time_s if isinstance(msg.body, messages.Step) else None
            self.emit(Event.STEP_PROGRESS, step=tracker.last_step, step_time_s=st,
                      step_p99_s=None if p99 is None else round(p99, 6),
                      hang_timeout_s=round(tracker.hang_timeout().s, 3), **sdc_cost(tracker.sdc_s))

    def _set_steady_timeout(self, tracker: AttemptTracker) -> None:
        """A launch that knew no step time ran with steady = init (docs/timeouts.md §3): once this
        attempt's steps are measured, tighten the ranks' collective timeout, and with it the hang
        cap that keeps the supervisor's detection first."""
        self.steady_pending = False
        steady = recovery.attempt_timeouts(self.config, step_times=tracker.step_window.samples,
                                           save_s=self.state.measured.get("stall_s"))
        if self.timeouts is None or steady.collective_s >= self.timeouts.collective_s:
            return
        self.agents.send(messages.SetTimeout(collective_s=round(steady.collective_s, 3)))
        tracker.hang_cap_s, tracker.save_allowance_s = steady.hang_cap_s, steady.save_allowance_s
        self.emit(Event.COLLECTIVE_TIMEOUT_SET, collective_s=round(steady.collective_s, 3),
                  was_s=round(self.timeouts.collective_s, 3), steps=len(tracker.step_window.samples))
        self.timeouts = steady

    def _forward_event(self, record: Any) -> None:
        """Append a rank's event (checkpoint_committed, …) to the restart log. The supervisor
        writes first_step / step_progress / run_complete itself from what it saw; a name it does
        not know (a rank of another ckptsup version) is logged and dropped."""
        name = Event.parse(record.get("event")) if isinstance(record, dict) else None
        if name is None:
            console.warning(f"ckptsup: dropped a rank event of unknown name: {str(record)[:120]}")
            return
        if name in OWN_EVENTS:
            return
        fields = {k: v for k, v in record.items() if k not in ("event", "ts", "mono", "job_id", "attempt", "epoch")}
        fields["rank_ts"] = record.get("ts")
        self.emit(name, **fields)
        tier = {Event.CHECKPOINT_COMMITTED: "committed", Event.CHECKPOINT_VALIDATED: "validated",
                Event.CHECKPOINT_PROMOTED: "durable"}.get(name)
        if tier is not None and isinstance(record.get("step"), int):
            self.operator.checkpoint(tier, record)
        if name is Event.CHECKPOINT_LOADED and isinstance(record.get("files_by_source"), dict):
            self.loaded_files = record["files_by_source"]
        if name is Event.CHECKPOINT_COMMITTED:
            for key in ("stall_s", "write_s"):
                if isinstance(record.get(key), (int, float)):
                    self.state.measured[key] = float(record[key])

    def _set_interval(self, change: IntervalChange) -> None:
        """The ranks follow a new disk interval or memory schedule (interval_tuner.py decides)."""
        self.agents.send(change.command())
        assert self.writer is not None
        self.writer.emit(Event.INTERVAL_CHANGED, **change.event_fields())

    # ---- deciding -----------------------------------------------------------------------------
    def _observe(self, failure: Failure | None, **fields: Any) -> Observation:
        base = dict(failure=failure, active=self.active, spares=self._spares(), excluded=frozenset(self.state.excluded_nodes),
                    nodes_needed=self.job.nodes_needed, can_requeue=self.placement.in_slurm,
                    restarts_used=self.state.restarts, agents_alive=all(self.agents.has_agent(n) for n in self.active),
                    min_nodes=self.sup.min_nodes,
                    shrink=self._shrink_costs() if 0 < self.sup.min_nodes < self.job.nodes_needed else None)
        return Observation(**{**base, **fields})

    def _shrink_costs(self) -> ShrinkCosts:
        """Fewer nodes vs a requeue: this run's measurements where it has them, else the knobs
        (docs/planning.md §Fewer nodes or a requeue)."""
        return shrink_costs(self.state.measured, self.sup, end_time=self.placement.job_end_time(), now=time.time())

    def _decide(self, obs: Observation) -> Action:
        """`decide`, answering its request for health checks when it makes one."""
        history = History(attempts=tuple(self.history))
        action = decide(obs, history, self.sup)
        if isinstance(action, CheckHealth):
            unhealthy = {}
            for node, result in self.health_checker(list(action.nodes)).items():
                self.emit(Event.HEALTH_CHECK, node=node, ok=result.ok, detail=result.summary())
                if not result.ok:
                    unhealthy[node] = result.summary()
            action = decide(replace(obs, unhealthy=frozenset(unhealthy), health_detail=tuple(sorted(unhealthy.items()))),
                            history, self.sup)
        return action

    # ---- recovery -----------------------------------------------------------------------------
    def _hang_fields(self, failure: Failure) -> dict[str, Any]:
        """A hang judged from evidence: every rank's (`ranks_seen`) and where its stacks stay."""
        if not failure.ranks_seen:
            return {}
        return {"ranks_seen": list(failure.ranks_seen),
                "stacks": f"attempt-{self.state.attempt}/{stack_dump.STACKS_DIR}"}

    def _recover(self, failure: Failure) -> ExitStatus | None:
        tracker = self.tracker
        assert tracker is not None
        t_detect = self.clock()
        self.emit(Event.FAILURE_DETECTED, kind=failure.kind, node=failure.node, rank=failure.rank,
                  step=failure.step, detect_s=round(failure.detect_s, 4), detail=failure.detail,
                  **sdc_fields(failure), **sdc_cost(tracker.sdc_s), **self._hang_fields(failure))
        if failure.kind is FailureKind.PREEMPTED:
            return self._carry_out(self._decide(self._observe(failure)))
        if failure.kind is FailureKind.HANG:
            self._dump_flight_recorder()
        silent, unreachable = self._kill_attempt(failure)
        t_killed = self.clock()
        silent_for = t_killed - tracker.node_views[silent[0]].last_heard if silent else 0.0
        result = self._attempt_result(tracker, failure)
        self.history.append(result)
        action = self._decide(self._observe(failure, silent=tuple(silent), silent_for_s=silent_for,
                                            unreachable=tuple(unreachable)))
        found = attributed(action) or failure
        self.history[-1] = replace(result, failure=found)
        self.state.failures.append(self.history[-1].to_record())
        if (found.kind, found.node) != (failure.kind, failure.node):
            self._attributed(found, failure)
        for earlier in action.also_user_errors if isinstance(action, GiveUp) else ():
            self._attributed(replace(earlier, kind=FailureKind.USER_ERROR,
                                     detail=f"the first of a crash loop: {earlier.detail}"), earlier)
        marks = Marks(detect=t_detect, killed=t_killed, health_done=self.clock())
        return self._carry_out(action, marks=marks)

    def _attempt_result(self, tracker: AttemptTracker, failure: Failure) -> AttemptResult:
        """The history entry of the attempt that just failed. An attempt without hooks starts at
        its first progress line (the script resumes itself: ckptsup does not know where); one
        without any step counts as progress when `progress_dir` got a newer entry, or when it
        outlived the init allowance (a script that dies on start-up does not)."""
        level = tracker.level or SupervisionLevel.PROCESS
        if level in (SupervisionLevel.HOOKS, SupervisionLevel.HEARTBEAT) or tracker.expect_hello:
            return AttemptResult(attempt=self.state.attempt, outcome=Outcome.FAILED, start_step=tracker.resume_step,
                                 last_step=tracker.last_step, failure=failure, level=level)
        if tracker.first_step is not None:
            return AttemptResult(attempt=self.state.attempt, outcome=Outcome.FAILED, start_step=tracker.first_step,
                                 last_step=tracker.last_step, failure=failure, level=level)
        ran_s = self.clock() - tracker.started
        # a new external step folder is progress too ([checkpoint] external_dir implies progress_dir)
        newer = progress_dir_newer(self.sup.progress_dir or self.config.checkpoint.external_dir, self.job.cwd,
                                   since_wall=self.attempt_wall_start)
        if self.hf_ckpt is not None and self.hf_ckpt.progressed(since_wall=self.attempt_wall_start):
            newer = True   # HF finished a save of its own (trainer_state.json, written last, is new)
        progress = newer if newer is not None else ran_s > self.sup.init_timeout_s
        return AttemptResult(attempt=self.state.attempt, outcome=Outcome.FAILED, start_step=0, last_step=None,
                             failure=failure, level=level, progress=progress)

    def _attributed(self, failure: Failure, detected: Failure) -> None:
        self.emit(Event.FAILURE_ATTRIBUTED, kind=failure.kind, node=failure.node, was_kind=detected.kind,
                  was_node=detected.node, detect_s=round(failure.detect_s, 4), detail=failure.detail)

    def _carry_out(self, action: Action, *, marks: Marks | None = None) -> ExitStatus | None:
        for node, why in blamed(action):
            self._exclude(node, why)
        shrink = action.shrink if isinstance(action, (RestartInAllocation, Requeue)) else None
        if shrink is not None:
            self._shrink_decided(shrink)
        match action:
            case GiveUp(reason=reason, failure=failure):
                self.emit(Event.GIVE_UP, reason=reason, kind=failure.kind if failure else None)
                self.state.status = RunStatus.GAVE_UP
                self._save_state()
                console.error(f"ckptsup: giving up: {reason}")
                console.error(recovery.log_tail(self.run_dir.attempt_dir(self.state.attempt),
                                                rank=failure.rank if failure else None), newlines=True)
                return ExitStatus.GIVE_UP
            case Requeue(preempted=True):
                kind = self._stop_for_preemption()
                return self._requeue(replace(action, reason=f"{kind.value}: {action.reason}"))
            case Requeue():
                return self._requeue(action)
            case RestartInAllocation(path=RecoveryPath.INITIAL, nodes=nodes):
                refused = self._check_script_checkpoint()
                if refused is not None:
                    return refused
                self._launch(nodes, path=RecoveryPath.INITIAL)
                return None
            case RestartInAllocation(nodes=nodes, path=path, backoff_s=backoff_s, failure=failure):
                refused = self._check_script_checkpoint()
                if refused is not None:
                    return refused
                if backoff_s > 0:
                    self.sleep(backoff_s)
                if failure is None or failure.kind is not FailureKind.REPLACED:
                    self.state.restarts += 1   # an operator's replace spends no restart budget
                self.state.attempt += 1
                self.state.epoch += 1
                self._save_state()
                assert marks is not None and failure is not None
                self.restart = {"detect": marks.detect, "path": path.value, "kind": failure.kind.value,
                                "backoff_s": backoff_s, "nodes": list(nodes)}
                self._launch(nodes, path=path, marks_from=marks)
                return None
            case Continue() | CheckHealth():
                raise AssertionError(f"{action} is not carried out")  # _decide answers CheckHealth itself

    def _check_script_checkpoint(self) -> ExitStatus | None:
        """Before a launch: the script's own checkpoint files whole, or put back (script_checkpoint.py);
        a corrupt one with no verified copy gives up in one line."""
        reason = self.script_ckpt.before_launch() if self.script_ckpt is not None else None
        if reason is None:
            return None
        self.emit(Event.GIVE_UP, reason=reason, kind=None)
        self.state.status = RunStatus.GAVE_UP
        self._save_state()
        console.error(f"ckptsup: giving up: {reason}")
        return ExitStatus.GIVE_UP

    def _shrink_decided(self, choice: ShrinkChoice) -> None:
        self.emit(Event.SHRINK_DECIDED, **choice.event_fields())
        console.warning(f"ckptsup: node lost, no spare left: {choice.reason}")

    def _kill_attempt(self, failure: Failure) -> tuple[list[str], list[str]]:
        """SIGKILL every rank of the attempt; the acks double as a liveness probe: returns the nodes
        whose agent neither acked nor spoke (a rank's crash is often the first symptom of a dead
        peer node), and those of them whose slurmd did not answer either. Live agents ack within
        tens of milliseconds; a silent node whose slurmd does not answer is dead now — no wait for
        an ack that cannot come (it cost the node path 2 s); one whose slurmd answers may just be
        slow and gets the whole window (`_kill`)."""
        dead = {failure.node} if failure.kind is FailureKind.NODE_DOWN else set()
        acks = self._kill(self.active, wait_for=[n for n in self.active if n not in dead], probe=True)
        if acks is None or len(acks.unacked) == len(self.active):
            return [], []   # nothing sent, or no agent answered: the supervisor's own link is the suspect
        return sorted(acks.unacked), sorted(acks.unreachable & acks.unacked)

    def _kill(self, send_to: Sequence[str], *, wait_for: Sequence[str], report: bool = False,
              probe: bool = False) -> KillAcks | None:
        """The one owner of the kill and its acks: `kill` to the agents of `send_to`, then the acks of
        `wait_for` within the ack window (min(node_silence_s, max(2 s, 3 beats))), with the
        survivors each names when `report`. With `probe`, the nodes still silent KILL_ACK_S after the
        kill have their slurmd asked and an unanswering one is not waited for. None when no kill
        could be sent (the agents are gone: their orphans are killed here instead)."""
        agents = self.agents
        acks = KillAcks(unacked=set(wait_for))
        if not agents.alive() or not agents.send(messages.Kill(grace=0, report=report), nodes=list(send_to)):
            self._kill_orphans()
            return None

        def acked(msg: Message) -> bool:
            if isinstance(msg.body, messages.Killed) and msg.node in acks.unacked:
                acks.unacked.discard(msg.node)
                acks.survivors += [{"node": msg.node, **{k: entry[k] for k in ("rank", "pid", "host_pid", "wchan", "stack")
                                                          if k in entry}} for entry in msg.body.survivors or ()]
            return False

        def gone() -> bool:
            return not any(agents.has_agent(n) for n in acks.unacked - acks.unreachable)

        deadline = self.clock() + min(self.sup.node_silence_s, max(2.0, 3 * self.sup.heartbeat_interval_s))
        if probe:
            self._await(acked, min(self.clock() + KILL_ACK_S, deadline), until=gone)
            if acks.unacked and not gone():
                acks.unreachable = self.placement.slurmd_down(sorted(acks.unacked), SLURMD_PROBE_S)
        self._await(acked, deadline, until=gone)
        return acks

    def _end_teardown(self, tracker: AttemptTracker) -> Failure | None:
        """The ranks finished but some of their processes did not exit within exit_grace_s (a
        stuck destroy_process_group, a non-daemon thread): kill them (the agents SIGKILL the whole
        tree, stopped processes included), name them in `teardown_hang`, and end those nodes as if
        torchrun had exited 0 there (the final checkpoint was committed before the bye)."""
        hang = tracker.teardown_hang(self.clock())
        if hang is None:
            return None
        acks = self._kill(hang.nodes, wait_for=hang.nodes, report=True)
        survivors = sorted(acks.survivors if acks is not None else [], key=lambda e: (e.get("rank", -1), e["node"]))
        self.emit(Event.TEARDOWN_HANG, ranks=survivors, nodes=list(hang.nodes), exit_grace_s=self.sup.exit_grace_s,
                  waited_s=round(hang.waited_s, 3))
        named = ", ".join(f"rank {e.get('rank')} on {e['node']} (pid {e.get('pid')})" for e in survivors) or \
            f"torchrun on {', '.join(hang.nodes)}"
        console.warning(f"ckptsup: the ranks finished, but {named} had not exited {self.sup.exit_grace_s:g}s later "
                        "([supervisor] exit_grace_s): killed; the run counts as finished")
        failure = None
        for node in hang.nodes:
            failure = failure or tracker.teardown_done(node)
        return failure

    def _dump_flight_recorder(self) -> None:
        """Before killing hung ranks, ask their hooks thread to dump the flight recorder (NCCL keeps
        one; gloo on CPU does not, so without GPUs there is nothing to wait for). Waits for every
        rank's `fr_dumped` or DUMP_WAIT_S, whichever comes first."""
        nccl = self.config.nccl
        if not (nccl.dump_on_timeout and nccl.flight_recorder_entries > 0 and self.placement.gpus_per_node > 0):
            return
        self.agents.send(messages.DumpFr(path=str(self.run_dir.attempt_dir(self.state.attempt) / "flight_recorder")))
        waiting = set(self.tracker.ranks) if self.tracker is not None else set()

        def dumped(msg: Message) -> bool:
            record = msg.body.record if isinstance(msg.body, messages.EventRecord) else None
            if record is not None and record.get("event") == Event.FR_DUMPED:
                waiting.discard(record.get("rank"))
            return False

        self._await(dumped, self.clock() + DUMP_WAIT_S, until=lambda: not waiting)

    def _take_notices(self, tracker: AttemptTracker) -> Failure | None:
        """The clouds' notices heard so far (docs/cloud.md): each decided on (`plan_notice`, pure),
        written as one `cloud_notice` event and one console line, and carried out: a spare
        excluded; a training node's ranks moved to a spare (or the job requeued without it) after
        an emergency checkpoint when one fits — the replace machinery, with the notice's deadline —
        else at once; a run with nowhere to move them stopped as a preemption. A notice for a node
        while another node's replace waits for its checkpoint waits its turn."""
        waiting, failure = [], None
        for node, notice, recv in self.notices:
            pending = self.operator.replace
            if failure is not None or (pending is not None and pending.node != node and node in self.active):
                waiting.append((node, notice, recv))
                continue
            plan = plan_notice(node=node, ahead_s=notice.ahead_s, config=self.config, active=self.active,
                               spares=self._spares(), excluded=frozenset(self.state.excluded_nodes),
                               can_requeue=self.placement.in_slurm,
                               checkpoints=not self.operator.save_refusal(tracker),
                               save_s=self.state.measured.get("stall_s"), write_s=self.state.measured.get("write_s"),
                               elapsed_s=self.clock() - recv, step_p99_s=tracker.step_window.p99())
            self.emit(Event.CLOUD_NOTICE, node=node, cloud=notice.cloud, action=notice.action, deadline=notice.deadline,
                      ahead_s=notice.ahead_s, detail=notice.detail, step=tracker.current_step(), **plan.as_event())
            console.warning(f"ckptsup: cloud notice: {notice.cloud} will {notice.action} {node} at {notice.deadline} "
                            f"({notice.ahead_s:.0f}s ahead): {plan.reason}")
            failure = self._carry_out_notice(node, notice, plan, tracker)
        self.notices = waiting
        return failure

    def _carry_out_notice(self, node: str, notice: messages.CloudNotice, plan: NoticePlan,
                          tracker: AttemptTracker) -> Failure | None:
        detail = f"cloud notice: {notice.cloud} {notice.action} at {notice.deadline}"
        if plan.way is NoticeWay.IGNORE:
            return None
        self.reclaimed.add(node)   # the cloud takes it back: excluded, but not drained (its next instance is another machine)
        if plan.way is NoticeWay.EXCLUDE:
            self._exclude(node, detail)
            return None
        if plan.way is NoticeWay.STOP:
            self.notice_stop = (self.clock(), plan.window_s)
            return Failure(kind=FailureKind.PREEMPTED, step=tracker.current_step(), detail=detail)
        if plan.way is NoticeWay.MOVE:
            pending = self.operator.replace
            if pending is not None and pending.node == node:
                self.operator.replace = None   # a replace of the same node waited for a checkpoint: it moves now
            return Failure(kind=FailureKind.REPLACED, node=node, step=tracker.current_step(), suspects=(node,),
                           detail=detail)
        deadline = self.clock() + plan.move_by_s
        pending = self.operator.replace
        if pending is not None and pending.node == node:   # already waiting for a checkpoint: by the deadline now
            pending.deadline = deadline if pending.deadline is None else min(pending.deadline, deadline)
            pending.detail = detail
            return None
        self.operator.replace = PendingReplace(request=f"cloud-notice-{node}", node=node,
                                               after_step=tracker.current_step() or 0, deadline=deadline,
                                               detail=detail)
        self.agents.send(messages.SaveNow(reason=f"cloud notice for {node}"), nodes=list(self.active))
        return None

    def _stop_for_preemption(self) -> StopKind:
        """Plan the stop (does an emergency save fit the window?), then stop the ranks."""
        kind = stop_kind(self.stop_signal) if self.stop_signal is not None else StopKind.PREEMPTION
        tracker = self.tracker
        notice = self.notice_stop if self.stop_signal is None else None
        if notice is not None:   # a cloud notice with nowhere to move the node's ranks: its window
            kind = StopKind.CLOUD_NOTICE
        plan = plan_stop(kind=kind, config=self.config, save_s=self.state.measured.get("stall_s"),
                         grace_time_s=self.interval.grace_time_s,
                         step_p99_s=tracker.step_window.p99() if tracker else None,
                         notice_s=notice[1] if notice else None,
                         elapsed_s=self.clock() - notice[0] if notice else 0.0)
        self.emit(Event.PREEMPTION, **plan.as_event())
        self._stop_ranks(reason=kind.value, save=plan.emergency_save, budget_s=plan.budget_s)
        return kind

    def _stop_ranks(self, *, reason: str, save: bool, budget_s: float) -> int | None:
        """Ask the ranks to agree on a stop step (and save if `save`); wait (bounded) for every
        node's torchrun to exit; then kill what is left. Returns the last step the nodes saw."""
        agents, tracker = self.agents, self.tracker
        last = tracker.last_step if tracker is not None else None
        if not agents.alive():
            return last
        agents.send(messages.StopAt(reason=reason, save=save, budget_s=budget_s))
        waiting = set(self.active) - (tracker.done_nodes if tracker else set())
        steps = [last] if last is not None else []

        def exited(msg: Message) -> bool:
            if isinstance(msg.body, messages.TorchrunExit):
                waiting.discard(msg.node)
                if msg.body.step is not None:
                    steps.append(msg.body.step)
            return False

        self._await(exited, self.clock() + budget_s + self.sup.kill_grace_s,
                    until=lambda: not waiting or not any(agents.has_agent(n) for n in waiting))
        agents.send(messages.Kill(grace=0))
        return max(steps) if steps else None

    def _requeue(self, action: Requeue) -> ExitStatus:
        """Inside Slurm: the fenced requeue (excluded nodes, spanning partition). Outside: nothing
        can requeue; a preempted local run exits PREEMPTED, anything else gives up."""
        if not self.placement.in_slurm:
            if action.preempted:
                self.state.status = RunStatus.STOPPED
                self._save_state()
                return ExitStatus.PREEMPTED
            self.emit(Event.GIVE_UP, reason=f"requeue needed ({action.reason}) but not inside Slurm")
            self.state.status = RunStatus.GAVE_UP
            self._save_state()
            return ExitStatus.GIVE_UP
        self.agents.abandon()  # ranks are already killed; srun may hang on a dead node's step: don't wait
        self._save_state()
        if self.writer is not None:
            self.writer.close()  # requeue_job appends the fenced `requeue` event itself
        try:
            self.requeue(RequeueRequest(job_id=self.placement.job_id, reason=action.reason, exclude=tuple(action.exclude),
                                        partition=self.config.slurm.spare_partition or None))
        except RequeueRefused as err:
            self.state = self.run_dir.load_state()
            self.emit(Event.GIVE_UP, reason=str(err))
            self.state.status = RunStatus.GAVE_UP
            self.run_dir.save_state(self.state)
            console.error(f"ckptsup: {err}")
            return ExitStatus.GIVE_UP
        except CkptsupError as err:  # e.g. Slurm already requeued a preempted job: the template retries
            console.error(f"ckptsup: requeue failed: {err}; leaving it to the batch script")
        self.notifier.offer_last(self.run_dir.path)   # requeue_job appended the requeue event itself
        return ExitStatus.PREEMPTED if action.preempted else ExitStatus.REQUEUE

    def _requeue_in_slurm(self, request: RequeueRequest) -> RequeueResult:
        assert self.placement.slurm is not None   # a requeue is asked for only inside Slurm
        return requeue_job(self.placement.slurm, self.run_dir, request)

    # ---- launching ----------------------------------------------------------------------------
    def _spec(self, nodes: tuple[str, ...], resume_from: str, timeouts: Timeouts) -> tuple[LaunchSpec, Path]:
        attempt_dir = self.run_dir.attempt_dir(self.state.attempt)
        line = self.job.torchrun
        env = recovery.rank_env(self.config, run_dir=self.run_dir.path, config_json=self.run_dir.config_json_path,
                                secret_path=self.run_dir.secret_path, ckpt_dir=self.ckpt_dir,
                                job_id=self.placement.job_id, attempt=self.state.attempt, epoch=self.state.epoch,
                                resume_from=resume_from, timeouts=timeouts, save_every_s=self.interval.current_s(),
                                preempt_budget_s=self.interval.preempt_budget_s(),
                                memory_every_steps=self.interval.memory_every_steps())
        script_args = self.script_ckpt.args(self.job.script_args) if self.script_ckpt is not None \
            else list(self.job.script_args)   # resume_args when the script's checkpoint is in place
        spec = LaunchSpec(script=self.job.script, script_args=script_args,
                          nproc_per_node=self.sup.nproc_per_node, nnodes=len(nodes),
                          rdzv_endpoint=self.placement.rdzv_endpoint(nodes[0], self.sup.rdzv_port, self.state.attempt),
                          rdzv_id=f"ckptsup-{self.placement.job_id}-{self.state.attempt}",
                          node_addrs={n: self.placement.addrs.get(n, n) for n in nodes}, env=env,
                          log_dir=str(attempt_dir), heartbeat_interval_s=self.sup.heartbeat_interval_s,
                          shutdown_timeout_s=max(60.0, self.sup.kill_grace_s, self.interval.preempt_window_s())
                          if line.shutdown_timeout_s is None else float(line.shutdown_timeout_s),
                          monitor_interval_s=line.monitor_interval_s or MONITOR_INTERVAL_S,
                          torchrun_log_dir=line.log_dir, torchrun_options=list(line.passed),
                          console_local_ranks=line.console_local_ranks(self.sup.nproc_per_node),
                          kill_grace_s=self.sup.kill_grace_s, cwd=self.job.cwd, rdzv_backend=self.sup.rdzv_backend,
                          progress_pattern=self.sup.progress_pattern, tee=self.sup.tee,
                          module=self.job.module, no_python=self.job.no_python, warm_ranks=self.sup.warm_ranks,
                          memory_keep=self.config.memory.keep if self.config.memory.enabled else 0,
                          # auto: each rank checks its own fit (memory_tier.fit_budget); the agent takes what comes
                          memory_max_bytes=0 if self.config.memory.max_bytes == AUTO else self.config.memory.max_bytes,
                          memory_addrs={n: self.placement.addrs.get(n, n) for n in self.placement.nodes}
                          if self.config.memory.enabled else {},
                          cloud_notice=self.config.preemption.cloud_notice,
                          cloud_endpoints={cloud: getattr(self.config.preemption, f"{cloud}_endpoint")
                                           for cloud in CLOUDS})
        path = attempt_dir / "launch.json"
        spec.write(path)
        return spec, path

    def _launch(self, nodes: tuple[str, ...], *, path: RecoveryPath, marks_from: Marks | None = None) -> None:
        if self.external_resume is not None:   # bad external step folders out of the framework's way
            self.external_resume.before_launch(nodes, attempt=self.state.attempt, epoch=self.state.epoch)
        if self.hf_ckpt is not None:   # bad checkpoint-N folders out of HF's get_last_checkpoint's way
            self.hf_ckpt.before_launch(world_size=len(nodes) * int(self.sup.nproc_per_node))
        self.loaded_files = {}
        resume_from = recovery.pick_resume(self.ckpt_dir, self.emit)
        step_times = self._step_times()
        timeouts = recovery.attempt_timeouts(self.config, step_times=step_times,
                                             save_s=self.state.measured.get("stall_s"))
        self.timeouts, self.steady_pending = timeouts, not step_times
        spec, spec_path = self._spec(nodes, resume_from, timeouts)
        now = self.clock()
        hooked_before = any(a.level in (SupervisionLevel.HOOKS, SupervisionLevel.HEARTBEAT) for a in self.history)
        if self.tracker is not None:   # rank 0's losses so far: the restore's first steps are compared with them
            self.losses = restore_check.keep(self.losses, self.tracker.losses)
            if len(self.tracker.nodes) != len(nodes):   # fewer nodes: another global batch a step, another loss
                self.losses = {}
        self.tracker = AttemptTracker(attempt=self.state.attempt, nodes=nodes, nproc_per_node=self.sup.nproc_per_node,
                                      config=self.sup, started=now, resume_step=recovery.resume_step(resume_from),
                                      hang_cap_s=timeouts.hang_cap_s, save_allowance_s=timeouts.save_allowance_s,
                                      expect_hello=self.job.expects_hello or hooked_before,
                                      loss_before=dict(self.losses))
        self.attempt_wall_start = time.time()
        if marks_from is not None:
            self.tracker.marks = marks_from
        self.tracker.marks.launch_sent = now
        spares = list(self._spares(nodes))
        present = [n for n in nodes if self.agents.has_agent(n)]
        if self.memory_peers is not None:   # before the restart: the ranks ask their agents at once
            too_few = self.memory_peers.launch(nodes, int(self.sup.nproc_per_node))
            if too_few is not None:
                console.warning(f"ckptsup: {too_few}")
            self._send_memory_peers()
        if present:
            # the agents that outlived the failure (survivors, warm spares) take the new spec; a
            # failed send means they just died: their step's EOF is the next failure
            self.agents.send(messages.Restart(attempt=self.state.attempt, spec=spec.to_json()),
                             nodes=present)
        missing = [n for n in nodes if n not in present]
        if missing:
            # the first launch brings up the spares' agents with the rest (standby, pre-warmed)
            start = [*missing, *(s for s in spares if not self.agents.has_agent(s))] if not present else missing
            self._start_agents(tuple(start), spec_path)
            # in a container their start is a phase of its own (Marks.agents_up; restart_done's container_s)
            self.awaiting_agents = set(missing) if self.placement.container.on else set()
        self.active = nodes
        self.emit(Event.LAUNCH, nodes=list(nodes), path=path.value, spares=spares, resume_from=resume_from or None,
                  world_size=len(nodes) * self.sup.nproc_per_node)

    def _send_memory_peers(self) -> None:
        """Every launched node's buddies and sources (memory_peers.py), to the agents that are up."""
        assert self.memory_peers is not None
        alive = [n for n in self.placement.nodes if self.agents.has_agent(n)]
        for node, body in self.memory_peers.commands(alive).items():
            if self.agents.has_agent(node):
                self.agents.send(body, nodes=[node])

    def _memory_replicated(self, node: str, note: messages.MemoryReplicated) -> None:
        if self.memory_peers is None:
            return
        if note.ok is not True:
            self.emit(Event.MEMORY_REPLICATED, ok=False, node=node, step=note.step,
                      rank=note.rank, buddy=note.buddy, reason=(note.reason or "")[:300])
            return
        world = len(self.active) * int(self.sup.nproc_per_node)
        step = self.memory_peers.on_replicated(note, world)
        if step is not None:
            self.emit(Event.MEMORY_REPLICATED, ok=True, step=step, ranks=world)

    def _poll_external(self) -> None:
        if self.external is not None and self.active:
            self.external.poll(send=self.agents.send, has_agent=self.agents.has_agent, nodes=self.active,
                               nproc_per_node=int(self.sup.nproc_per_node),
                               ids={"job_id": self.placement.job_id, "attempt": self.state.attempt,
                                    "epoch": self.state.epoch,
                                    "world_size": len(self.active) * int(self.sup.nproc_per_node)})

    def _start_agents(self, nodes: tuple[str, ...], spec_path: Path) -> None:
        """One step of agents on `nodes`: those in the launch spec start their ranks, the others
        wait in standby."""
        log = self.run_dir.attempt_dir(self.state.attempt) / "agents.log"
        self.agents.add(self.step_factory(argv=self.placement.agent_argv(nodes, str(spec_path), self.state.attempt),
                                          env=self.placement.agent_env(nodes[0]), nodes=nodes, secret=self.secret,
                                          sender=self.sender, inbox=self.inbox, log_path=log))

    def _kill_orphans(self) -> None:
        """Local mode, agent gone: its torchrun (own session) and ranks would live on. Slurm
        cleans a step's processes itself; here the supervisor kills the trees it was told of."""
        if self.placement.in_slurm:
            return
        from ..processes import terminate

        for pid in self.torchrun_pids:
            terminate(pid, 0)
        self.torchrun_pids.clear()

    def _exclude(self, node: str, reason: str) -> None:
        if node in self.state.excluded_nodes:
            return
        self.state.excluded_nodes[node] = reason
        self._save_state()
        self.agents.send(messages.Exit(), nodes=[node])   # a live agent there leaves (no ranks, no standby)
        self.agents.lose(node)
        may_drain = self.placement.in_slurm and self.config.slurm.drain_bad_nodes and node not in self.reclaimed
        drained = recovery.drain(self.placement.slurm if may_drain else None, node, reason,
                                 job_id=self.placement.job_id)
        self.emit(Event.NODE_EXCLUDED, node=node, reason=reason, drained=drained)
