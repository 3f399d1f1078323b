"""Pure detectors: hang (per-phase allowances, automatic timeout), node down, exits, NaN."""
import math

import pytest

from ckptsup.config import SupervisorConfig
from ckptsup.env import ExitStatus
from ckptsup.wire import Phase
from ckptsup.supervisor.job.detection import (NodeView, RankView, StepWindow, allowance, classify_rank_exit,
                                          detect_hang, detect_node_down, HangTimeout, percentile)
from ckptsup.supervisor.job.observations import FailureKind

CFG = SupervisorConfig(hang_min_s=30.0, hang_step_factor=10.0, init_timeout_s=300.0, load_timeout_s=600.0,
                       save_timeout_s=600.0)


def test_automatic_hang_timeout_is_ten_times_p99_step_with_a_30s_floor():
    assert HangTimeout.of(CFG, None).s == 30.0
    assert HangTimeout.of(CFG, 0.5).s == 30.0
    assert HangTimeout.of(CFG, 7.0).s == 70.0
    assert HangTimeout.of(CFG, 7.0).reason() == "max(hang_min_s 30s, 10 x p99 step 7.000s)"
    assert HangTimeout.of(CFG, 7.0, cap_s=40.0).s == 40.0
    assert HangTimeout.of(CFG, 7.0, cap_s=40.0).reason().endswith("capped below the ranks' collective timeout (40s)")


def test_configured_hang_timeout_wins_over_auto():
    assert HangTimeout.of(SupervisorConfig(hang_timeout_s=12), 100.0).s == 12.0


def test_step_window_p99_ignores_bad_samples_and_stays_bounded():
    w = StepWindow(size=100)
    for i in range(1000):
        w.add(float(i % 100))
    w.add(math.nan)
    w.add(-1.0)
    assert len(w.samples) == 100 and w.p99() == 98.0
    assert percentile([], 0.99) is None


def test_phases_have_their_own_allowances():
    assert allowance(Phase.INIT, CFG, 30.0) == 300.0
    assert allowance(Phase.LOAD, CFG, 30.0) == 600.0
    assert allowance(Phase.SAVE, CFG, 30.0) == 600.0   # no save measured: the whole save_timeout_s
    assert allowance(Phase.TRAIN, CFG, 30.0) == 30.0


@pytest.mark.parametrize("saves", [[], [2.0], [50.0], [900.0]])
def test_the_save_allowance_detection_applies_is_the_one_the_collective_timeout_was_derived_from(saves):
    """docs/timeouts.md: min(save_timeout_s, max(hang_s, 3 x slowest save)); one figure for the
    detector and for the ranks' collective timeout (nccl.derive_timeouts), not two."""
    from ckptsup.config import Config
    from ckptsup.supervisor.job import nccl

    config = Config()
    t = nccl.derive_timeouts(config, step_times=[0.5] * 20, save_times=saves)
    expected = min(config.supervisor.save_timeout_s, max(t.hang.s, 3 * max(saves))) if saves \
        else config.supervisor.save_timeout_s
    assert t.save_allowance_s == expected
    assert allowance(Phase.SAVE, config.supervisor, t.hang.s, save_allowance_s=t.save_allowance_s) == expected
    saving = [rank(0, step=9, last=100.0, phase=Phase.SAVE)]
    assert detect_hang(saving, now=100.0 + expected - 0.5, config=config.supervisor, train_timeout_s=t.hang.s,
                       save_allowance_s=t.save_allowance_s) is None
    assert detect_hang(saving, now=100.0 + expected + 0.5, config=config.supervisor, train_timeout_s=t.hang.s,
                       save_allowance_s=t.save_allowance_s).kind is FailureKind.HANG


def rank(r, *, step, last, phase=Phase.TRAIN, stopped=False, node="n1"):
    return RankView(rank=r, node=node, phase=phase, phase_since=0.0, last_step=step, last_progress=last,
                    stopped=stopped)


def test_no_hang_within_the_timeout():
    assert detect_hang([rank(0, step=9, last=100.0)], now=129.0, config=CFG, train_timeout_s=30.0) is None


