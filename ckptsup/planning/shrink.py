"""Fewer nodes or a requeue: the price of each after a node is lost with no spare left (pure).

Both are counted in seconds of the whole job's progress (a node-second of the full job is 1/N of
one): what the job has done at the end of the horizon, compared with a job that lost nothing.

  continue on k of N nodes: restart_s + horizon_s x (1 - k/N)
      an in-allocation restart, then k/N of the throughput until the job grows back (the next
      allocation: a time limit, a preemption, a later requeue) or ends: the horizon
  requeue:                  queue_wait_s + requeue_restart_s
      the whole job waits in the queue, then starts a new allocation of N nodes

First order: a failure inside the horizon, and the restart a requeued job makes anyway at its
next time limit, are the same either way. Used by supervisor/job/policy.py `decide` with measured
or configured inputs (each named with its source), and by `ckptsup plan --min-nodes`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One input and where it came from: "measured" (this run's events), "configured" (a knob or
    a flag), or "slurm" (the job's end time)."""

    value_s: float
    source: str

    def shown(self) -> str:
        return f"{self.value_s:.0f}s {self.source}"


@dataclass(frozen=True, kw_only=True)
class ShrinkInputs:
    nodes: int                # N: the active nodes the job runs on (MAX)
    survivors: int            # k: usable nodes left after the loss
    horizon: Figure           # how long the job would run on k nodes
    restart: Figure           # an in-allocation restart (detection to first step)
    queue_wait: Figure        # a requeue's time in the queue
    requeue_restart: Figure   # a new allocation's start-up (supervisor start to first step)


@dataclass(frozen=True, kw_only=True)
class ShrinkPrice:
    continue_s: float   # job-seconds lost continuing on the survivors
    requeue_s: float    # job-seconds lost requeueing

    @property
    def continue_wins(self) -> bool:
        return self.continue_s < self.requeue_s


def price(inp: ShrinkInputs) -> ShrinkPrice:
    if inp.nodes < 1 or not 0 <= inp.survivors <= inp.nodes:
        raise ValueError(f"survivors {inp.survivors} of {inp.nodes} nodes")
    lost_share = 1.0 - inp.survivors / inp.nodes
    return ShrinkPrice(continue_s=inp.restart.value_s + inp.horizon.value_s * lost_share,
                       requeue_s=inp.queue_wait.value_s + inp.requeue_restart.value_s)


def break_even_horizon_s(inp: ShrinkInputs) -> float | None:
    """The horizon below which continuing costs less (None: never, the survivors are none, or
    always: a restart alone already costs more than the requeue gives back)."""
    lost_share = 1.0 - inp.survivors / inp.nodes
    gap = inp.queue_wait.value_s + inp.requeue_restart.value_s - inp.restart.value_s
    if lost_share <= 0 or gap <= 0:
        return None
    return gap / lost_share
