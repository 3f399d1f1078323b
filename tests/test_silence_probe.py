"""silence_probe.py: a silent agent's node asked through its slurmd (issue 38: a dead node found in ~2 s,
not after node_silence_s). The pure parts and the tracker's list of silent nodes here; the real probe
against a dead dev-cluster node's slurmd in tests/test_supervisor_slurm_node_death.py."""

from __future__ import annotations

import time

from ckptsup.config import SupervisorConfig
from ckptsup.supervisor.job.attempt import AttemptTracker
from ckptsup.supervisor.job.silence_probe import SilenceProbe, due, suspect_after_s


def test_the_suspect_threshold_is_two_beats_and_never_under_a_second() -> None:
    assert suspect_after_s(1.0) == 2.0 and suspect_after_s(0.5) == 1.0 and suspect_after_s(0.1) == 1.0


def test_a_node_is_asked_once_per_silence_and_again_after_it_spoke() -> None:
    asked = {"n2": 10.0}
    assert due([("n2", 10.0, 3.0), ("n3", 11.0, 2.1)], asked) == ["n3"]
    assert due([("n2", 12.5, 2.2)], asked) == ["n2"]   # heard at 12.5 since: a new silence


def wait(probe: SilenceProbe) -> None:
    deadline = time.monotonic() + 5
    while probe.pending and not all(f.done() for f, _ in probe.pending) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_node_whose_slurmd_does_not_answer_is_down_unless_its_agent_spoke_meanwhile() -> None:
    calls: list[tuple[list[str], float]] = []
    probe = SilenceProbe(down=lambda nodes, timeout_s: calls.append((list(nodes), timeout_s)) or {"n2"})
    probe.offer([("n2", 100.0, 2.2), ("n3", 101.0, 1.2)])
    probe.offer([("n2", 100.0, 2.4)])   # asked already: no second probe
    wait(probe)
    assert calls == [(["n2", "n3"], 0.5)]
    down = probe.take(102.5, still_silent=lambda node, heard: True, step=7)
    assert down is not None and (down.node, down.step, round(down.detect_s, 1)) == ("n2", 7, 2.5)
    assert "slurmd does not answer" in down.detail
    probe.offer([("n2", 103.0, 2.1)])
    wait(probe)
    assert probe.take(105.0, still_silent=lambda node, heard: False, step=9) is None   # it spoke: no verdict
    probe.close()


def test_a_slurmd_that_answers_or_a_failing_probe_says_nothing() -> None:
    def broken(nodes, timeout_s):
        raise OSError("no route")

    for down in (lambda nodes, timeout_s: set(), broken):
        probe = SilenceProbe(down=down)
        probe.offer([("n2", 1.0, 2.5)])
        wait(probe)
        assert probe.take(3.5, still_silent=lambda node, heard: True, step=None) is None
        probe.close()


def test_the_tracker_lists_nodes_silent_past_the_threshold_only_while_another_talks() -> None:
    tracker = AttemptTracker(attempt=0, nodes=("n1", "n2", "n3"), nproc_per_node=1, config=SupervisorConfig(),
                             started=0.0)
    for node, t in (("n1", 10.0), ("n2", 7.5), ("n3", 9.9)):
        tracker.node_views[node].last_heard = t
        tracker._heard(node, t)
    assert tracker.silent_past(10.0, 2.0) == [("n2", 7.5, 2.5)]
    assert tracker.silent_past(20.0, 2.0) == []   # every agent silent: the supervisor's side, not a node
