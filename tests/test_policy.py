"""The recovery policy is a pure function: each rule tested on literal observations."""
from ckptsup.config import SupervisorConfig
from ckptsup.supervisor.job.observations import (AttemptResult, Failure, FailureKind, History, Observation,
                                             Outcome, RecoveryPath)
from ckptsup.supervisor.job.policy import Continue, GiveUp, Requeue, RestartInAllocation, backoff_s, decide

CFG = SupervisorConfig(max_restarts=10, crash_loop_threshold=3)


def failed(kind, step, *, attempt=0, start=0, last=None, node="n1"):
    f = Failure(kind=kind, node=node, rank=0, step=step)
    return AttemptResult(attempt=attempt, outcome=Outcome.FAILED, start_step=start, last_step=last, failure=f)


def obs(kind=FailureKind.CRASH, *, node="n1", active=("n1", "n2"), spares=(), excluded=(), unhealthy=(),
        needed=2, can_requeue=False, restarts=0, step=5):
    f = None if kind is None else Failure(kind=kind, node=node, rank=0, step=step)
    return Observation(failure=f, active=tuple(active), spares=tuple(spares), excluded=frozenset(excluded),
                       unhealthy=frozenset(unhealthy), nodes_needed=needed, can_requeue=can_requeue,
                       restarts_used=restarts)


def hist(*attempts):
    return History(attempts=tuple(attempts))


def test_no_failure_continues():
    assert decide(obs(None), hist(), CFG) == Continue()