def test_hang_blames_the_stopped_process():
    ranks = [rank(0, step=9, last=100.0), rank(1, step=9, last=100.0, stopped=True, node="n2")]
    f = detect_hang(ranks, now=131.0, config=CFG, train_timeout_s=30.0)
    assert f.kind is FailureKind.HANG and f.rank == 1 and f.node == "n2" and f.detect_s == 31.0
    assert "stopped" in f.detail


def test_hang_blames_the_rank_furthest_behind_when_none_is_stopped():
    ranks = [rank(0, step=9, last=100.0), rank(1, step=8, last=95.0, node="n2")]
    f = detect_hang(ranks, now=131.0, config=CFG, train_timeout_s=30.0)
    assert f.rank == 1 and f.suspects == ("n2",)


def test_a_long_save_is_not_a_hang():
    ranks = [rank(0, step=9, last=100.0, phase=Phase.SAVE)]
    assert detect_hang(ranks, now=400.0, config=CFG, train_timeout_s=30.0) is None


def test_node_down_when_one_agent_is_silent_while_others_talk():
    views = [NodeView(node="n1", last_heard=100.0), NodeView(node="n2", last_heard=94.0)]
    f = detect_node_down(views, now=100.5, silence_s=5.0, step=12)
    assert f.kind is FailureKind.NODE_DOWN and f.node == "n2" and f.step == 12 and f.detect_s == 6.5


def test_everyone_silent_waits_twice_as_long_before_blaming():
    views = [NodeView(node="n1", last_heard=94.0), NodeView(node="n2", last_heard=94.0)]
    assert detect_node_down(views, now=100.0, silence_s=5.0) is None
    f = detect_node_down(views, now=104.5, silence_s=5.0)
    assert f is not None and set(f.suspects) == {"n1", "n2"}


def test_exit_codes_classify_into_crash_nan_or_nothing():
    assert classify_rank_exit(node="n1", rank=0, rc=0, step=3) is None
    assert classify_rank_exit(node="n1", rank=0, rc=int(ExitStatus.RANK_STOPPED), step=3) is None
    assert classify_rank_exit(node="n1", rank=0, rc=int(ExitStatus.RANK_NAN), step=3).kind is FailureKind.NAN
    crash = classify_rank_exit(node="n1", rank=1, rc=-9, step=3)
    assert crash.kind is FailureKind.CRASH and "signal 9" in crash.detail
    assert "lost its connection" in classify_rank_exit(node="n1", rank=1, rc=None, step=3).detail


def test_after_a_rank_finishes_the_others_get_the_stopping_allowance():
    from ckptsup.supervisor.job.attempt import AttemptTracker
    from ckptsup.supervisor.job.agent_step import Message

    cfg = SupervisorConfig(hang_timeout_s=5, save_timeout_s=600.0, node_silence_s=1e9)
    t = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=cfg, started=0.0)
    for rank in (0, 1):
        t.on_message(Message.received(recv=1.0, m="hello", body={"node": "n1", "rank": rank}, step_id=1))
        t.on_message(Message.received(recv=2.0, m="step", body={"node": "n1", "rank": rank, "step": 9}, step_id=1))
    t.on_message(Message.received(recv=3.0, m="bye", body={"node": "n1", "rank": 1, "status": 0}, step_id=1))
    assert t.check(now=60.0) is None  # rank 0 drains its housekeeping: not a hang
    assert t.check(now=700.0).kind is FailureKind.HANG


def test_the_hang_timeout_is_clamped_below_the_attempts_collective_timeout():
    from ckptsup.supervisor.job.attempt import AttemptTracker

    t = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=1, config=CFG, started=0.0, hang_cap_s=40.0)
    for _ in range(50):
        t.step_window.add(9.0)  # steps slowed down: 10 x p99 = 90 s
    assert t.hang_timeout().s == 40.0


