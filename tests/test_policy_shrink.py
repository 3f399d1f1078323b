"""Fewer nodes or a requeue (issue 24 part 3): a node lost with no spare left continues on the
survivors (>= min_nodes) when planning/shrink.py prices it below a requeue. Pure: literal
observations, as tests/test_policy.py."""
import dataclasses

import pytest

from ckptsup.config import SupervisorConfig
from ckptsup.planning.shrink import Figure, ShrinkInputs, break_even_horizon_s, price
from ckptsup.supervisor.job.observations import (AttemptResult, Failure, FailureKind, History, Observation, Outcome,
                                             RecoveryPath, ShrinkCosts)
from ckptsup.supervisor.job.policy import Requeue, RestartInAllocation, ShrinkWay, decide
from ckptsup.supervisor.job.shrinking import queue_time_s, shrink_costs

CFG = SupervisorConfig(max_restarts=10, crash_loop_threshold=3)
ACTIVE = ("n1", "n2", "n3")


def costs(*, horizon=600.0, restart=5.0, queue=900.0, startup=20.0) -> ShrinkCosts:
    return ShrinkCosts(horizon=Figure(value_s=horizon, source="configured"), restart=Figure(value_s=restart, source="measured"),
                       queue_wait=Figure(value_s=queue, source="configured"),
                       requeue_restart=Figure(value_s=startup, source="measured"))


def lost(node="n3", *, min_nodes=2, shrink=None, can_requeue=True, unhealthy=(), active=ACTIVE, kind=FailureKind.NODE_DOWN):
    f = Failure(kind=kind, node=node, rank=0, step=7)
    observation = Observation(failure=f, active=active, nodes_needed=3, can_requeue=can_requeue, min_nodes=min_nodes,
                              shrink=costs() if shrink is None else shrink, unhealthy=frozenset(unhealthy))
    history = History(attempts=(AttemptResult(attempt=0, outcome=Outcome.FAILED, start_step=0, last_step=6, failure=f),))
    return decide(observation, history, CFG)


def test_a_lost_node_continues_on_the_survivors_when_that_costs_less_than_a_requeue():
    # 1/3 of a 600 s horizon + a 5 s restart = 205 s < a 900 s queue wait + 20 s start-up
    action = lost()
    assert isinstance(action, RestartInAllocation)
    assert action.nodes == ("n1", "n2") and action.path is RecoveryPath.NODE and action.exclude == ("n3",)
    choice = action.shrink
    assert choice is not None and choice.way is ShrinkWay.CONTINUE
    assert choice.price is not None and choice.price.continue_s == pytest.approx(205.0)
    assert choice.price.requeue_s == pytest.approx(920.0)
    fields = choice.event_fields()
    assert fields["choice"] == "continue" and fields["survivors"] == 2 and fields["nodes"] == 3 and fields["min_nodes"] == 2
    assert fields["horizon_source"] == "configured" and fields["restart_source"] == "measured"
    assert "continue on 2 of 3 nodes" in choice.reason and "205s" in choice.reason and "920s" in choice.reason


def test_a_lost_node_requeues_when_the_smaller_job_would_lose_more_than_the_queue_wait():
    # 1/3 of a 6 h horizon (7,200 s) is far more than a 900 s queue wait
    action = lost(shrink=costs(horizon=6 * 3600.0))
    assert isinstance(action, Requeue) and action.exclude == ("n3",) and action.newly_excluded == ("n3",)
    assert action.shrink is not None and action.shrink.way is ShrinkWay.REQUEUE
    assert "requeue rather than 2 of 3 nodes" in action.reason and ">=" in action.reason


def test_the_break_even_horizon_is_where_the_decision_turns():
    inputs = ShrinkInputs(nodes=3, survivors=2, horizon=Figure(value_s=0, source="x"), restart=Figure(value_s=5, source="x"),
                          queue_wait=Figure(value_s=900, source="x"), requeue_restart=Figure(value_s=20, source="x"))
    even = break_even_horizon_s(inputs)
    assert even == pytest.approx(3 * 915.0)
    assert isinstance(lost(shrink=costs(horizon=even - 1)), RestartInAllocation)
    assert isinstance(lost(shrink=costs(horizon=even + 1)), Requeue)
    assert price(dataclasses.replace(inputs, survivors=3)).continue_s == 5.0   # nothing lost: the restart alone


