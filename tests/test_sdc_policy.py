"""The SDC and NaN-replay rules of the policy (docs/sdc.md), on literal observations, and the
supervisor's reading of an `sdc` frame (supervisor/job/sdc.py)."""
from ckptsup.config import SupervisorConfig
from ckptsup.supervisor.job.observations import AttemptResult, Failure, FailureKind, History, Observation, Outcome, RecoveryPath
from ckptsup.supervisor.job.policy import GiveUp, Requeue, RestartInAllocation, blamed, decide
from ckptsup.messages import Sdc
from ckptsup.supervisor.job.sdc import sdc_failure

CFG = SupervisorConfig(max_restarts=10, crash_loop_threshold=3)


def attempt(f, i=0):
    return AttemptResult(attempt=i, outcome=Outcome.FAILED, start_step=0, last_step=f.step, failure=f)


def observe(f, *, active=("n1", "n2", "n3"), spares=(), can_requeue=False, needed=None):
    return Observation(failure=f, active=tuple(active), spares=tuple(spares), excluded=frozenset(),
                       unhealthy=frozenset(), nodes_needed=needed or len(active), can_requeue=can_requeue,
                       restarts_used=0)


def nan(step, node="n1", rank=0):
    return Failure(kind=FailureKind.NAN, node=node, rank=rank, step=step)


NODES = {0: "n1", 1: "n2", 2: "n3"}


def test_an_sdc_frame_with_a_majority_names_the_outvoted_rank_and_its_node():
    f = sdc_failure(Sdc.from_body({"step": 24, "copies": 3, "disputed": [1], "majority": True}), node="n1", nodes_of=NODES)
    assert f.kind is FailureKind.SDC and f.rank == 1 and f.node == "n2" and f.step == 24 and f.suspects == ("n2",)
    assert "rank(s) 1 on n2" in f.detail and "majority of 3 copies" in f.detail


def test_an_sdc_frame_without_a_majority_pins_no_node():
    f = sdc_failure(Sdc.from_body({"step": 9, "copies": 2, "disputed": [0, 1], "majority": False}), node="n1", nodes_of=NODES)
    assert f.node is None and f.rank is None and f.suspects == ("n1", "n2") and "no majority" in f.detail


def test_three_copies_exclude_the_outvoted_node_and_take_the_spare():
    f = sdc_failure(Sdc.from_body({"step": 24, "copies": 3, "disputed": [1], "majority": True}), node="n1", nodes_of=NODES)
    action = decide(observe(f, spares=("n4",)), History(attempts=(attempt(f),)), CFG)
    assert isinstance(action, RestartInAllocation) and action.nodes == ("n1", "n3", "n4")
    assert action.exclude == ("n2",) and action.path is RecoveryPath.NODE
    assert "sdc" in dict(blamed(action))["n2"]


def test_three_copies_without_a_spare_requeue_excluding_the_outvoted_node():
    f = sdc_failure(Sdc.from_body({"step": 24, "copies": 3, "disputed": [2], "majority": True}), node="n1", nodes_of=NODES)
    action = decide(observe(f, can_requeue=True), History(attempts=(attempt(f),)), CFG)
    assert isinstance(action, Requeue) and action.newly_excluded == ("n3",) and "sdc" in dict(action.reasons)["n3"]


def test_three_copies_on_one_node_with_nothing_to_replace_it_resume_in_place():
    f = sdc_failure(Sdc.from_body({"step": 24, "copies": 3, "disputed": [1], "majority": True}), node="local",
                    nodes_of={0: "local", 1: "local", 2: "local"})
    action = decide(observe(f, active=("local",)), History(attempts=(attempt(f),)), CFG)
    assert action == RestartInAllocation(nodes=("local",), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def two(step, nodes=("n1", "n2")):
    return Failure(kind=FailureKind.SDC, step=step, suspects=tuple(nodes))


def test_two_copies_rerun_on_the_same_nodes_first():
    f = two(9)
    action = decide(observe(f, active=("n1", "n2"), spares=("n3",)), History(attempts=(attempt(f),)), CFG)
    assert action == RestartInAllocation(nodes=("n1", "n2"), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def test_two_copies_disagreeing_again_swap_a_spare_in_for_one_of_the_pair_without_blame():
    h = History(attempts=(attempt(two(9)), attempt(two(9), 1)))
    action = decide(observe(two(9), active=("n1", "n2"), spares=("n3",)), h, CFG)
    assert isinstance(action, RestartInAllocation) and action.nodes == ("n2", "n3") and action.exclude == ()


def test_the_node_in_both_disputes_after_the_swap_is_named():
    h = History(attempts=(attempt(two(9)), attempt(two(9), 1), attempt(two(9, ("n2", "n3")), 2)))
    action = decide(observe(two(9, ("n2", "n3")), active=("n2", "n3"), spares=("n1", "n4")), h, CFG)
    assert isinstance(action, RestartInAllocation) and action.exclude == ("n2",)
    assert "both of two replica disputes" in dict(blamed(action))["n2"] and "n2" not in action.nodes


def test_two_copies_disagreeing_again_with_nothing_to_tell_them_apart_give_up():
    h = History(attempts=(attempt(two(9)), attempt(two(12), 1)))
    action = decide(observe(two(12), active=("n1", "n2")), h, CFG)
    assert isinstance(action, GiveUp) and "disagreed twice" in action.reason


def test_a_first_nan_replays_on_the_same_nodes_and_blames_nobody():
    f = nan(7)
    action = decide(observe(f, spares=("n4",), can_requeue=True), History(attempts=(attempt(f),)), CFG)
    assert action == RestartInAllocation(nodes=("n1", "n2", "n3"), path=RecoveryPath.FAST, exclude=(), backoff_s=0.0)


def test_the_same_nan_on_the_same_rank_after_the_replay_is_the_datas_and_drains_nothing():
    h = History(attempts=(attempt(nan(7, rank=2)), attempt(nan(7, rank=2), 1)))
    action = decide(observe(nan(7, rank=2), spares=("n4",), can_requeue=True), h, CFG)
    assert isinstance(action, GiveUp) and action.failure.kind is FailureKind.USER_ERROR
    assert "step 7 on rank 2 again" in action.reason and "no node is blamed" in action.reason


def test_a_nan_at_another_step_on_the_same_node_makes_it_the_nodes():
    h = History(attempts=(attempt(nan(7)), attempt(nan(30), 1)))
    action = decide(observe(nan(30), spares=("n4",)), h, CFG)
    assert isinstance(action, RestartInAllocation) and action.exclude == ("n1",) and action.nodes == ("n2", "n3", "n4")
    assert "steps 7 and 30" in dict(blamed(action))["n1"]


def test_a_nan_at_another_step_on_another_node_is_a_first_nan_there():
    h = History(attempts=(attempt(nan(7)), attempt(nan(30, node="n2"), 1)))
    action = decide(observe(nan(30, node="n2"), spares=("n4",)), h, CFG)
    assert isinstance(action, RestartInAllocation) and action.exclude == ()
