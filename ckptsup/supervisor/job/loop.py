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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ... import messages, stack_dump
from ...config import Resolved, set_explicitly, write_config_json
from ...env import ExitStatus
from ...errors import CkptsupError, ConfigError
from ...events import Event, EventWriter, read_events
from ...rundir import RunDir, RunState, RunStatus
from ... import console
from . import control, recovery
from ..spec import LaunchSpec
from .agent_launch import AgentLaunch
from .agent_start import AgentStarts
from .agent_set import AgentSet, StepFactory
from .agent_step import AgentStep, CommandSender, Inbox, Message, StepEof, StepSignal
from .operating import Operator
from .own_checkpoints import OwnCheckpoints
from .memory_peers import MemoryPeers
from .notify import Notifier
from .silence_probe import SilenceProbe, suspect_after_s
from .relays import RelayTree
from .attempt import AttemptTracker, Marks
from . import restore_check
from .kill_window import KillWindow
from .launch_spec import AttemptIds, Job, launch_spec
from . import rank_events, teardown
from .tracker_news import TrackerNews
from .retuning import STEADY_AFTER_STEPS, Retuning  # noqa: F401 (STEADY_AFTER_STEPS: also the loop's name, docs/timeouts.md)
from .restart_record import RestartRecord, load_by_source  # noqa: F401 (load_by_source: also the loop's name)
from .interval_tuner import SCHEDULE_KEYS, IntervalTuner
from .nccl import Timeouts
from .observations import (AttemptResult, Failure, FailureKind, History, Observation, RecoveryPath, ShrinkCosts,
                           SupervisionLevel)
from .detection import HEARTBEATS_PER_S, at_scale
from .placement import Placement
from ..node.rank_output import print_console
from .sdc import sdc_cost, sdc_fields
from .unhooked import failed_attempt, progress_dir_newer, stepless_progress
from .shrinking import queue_time_s, shrink_costs
from .policy import Action, CheckHealth, Continue, GiveUp, Requeue, RestartInAllocation, ShrinkChoice, attributed, blamed, decide
from .preemption import StopKind, plan_stop, stop_kind
from .reclaims import Reclaims
from .requeue import RequeueRefused, RequeueRequest, RequeueResult, requeue_job
from .step_completion import tree_waits, wait_budget_s, wait_for_agent_steps

