"""AdaptiveInterval: pure, clock injected; the interval the hooks follow moves with measured costs."""

import random

import pytest

from ckptsup.planning.adaptive import AdaptiveInterval, posterior
from ckptsup.planning.interval import daly_interval


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(clock, **kw):
    args = dict(gpu_mtbf_hours=45000.0, devices=1024, initial_interval_s=1800.0, clock=clock,
                rng=random.Random(1), jitter_fraction=0.0)
    args.update(kw)
    return AdaptiveInterval(**args)


def commit(stall, write=0.0):
    return {"event": "checkpoint_committed", "step": 1, "stall_s": stall, "write_s": write}


def test_interval_changes_when_the_measured_stall_changes():
    clock = FakeClock()
    ai = make(clock)
    first = ai.observe(commit(30.0))
    assert first is not None
    mtbf = 45000 * 3600 / 1024
    assert first[0] == pytest.approx(daly_interval(30.0, mtbf).interval_s)
    assert ai.observe(commit(30.0)) is None  # same stall: no change, no event
    for _ in range(5):
        changed = ai.observe(commit(2.0))
    assert changed is not None or ai.interval_s == pytest.approx(daly_interval(2.0, mtbf).interval_s)
    assert ai.interval_s == pytest.approx(daly_interval(2.0, mtbf).interval_s)
    assert ai.interval_s < first[0] / 3


def test_small_changes_below_the_threshold_are_not_reported():
    ai = make(FakeClock(), change_threshold=0.2)
    ai.observe(commit(30.0))
    assert ai.observe(commit(31.0)) is None


def test_failures_shorten_the_interval_through_the_gamma_poisson_posterior():
    clock = FakeClock()
    ai = make(clock, devices=64)
    ai.observe(commit(30.0))
    before = ai.interval_s
    clock.now = 3600.0
    for _ in range(5):
        ai.observe({"event": "failure_detected", "kind": "node_down"})
    post = ai.posterior()
    assert post.alpha == 6 and post.beta_hours == pytest.approx(45000 + 64)
    assert ai.interval_s < before
    target = daly_interval(30.0, post.job_mtbf_s(64)).interval_s
    assert abs(ai.interval_s / target - 1) <= ai.change_threshold  # follows it up to the threshold


def test_user_errors_do_not_count_as_hardware_failures():
    ai = make(FakeClock())
    ai.observe({"event": "failure_detected", "kind": "user_error"})
    assert ai.failures == 0


def test_posterior_mean_moves_from_the_prior_to_the_data():
    prior_only = posterior(gpu_mtbf_hours=1000, prior_weight=1, failures=0, device_hours=0)
    assert prior_only.device_mtbf_s == pytest.approx(1000 * 3600)
    lots = posterior(gpu_mtbf_hours=1000, prior_weight=1, failures=1000, device_hours=100_000)
    assert lots.device_mtbf_s / 3600 == pytest.approx(100, rel=0.02)


def test_async_persist_time_bounds_the_interval_from_below():
    ai = make(FakeClock())
    ai.observe(commit(1.0, write=900.0))
    assert ai.interval_s == pytest.approx(900.0)


def test_jitter_spreads_intervals_but_stays_within_the_fraction():
    values = []
    for seed in range(20):
        ai = make(FakeClock(), rng=random.Random(seed), jitter_fraction=0.1)
        values.append(ai.observe(commit(30.0))[0])
    base = daly_interval(30.0, 45000 * 3600 / 1024).interval_s
    assert len(set(values)) > 1 and all(abs(v / base - 1) <= 0.1 for v in values)


def test_clamps_keep_the_interval_in_range():
    ai = make(FakeClock(), min_interval_s=120.0)
    ai.observe(commit(0.001))
    assert ai.interval_s == 120.0


def test_every_change_carries_a_reason():
    ai = make(FakeClock())
    interval, why = ai.observe(commit(30.0))
    assert "checkpoint_committed" in why and "Daly" in why and "C=" in why


def test_allocation_sets_the_gang_to_its_active_devices():
    ai = make(FakeClock(), devices=1)
    ai.observe({"event": "allocation", "nodes": 5, "active": 4, "gpus_per_node": 8, "spares": 1})
    assert ai.devices == 32


def test_seed_carries_failures_and_costs_across_a_requeue():
    from test_accounting import faulted_run

    ai = make(FakeClock(), devices=8)
    ai.seed(faulted_run())
    assert ai.failures == 1  # the crash; the preemption says nothing of the hardware
    assert ai.device_hours == pytest.approx(1230 * 8 / 3600, rel=0.01)
    assert list(ai.stalls) == [5.0, 5.0, 10.0, 5.0]
    change = ai.observe({"event": "step_progress", "step": 1})
    assert change is None  # nothing new; the next commit retargets with the seeded history
    assert ai.observe(commit(5.0)) is not None


def test_the_supervisors_tuner_counts_the_allocations_gpus_else_the_ranks():
    from ckptsup.config import Config
    from ckptsup.supervisor.interval_tuner import IntervalTuner

    config = Config()
    config.supervisor.nodes, config.supervisor.nproc_per_node, config.sbatch.gpus_per_node = 2, 3, 8
    assert IntervalTuner(config, gpus_per_node=4)._adaptive.devices == 8   # 2 nodes x the allocation's 4
    assert IntervalTuner(config)._adaptive.devices == 6                    # no GPU: 2 nodes x 3 ranks
    config.supervisor.nproc_per_node = "auto"                              # unresolved: one a node
    assert IntervalTuner(config)._adaptive.devices == 2