def test_below_min_nodes_requeues_and_says_so():
    # two of three nodes lost (one dead, one failing its health check): 1 survivor < min_nodes 2
    action = lost(unhealthy=("n2",))
    assert isinstance(action, Requeue) and set(action.exclude) == {"n2", "n3"}
    assert action.shrink is not None and action.shrink.way is ShrinkWay.REQUEUE and action.shrink.survivors == 1
    assert "below supervisor.min_nodes=2 of 3" in action.reason


def test_min_nodes_equal_to_the_active_nodes_is_the_requeue_of_today_with_no_choice_recorded():
    for least in (0, 3):
        action = lost(min_nodes=least)
        assert isinstance(action, Requeue) and action.shrink is None
        assert action.reason == "2 healthy node(s) left, 3 needed"


def test_outside_slurm_the_survivors_continue_rather_than_give_up():
    action = lost(can_requeue=False, shrink=costs(horizon=10 ** 6))
    assert isinstance(action, RestartInAllocation) and action.nodes == ("n1", "n2")
    assert action.shrink is not None and "no requeue outside Slurm" in action.shrink.reason


def test_a_crash_after_shrinking_restarts_on_the_same_smaller_set_on_the_fast_path():
    action = lost(node="n1", kind=FailureKind.CRASH, active=("n1", "n2"))
    assert isinstance(action, RestartInAllocation) and action.nodes == ("n1", "n2")
    assert action.path is RecoveryPath.FAST and action.exclude == ()
    assert action.shrink is not None and action.shrink.way is ShrinkWay.CONTINUE


def test_the_inputs_come_from_this_runs_measurements_else_the_knobs():
    sup = SupervisorConfig(requeue_wait_s=600.0, shrink_horizon_s=1800.0)
    none = shrink_costs({}, sup, end_time=None, now=1000.0)
    assert (none.horizon.value_s, none.horizon.source) == (1800.0, "configured")
    assert (none.queue_wait.value_s, none.queue_wait.source) == (600.0, "configured")
    assert (none.restart.value_s, none.restart.source) == (0.0, "unmeasured")
    some = shrink_costs({"restart_s": 3.5, "startup_s": 12.0, "queue_s": 42.0}, sup, end_time=1000.0 + 300, now=1000.0)
    assert (some.horizon.value_s, some.horizon.source) == (300.0, "slurm")
    assert (some.queue_wait.value_s, some.queue_wait.source) == (42.0, "measured")
    assert (some.restart.value_s, some.requeue_restart.value_s) == (3.5, 12.0)
    past = shrink_costs({"startup_s": 12.0}, sup, end_time=900.0, now=1000.0)   # past its end: the knob
    assert past.horizon.source == "configured" and past.restart.value_s == 12.0
    # a day left in the allocation: the job's own horizon (the rest of its work) is shorter
    far = shrink_costs({}, sup, end_time=1000.0 + 86400, now=1000.0)
    assert (far.horizon.value_s, far.horizon.source) == (1800.0, "configured")


def test_queue_time_is_the_last_requeue_to_the_new_supervisor():
    ts = "2026-12-04T06:00:00+00:00"
    start = 1796364000.0   # that instant
    assert queue_time_s([{"event": "supervisor_start", "ts": ts}, {"event": "requeue", "ts": ts}], start + 30) == 30.0
    assert queue_time_s([{"event": "requeue", "ts": ts}, {"event": "supervisor_start", "ts": ts}], start + 30) is None
    assert queue_time_s([], start) is None


def test_the_jobs_end_comes_from_slurm_job_end_time_else_squeue():
    from ckptsup.slurm.parsers import JobInfo, JobState
    from ckptsup.supervisor.job.placement import Placement, job_end_time

    assert job_end_time({"SLURM_JOB_END_TIME": "1796364000"}) == 1796364000.0
    assert job_end_time({"SLURM_JOB_END_TIME": "0"}) is None and job_end_time({}) is None
    assert job_end_time({"SLURM_JOB_END_TIME": "soon"}) is None

    class Squeue:
        def job_info(self, job_id):
            return JobInfo(job_id=job_id, name="j", state=JobState.RUNNING, nodes=[], partition="p", reason="None",
                           requeue=True, restart_count=0, batch_host="n1", excluded_nodes=[], exit_code=None,
                           exit_signal=None, end_time=1796367600, raw={})

    assert Placement(job_id="7", nodes=("n1",), in_slurm=True, slurm=Squeue()).job_end_time() == 1796367600.0
    assert Placement(job_id="7", nodes=("n1",), in_slurm=True, slurm=Squeue(), end_time=5.0).job_end_time() == 5.0
    assert Placement(job_id="7", nodes=("n1",)).job_end_time() is None   # local: no allocation, no end
