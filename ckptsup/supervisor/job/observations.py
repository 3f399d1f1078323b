"""What the supervisor observes and what an attempt ended with: plain data for the pure policy.

A failed attempt is data (`AttemptResult`), never an exception: the loop records it in the run's
history and asks the policy what to do next.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ...events import FailureKind
from ...planning.shrink import Figure

__all__ = ["FailureKind", "ShrinkCosts", "Dispute", "Failure", "Outcome", "AttemptResult", "Observation", "RecoveryPath", "SupervisionLevel"]


class SupervisionLevel(str, enum.Enum):
    """How closely an attempt is watched (docs/drop-in.md): what its ranks tell the supervisor."""

    HOOKS = "hooks"          # ckptsup.attach: steps, phases, checkpoints, stop at a step
    HEARTBEAT = "heartbeat"  # ckptsup.heartbeat: steps and NaN checks; the script checkpoints itself
    PROGRESS = "progress"    # no hello; progress lines of the ranks' output give the steps
    PROCESS = "process"      # no hello, no progress line: processes only (crash, node death, exit)


class RecoveryPath(str, enum.Enum):
    """How an attempt of this allocation is launched (docs/architecture.md §Recovery paths)."""

    INITIAL = "initial"  # the first launch of this allocation
    FAST = "fast"   # same nodes: restart torchrun inside the running agents
    NODE = "node"   # node set changes: a new agent step (srun --overlap) on healthy nodes + spares


class Outcome(str, enum.Enum):
    """How an attempt ended. Transitions: RUNNING → COMPLETED | FAILED | PREEMPTED."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"


@dataclass(frozen=True, kw_only=True)
class Dispute:
    """What an sdc failure knows beyond a Failure's fields (docs/sdc.md): every rank in dispute, and
    the last step after which this attempt's replicas agreed (None: no check of the attempt had)."""

    ranks: tuple[int, ...] = ()
    agreed_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One detected failure. `node`/`rank` are None when it cannot be pinned on one."""

    kind: FailureKind
    node: str | None = None
    rank: int | None = None
    step: int | None = None       # last step the job had reached when it failed
    detect_s: float = 0.0         # fault (or last sign of life) → detection, seconds
    detail: str = ""
    suspects: tuple[str, ...] = ()  # nodes to health-check (and exclude if they fail)
    dispute: Dispute | None = None  # sdc: the ranks in dispute, the last agreed step
    ranks_seen: tuple[dict[str, object], ...] = ()   # hang: every rank's evidence (liveness.RankSeen records)

    @property
    def blamed_node(self) -> str | None:
        """The node a failure of this kind is pinned on without a health check."""
        if self.kind in (FailureKind.NODE_DOWN, FailureKind.NAN):
            return self.node
        return None

    def to_record(self) -> dict:
        return {"kind": self.kind.value, "node": self.node, "rank": self.rank, "step": self.step,
                "detect_s": round(self.detect_s, 4), "detail": self.detail}

    @classmethod
    def from_record(cls, record: dict) -> "Failure":
        return cls(kind=FailureKind(record["kind"]), node=record.get("node"), rank=record.get("rank"),
                   step=record.get("step"), detect_s=float(record.get("detect_s") or 0.0),
                   detail=record.get("detail", ""))


@dataclass(frozen=True, kw_only=True)
class AttemptResult:
    """The history entry for one attempt (persisted in state.json `failures`)."""

    attempt: int
    outcome: Outcome
    start_step: int               # step the attempt resumed at
    last_step: int | None         # highest step it reported done (None: never stepped)
    failure: Failure | None = None
    level: SupervisionLevel = SupervisionLevel.HOOKS
    # progress seen without steps (a newer file in [supervisor] progress_dir, or a process-level
    # attempt that outlived the init allowance); None: judge by the steps
    progress: bool | None = None

    @property
    def progressed(self) -> bool:
        if self.last_step is not None:
            return self.last_step >= self.start_step
        return bool(self.progress)

    def to_record(self) -> dict:
        out = {"attempt": self.attempt, "outcome": self.outcome.value, "start_step": self.start_step,
               "last_step": self.last_step, "level": self.level.value}
        if self.progress is not None:
            out["progress"] = self.progress
        if self.failure is not None:
            out.update(self.failure.to_record())
        return out

    @classmethod
    def from_record(cls, record: dict) -> "AttemptResult":
        failure = Failure.from_record(record) if record.get("kind") else None
        try:
            level = SupervisionLevel(record.get("level", "hooks"))
        except ValueError:
            level = SupervisionLevel.HOOKS
        progress = record.get("progress")
        return cls(attempt=int(record.get("attempt", 0)), outcome=Outcome(record.get("outcome", "failed")),
                   start_step=int(record.get("start_step", 0)), last_step=record.get("last_step"),
                   failure=failure, level=level, progress=progress if isinstance(progress, bool) else None)


@dataclass(frozen=True, kw_only=True)
class ShrinkCosts:
    """What continuing on fewer nodes and a requeue cost, each measured or configured
    (planning/shrink.py; docs/planning.md §Fewer nodes or a requeue)."""

    horizon: Figure           # how long the job would run on fewer nodes
    restart: Figure           # an in-allocation restart
    queue_wait: Figure        # a requeue's time in the queue
    requeue_restart: Figure   # a new allocation's start-up


@dataclass(frozen=True, kw_only=True)
class Observation:
    """The world as the policy sees it: at start-up (`starting`, nothing launched: every usable
    node is in `spares`), after a failure, or at a tick (failure=None)."""

    failure: Failure | None
    active: tuple[str, ...]               # nodes of the current attempt, in rank order
    spares: tuple[str, ...] = ()          # allocated nodes not in use and not excluded
    excluded: frozenset[str] = frozenset()  # every node the job must never use again
    unhealthy: frozenset[str] | None = None  # nodes that failed their health check now; None: not checked
    health_detail: tuple[tuple[str, str], ...] = ()  # (node, why) for the unhealthy ones
    nodes_needed: int = 1
    can_requeue: bool = False              # inside Slurm with requeue allowed
    restarts_used: int = 0
    starting: bool = False
    silent: tuple[str, ...] = ()           # nodes whose agent neither answered the kill nor spoke
    silent_for_s: float = 0.0              # how long the first of them had been silent
    unreachable: tuple[str, ...] = ()      # of the silent, those whose slurmd did not answer either (dead now)
    agents_alive: bool = True              # the agent step still runs (the fast path needs it)
    min_nodes: int = 0                     # fewest nodes to continue on (0: nodes_needed, never fewer)
    shrink: ShrinkCosts | None = None      # the prices of fewer nodes vs a requeue (with min_nodes)


@dataclass(frozen=True, kw_only=True)
class History:
    """Every finished attempt of the run, oldest first."""

    attempts: tuple[AttemptResult, ...] = field(default_factory=tuple)

    def failures(self) -> list[AttemptResult]:
        return [a for a in self.attempts if a.outcome is Outcome.FAILED]
