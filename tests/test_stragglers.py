"""Straggler detection (supervisor/job/stragglers.py) on compute times, and the loop's answer to a
flag (the event; with straggler_replace, the node moves to a spare at the next checkpoint)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ckptsup.events import Event
from ckptsup.supervisor.spec import LaunchSpec
from ckptsup.supervisor.job.stragglers import StragglerDetector
from ckptsup.wire import MessageKind

from test_supervisor_loop import (Clock, FakeSlurm, FakeStep, Fault, World, fast_ticks, launch_nodes, of,  # noqa: F401
                                 site, supervisor)


def feed(detector: StragglerDetector, steps: int, compute, ranks=3) -> list:
    flags = []
    for step in range(steps):
        for rank in range(ranks):
            flags += detector.add(rank=rank, node=f"n{rank + 1}", step=step, compute_s=compute(rank, step))
    return flags


def detector(**kw) -> StragglerDetector:
    return StragglerDetector(**{"ratio": 1.15, "window_steps": 10, "windows": 3, **kw})


def test_a_rank_1_3x_slower_is_flagged_after_three_windows_with_the_evidence():
    rng = random.Random(0)
    flags = feed(detector(), 60, lambda r, s: (0.13 if r == 2 else 0.10) * rng.uniform(0.97, 1.03))
    [flag] = flags
    assert (flag.rank, flag.node, flag.windows, flag.step) == (2, "n3", 3, 29)   # named within 30 steps
    assert 1.2 < flag.ratio < 1.4 and flag.others_s < flag.compute_s


def test_two_ranks_are_enough_since_each_is_compared_with_the_others_only():
    [flag] = feed(detector(), 30, lambda r, s: 0.2 if r == 1 else 0.1, ranks=2)
    assert flag.rank == 1 and flag.ratio == 2.0


def test_no_flag_for_noise_a_short_burst_or_millisecond_steps():
    rng = random.Random(1)
    assert feed(detector(), 600, lambda r, s: 0.1 * rng.uniform(0.9, 1.1)) == []
    # slow for two windows only, then fine again: the strikes reset
    assert feed(detector(), 60, lambda r, s: 0.2 if r == 0 and 10 <= s < 30 else 0.1) == []
    # 1.5x of a millisecond is below the absolute floor
    assert feed(detector(), 60, lambda r, s: 0.0015 if r == 0 else 0.001) == []


def test_a_flag_is_said_once_and_unmeasured_ranks_are_not_compared():
    d = detector()
    assert len(feed(d, 90, lambda r, s: 0.3 if r == 0 else 0.1)) == 1   # once per attempt
    lone = detector()
    assert feed(lone, 60, lambda r, s: 0.5, ranks=1) == []   # nobody to compare with


@dataclass
class SlowRankWorld(World):
    """Scripted ranks that report compute times (rank 1 twice as slow on the first launch) and
    commit a checkpoint when asked to save now, as the hooks do."""

    def factory(self, *, nodes, inbox, argv, **_: Any) -> "ComputeStep":
        self.steps_made.append(len(self.steps_made))
        step = ComputeStep(world=self, nodes=tuple(nodes), inbox=inbox, step_id=100 + len(self.steps_made))
        step.play(launch_nodes(LaunchSpec.read(argv[argv.index("--spec") + 1])))
        return step


class ComputeStep(FakeStep):
    def put(self, m, node: str, **body: Any) -> None:
        if m is MessageKind.STEP:
            body["compute_s"] = 0.2 if body.get("rank") == 1 and self.world.launches == 1 else 0.1
        super().put(m, node, **body)

    def send(self, msg, *, nodes=None) -> bool:
        if msg.KIND is MessageKind.SAVE_NOW:
            self.put(MessageKind.EVENT, self.active[0], record={"event": "checkpoint_committed", "step": 35})
        return super().send(msg, nodes=nodes)


def test_the_loop_records_the_straggler_and_with_replace_moves_its_node_to_the_spare(tmp_path, site):
    world = SlowRankWorld(clock=Clock(), steps=40, faults={0: Fault("hang", 36)})   # still running after the flag
    slurm = FakeSlurm()
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3", "n4"), needed=3, in_slurm=True, slurm=slurm,
                    flags={"supervisor.straggler_replace": True})
    sv.run()
    [flag] = of(tmp_path, Event.STRAGGLER)
    assert flag["rank"] == 1 and flag["node"] == "n2" and flag["ratio"] == 2.0 and flag["replace"] is True
    [detected] = of(tmp_path, Event.FAILURE_DETECTED)
    assert detected["kind"] == "replaced" and detected["node"] == "n2"
    relaunch = [e for e in of(tmp_path, Event.LAUNCH) if e["path"] == "node"][-1]
    assert relaunch["nodes"] == ["n1", "n3", "n4"] and slurm.drained == ["n2"]


def test_without_straggler_replace_the_flag_is_only_recorded(tmp_path, site):
    world = SlowRankWorld(clock=Clock(), steps=40)
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=3, in_slurm=True, slurm=FakeSlurm())
    sv.run()
    [flag] = of(tmp_path, Event.STRAGGLER)
    assert flag["replace"] is False and not of(tmp_path, Event.FAILURE_DETECTED)
