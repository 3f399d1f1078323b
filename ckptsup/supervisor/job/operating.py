"""The operator's side of the supervisor loop, one `Operator` the Supervisor owns: the published
status (supervisor/job/status.py, supervisor/job/prom_live.py), operator requests (supervisor/job/control.py:
save-now, stop, replace), and what a straggler flag leads to. Kept out of loop.py so that the loop
reads as detect → decide → recover. What it needs of the loop comes in through its constructor
(fixed collaborators) or as arguments (this attempt's tracker and nodes); what the loop tells it
(an agent heard, a node warm, a checkpoint committed) goes through its methods."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from ...events import Event, read_events
from ...config import Config, SupervisorConfig
from ...rundir import RunDir, RunState
from ... import console
from ... import messages
from . import control, prom_live, status
from .agent_set import AgentSet
from .attempt import AttemptTracker
from .interval_tuner import IntervalTuner
from .observations import Failure, FailureKind, SupervisionLevel

CONTROL_POLL_S = 0.5   # how often the run dir's control/ is looked at (one scandir)


@dataclass(kw_only=True)
class PendingReplace:
    request: str
    node: str
    after_step: int      # the slowest rank's position when asked: the save it asked for is newer
    due: bool = False    # the checkpoint it waits for was committed
    deadline: float | None = None   # (clock) a cloud notice's: the move happens then at the latest, saved or not
    detail: str = ""     # the failure's detail (default: the operator's request)

    def failure(self, step: int | None) -> Failure:
        return Failure(kind=FailureKind.REPLACED, node=self.node, step=step, suspects=(self.node,),
                       detail=self.detail or f"operator request {self.request}")


class Emit(Protocol):
    def __call__(self, name: Event, **fields: Any) -> None: ...


class Operator:
    """status.json and the live textfile, the operator's requests, straggler moves."""

    def __init__(self, *, config: Config, run_dir: RunDir, job_id: str, agents: AgentSet,
                 interval: IntervalTuner, emit: Emit, clock: Callable[[], float],
                 run_state: Callable[[], RunState], spares: Callable[[], tuple[str, ...]]) -> None:
        self.config = config
        self.sup: SupervisorConfig = config.supervisor
        self.run_dir = run_dir
        self.job_id = job_id
        self.agents = agents
        self.interval = interval
        self.emit = emit
        self.clock = clock
        self.run_state = run_state   # the loop's RunState (replaced after a refused requeue)
        self.spares = spares         # this attempt's spare nodes, in pick order
        self.control_seen: set[str] = set()     # operator requests answered (control.py)
        self.control_polled = 0.0
        self.heard: dict[str, float] = {}        # node -> mono of its agent's last frame (status.py)
        self.warm_nodes: set[str] = set()        # nodes whose next launch starts warm
        self.checkpoints: dict[str, dict[str, Any]] = {}   # committed | validated | durable -> {step, ts}
        self.last_commit_mono: float | None = None
        self.status_published = -float("inf")
        self.status_every_s = status.STATUS_EVERY_S   # longer where one publish costs much (status.next_publish_s)
        self.replace: PendingReplace | None = None   # an operator's replace, waiting for its checkpoint
        self.goodput: float | None = None         # so far, for the live Prometheus textfile
        self.sdc: dict[str, Any] = {}             # planning/sdc_report.py, from the same read of the log
        self.goodput_at = -float("inf")
        self.goodput_commit: float | None = None
        self.said: set[str] = set()

    # ---- what the loop tells it ---------------------------------------------------------------
    def heard_from(self, node: str, at: float) -> None:
        self.heard[node] = at

    def set_warm(self, node: str, warm: bool) -> None:
        """`node`'s warm interpreters are ready (True) or now run the ranks (False)."""
        (self.warm_nodes.add if warm else self.warm_nodes.discard)(node)

    def checkpoint(self, tier: str, record: dict[str, Any]) -> None:
        """A checkpoint reached `tier` (committed | validated | durable); a commit is what a
        waiting replace waited for."""
        self.checkpoints[tier] = {"step": record["step"], "ts": record.get("ts"),
                                  **({"tier": record["tier"]} if isinstance(record.get("tier"), str) else {})}
        if tier == "committed":
            self.last_commit_mono = self.clock()
            # a save of this step or an earlier one began before the ranks heard the request
            # (its write runs in the background): the replace waits for a newer one
            step = record["step"]
            if self.replace is not None and isinstance(step, int) and step > self.replace.after_step:
                self.replace.due = True

    def due_replace(self, step: int | None) -> Failure | None:
        """The replace whose checkpoint was committed, as the failure the loop recovers from."""
        if self.replace is None:
            return None
        late = self.replace.deadline is not None and self.clock() >= self.replace.deadline
        if not (self.replace.due or late):
            return None
        if late and not self.replace.due:
            console.warning(f"ckptsup: {self.replace.node}'s emergency checkpoint was not committed before its "
                            "cloud notice's deadline: moving its ranks from the newest checkpoint")
        failure, self.replace = self.replace.failure(step), None
        return failure

    def publish_status(self, *, active: tuple[str, ...], tracker: AttemptTracker | None, force: bool = False) -> None:
        """status.json for `ckptsup status`, every STATUS_EVERY_S (and at the end)."""
        now = self.clock()
        if not force and now - self.status_published < self.status_every_s:
            return
        self.status_published = now
        cpu = time.thread_time()   # this thread's: the agent readers' meanwhile are not the publish's
        spares = self.spares()
        state = self.run_state()
        seen = status.Seen(now_mono=now, now_wall=time.time(), heard=self.heard, has_agent=self.agents.has_agent,
                           warm_nodes=frozenset(self.warm_nodes), checkpoints=self.checkpoints,
                           interval_s=self.interval.current_s(), last_commit_mono=self.last_commit_mono)
        current = status.build_status(
            job_id=self.job_id, attempt=state.attempt, epoch=state.epoch,
            run_status=state.status.value, active=active, spares=spares,
            excluded=state.excluded_nodes, tracker=tracker, config=self.sup, seen=seen)
        try:
            status.publish(self.run_dir.path, current)
        except OSError as err:   # a full run dir costs the status, never the run
            self.once(f"cannot publish {status.STATUS_FILE}: {err.strerror or err}")
        self.status_every_s = status.next_publish_s(time.thread_time() - cpu)
        if self.config.report.prom_textfile:
            self._publish_prom(current, now, force=force)

    def _publish_prom(self, current: dict[str, Any], now: float, *, force: bool) -> None:
        # goodput moves at commits (progress is useful once saved): recompute then, else seldom
        if force or now - self.goodput_at >= prom_live.GOODPUT_EVERY_S or self.goodput_commit != self.last_commit_mono:
            from ...planning.accounting import account
            from ...planning.sdc_report import sdc_summary

            self.goodput_at, self.goodput_commit = now, self.last_commit_mono
            events = read_events(self.run_dir.path)
            acc = account(events)
            self.goodput = acc.useful_device_s / acc.paid_device_s if acc.paid_device_s else None
            self.sdc = sdc_summary(events)
        path = Path(self.config.report.prom_textfile.replace("{job_id}", self.job_id))
        try:
            prom_live.write_textfile(path, prom_live.live_text(current, self.goodput, self.sdc))
        except OSError as err:
            self.once(f"cannot write the Prometheus textfile {path}: {err.strerror or err}")

    def once(self, line: str) -> None:
        """A line for a problem that repeats every few seconds: said once per run."""
        if line not in self.said:
            self.said.add(line)
            console.warning(f"ckptsup: {line}")

    # ---- operator requests (control.py) -------------------------------------------------------
    def take_control(self, tracker: AttemptTracker, active: tuple[str, ...]) -> control.ControlRequest | None:
        """Answer the operator's waiting requests; a stop is returned for the loop to carry out."""
        now = self.clock()
        if now - self.control_polled < CONTROL_POLL_S:
            return None
        self.control_polled = now
        stop = None
        for request in control.take(self.run_dir.path, self.control_seen):
            if isinstance(request, control.BadRequest):
                self._ack(request.id, None, control.Outcome.REFUSED, request.why, tracker)
            elif request.command is control.ControlCommand.SAVE_NOW:
                refusal = self.save_refusal(tracker)
                if refusal:
                    self._ack(request.id, request.command, control.Outcome.REFUSED, refusal, tracker)
                else:
                    self.agents.send(messages.SaveNow(reason=f"operator request {request.id}"),
                                     nodes=list(active))
                    self._ack(request.id, request.command, control.Outcome.ACCEPTED,
                              "a checkpoint at the next step boundary", tracker)
            elif request.command is control.ControlCommand.REPLACE:
                self._take_replace(request, tracker, active)
            elif stop is None:
                stop = request
                save = "checkpoint, then stop" if request.save else "stop without a checkpoint"
                self._ack(request.id, request.command, control.Outcome.ACCEPTED, f"{save}; no requeue", tracker)
            else:
                self._ack(request.id, request.command, control.Outcome.REFUSED, "a stop is already under way", tracker)
        return stop

    def _take_replace(self, request: control.ControlRequest, tracker: AttemptTracker,
                      active: tuple[str, ...]) -> None:
        """Accept a replace when it can be done: ask for a checkpoint now; the restart without
        the node follows its commit (the loop's `self.replace.due`)."""
        node = request.node or ""
        spares = self.spares()
        refusal = self.save_refusal(tracker)
        if node not in active:
            refusal = f"{node} is not an active node of this attempt (active: {', '.join(active)})"
        elif not spares:
            refusal = f"no spare node to move {node}'s ranks to"
        elif self.replace is not None:
            refusal = f"a replace of {self.replace.node} is already waiting for its checkpoint"
        if refusal:
            self._ack(request.id, request.command, control.Outcome.REFUSED, refusal, tracker)
            return
        self.replace = PendingReplace(request=request.id, node=node, after_step=tracker.current_step() or 0)
        self.agents.send(messages.SaveNow(reason=f"operator replace {request.id}"), nodes=list(active))
        self._ack(request.id, request.command, control.Outcome.ACCEPTED,
                  f"{node}'s ranks move to {spares[0]} after the next checkpoint; {node} is excluded", tracker)

    def straggler(self, tracker: AttemptTracker, found: Any, active: tuple[str, ...]) -> None:
        """A rank flagged as a straggler: the event with the evidence; with straggler_replace, its
        node moves to a spare at the next checkpoint (an operator's replace, by ckptsup)."""
        spares = self.spares()
        replace = (self.sup.straggler_replace and bool(spares) and self.replace is None
                   and tracker.level is SupervisionLevel.HOOKS)
        self.emit(Event.STRAGGLER, **found.evidence(), replace=replace)
        console.warning(f"ckptsup: rank {found.rank} on {found.node} is a straggler: {found.ratio:.2f}x the other "
                        f"ranks' compute time per step for {found.windows} windows"
                        + (f"; moving it to {spares[0]} at the next checkpoint" if replace else ""))
        if replace:
            self.replace = PendingReplace(request=f"straggler-rank{found.rank}", node=found.node,
                                          after_step=tracker.current_step() or 0)
            self.agents.send(messages.SaveNow(reason=f"straggler on {found.node}"), nodes=list(active))

    def save_refusal(self, tracker: AttemptTracker) -> str:
        """Why the ranks cannot be asked for a checkpoint now ("": they can)."""
        level = tracker.level
        if tracker.first_step is None and level is None:
            return "the ranks have not started yet; ask again once they step"
        if level is not SupervisionLevel.HOOKS:
            return (f"this attempt is supervised at the {level.value if level else 'process'} level: its ranks "
                    "do not keep ckptsup checkpoints, so nothing can save now (docs/drop-in.md)")
        return ""

    def _ack(self, request: str, command: control.ControlCommand | None, outcome: control.Outcome,
             detail: str, tracker: AttemptTracker) -> None:
        self.emit(Event.CONTROL, request=request, command=command.value if command else None,
                  outcome=outcome.value, detail=detail, step=tracker.current_step())
        console.info(f"ckptsup: operator request {request} ({command.value if command else '?'}): {outcome.value}: {detail}")