def test_crash_on_healthy_nodes_takes_the_fast_path_on_the_same_nodes():
    action = decide(obs(), hist(failed(FailureKind.CRASH, 5, last=4)), CFG)
    assert action == RestartInAllocation(nodes=("n1", "n2"), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def test_dead_node_is_excluded_and_a_spare_takes_its_place_on_the_node_path():
    action = decide(obs(FailureKind.NODE_DOWN, node="n2", active=("n1", "n2", "n3"), spares=("n4",), needed=3),
                    hist(failed(FailureKind.NODE_DOWN, 5, last=4, node="n2")), CFG)
    assert isinstance(action, RestartInAllocation)
    assert action.nodes == ("n1", "n3", "n4") and action.path is RecoveryPath.NODE and action.exclude == ("n2",)


def test_dead_node_without_a_spare_requeues_excluding_it_inside_slurm():
    action = decide(obs(FailureKind.NODE_DOWN, node="n2", can_requeue=True, excluded=("n9",)),
                    hist(failed(FailureKind.NODE_DOWN, 5, last=4, node="n2")), CFG)
    assert isinstance(action, Requeue)
    assert action.exclude == ("n2", "n9") and action.newly_excluded == ("n2",) and not action.preempted


def test_dead_node_without_spare_or_slurm_gives_up():
    action = decide(obs(FailureKind.NODE_DOWN, node="n2"), hist(failed(FailureKind.NODE_DOWN, 5, last=4)), CFG)
    assert isinstance(action, GiveUp) and "no requeue outside Slurm" in action.reason


def test_a_first_nan_is_replayed_on_the_same_nodes_even_with_a_spare():
    # replay before blame (docs/sdc.md): no node is excluded before the replay says it is the node
    action = decide(obs(FailureKind.NAN, node="n1", spares=("n3",)), hist(failed(FailureKind.NAN, 5, last=4)), CFG)
    assert action == RestartInAllocation(nodes=("n1", "n2"), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def test_nan_restarts_in_place_when_nothing_could_replace_the_node():
    action = decide(obs(FailureKind.NAN, node="n1", active=("n1",), needed=1),
                    hist(failed(FailureKind.NAN, 5, last=4)), CFG)
    assert action == RestartInAllocation(nodes=("n1",), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def test_suspect_failing_health_check_is_excluded():
    action = decide(obs(FailureKind.HANG, unhealthy=("n2",), spares=("n3",)), hist(failed(FailureKind.HANG, 5, last=4)), CFG)
    assert isinstance(action, RestartInAllocation) and action.exclude == ("n2",) and action.nodes == ("n1", "n3")


def test_same_failure_at_same_step_k_times_gives_up_as_user_error():
    h = hist(*(failed(FailureKind.CRASH, 7, attempt=i, start=3, last=6) for i in range(3)))
    action = decide(obs(FailureKind.CRASH, step=7), h, CFG)
    assert isinstance(action, GiveUp) and "user error" in action.reason and "step 7 3 times" in action.reason


def test_same_failure_at_different_steps_is_not_a_crash_loop():
    h = hist(*(failed(FailureKind.CRASH, 5 + i, attempt=i, start=i, last=4 + i) for i in range(3)))
    assert isinstance(decide(obs(), h, CFG), RestartInAllocation)


def test_no_progress_across_k_attempts_gives_up():
    h = hist(failed(FailureKind.CRASH, 5, start=5), failed(FailureKind.HANG, 5, start=5),
             failed(FailureKind.CRASH, 6, start=5))
    action = decide(obs(), h, CFG)
    assert isinstance(action, GiveUp) and "no progress across 3 attempts" in action.reason


def test_node_deaths_never_count_as_a_crash_loop():
    h = hist(*(failed(FailureKind.NODE_DOWN, 5, start=5, node=f"n{i}") for i in range(4)))
    action = decide(obs(FailureKind.NODE_DOWN, node="n2", spares=("n3",)), h, CFG)
    assert isinstance(action, RestartInAllocation)


def test_restart_budget_spent_gives_up():
    action = decide(obs(restarts=10), hist(failed(FailureKind.CRASH, 5, last=4)), CFG)
    assert isinstance(action, GiveUp) and "restart budget spent" in action.reason


def test_preemption_requeues_as_preempted():
    action = decide(obs(FailureKind.PREEMPTED), hist(), CFG)
    assert isinstance(action, Requeue) and action.preempted


def test_backoff_is_zero_then_doubles_up_to_the_cap():
    cfg = SupervisorConfig(backoff_initial_s=2.0, backoff_max_s=5.0, crash_loop_threshold=10)
    quick = [failed(FailureKind.CRASH, 5 + i, start=5 + i) for i in range(4)]
    assert backoff_s(hist(*quick[:1]), cfg) == 0.0
    assert backoff_s(hist(*quick[:2]), cfg) == 2.0
    assert backoff_s(hist(*quick[:3]), cfg) == 4.0
    assert backoff_s(hist(*quick[:4]), cfg) == 5.0
    progressed = quick[:3] + [failed(FailureKind.CRASH, 20, start=8, last=19)]
    assert backoff_s(hist(*progressed), cfg) == 0.0


def test_attempt_result_round_trips_through_state_json_records():
    a = failed(FailureKind.HANG, 9, attempt=4, start=3, last=8)
    assert AttemptResult.from_record(a.to_record()) == a


def test_an_operators_replace_moves_to_a_spare_on_the_node_path_without_checks_or_budget():
    spent = SupervisorConfig(max_restarts=0, crash_loop_threshold=1)   # no budget, a loop at once
    action = decide(obs(FailureKind.REPLACED, node="n2", spares=("n3",)), hist(failed(FailureKind.REPLACED, 9, node="n2")),
                    spent)
    assert isinstance(action, RestartInAllocation) and action.path is RecoveryPath.NODE
    assert action.nodes == ("n1", "n3") and action.exclude == ("n2",) and action.reasons[0][1].startswith("replaced")


def test_a_replace_without_a_spare_requeues_without_the_node_inside_slurm():
    action = decide(obs(FailureKind.REPLACED, node="n2", can_requeue=True), hist(failed(FailureKind.REPLACED, 9, node="n2")),
                    CFG)
    assert isinstance(action, Requeue) and action.exclude == ("n2",) and not action.preempted
