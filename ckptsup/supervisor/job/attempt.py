"""What the supervisor knows about the running attempt, built from agent messages.

`AttemptTracker.on_message` folds one message in and returns a Failure when the message itself is
one (a crash report, a NaN, a preemption); `check(now)` runs the time-based detectors (hang, node
down). Timestamps are the supervisor's monotonic clock at receipt; the restart phases come from
the marks set here (launch → every rank said hello → rendezvous done → load done → first step).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ...config import SupervisorConfig
from ...env import ExitStatus
from .agent_step import Message
from ... import messages
from ...wire import Phase
from .sdc import sdc_failure
from .detection import (HangTimeout, NodeView, RankView, StepWindow, TeardownHang, classify_rank_exit, detect_hang, detect_silence, detect_stopped,
                        detect_node_down, detect_teardown_hang, nan_failure)
from .observations import Failure, FailureKind, SupervisionLevel
from .stragglers import Straggler, StragglerDetector
from .liveness import EVIDENCE_WINDOW_S, ChildSeen, Hung, Leaving, NeedStacks, RankEvidence, Working, data_hang, judge
from .node_evidence import NodeEvidence
from ..node.relay import SUMMARIES_PER_BEAT
from . import restore_check
from .restore_check import LossJump


# A rank that said bye with a failure has this long to exit (its traceback printed, its exit status
# the crash report) before it is reported as crashed anyway
FAILED_BYE_EXIT_S = 3.0
RECHECK_S = 2.0          # a busy spell that ends without progress is judged again from stacks this much later


@dataclass(kw_only=True)
class Marks:
    """Supervisor-mono timestamps of one (re)launch, for the restart phase breakdown."""

    detect: float | None = None
    killed: float | None = None
    health_done: float | None = None
    launch_sent: float | None = None
    agents_up: float | None = None         # in a container: the launch's new agents all said hello (the container phase)
    all_hello: float | None = None
    rendezvous_done: float | None = None   # first rank past init (load or train phase)
    train_start: float | None = None       # first rank in train phase (load finished)
    first_step: float | None = None

    def phases(self) -> dict[str, float]:
        """Consecutive differences; a phase whose mark is missing takes no time (its successor
        absorbs it), so the phases always add up to detect → first step. `container_s` only where
        the launch started agents in containers (the runtime's start, a pyxis import included)."""
        container = [("container_s", self.agents_up)] if self.agents_up is not None else []
        order = [("kill_s", self.killed), ("health_s", self.health_done), *container, ("launch_s", self.all_hello),
                 ("rendezvous_s", self.rendezvous_done), ("load_s", self.train_start),
                 ("first_step_s", self.first_step)]
        out: dict[str, float] = {}
        prev = self.detect if self.detect is not None else self.launch_sent
        for name, mark in order:
            if mark is None or prev is None or mark < prev:
                out[name] = 0.0
                continue
            out[name] = round(mark - prev, 4)
            prev = mark
        return out


HEARD_SLACK_S = 1.0   # how far out of order frames may be handled and the node order still hold


@dataclass(kw_only=True)
class AttemptTracker:
    attempt: int
    nodes: tuple[str, ...]
    nproc_per_node: int
    config: SupervisorConfig
    started: float
    resume_step: int = 0
    hang_cap_s: float = float("inf")    # keeps the supervisor before torch's collective timeout (nccl.py)
    save_allowance_s: float | None = None  # a blocking save's allowance (nccl.Timeouts); None: save_timeout_s
    step_window: StepWindow = field(default_factory=StepWindow)
    marks: Marks = field(default_factory=Marks)
    node_views: dict[str, NodeView] = field(default_factory=dict)
    ranks: dict[int, RankView] = field(default_factory=dict)
    done_nodes: set[str] = field(default_factory=set)
    first_step: int | None = None
    last_step: int | None = None
    hellos: int = 0
    preempted: bool = False
    finished_ranks: set[int] = field(default_factory=set)   # said bye with status DONE
    bye_status: dict[int, int] = field(default_factory=dict)  # rank -> the status its bye said
    failed_byes: dict[int, float] = field(default_factory=dict)  # rank -> when its bye said FAILURE (its loop raised)
    hooked: set[int] = field(default_factory=set)            # ranks that said hello
    heartbeat_only: set[int] = field(default_factory=set)    # of those, ckptsup.heartbeat ranks (no checkpoints)
    line_ranks: set[int] = field(default_factory=set)        # ranks seen through progress lines
    line_seen: dict[int, float] = field(default_factory=dict)  # rank -> mono of its last progress line
    expect_hello: bool = True          # the script uses ckptsup's hooks: no hello within the init allowance is a hang
    unhooked: bool = False             # the init allowance passed without a hello: process level
    reported_level: SupervisionLevel | None = None
    stale_warned: bool = False
    stopped_sent: bool = False         # an agent passed a stop to the ranks (TORCHRUN_EXIT stopped)
    teardown_errors: list[dict[str, Any]] = field(default_factory=list)  # for the loop to record
    teardown_since: float | None = None  # every rank said bye, or (without hooks) one exited 0: exit_grace_s runs
    exited_ok: set[int] = field(default_factory=set)          # ranks without hooks whose process exited 0
    node_pids: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # node -> rank -> {pid, host_pid} (heartbeats)
    node_pids_packed: dict[str, str] = field(default_factory=dict)   # node -> its last heartbeat's packed pids
    stopped_nodes: set[str] = field(default_factory=set)   # nodes whose last heartbeat named a stopped rank
    stragglers: StragglerDetector | None = None
    straggler_flags: list[Straggler] = field(default_factory=list)       # for the loop to record
    # liveness.py: a silence is weighed against what the agents measure of every rank
    evidence: dict[int, RankEvidence] = field(default_factory=dict)   # parsed while suspect (node_evidence.py)
    node_evidence: dict[str, NodeEvidence] = field(default_factory=dict)   # node -> its recent evidence, packed
    evidence_watched: bool = False     # a suspicion: every node's evidence is parsed into `evidence`
    stacks: dict[int, str] = field(default_factory=dict)     # rank -> its faulthandler dump (this suspicion)
    wchan: dict[int, str] = field(default_factory=dict)      # rank -> its main thread's kernel wait channel (this suspicion)
    children: dict[int, list[ChildSeen]] = field(default_factory=dict)   # rank -> its live descendants (this suspicion)
    stacks_asked_at: float | None = None
    stacks_waiting: set[str] = field(default_factory=set)    # nodes asked for stacks that have not answered
    want_stacks: bool = False          # for the loop: send `stacks` to the agents
    busy: Working | None = None        # working without progress now (status, the busy event)
    busy_since: float | None = None
    recheck_at: float | None = None    # a busy spell ended without progress: judged again from stacks taken after this
    busy_news: list[Working] = field(default_factory=list)  # for the loop to record (one per busy spell)
    busy_quiet_since: float | None = None   # the spell's last progress (its silence began there)
    busy_over_news: list[tuple[tuple[int, ...], float]] = field(default_factory=list)   # (ranks, busy_s) of spells over
    # nodes by when their agent was last heard, oldest first: the node-down check reads only the
    # silent front, not 16,384 views every tick (bench_supervisor_scale.py)
    heard_order: dict[str, None] = field(default_factory=dict)
    # restore_check.py: rank 0's losses before this attempt, and this attempt's (the next one's before)
    loss_before: dict[int, float] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    restore_compared: int = 0
    restore_news: list[LossJump] = field(default_factory=list)   # for the loop to record (a warning)
    sdc_s: float | None = None   # rank 0's seconds on replica fingerprints in this attempt (its step frames)
    heard_latest: float = float("-inf")
    # the heartbeat tree (relays.py): each node's agent as its own frames name it, and as its relay's
    # summaries do; a summary's word on a node whose current agent is another one is not taken (fencing)
    agent_of: dict[str, str] = field(default_factory=dict)
    child_agent: dict[str, str] = field(default_factory=dict)
    relayed: bool = False              # a relay summary came in this attempt (relays.py)
    evidence_thin_until: float = float("-inf")   # a suspicion began with nodes' evidence at their relays: no hung verdict before

    def __post_init__(self) -> None:
        for node in self.nodes:
            self.node_views[node] = NodeView(node=node, last_heard=self.started)
            self.heard_order[node] = None
        self.heard_latest = self.started
        if self.stragglers is None:
            c = self.config
            self.stragglers = StragglerDetector(ratio=c.straggler_ratio, window_steps=c.straggler_window_steps,
                                                windows=c.straggler_windows)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    @property
    def complete(self) -> bool:
        return set(self.nodes) <= self.done_nodes

    @property
    def level(self) -> SupervisionLevel | None:
        """How this attempt is watched; None while that is not known yet (no hello, no progress
        line, init allowance not passed)."""
        if self.hooked:
            return SupervisionLevel.HEARTBEAT if self.hooked <= self.heartbeat_only else SupervisionLevel.HOOKS
        if self.line_ranks:
            return SupervisionLevel.PROGRESS
        return SupervisionLevel.PROCESS if self.unhooked else None

    def take_level(self) -> SupervisionLevel | None:
        """The level, once, when it becomes known or changes (for the supervision_level event)."""
        level = self.level
        if level is None or level is self.reported_level:
            return None
        self.reported_level = level
        return level

    def current_step(self) -> int | None:
        """The step the job is working on: the slowest rank's next step (a rank that has not
        stepped yet, or not even said hello, is at the resume step). Without hooks only what was
        seen counts: the slowest progress line's next step, or None (no "step 0" for a script
        that reports no steps)."""
        if not self.hooked and not self.expect_hello:
            seen = [v.last_step + 1 for v in self.ranks.values() if v.last_step is not None]
            return min(seen) if seen else None
        positions = [v.last_step + 1 if v.last_step is not None else self.resume_step
                     for v in self.ranks.values()]
        if len(self.ranks) < self.world_size or not positions:
            positions.append(self.resume_step)
        return min(positions)

    def hang_timeout(self) -> HangTimeout:
        """The hang timeout now, clamped so that it stays below the collective timeout this
        attempt was launched with even if steps slow down mid-attempt."""
        return HangTimeout.of(self.config, self.step_window.p99(), cap_s=self.hang_cap_s)

    # ---- messages -----------------------------------------------------------------------------
    def on_message(self, msg: Message) -> Failure | None:
        """Fold one agent message into the attempt: the node is heard, then the handler of the
        body's kind (_BODY_HANDLERS) updates what is known and says whether it is a failure."""
        view = self.node_views.get(msg.node)
        if view is None:
            return None  # an agent of a node not in this attempt (a late frame of an old step)
        view.last_heard = msg.recv
        self._heard(msg.node, msg.recv)
        self.agent_of[msg.node] = msg.agent
        handler = _BODY_HANDLERS.get(type(msg.body))
        return None if handler is None else handler(self, msg.body, msg.node, msg.recv)

    def _on_heartbeat(self, body: messages.Heartbeat, node: str, now: float) -> Failure | None:
        view = self.node_views[node]
        if body.ranks_alive is not None:
            view.ranks_alive = body.ranks_alive
        self._note_pids(node, body.pids)
        if body.evidence is not None:
            held = self.node_evidence.get(node)
            if held is None:
                held = self.node_evidence[node] = NodeEvidence(node=node, watched=self.evidence_watched)
            held.add(now, body.evidence, self.evidence)
        stopped = set(body.stopped_ranks)
        # a node whose ranks run is not walked (at 16,384 x 8 ranks a walk of every rank a beat
        # was the whole budget): only one that reports, or last reported, a stopped rank
        if stopped or node in self.stopped_nodes:
            for seen in self.ranks.values():
                if seen.node == node:
                    seen.stopped = seen.rank in stopped
                    seen.stopped_since = (seen.stopped_since if seen.stopped_since is not None else now) \
                        if seen.stopped else None
            (self.stopped_nodes.add if stopped else self.stopped_nodes.discard)(node)
        if not self.hooked:
            # a stopped worker that prints nothing (rank 1 while rank 0 prints): a view, so
            # that the hang it causes is pinned on it
            for quiet in stopped - set(self.ranks):
                self.ranks[quiet] = RankView(rank=quiet, node=node, phase=Phase.TRAIN, phase_since=now,
                                             last_progress=now, stopped=True, stopped_since=now)
        return None

    def _on_relay_summary(self, body: messages.RelaySummary, relay: str, now: float) -> Failure | None:
        """A relay's beat for its children: each child it heard is heard (blamed for its own
        silence, as if its frames had come here) at the start of the relay's window, the earliest
        its beat can have been (so that a silence is judged no later than node_silence_s after a
        child's last beat: node death <= 5 s at relayed scale, BENCHMARKS.md §Relays), a changed
        child's state is folded in as its heartbeat, its evidence kept while asked for. The relay
        itself was heard by on_message."""
        self.relayed = True
        for child, (agent, hb) in body.child_changes().items():
            if child in self.node_views:
                self.child_agent[child] = agent
                if self.agent_of.get(child, agent) == agent:
                    self._on_heartbeat(hb, child, now)   # a change carries no evidence
        # _heard inlined for the common case (frames in order): this loop is the supervisor's work per
        # node and beat at 16,384 nodes (bench_supervisor_scale.py)
        heard_at = now - self.config.heartbeat_interval_s / SUMMARIES_PER_BEAT
        in_order, order, views = heard_at >= self.heard_latest - HEARD_SLACK_S, self.heard_order, self.node_views
        for child in body.heard_nodes():
            view = views.get(child)
            said = self.child_agent.get(child)
            if view is None or (said is not None and self.agent_of.get(child, said) != said):
                continue   # not this attempt's node, or a replaced agent's word
            if heard_at <= view.last_heard:
                continue   # heard later already (its own frame, after a relay's silence)
            view.last_heard = heard_at
            if in_order:
                order.pop(child, None)
                order[child] = None
            else:
                self._heard(child, heard_at)
        if in_order and heard_at > self.heard_latest:
            self.heard_latest = heard_at
        for child, packed in (body.evidence or {}).items():
            if child in self.node_views:
                held = self.node_evidence.get(child)
                if held is None:
                    held = self.node_evidence[child] = NodeEvidence(node=child, watched=self.evidence_watched)
                held.add(now, packed, self.evidence)
        return None

    def excuse(self, nodes: Sequence[str], now: float) -> None:
        """These nodes' relay fell silent and they were told to report directly: their silence so
        far was the relay's; from now on it is their own again (relays.py)."""
        for node in nodes:
            view = self.node_views.get(node)
            if view is not None and node not in self.done_nodes:
                view.last_heard = max(view.last_heard, now)
                self._heard(node, view.last_heard)

    def _on_hello(self, body: messages.Hello, node: str, now: float) -> Failure | None:
        rank = body.rank
        self.ranks[rank] = RankView(rank=rank, node=node, phase=Phase.INIT, phase_since=now, last_progress=now)
        self.hooked.add(rank)
        if body.checkpoints is False:
            self.heartbeat_only.add(rank)
        self.hellos += 1
        if self.hellos >= self.world_size and self.marks.all_hello is None:
            self.marks.all_hello = now
        return None

    def _on_phase(self, body: messages.PhaseChange, node: str, now: float) -> Failure | None:
        rv = self._rank(body.rank, node, now)
        if body.phase is rv.phase:
            rv.last_progress = now   # the phase it is in, again: a heartbeat in it (an eval batch)
        else:
            rv.phase, rv.phase_since = body.phase, now
        if rv.phase in (Phase.LOAD, Phase.TRAIN) and self.marks.rendezvous_done is None:
            self.marks.rendezvous_done = now
        if rv.phase is Phase.TRAIN and self.marks.train_start is None:
            self.marks.train_start = now
        return None

    def _on_bye(self, body: messages.Bye, node: str, now: float) -> Failure | None:
        rv = self._rank(body.rank, node, now)
        rv.phase, rv.phase_since = Phase.DONE, now
        self.bye_status[rv.rank] = body.status
        if body.status == ExitStatus.FAILURE:
            self.failed_byes.setdefault(rv.rank, now)   # crashing: check() gives its process FAILED_BYE_EXIT_S
        if len(self.bye_status) >= self.world_size and self.teardown_since is None:
            self.teardown_since = now   # every rank is through run.close(): their processes have exit_grace_s
        if body.status == ExitStatus.DONE:
            self.finished_ranks.add(rv.rank)
            # one rank finished its loop: the others are closing too (final save, draining
            # promotions or test loads without step progress): give them the stopping allowance
            for other in self.ranks.values():
                if other.phase is Phase.TRAIN:
                    other.phase, other.phase_since = Phase.STOPPING, now
        return None

    def _on_nan(self, body: messages.Nan, node: str, now: float) -> Failure | None:
        return nan_failure(node=node, rank=body.rank, step=-1 if body.step is None else body.step, loss=body.loss)

    def _on_stacks(self, body: messages.StacksTaken, node: str, now: float) -> Failure | None:
        self.stacks_waiting.discard(node)
        for entries, into in ((body.stacks, self.stacks), (body.wchan, self.wchan)):
            for entry in entries:
                if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and isinstance(entry[1], str):
                    into[entry[0]] = entry[1]
        for entry in body.children:
            if (isinstance(entry, list) and len(entry) == 4 and all(isinstance(v, int) for v in entry[:2])
                    and all(isinstance(v, str) for v in entry[2:])):
                self.children.setdefault(entry[0], []).append(ChildSeen(pid=entry[1], state=entry[2], waiting_in=entry[3]))
        return None

    def _on_sdc(self, body: messages.Sdc, node: str, now: float) -> Failure | None:
        return sdc_failure(body, node=node, nodes_of={r: v.node for r, v in self.ranks.items()})

    def _on_rank_exit(self, body: messages.RankExit, node: str, now: float) -> Failure | None:
        if body.rc == 0 and body.rank is not None:
            self._exited_ok(body.rank, node, now)
        return classify_rank_exit(node=node, rank=body.rank, rc=body.rc, step=self.current_step(),
                                  age_s=float(body.age_s or 0.0), detail=body.detail)

    def _on_torchrun_exit(self, body: messages.TorchrunExit, node: str, now: float) -> Failure | None:
        rc = body.rc
        if body.stopped:
            self.stopped_sent = True
        if body.preempted:
            self.done_nodes.add(node)
            return self._preemption(node, "torchrun exited after the agent got the preemption signal")
        if rc == 0:
            return self._exited_zero(node)
        if rc == ExitStatus.RANK_NAN:
            return Failure(kind=FailureKind.NAN, node=node, step=self.current_step(),
                           suspects=(node,), detail="torchrun reported a NaN exit")
        if self._all_finished_on(node):
            # Every rank of the node finished its loop (final checkpoint committed) before
            # torchrun failed: a crash in process teardown (a C++ abort at interpreter exit)
            # loses nothing, and a restart would only resume to find nothing left to do.
            self.done_nodes.add(node)
            self.teardown_errors.append({"node": node, "rc": rc})
            return None
        return classify_rank_exit(node=node, rank=None, rc=rc, step=self.current_step(),
                                  detail=f"torchrun on {node} exited rc={rc}")

    def _on_preempt(self, body: messages.Preempt, node: str, now: float) -> Failure | None:
        self.preempted = True
        return Failure(kind=FailureKind.PREEMPTED, node=node, step=self.current_step(),
                       detail=f"agent on {node} got signal {body.signal}")

    def _note_pids(self, node: str, pids: str | None) -> None:
        """The heartbeat lists the node's live rank processes: the others are gone. Per node, so
        that a heartbeat costs the same at 16,384 nodes as at 2 (bench_supervisor_scale.py), and
        parsed only when the list changed (a rank's pid is the same for its whole life)."""
        if pids is None or self.node_pids_packed.get(node) == pids:
            return
        self.node_pids_packed[node] = pids
        self.node_pids[node] = messages.unpack_pids(pids)

    @property
    def pids(self) -> dict[int, dict[str, Any]]:
        """rank -> {node, pid, host_pid}, every node's (for status: built when asked)."""
        return {rank: {"node": node, **v} for node, ranks in self.node_pids.items() for rank, v in ranks.items()}

    def _exited_ok(self, rank: int, node: str, now: float) -> None:
        """A rank without hooks exited 0: its loop is over, so the others are closing too (the
        stopping allowance instead of the hang timeout) and exit_grace_s starts."""
        if self.hooked:
            return   # hooked ranks finish with bye
        self.exited_ok.add(rank)
        rv = self._rank(rank, node, now)
        rv.phase, rv.phase_since = Phase.DONE, now
        for other in self.ranks.values():
            if other.phase is Phase.TRAIN:
                other.phase, other.phase_since = Phase.STOPPING, now
        if self.teardown_since is None:
            self.teardown_since = now

    def teardown_hang(self, now: float) -> TeardownHang | None:
        """Nodes whose rank processes outlived exit_grace_s after the ranks finished (pure)."""
        if self.teardown_since is None:
            return None   # every tick: nothing to scan while the ranks train
        activity = [v.last_progress for v in self.ranks.values() if v.rank not in self.exited_ok
                    and v.rank not in self.bye_status]
        return detect_teardown_hang(since=self.teardown_since, activity=activity,
                                    pending=[n for n in self.nodes if n not in self.done_nodes], now=now,
                                    exit_grace_s=self.config.exit_grace_s)

    def teardown_done(self, node: str) -> Failure | None:
        """`node`'s leftover rank processes were killed: it ends as if torchrun had exited 0 there."""
        return self._exited_zero(node)

    def _preemption(self, node: str, detail: str) -> Failure | None:
        if self.preempted:
            return None   # already reported (the agent's `preempt` comes first)
        self.preempted = True
        return Failure(kind=FailureKind.PREEMPTED, node=node, step=self.current_step(), detail=detail)

    def _exited_zero(self, node: str) -> Failure | None:
        """torchrun exited 0 on `node`. Done only if nothing says otherwise: after a stop was passed
        to the ranks it is a preemption (a script whose SIGTERM handler exits 0: Lightning's), and
        a hooked rank whose bye said anything but DONE did not finish."""
        if self.stopped_sent:
            self.done_nodes.add(node)
            return self._preemption(node, "the ranks exited 0 after a stop was passed to them")
        unfinished = sorted(r for r, v in self.ranks.items() if v.node == node and r in self.bye_status
                            and self.bye_status[r] != ExitStatus.DONE)
        if unfinished:
            status = self.bye_status[unfinished[0]]
            if status in (ExitStatus.PREEMPTED, ExitStatus.RANK_STOPPED):
                self.done_nodes.add(node)
                return self._preemption(node, f"rank {unfinished[0]} stopped (status {status}) and torchrun exited 0")
            return Failure(kind=FailureKind.CRASH, node=node, rank=unfinished[0], step=self.current_step(),
                           suspects=(node,), detail=f"torchrun exited 0 but rank {unfinished[0]} said bye with "
                                                    f"status {status}, not done")
        self.done_nodes.add(node)
        return None

    def _all_finished_on(self, node: str) -> bool:
        on_node = [v.rank for v in self.ranks.values() if v.node == node]
        return len(on_node) == self.nproc_per_node and set(on_node) <= self.finished_ranks

    def _rank(self, rank: int, node: str, now: float) -> RankView:
        rv = self.ranks.get(rank)
        if rv is None:
            rv = self.ranks[rank] = RankView(rank=rank, node=node, phase_since=now, last_progress=now)
        return rv

    def _on_step(self, body: messages.Step, node: str, now: float) -> Failure | None:
        rv = self._rank(body.rank, node, now)
        step = body.step
        rv.last_step, rv.last_progress = step, now
        loss = body.loss
        if rv.rank == 0 and loss is not None:
            self._note_loss(step, float(loss))
        sdc_s = body.sdc_s
        if rv.rank == 0 and sdc_s is not None and sdc_s >= 0:
            self.sdc_s = max(float(sdc_s), self.sdc_s or 0.0)   # cumulative: a late frame never lowers it
        closing = rv.phase is Phase.STOPPING and bool(self.exited_ok)   # a peer without hooks exited 0
        if rv.phase is not Phase.TRAIN and not closing:   # closing: its lines push exit_grace_s, not the hang timeout
            rv.phase, rv.phase_since = Phase.TRAIN, now
            if self.marks.rendezvous_done is None:
                self.marks.rendezvous_done = now
            if self.marks.train_start is None:
                self.marks.train_start = now
        st = body.step_time_s
        if st is not None and step > self.resume_step and self.busy is None:
            # not the first step after a (re)start (warm-up), nor the one a busy spell held up: an
            # evaluation is not a step, and would raise the automatic hang timeout for 512 steps
            self.step_window.add(float(st))
            view = self.node_views[node]
            if view.step_window is None:
                view.step_window = StepWindow(size=128)
            view.step_window.add(float(st))
        compute = body.compute_s
        if compute is not None and step > self.resume_step and self.stragglers is not None:
            self.straggler_flags += self.stragglers.add(rank=rv.rank, node=node, step=step, compute_s=float(compute))
        if self.first_step is None:
            self.first_step = step
            self.marks.first_step = now
        if self.last_step is None or step > self.last_step:
            self.last_step = step
        if body.loss_finite is False:
            return nan_failure(node=node, rank=rv.rank, step=step, loss=body.loss)
        return None

    def _on_progress(self, body: messages.Progress, node: str, now: float) -> Failure | None:
        """A progress line: a step of a rank that did not say hello. The time between two lines
        is the step time the hang timeout learns from (a script may print every k steps; the
        timeout must outlast the gap between its lines, not one step)."""
        rank, step = body.rank, body.step
        if rank in self.hooked:
            return None
        rv = self.ranks.get(rank)
        if rv is None:
            rv = self.ranks[rank] = RankView(rank=rank, node=node, phase=Phase.TRAIN, phase_since=now,
                                             last_progress=now)
        first_of_rank = rank not in self.line_ranks
        self.line_ranks.add(rank)
        previous = self.line_seen.get(rank)
        self.line_seen[rank] = now
        if previous is not None and not first_of_rank and (rv.last_step is None or step > rv.last_step):
            if self.busy is None:   # a busy spell's gap is not a step (above)
                self.step_window.add(now - previous)
        if rv.last_step is not None and step <= rv.last_step:
            return None
        return self._on_step(messages.Step(rank=rank, step=step), node, now)

    # ---- time-based detection -----------------------------------------------------------------
    def _heard(self, node: str, now: float) -> None:
        if now >= self.heard_latest - HEARD_SLACK_S:   # agents' readers hand frames over a few ms apart
            self.heard_order.pop(node, None)
            self.heard_order[node] = None   # to the end: the most recently heard
            self.heard_latest = max(self.heard_latest, now)
        else:   # far older than the newest (a test's clock): sort again
            self.heard_order[node] = None
            self.heard_order = dict.fromkeys(sorted(self.heard_order, key=lambda n: self.node_views[n].last_heard))

    def _live_views(self, now: float) -> list[NodeView]:
        """What detect_node_down needs of the live nodes: every one silent for node_silence_s (the
        front of heard_order, sorted to within HEARD_SLACK_S) and the first that is not, if any
        (so "others still talk"), without reading every view every tick."""
        silence = self.config.node_silence_s
        silent: list[NodeView] = []
        talking: NodeView | None = None
        for node in self.heard_order:
            if node in self.done_nodes:
                continue
            view = self.node_views[node]
            age = now - view.last_heard
            if age > silence:
                silent.append(view)
            elif talking is None:
                talking = view
            if age <= silence - HEARD_SLACK_S:
                break
        return silent + ([talking] if talking is not None else [])

    def silent_past(self, now: float, after_s: float) -> list[tuple[str, float, float]]:
        """(node, last_heard, seconds silent) of the live nodes silent longer than `after_s` while
        another still talks: the front of heard_order (silence_probe.py asks their slurmd)."""
        silent: list[tuple[str, float, float]] = []
        talking = False
        for node in self.heard_order:
            if node in self.done_nodes:
                continue
            last = self.node_views[node].last_heard
            if now - last > after_s:
                silent.append((node, last, now - last))
            else:
                talking = True
            if now - last <= after_s - HEARD_SLACK_S:
                break
        return silent if talking else []

    def check(self, now: float) -> Failure | None:
        down = detect_node_down(self._live_views(now), now=now, silence_s=self.config.node_silence_s,
                                step=self.current_step())
        if down is not None:
            return down
        if self.failed_byes:
            return self._failed_bye(now)   # a crash under way: no hang verdict on the peers it left waiting
        ranks = list(self.ranks.values())
        if not self.hooked and not self.expect_hello:
            return self._check_unhooked(now, ranks)
        if self.hellos < self.world_size:
            # not every rank has said hello yet: the init allowance runs from launch
            pending = RankView(rank=-1, node=self.nodes[0], phase=Phase.INIT, phase_since=self.started,
                               last_progress=self.started)
            if now - self.started > self.config.init_timeout_s:
                return replace(detect_hang([pending], now=now, config=self.config, train_timeout_s=0.0)
                               or Failure(kind=FailureKind.HANG), step=self.current_step(),
                               detail=f"only {self.hellos} of {self.world_size} ranks started within "
                                      f"supervisor.init_timeout_s={self.config.init_timeout_s:g}s")
            return None
        hang = self._hang(ranks, now, self.hang_timeout().s)
        if hang is not None:
            return replace(hang, step=self.current_step())
        return None

    def _failed_bye(self, now: float) -> Failure | None:
        """A rank whose bye said FAILURE (its training loop raised) is crashing. Its process's exit
        normally reports it (with its traceback, error_quote). One stuck in its teardown (a
        collective's destructor waiting on peers that wait on it) is a crash FAILED_BYE_EXIT_S after
        its bye, never a hang of the peers it left in a collective."""
        rank, since = min(self.failed_byes.items(), key=lambda item: item[1])
        if now - since < FAILED_BYE_EXIT_S:
            return None
        rv = self.ranks[rank]
        return Failure(kind=FailureKind.CRASH, node=rv.node, rank=rank, step=self.current_step(), detect_s=now - since,
                       suspects=(rv.node,), detail=f"rank {rank} said goodbye with a failure (its training loop raised) "
                                                   f"and its process had not exited {FAILED_BYE_EXIT_S:g}s later")

    def _check_unhooked(self, now: float, ranks: list[RankView]) -> Failure | None:
        """No rank said hello. Never a hang for that: once the init allowance passes, the attempt
        is watched at the process level; ranks seen through progress lines are hang-checked from
        their first line on."""
        if not self.unhooked and now - self.started > self.config.init_timeout_s:
            self.unhooked = True
        if not self.line_ranks:
            # before the first line only a stopped process can be a hang (its views come from heartbeats)
            held = [v for v in ranks if v.stopped]
            return replace(hang, step=None) if held and (hang := detect_hang(held, now=now, config=self.config,
                                                                             train_timeout_s=math.inf)) else None
        hang = self._hang(ranks, now, self.hang_timeout().s)
        if hang is not None:
            return replace(hang, step=self.current_step(),
                           detail=f"{hang.detail} (no progress line; supervisor.progress_pattern)")
        return None

    def _hang(self, ranks: list[RankView], now: float, train_timeout_s: float) -> Failure | None:
        """A stopped rank at once; a silence past its allowance only when no rank works through
        the evidence window (liveness.py), named from the ranks' stacks; busy until busy_limit_s."""
        stopped = detect_stopped(ranks, now=now, config=self.config)
        if stopped is not None:
            return stopped
        silence = detect_silence(ranks, now=now, config=self.config, train_timeout_s=train_timeout_s,
                                 save_allowance_s=self.save_allowance_s)
        if silence is None:
            self._suspicion_over(now)
            return None
        if not self.evidence_watched:   # suspect: the evidence parsed, and from here on at every beat
            self.evidence_watched = True
            for held in self.node_evidence.values():
                held.watch(self.evidence)
            if self.relayed and len(self.node_evidence) < len(self.nodes):
                # relayed nodes' evidence is kept at their relays and comes only from now on
                # (relays.py): a rank is not judged idle before its rates window could fill
                self.evidence_thin_until = now + EVIDENCE_WINDOW_S
        if not self.evidence:
            return silence   # agents that measure nothing (an old agent, a test's stand-in): the silence alone
        verdict = judge(self.evidence, self.stacks, now=now, stacks_asked_at=self.stacks_asked_at,
                        stacks_answered=not self.stacks_waiting, wchan=self.wchan)
        if isinstance(verdict, Working):
            self.recheck_at = None
            if self.busy is None:
                self.busy_since, self.busy_quiet_since = now, now - silence.detect_s
                self.busy_news.append(verdict)
            self.busy = verdict
            if silence.detect_s < self.config.busy_limit_s:
                return None
            if verdict.data:
                # a data wait past its allowance: the rank whose data never came, and what its workers wait in
                hung = data_hang(verdict, self.evidence, self.stacks, self.children, now=now, for_s=silence.detect_s)
                named = self._named(silence, hung)
                return replace(named, detail=f"{hung.detail} (past supervisor.busy_limit_s={self.config.busy_limit_s:g}s)")
            return replace(silence, suspects=(), detail=f"busy without progress for {silence.detect_s:.0f}s, past "
                                                         f"supervisor.busy_limit_s={self.config.busy_limit_s:g}s: {verdict.detail}")
        if isinstance(verdict, NeedStacks):
            if not self.stacks_waiting:
                self.want_stacks = True   # none asked yet, or the last answers are stale
            return None
        if isinstance(verdict, Leaving):
            # the ranks exited; torchrun's exit decides how. A launcher that never exits is killed
            # at the busy limit, as a busy spell would be
            if silence.detect_s < self.config.busy_limit_s:
                return None
            return replace(silence, suspects=(), detail=f"{silence.detail}; {verdict.detail}, and the launcher has not "
                                                         f"exited for supervisor.busy_limit_s={self.config.busy_limit_s:g}s")
        if self.busy is not None and not self._rechecked(now):
            return None
        if now < self.evidence_thin_until:
            return None
        return self._named(silence, verdict)

    def _rechecked(self, now: float) -> bool:
        """A busy spell whose ranks stopped working: judged hung only from stacks taken RECHECK_S
        later. A stack is a snapshot: one taken as a data wait ends finds the rank between its
        batch and its progress line (a 40 s data stall was killed at its very end so)."""
        if self.recheck_at is None:
            self.recheck_at = now + RECHECK_S
        if now < self.recheck_at:
            return False
        if self.stacks_asked_at is None or self.stacks_asked_at < self.recheck_at:
            if not self.stacks_waiting:
                self.want_stacks = True
            return False
        return True

    def _named(self, silence: Failure, verdict: Hung) -> Failure:
        """The hang, blamed on the rank the evidence names. A node is suspect only when the evidence
        points at it (uninterruptible I/O); a rank stuck in its own code is the job's: no node."""
        rank = verdict.culprits[0] if verdict.culprits else silence.rank
        node = self.evidence[rank].node if rank in self.evidence else silence.node
        if verdict.node_evidence:
            suspects = verdict.node_evidence
        elif verdict.culprits:
            suspects = ()
        else:
            suspects = silence.suspects
        return replace(silence, rank=rank, node=node, suspects=suspects, detail=f"{silence.detail}; {verdict.detail}",
                       ranks_seen=tuple(seen.to_record() for seen in verdict.ranks))

    def _note_loss(self, step: int, loss: float) -> None:
        """Rank 0's loss: kept for the next attempt, and the first steps after a restore compared
        with the same steps before it (restore_check.py)."""
        self.losses[step] = loss
        if len(self.losses) > restore_check.KEEP_STEPS:
            del self.losses[min(self.losses)]
        if self.loss_before and self.restore_compared < restore_check.CHECK_STEPS:
            self.restore_compared += 1
            jump = restore_check.loss_jump(self.loss_before, step, loss)
            if jump is not None:
                self.restore_news.append(jump)
                self.restore_compared = restore_check.CHECK_STEPS   # one warning a restore

    def _suspicion_over(self, now: float) -> None:
        if self.busy is not None or self.stacks_asked_at is not None or self.stacks:
            if self.busy is not None and self.busy_quiet_since is not None:
                self.busy_over_news.append((self.busy.ranks, now - self.busy_quiet_since))
            self.busy, self.busy_since, self.busy_quiet_since = None, None, None
            self.stacks, self.wchan, self.stacks_asked_at, self.stacks_waiting = {}, {}, None, set()
            self.children, self.recheck_at = {}, None
        if self.evidence_watched:   # the next suspicion parses its own window again
            for held in self.node_evidence.values():
                held.unwatch()
            self.evidence, self.evidence_watched = {}, False

    def asked_for_stacks(self, now: float, nodes: set[str]) -> None:
        """The loop sent `stacks` to these agents."""
        self.want_stacks = False
        self.stacks_asked_at = now
        self.stacks_waiting = set(nodes)
        self.stacks, self.wchan, self.children = {}, {}, {}

    def progress_stale(self, now: float, warn_s: float) -> float | None:
        """Seconds since launch when an attempt without hello has shown no progress line for
        `warn_s` (reported once), else None: a warning, never a kill."""
        if self.stale_warned or self.hooked or self.line_ranks or now - self.started < warn_s:
            return None
        self.stale_warned = True
        return now - self.started


# The tracker's handler of each body kind (AttemptTracker.on_message); a kind not here only marks
# its node heard. A dict by type: one lookup a frame, whatever the number of kinds.
_BODY_HANDLERS: dict[type, Callable[..., Failure | None]] = {
    messages.Heartbeat: AttemptTracker._on_heartbeat,
    messages.Hello: AttemptTracker._on_hello,
    messages.PhaseChange: AttemptTracker._on_phase,
    messages.Step: AttemptTracker._on_step,
    messages.Progress: AttemptTracker._on_progress,
    messages.Bye: AttemptTracker._on_bye,
    messages.Nan: AttemptTracker._on_nan,
    messages.StacksTaken: AttemptTracker._on_stacks,
    messages.Sdc: AttemptTracker._on_sdc,
    messages.RankExit: AttemptTracker._on_rank_exit,
    messages.TorchrunExit: AttemptTracker._on_torchrun_exit,
    messages.Preempt: AttemptTracker._on_preempt,
    messages.RelaySummary: AttemptTracker._on_relay_summary,
}