TICK_S = 0.05
STEP_PROGRESS_EVERY_S = 5.0
STEP_TIMES_KEPT = 64    # step times carried across restarts and requeues (state.json) for the timeouts


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
        self.news = TrackerNews(emit=self.emit, agents=self.agents, clock=clock, sup=self.sup)   # tracker_news.py
        # every kill, stop and flight-recorder dump, with its bounded wait for the agents' answers
        self.kills = KillWindow(agents=self.agents, await_answers=self._await, clock=clock, sup=self.sup,
                                nccl=self.config.nccl, placement=placement)
        self.tracker: AttemptTracker | None = None
        self.losses: dict[int, float] = {}   # rank 0's, across attempts (restore_check.py)
        self.history: list[AttemptResult] = [AttemptResult.from_record(r) for r in self.state.failures
                                             if isinstance(r, dict)]
        self.active: tuple[str, ...] = ()
        self.restarts = RestartRecord()   # restart_done's fields, gathered from the decision to the first step
        self.stop_signal: int | None = None
        self.agent_starts = AgentStarts()   # whether the agents can start at all; container phases (agent_start.py)
        # a silent agent's node asked through its slurmd (dead nodes found in ~2 s; silence_probe.py)
        self.silence = SilenceProbe(down=self.placement.slurmd_down) if self.placement.in_slurm else None
        self.relays = RelayTree(above=self.sup.relay_above_nodes)   # the heartbeat tree past relay_above_nodes (relays.py)
        self.lease_stop = threading.Event()
        self.last_progress_event = 0.0
        self.ckpt_dir = recovery.checkpoint_dir(self.config, run_dir.path, placement.job_id)
        self.interval = IntervalTuner(self.config, gpus_per_node=placement.gpus_per_node,
                                      provenance=resolved.provenance)
        self.attempt_wall_start = time.time()   # wall clock of the current launch (progress_dir mtimes)
        self.started_at = clock()               # this supervisor's start: an allocation's start-up is measured from it
        self.first_attempt = self.state.attempt  # set again in _start
        self.operator = Operator(config=self.config, run_dir=run_dir, job_id=placement.job_id, agents=self.agents,
                                 interval=self.interval, emit=self.emit, clock=clock,
                                 run_state=lambda: self.state, spares=self._spares)
        self.reclaims = Reclaims(config=self.config, operator=self.operator, agents=self.agents, emit=self.emit,   # docs/cloud.md
                                 clock=clock, exclude=self._exclude, spares=self._spares, run_state=lambda: self.state,
                                 can_requeue=placement.in_slurm)
        self.interval.grace_time_s = placement.grace_time_s
        # the ranks' checkpoint schedule and collective timeout, retuned as they are measured
        self.retuning = Retuning(config=self.config, interval=self.interval, agents=self.agents, emit=self.emit,
                                 writer=lambda: self.writer)
        self.memory_peers = MemoryPeers(replicas=self.config.memory.replicas,   # the memory tier's placement
                                        domain_pattern=self.config.memory.domain_pattern) if self.config.memory.enabled else None
        self.agent_launch = AgentLaunch(agents=self.agents, memory_peers=self.memory_peers, allocation=placement.nodes,
                                        sup=self.sup, start_agents=self._start_agents)
        # a framework's step folders, HF's checkpoint-N, the script's own files: checked before each launch
        self.own_ckpts = OwnCheckpoints(config=self.config, cwd=job.cwd, script_args=job.script_args, run_dir=run_dir,
                                        job_id=placement.job_id, agents=self.agents, clock=clock, emit=self.emit,
                                        await_answers=self._await)
        self.notifier = Notifier.from_config(self.config.notify, run_dir=str(run_dir.path))   # [notify]: off the loop

    # ---- bookkeeping --------------------------------------------------------------------------
    def emit(self, name: Event, **fields: Any) -> None:
        assert self.writer is not None
        self.writer.attempt, self.writer.epoch = self.state.attempt, self.state.epoch
        record = self.writer.emit(name, **fields)
        self.notifier.offer(record)   # never blocks: the events a person must know (notify.py)
        self.retuning.observe(record)

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
            self.own_ckpts.close()
            self.operator.publish_status(active=self.active, tracker=self.tracker, force=True)
            self.agents.close(self.sup.kill_grace_s)
            self._finish_lost_steps()
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
        step = self.kills.stop_ranks(active=self.active, tracker=self.tracker, reason="cancelled", save=request.save,
                                     budget_s=self.sup.save_timeout_s)
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
            self.own_ckpts.tick(active=self.active, step=tracker.last_step, ids=lambda: {
                "job_id": self.placement.job_id, "attempt": self.state.attempt, "epoch": self.state.epoch,
                "world_size": len(self.active) * int(self.sup.nproc_per_node)})
            self.news.level(tracker, self.state.attempt)
            self.operator.publish_status(active=self.active, tracker=tracker)
            stop = self.operator.take_control(tracker, self.active)
            if stop is not None:
                return self._cancel(stop)
            if failure is None and self.stop_signal is None and self.reclaims.heard:
                failure = self.reclaims.take(tracker, self.active)
            if failure is None and self.stop_signal is None and not tracker.complete:
                failure = teardown.end_teardown(tracker, kills=self.kills, emit=self.emit, clock=self.clock,
                                                exit_grace_s=self.sup.exit_grace_s)
            if failure is None and tracker.complete and self.stop_signal is None:
                hooked = tracker.hooked or tracker.expect_hello
                self.emit(Event.RUN_COMPLETE, step=tracker.last_step if tracker.last_step is not None
                          else (tracker.resume_step - 1 if hooked else None), **sdc_cost(tracker.sdc_s))
                return self._end(RunStatus.DONE, ExitStatus.DONE)
            if failure is None and self.stop_signal is not None:
                failure = Failure(kind=FailureKind.PREEMPTED, step=tracker.current_step(),
                                  detail=f"signal {signal.Signals(self.stop_signal).name}")
            if failure is None:
                failure = self.operator.due_replace(tracker.current_step())
            if failure is None:
                failure = tracker.check(self.clock())
                self.relays.tick(self.clock(), tracker, self.agents, suspect_after_s(self.sup.heartbeat_interval_s))
                self.news.level(tracker, self.state.attempt)
                self.news.after_check(tracker)
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
            self.kills.torchrun_pids.add(body.pid)
            if msg.node in tracker.node_views:   # the attempt's nodes (self.active), by dict
                self.restarts.launched(body.warm)
        had_first = tracker.first_step is not None
        failure = tracker.on_message(msg)
        while tracker.straggler_flags:
            self.operator.straggler(tracker, tracker.straggler_flags.pop(0), self.active)
        teardown.report_errors(tracker, self.emit)
        if isinstance(body, (messages.Step, messages.Progress)):
            self._on_step(tracker, had_first, msg)
        elif isinstance(body, messages.Hello):
            self.retuning.on_hello(tracker, body, measured=self.state.measured)
        return failure

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
            self.own_ckpts.on_answer(msg.node, body)
        elif isinstance(body, messages.MemoryPeer):
            self.agent_launch.peer_address(msg.node, body.addr)
        elif isinstance(body, messages.MemoryReplicated):
            replicated = None if self.memory_peers is None else self.memory_peers.replicated_event(
                msg.node, body, len(self.active) * int(self.sup.nproc_per_node))
            if replicated is not None:
                self.emit(Event.MEMORY_REPLICATED, **replicated)
        elif isinstance(body, messages.CloudNotice):
            self.reclaims.offer(msg.node, body, msg.recv)
        elif isinstance(body, messages.AgentHello):
            self._agent_hello(msg, body)
        elif isinstance(body, messages.RelayReady):
            self.relays.ready(msg.node, body, self.agents)
        else:
            return False
        return True

    def _agent_hello(self, msg: Message, hello: messages.AgentHello) -> None:
        """An agent's first frame: an agent of another wire ends the run in one line (agent_start.py);
        otherwise it is recorded with its container phase: the step's srun to the agent's process."""
        seen = self.agent_starts.hello(msg.node, hello, recv=msg.recv, started=self.agents.started(msg.step_id))
        if seen.problem is not None:
            raise ConfigError(seen.problem)
        if seen.note is not None:
            console.warning(seen.note)
        if seen.all_up and self.tracker is not None:
            self.tracker.marks.agents_up = msg.recv
        self.emit(Event.AGENT_STARTED, **seen.fields)

    def _step_ended(self, tracker: AttemptTracker, msg: Message) -> Failure | None:
        """A step's agents are all gone. A spare's is only noted (a launch that needs the node
        starts it a new one); an active node's is the attempt's failure."""
        lost = self.agents.ended(msg.step_id)
        active = tuple(n for n in self.active if n in lost)
        rc = msg.body.rc if isinstance(msg.body, StepEof) else None
        never = self.agent_starts.never_started(rc=rc, log=msg.body.log) if isinstance(msg.body, StepEof) else None
        if never is not None:   # no agent of this supervisor ever spoke, and their log says why
            raise ConfigError(never)
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

    def _on_step(self, tracker: AttemptTracker, had_first: bool, msg: Message) -> None:
        if not had_first and tracker.first_step is not None:
            self.emit(Event.FIRST_STEP, step=tracker.first_step,
                      since_launch_s=round(msg.recv - (tracker.marks.launch_sent or tracker.started), 4))
            done = self.restarts.done(recv=msg.recv, resume_step=tracker.first_step, phases=tracker.marks.phases())
            if done is not None:
                self.emit(Event.RESTART_DONE, **done)
                self.state.measured["restart_s"] = done["restart_s"]
            elif tracker.attempt == self.first_attempt:   # this allocation's first launch
                self.state.measured["startup_s"] = round(msg.recv - self.started_at, 4)
        self.retuning.on_steps(tracker, save_s=self.state.measured.get("stall_s"))
        now = msg.recv
        if now - self.last_progress_event >= STEP_PROGRESS_EVERY_S:
            self.last_progress_event = now
            p99 = tracker.step_window.p99()
            st = msg.body.step_time_s if isinstance(msg.body, messages.Step) else None
            self.emit(Event.STEP_PROGRESS, step=tracker.last_step, step_time_s=st,
                      step_p99_s=None if p99 is None else round(p99, 6),
                      hang_timeout_s=round(tracker.hang_timeout().s, 3), **sdc_cost(tracker.sdc_s))

    def _forward_event(self, record: Any) -> None:
        """A rank's event (checkpoint_committed, …) to the restart log, and what it tells the loop
        (rank_events.py); the supervisor's own events and unknown names are not forwarded."""
        event = rank_events.read(record)
        if event.fate is rank_events.Fate.UNKNOWN:
            console.warning(f"ckptsup: dropped a rank event of unknown name: {str(record)[:120]}")
        if event.fate is not rank_events.Fate.FORWARD or event.name is None:
            return
        self.emit(event.name, **event.fields)
        if event.tier is not None:
            self.operator.checkpoint(event.tier, record)
        if event.files_by_source is not None:
            self.restarts.loaded(event.files_by_source)
        self.state.measured.update(event.measured)

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
            self.kills.dump_flight_recorder(lambda: self.run_dir.attempt_dir(self.state.attempt) / "flight_recorder",
                                            tracker.ranks)
        silent, unreachable = self.kills.kill_attempt(self.active, failure)
        t_killed = self.clock()
        silent_for = t_killed - tracker.node_views[silent[0]].last_heard if silent else 0.0
        result = failed_attempt(tracker, attempt=self.state.attempt, failure=failure,
                                progressed=lambda: self._stepless_progress(tracker))
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

    def _stepless_progress(self, tracker: AttemptTracker) -> bool:
        """Whether the failed attempt progressed without any step (unhooked.failed_attempt)."""
        ran_s = self.clock() - tracker.started
        # a new external step folder is progress too ([checkpoint] external_dir implies progress_dir)
        newer = progress_dir_newer(self.sup.progress_dir or self.config.checkpoint.external_dir, self.job.cwd,
                                   since_wall=self.attempt_wall_start)
        if self.own_ckpts.hf_saved(since_wall=self.attempt_wall_start):
            newer = True   # HF finished a save of its own (trainer_state.json, written last, is new)
        return stepless_progress(ran_s=ran_s, init_timeout_s=self.sup.init_timeout_s, newer=newer)

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
                self._give_up(reason, kind=failure.kind if failure else None)
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
                self.restarts.begin(detect=marks.detect, path=path, kind=failure.kind, backoff_s=backoff_s, nodes=nodes)
                self._launch(nodes, path=path, marks_from=marks)
                return None
            case Continue() | CheckHealth():
                raise AssertionError(f"{action} is not carried out")  # _decide answers CheckHealth itself

    def _check_script_checkpoint(self) -> ExitStatus | None:
        """Before a launch: the script's own checkpoint files whole, or put back (script_checkpoint.py);
        a corrupt one with no verified copy gives up in one line."""
        reason = self.own_ckpts.script_refusal()
        return None if reason is None else self._give_up(reason, kind=None)

    def _give_up(self, reason: str, *, kind: FailureKind | None) -> ExitStatus:
        """The run ends as the policy or a check before a launch decided: no requeue, exit GIVE_UP."""
        self.emit(Event.GIVE_UP, reason=reason, kind=kind)
        self.state.status = RunStatus.GAVE_UP
        self._save_state()
        console.error(f"ckptsup: giving up: {reason}")
        return ExitStatus.GIVE_UP

    def _end(self, status: RunStatus, exit_status: ExitStatus) -> ExitStatus:
        self.state.status = status
        self._save_state()
        return exit_status

    def _shrink_decided(self, choice: ShrinkChoice) -> None:
        self.emit(Event.SHRINK_DECIDED, **choice.event_fields())
        console.warning(f"ckptsup: node lost, no spare left: {choice.reason}")

    def _stop_for_preemption(self) -> StopKind:
        """Plan the stop (does an emergency save fit the window?), then stop the ranks."""
        kind = stop_kind(self.stop_signal) if self.stop_signal is not None else StopKind.PREEMPTION
        tracker = self.tracker
        notice = self.reclaims.stop if self.stop_signal is None else None
        if notice is not None:   # a cloud notice with nowhere to move the node's ranks: its window
            kind = StopKind.CLOUD_NOTICE
        plan = plan_stop(kind=kind, config=self.config, save_s=self.state.measured.get("stall_s"),
                         grace_time_s=self.interval.grace_time_s,
                         step_p99_s=tracker.step_window.p99() if tracker else None,
                         notice_s=notice[1] if notice else None,
                         elapsed_s=self.clock() - notice[0] if notice else 0.0)
        self.emit(Event.PREEMPTION, **plan.as_event())
        self.kills.stop_ranks(active=self.active, tracker=tracker, reason=kind.value, save=plan.emergency_save,
                              budget_s=plan.budget_s)
        return kind

    def _requeue(self, action: Requeue) -> ExitStatus:
        """Inside Slurm: the fenced requeue (excluded nodes, spanning partition). Outside: nothing
        can requeue; a preempted local run exits PREEMPTED, anything else gives up."""
        if not self.placement.in_slurm:
            if action.preempted:
                return self._end(RunStatus.STOPPED, ExitStatus.PREEMPTED)
            self.emit(Event.GIVE_UP, reason=f"requeue needed ({action.reason}) but not inside Slurm")
            return self._end(RunStatus.GAVE_UP, ExitStatus.GIVE_UP)
        # the ranks are stopped: the agents leave, and a step that lost a node is finished in Slurm
        # before the requeue kills the job (step_completion.py)
        self.agents.close(self.sup.kill_grace_s)
        self._finish_lost_steps()
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

    def _finish_lost_steps(self) -> None:
        """The agents have left. If a node was lost under their step of 7 nodes or more (a tree:
        step_completion.py), wait (bounded, never past the time limit less a requeue's margin)
        until Slurm has finished that step, so that ending the job does not drain the healthy nodes
        still waiting for the dead one's report."""
        lost = {node: n for node, n in self.agents.take_lost().items() if tree_waits(n)}
        if not lost or self.placement.slurm is None:
            return
        budget = wait_budget_s(step_nodes=max(lost.values()), now=time.time(), end_time=self.placement.job_end_time())
        wait = wait_for_agent_steps(self.placement.slurm, self.placement.job_id, budget_s=budget, lost=sorted(lost))
        if self.writer is not None:
            self.emit(Event.AGENT_STEPS_FINISHED, lost=sorted(lost), **wait.as_event())

    def _requeue_in_slurm(self, request: RequeueRequest) -> RequeueResult:
        assert self.placement.slurm is not None   # a requeue is asked for only inside Slurm
        return requeue_job(self.placement.slurm, self.run_dir, request)

    # ---- launching ----------------------------------------------------------------------------
    def _spec(self, nodes: tuple[str, ...], resume_from: str, timeouts: Timeouts) -> tuple[LaunchSpec, Path]:
        attempt_dir = self.run_dir.attempt_dir(self.state.attempt)
        script_args = self.own_ckpts.script_args(self.job.script_args)   # resume_args when the script's checkpoint is in place
        ids = AttemptIds(job_id=self.placement.job_id, attempt=self.state.attempt, epoch=self.state.epoch,
                         attempt_dir=attempt_dir)
        spec = launch_spec(config=self.config, job=self.job, script_args=script_args, placement=self.placement,
                           run_dir=self.run_dir, ckpt_dir=self.ckpt_dir, ids=ids, nodes=nodes,
                           resume_from=resume_from, timeouts=timeouts, interval=self.interval)
        path = attempt_dir / "launch.json"
        spec.write(path)
        return spec, path

    def _launch(self, nodes: tuple[str, ...], *, path: RecoveryPath, marks_from: Marks | None = None) -> None:
        self.own_ckpts.before_launch(nodes, attempt=self.state.attempt, epoch=self.state.epoch)
        self.restarts.new_launch()
        resume_from = recovery.pick_resume(self.ckpt_dir, self.emit)
        timeouts = self.retuning.launch(step_times=self._step_times(), save_s=self.state.measured.get("stall_s"))
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
        missing = self.agent_launch.launch(nodes, spares=spares, spec=spec, spec_path=spec_path, attempt=self.state.attempt)
        if missing:   # in a container their start is a phase of its own (Marks.agents_up; restart_done's container_s)
            self.agent_starts.awaiting = set(missing) if self.placement.container.on else set()
        self.active = nodes
        self.emit(Event.LAUNCH, nodes=list(nodes), path=path.value, spares=spares, resume_from=resume_from or None,
                  world_size=len(nodes) * self.sup.nproc_per_node)

    def _start_agents(self, nodes: tuple[str, ...], spec_path: Path) -> None:
        """One step of agents on `nodes`: those in the launch spec start their ranks, the others
        wait in standby."""
        log = self.run_dir.attempt_dir(self.state.attempt) / "agents.log"
        self.agents.add(self.step_factory(argv=self.placement.agent_argv(nodes, str(spec_path), self.state.attempt),
                                          env=self.placement.agent_env(nodes[0]), nodes=nodes, secret=self.secret,
                                          sender=self.sender, inbox=self.inbox, log_path=log))

    def _exclude(self, node: str, reason: str) -> None:
        if node in self.state.excluded_nodes:
            return
        self.state.excluded_nodes[node] = reason
        self._save_state()
        self.agents.send(messages.Exit(), nodes=[node])   # a live agent there leaves (no ranks, no standby)
        self.agents.lose(node)
        may_drain = self.placement.in_slurm and self.config.slurm.drain_bad_nodes and node not in self.reclaims.reclaimed
        drained = recovery.drain(self.placement.slurm if may_drain else None, node, reason,
                                 job_id=self.placement.job_id)
        self.emit(Event.NODE_EXCLUDED, node=node, reason=reason, drained=drained)