@pytest.mark.parametrize("finished, crash", [((0, 1), False), ((1,), True), ((), True)])
def test_torchrun_failing_after_every_rank_of_the_node_finished_is_a_teardown_error_not_a_crash(finished, crash):
    from ckptsup.supervisor.job.attempt import AttemptTracker
    from ckptsup.supervisor.job.agent_step import Message

    cfg = SupervisorConfig(hang_timeout_s=5, save_timeout_s=600.0, node_silence_s=1e9)
    t = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=cfg, started=0.0)
    for rank in (0, 1):
        t.on_message(Message.received(recv=1.0, m="hello", body={"node": "n1", "rank": rank}, step_id=1))
    for rank in finished:
        t.on_message(Message.received(recv=3.0, m="bye", body={"node": "n1", "rank": rank, "status": 0}, step_id=1))
    failure = t.on_message(Message.received(recv=4.0, m="torchrun_exit", body={"node": "n1", "rc": 1}, step_id=1))
    if crash:
        assert failure.kind is FailureKind.CRASH and not t.complete and not t.teardown_errors
    else:
        assert failure is None and t.complete and t.teardown_errors == [{"node": "n1", "rc": 1}]


def test_the_node_down_check_reads_only_the_silent_front_yet_finds_what_a_full_scan_would():
    """heard_order keeps nodes oldest-heard first (bench_supervisor_scale.py: 16,384 views are not
    read every tick): a silent node is found wherever it started, also after frames out of order."""
    from ckptsup.config import SupervisorConfig
    from ckptsup.supervisor.job.agent_step import Message
    from ckptsup.supervisor.job.attempt import AttemptTracker
    from ckptsup.wire import MessageKind

    t = AttemptTracker(attempt=0, nodes=("n1", "n2", "n3", "n4"), nproc_per_node=1, config=SupervisorConfig(),
                       started=0.0)
    for second in range(0, 9):
        for node in ("n4", "n1", "n2", "n3"):
            if node != "n3" or second <= 2:
                t.on_message(Message.received(recv=float(second), m=MessageKind.HB, body={"node": node, "ranks_alive": []},
                                     step_id=1))
    assert list(t.heard_order)[0] == "n3"
    failure = t.check(8.0)
    assert failure is not None and failure.node == "n3" and failure.kind.value == "node_down"
    t.on_message(Message.received(recv=1.0, m=MessageKind.HB, body={"node": "n4", "ranks_alive": []}, step_id=1))   # far older
    assert list(t.heard_order)[:2] == ["n4", "n3"] and t.check(8.0).node == "n4"


def test_beyond_2048_nodes_agents_beat_less_often_and_a_dead_node_takes_as_many_missed_beats():
    """Without relays (relay_above_nodes = 0) the beat slows with the allocation."""
    from ckptsup.supervisor.job.detection import HEARTBEATS_PER_S, MISSED_HEARTBEATS, at_scale

    base = SupervisorConfig(relay_above_nodes=0)
    assert at_scale(base, 8) is base and at_scale(base, HEARTBEATS_PER_S) is base
    big = at_scale(base, 16_384)
    assert big.heartbeat_interval_s == 8.0 and big.node_silence_s == MISSED_HEARTBEATS * 8.0 == 24.0
    assert big.hang_min_s == base.hang_min_s and big.busy_limit_s == base.busy_limit_s   # nothing else moves
    assert at_scale(base, 16_384, interval_chosen=True) is base   # a period the user set is kept
    patient = SupervisorConfig(node_silence_s=60.0, relay_above_nodes=0)
    assert at_scale(patient, 4096).node_silence_s == 60.0 and at_scale(patient, 4096).heartbeat_interval_s == 2.0


def test_with_relays_at_the_defaults_the_beat_stays_at_one_second_at_16384_nodes():
    """Relays summarise past relay_above_nodes (1,024: 2,048 x 8 direct cost 12.5-13 % of a core on a
    quiet box, relayed 1.8-1.9 %): the supervisor folds ~sqrt(N) frames a beat, so the period and the
    silence that means a dead node stay what small jobs get."""
    from ckptsup.supervisor.job.detection import at_scale, relayed

    base = SupervisorConfig()
    assert relayed(base, 16_384) and relayed(base, 2_048) and not relayed(base, 1_024)
    assert at_scale(base, 16_384) is base
