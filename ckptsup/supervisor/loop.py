"""The supervisor loop: launch agents, fold their messages into the attempt's view, detect, ask the
pure policy, carry the action out (DESIGN §1, §5). Owns the run dir's state, events and lease.

Recovery, in order: failure_detected → kill the attempt's ranks (SIGKILL: their state is in the
last checkpoint; a stopped rank would never see SIGTERM) → health checks on suspects → decide →
exclude blamed nodes → pick the newest checkpoint that validates (levels 1-2; a bad one is
quarantined) → fast path (restart torchrun inside the agents) or node path (new agent step with
srun --overlap) → restart_done with the phase breakdown at the first step after resume.
"""

from __future__ import annotations

import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ..config import Resolved, write_config_json
from ..env import ExitStatus
from ..events import Event, EventWriter
from ..rundir import RunDir, RunState, RunStatus
from . import recovery
from .agent import LaunchSpec
from .attempt import AttemptTracker, Marks
from ..wire import MessageKind
from .agent_step import AgentStep, CommandSender, Message, StepSignal
from .observations import AttemptResult, Failure, FailureKind, History, Observation, Outcome, RecoveryPath
from .placement import Placement
from .policy import GiveUp, Requeue, RestartInAllocation, decide

TICK_S = 0.05
STEP_PROGRESS_EVERY_S = 5.0
KILL_ACK_TIMEOUT_S = 5.0
OWN_EVENTS = frozenset({Event.FIRST_STEP.value, Event.STEP_PROGRESS.value, Event.RUN_COMPLETE.value})


@dataclass(kw_only=True)
class Job:
    script: str
    script_args: list[str]
    cwd: str
    nodes_needed: int


class Supervisor:
    def __init__(self, *, resolved: Resolved, job: Job, run_dir: RunDir, placement: Placement,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.resolved = resolved
        self.config = resolved.config
        self.sup = resolved.config.supervisor
        self.job = job
        self.run_dir = run_dir
        self.placement = placement
        self.clock = clock
        self.sleep = sleep
        self.secret = run_dir.read_secret()
        self.sender = CommandSender(self.secret)
        self.inbox: "queue.Queue[Message]" = queue.Queue()
        self.state: RunState = run_dir.load_state()
        self.writer: EventWriter | None = None
        self.step: AgentStep | None = None
        self.tracker: AttemptTracker | None = None
        self.history: list[AttemptResult] = [AttemptResult.from_record(r) for r in self.state.failures
                                             if isinstance(r, dict)]
        self.active: tuple[str, ...] = ()
        self.restart: dict[str, Any] | None = None   # pending restart_done fields
        self.torchrun_pids: set[int] = set()          # local mode: launchers to reap if the agent dies
        self.stop_signal: int | None = None
        self.lease_stop = threading.Event()
        self.last_progress_event = 0.0
        self.interval = recovery.IntervalTuner(self.config)
        self.interval.grace_time_s = placement.grace_time_s

    # ---- bookkeeping --------------------------------------------------------------------------
    def emit(self, name: Event | str, **fields: Any) -> None:
        assert self.writer is not None
        self.writer.attempt, self.writer.epoch = self.state.attempt, self.state.epoch
        record = self.writer.emit(name, **fields)
        change = self.interval.observe(record)
        if change is not None:
            self._set_interval(*change)

    def _lease_loop(self) -> None:
        host = socket.gethostname()
        while not self.lease_stop.is_set():
            try:
                self.run_dir.renew_lease(epoch=self.state.epoch, host=host)
            except OSError as err:  # a full or flaky FS: the watchdog will see a stale lease
                print(f"ckptsup: lease renewal failed: {err}", flush=True)
            self.lease_stop.wait(self.sup.lease_interval_s)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum  # acted on in the loop

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> ExitStatus:
        self._start()
        try:
            return self._run()
        finally:
            self.lease_stop.set()
            if self.step is not None:
                self.step.close(self.sup.kill_grace_s)
            if self.writer is not None:
                self.writer.close()

    def _start(self) -> None:
        first = not self.run_dir.state_path.exists()
        self.state.epoch += 1
        if not first:
            self.state.attempt += 1
        self.state.status = RunStatus.RUNNING
        self.run_dir.save_state(self.state)
        write_config_json(self.resolved, self.run_dir.config_json_path)
        self.writer = EventWriter(run_dir=self.run_dir.path, job_id=self.placement.job_id,
                                  attempt=self.state.attempt, epoch=self.state.epoch)
        threading.Thread(target=self._lease_loop, name="lease", daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        usable = [n for n in self.placement.nodes if n not in self.state.excluded_nodes]
        self.emit(Event.SUPERVISOR_START, script=self.job.script, resumed=not first,
                  in_slurm=self.placement.in_slurm, excluded=sorted(self.state.excluded_nodes))
        self.emit(Event.ALLOCATION, nodes=len(self.placement.nodes), node_names=list(self.placement.nodes),
                  gpus_per_node=self.config.sbatch.gpus_per_node if self.placement.in_slurm else 0,
                  spares=max(0, len(usable) - self.job.nodes_needed), ranks_per_node=self.sup.nproc_per_node,
                  active=self.job.nodes_needed)

    def _run(self) -> ExitStatus:
        usable = [n for n in self.placement.nodes if n not in self.state.excluded_nodes]
        unhealthy = recovery.health(self, usable)
        for node, why in unhealthy.items():
            self._exclude(node, f"health: {why}")
        usable = [n for n in usable if n not in unhealthy]
        if len(usable) < self.job.nodes_needed:
            failure = Failure(kind=FailureKind.NODE_DOWN, detail="too few healthy nodes at start")
            return self._carry_out(failure, Requeue(exclude=tuple(sorted(self.state.excluded_nodes)),
                                                    reason=f"{len(usable)} healthy node(s), {self.job.nodes_needed} needed")
                                   if self.placement.in_slurm else
                                   GiveUp(reason=f"{len(usable)} healthy node(s), {self.job.nodes_needed} needed"))
        self._launch(tuple(usable[: self.job.nodes_needed]), path="initial")
        while True:
            failure = self._pump()
            tracker = self.tracker
            assert tracker is not None
            if failure is None and tracker.complete:
                self.emit(Event.RUN_COMPLETE, step=tracker.last_step if tracker.last_step is not None
                          else tracker.resume_step - 1)
                self.state.status = RunStatus.DONE
                self.run_dir.save_state(self.state)
                return ExitStatus.DONE
            if failure is None and self.stop_signal is not None:
                failure = Failure(kind=FailureKind.PREEMPTED, step=tracker.current_step(),
                                  detail=f"signal {signal.Signals(self.stop_signal).name}")
            if failure is None:
                failure = tracker.check(self.clock())
            if failure is None:
                continue
            status = self._recover(failure)
            if status is not None:
                return status

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

    def _handle(self, msg: Message) -> Failure | None:
        tracker, step = self.tracker, self.step
        if tracker is None or step is None or msg.step_id != step.step_id:
            return None  # a message from a replaced step
        if msg.m is StepSignal.EOF:
            if tracker.complete or tracker.preempted:
                return None
            if not self.placement.in_slurm:
                return Failure(kind=FailureKind.CRASH, node=self.active[0], step=tracker.current_step(),
                               detail=f"the agent died (rc={msg.body.get('rc')})")
            # Slurm kills a step that includes a dead node: health checks find which one
            return Failure(kind=FailureKind.NODE_DOWN, node=None, step=tracker.current_step(), suspects=self.active,
                           detail=f"agent step ended unexpectedly (rc={msg.body.get('rc')})")
        if msg.m == MessageKind.EVENT:
            self._forward_event(msg.body.get("record"))
            return None
        if msg.m == MessageKind.LAUNCHED and isinstance(msg.body.get("pid"), int):
            self.torchrun_pids.add(msg.body["pid"])
        had_first = tracker.first_step is not None
        failure = tracker.on_message(msg)
        while tracker.teardown_errors:
            error = tracker.teardown_errors.pop(0)
            print(f"ckptsup: every rank on {error['node']} finished, then torchrun exited rc={error['rc']}: "
                  "a crash in process teardown; nothing is lost, not restarting", flush=True)
            self.emit(Event.TEARDOWN_ERROR, **error)
        if msg.m == MessageKind.STEP:
            self._on_step(tracker, had_first, msg)
        return failure

    def _on_step(self, tracker: AttemptTracker, had_first: bool, msg: Message) -> None:
        if not had_first and tracker.first_step is not None:
            self.emit(Event.FIRST_STEP, step=tracker.first_step,
                      since_launch_s=round(msg.recv - (tracker.marks.launch_sent or tracker.started), 4))
            if self.restart is not None:
                restart, self.restart = self.restart, None
                restart_s = msg.recv - restart.pop("detect")
                self.emit(Event.RESTART_DONE, restart_s=round(restart_s, 4), resume_step=tracker.first_step,
                          phases=tracker.marks.phases(), **restart)
                self.state.measured["restart_s"] = round(restart_s, 4)
        now = msg.recv
        if now - self.last_progress_event >= STEP_PROGRESS_EVERY_S:
            self.last_progress_event = now
            p99 = tracker.step_window.p99()
            st = msg.body.get("step_time_s")
            self.emit(Event.STEP_PROGRESS, step=tracker.last_step, step_time_s=st,
                      step_p99_s=None if p99 is None else round(p99, 6),
                      hang_timeout_s=round(tracker.hang_timeout_s(), 3))

    def _forward_event(self, record: Any) -> None:
        """Append a rank's event (checkpoint_committed, …) to the restart log. The supervisor
        writes first_step / step_progress / run_complete itself from what it saw."""
        if not isinstance(record, dict) or "event" not in record or record["event"] in OWN_EVENTS:
            return
        fields = {k: v for k, v in record.items() if k not in ("event", "ts", "mono", "job_id", "attempt", "epoch")}
        fields["rank_ts"] = record.get("ts")
        self.emit(str(record["event"]), **fields)
        if record["event"] == Event.CHECKPOINT_COMMITTED.value:
            for key in ("stall_s", "write_s"):
                if isinstance(record.get(key), (int, float)):
                    self.state.measured[key] = float(record[key])
            self.interval.note_save(record)

    def _set_interval(self, interval_s: float, why: str) -> None:
        interval_s = round(interval_s, 3)
        if self.step is not None:
            self.step.send(MessageKind.SET_INTERVAL, {"interval_s": interval_s})
        assert self.writer is not None
        self.writer.emit(Event.INTERVAL_CHANGED, interval_s=interval_s, why=why)

    # ---- launching ----------------------------------------------------------------------------
    def _spec(self, nodes: tuple[str, ...], resume_from: str) -> tuple[LaunchSpec, Path]:
        attempt_dir = self.run_dir.attempt_dir(self.state.attempt)
        env = recovery.rank_env(self, resume_from)
        spec = LaunchSpec(script=self.job.script, script_args=list(self.job.script_args),
                          nproc_per_node=self.sup.nproc_per_node, nnodes=len(nodes),
                          rdzv_endpoint=self.placement.rdzv_endpoint(nodes[0], self.sup.rdzv_port, self.state.attempt),
                          rdzv_id=f"ckptsup-{self.placement.job_id}-{self.state.attempt}",
                          node_addrs={n: self.placement.addrs.get(n, n) for n in nodes}, env=env,
                          log_dir=str(attempt_dir), heartbeat_interval_s=self.sup.heartbeat_interval_s,
                          shutdown_timeout_s=max(60.0, self.sup.kill_grace_s, self.interval.preempt_window_s()),
                          kill_grace_s=self.sup.kill_grace_s, cwd=self.job.cwd, rdzv_backend=self.sup.rdzv_backend)
        path = attempt_dir / "launch.json"
        spec.write(path)
        return spec, path

    def _launch(self, nodes: tuple[str, ...], *, path: str, resume_from: str | None = None,
                marks_from: Marks | None = None) -> None:
        if resume_from is None:
            resume_from = recovery.pick_resume(self)
        hang_cap = recovery.attempt_timeouts(self).hang_cap_s
        spec, spec_path = self._spec(nodes, resume_from)
        now = self.clock()
        self.tracker = AttemptTracker(attempt=self.state.attempt, nodes=nodes, nproc_per_node=self.sup.nproc_per_node,
                                      config=self.sup, started=now, resume_step=recovery.resume_step(resume_from),
                                      hang_cap_s=hang_cap)
        if marks_from is not None:
            self.tracker.marks = marks_from
        self.tracker.marks.launch_sent = now
        if path == RecoveryPath.FAST.value and self.step is not None:
            self.step.send(MessageKind.RESTART, {"attempt": self.state.attempt, "spec": spec.to_json()})
        else:
            if self.step is not None:
                self.step.abandon()
            log = self.run_dir.attempt_dir(self.state.attempt) / "agents.log"
            self.step = AgentStep(argv=self.placement.agent_argv(nodes, str(spec_path), self.state.attempt),
                                  env=self.placement.agent_env(nodes[0]), nodes=nodes, secret=self.secret,
                                  sender=self.sender, inbox=self.inbox, log_path=log)
        self.active = nodes
        spares = [n for n in self.placement.nodes if n not in nodes and n not in self.state.excluded_nodes]
        self.emit(Event.LAUNCH, nodes=list(nodes), path=path, spares=spares, resume_from=resume_from or None,
                  world_size=len(nodes) * self.sup.nproc_per_node)

    # ---- recovery -----------------------------------------------------------------------------
    def _recover(self, failure: Failure) -> ExitStatus | None:
        tracker = self.tracker
        assert tracker is not None
        t_detect = self.clock()
        self.emit(Event.FAILURE_DETECTED, kind=failure.kind, node=failure.node, rank=failure.rank,
                  step=failure.step, detect_s=round(failure.detect_s, 4), detail=failure.detail)
        if failure.kind is FailureKind.PREEMPTED:
            return recovery.stop_for_preemption(self, failure)
        if failure.kind is FailureKind.HANG:
            recovery.dump_flight_recorder(self)
        silent = self._kill_attempt(failure)
        t_killed = self.clock()
        if silent and self.tracker is not None:
            node = silent[0]
            last = self.tracker.node_views[node].last_heard
            failure = Failure(kind=FailureKind.NODE_DOWN, node=node, step=failure.step, detect_s=t_killed - last,
                              suspects=tuple(silent), detail=f"agent did not answer the kill ({failure.kind.value} "
                                                              f"on {failure.node} was the first symptom)")
            self.emit(Event.FAILURE_DETECTED, kind=failure.kind, node=node, rank=None, step=failure.step,
                      detect_s=round(failure.detect_s, 4), detail=failure.detail)
        unhealthy = recovery.health(self, recovery.suspects(failure, self.history, self.active))
        if failure.kind is FailureKind.NODE_DOWN and failure.node is None and unhealthy:
            failure = replace(failure, node=sorted(unhealthy)[0])
        t_health = self.clock()
        result = AttemptResult(attempt=self.state.attempt, outcome=Outcome.FAILED, start_step=tracker.resume_step,
                               last_step=tracker.last_step, failure=failure)
        self.history.append(result)
        self.state.failures.append(result.to_record())
        spares = tuple(n for n in self.placement.nodes
                       if n not in self.active and n not in self.state.excluded_nodes)
        obs = Observation(failure=failure, active=self.active, spares=spares,
                          excluded=frozenset(self.state.excluded_nodes), unhealthy=frozenset(unhealthy),
                          nodes_needed=self.job.nodes_needed, can_requeue=self.placement.in_slurm,
                          restarts_used=self.state.restarts)
        action = decide(obs, History(attempts=tuple(self.history)), self.sup)
        blamed = action.exclude if isinstance(action, RestartInAllocation) else \
            action.newly_excluded if isinstance(action, Requeue) else ()
        for node in blamed:
            self._exclude(node, unhealthy.get(node) or failure.kind.value)
        marks = Marks(detect=t_detect, killed=t_killed, health_done=t_health)
        return self._carry_out(failure, action, marks=marks, t_detect=t_detect)

    def _carry_out(self, failure: Failure, action: Any, *, marks: Marks | None = None, t_detect: float | None = None) -> ExitStatus | None:
        if isinstance(action, GiveUp):
            self.emit(Event.GIVE_UP, reason=action.reason, kind=failure.kind)
            self.state.status = RunStatus.GAVE_UP
            self.run_dir.save_state(self.state)
            print(f"ckptsup: giving up: {action.reason}", flush=True)
            print(recovery.log_tail(self.run_dir.attempt_dir(self.state.attempt)), flush=True)
            return ExitStatus.GIVE_UP
        if isinstance(action, Requeue):
            return recovery.requeue(self, action)
        assert isinstance(action, RestartInAllocation)
        if action.backoff_s > 0:
            self.sleep(action.backoff_s)
        self.state.restarts += 1
        self.state.attempt += 1
        self.state.epoch += 1
        self.run_dir.save_state(self.state)
        self.restart = {"detect": t_detect if t_detect is not None else self.clock(), "path": action.path.value,
                        "kind": failure.kind.value, "backoff_s": action.backoff_s,
                        "nodes": list(action.nodes)}
        path = action.path
        if path is RecoveryPath.FAST and (self.step is None or not self.step.alive()):
            path = RecoveryPath.NODE  # the agents themselves are gone: start new ones
        self._launch(action.nodes, path=path.value, marks_from=marks)
        return None

    def _kill_attempt(self, failure: Failure) -> list[str]:
        """SIGKILL every rank of the attempt and wait (bounded) for each live agent's ack. The ack
        doubles as a liveness probe: returns the nodes whose agent neither acked nor spoke (a
        rank's crash is often the first symptom of a dead peer node)."""
        step = self.step
        if step is None:
            return []
        dead = {failure.node} if failure.kind is FailureKind.NODE_DOWN else set()
        waiting = {n for n in self.active if n not in dead}
        if not step.alive() or not step.send(MessageKind.KILL, {"grace": 0}):
            self._kill_orphans()
            return []
        deadline = self.clock() + min(self.sup.node_silence_s, max(2.0, 3 * self.sup.heartbeat_interval_s))
        while waiting and self.clock() < deadline:
            try:
                msg = self.inbox.get(timeout=TICK_S)
            except queue.Empty:
                if not step.alive():
                    break
                continue
            if msg.step_id == step.step_id and msg.m == MessageKind.KILLED:
                waiting.discard(msg.node)
            elif msg.m == MessageKind.EVENT:
                self._forward_event(msg.body.get("record"))
        return sorted(waiting) if len(waiting) < len(self.active) else []

    def _kill_orphans(self) -> None:
        """Local mode, agent gone: its torchrun (own session) and ranks would live on. Slurm
        cleans a step's processes itself; here the supervisor kills the trees it was told of."""
        if self.placement.in_slurm:
            return
        from .processes import terminate

        for pid in self.torchrun_pids:
            terminate(pid, 0)
        self.torchrun_pids.clear()

    def _exclude(self, node: str, reason: str) -> None:
        if node in self.state.excluded_nodes:
            return
        self.state.excluded_nodes[node] = reason
        self.run_dir.save_state(self.state)
        drained = recovery.drain(self, node, reason)
        self.emit(Event.NODE_EXCLUDED, node=node, reason=reason, drained=drained)

