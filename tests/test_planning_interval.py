"""Young, Daly, expected waste, spares and spot: against published and hand-worked values."""

import math

import pytest

from ckptsup.errors import ConfigError
from ckptsup.planning import interval as iv


@pytest.mark.parametrize("mtbf_s, expected_min", [(24 * 3600, 117), (6 * 3600, 57), (15 * 60, 9.1)])
def test_daly_matches_published_cases_for_a_5_minute_checkpoint(mtbf_s, expected_min):
    # Daly (2006) validation cases, delta = 5 min: M = 24 h -> ~117 min, 6 h -> ~57 min, 15 min -> ~9.1 min
    result = iv.daly_interval(300.0, mtbf_s)
    assert not result.capped
    assert result.interval_s / 60 == pytest.approx(expected_min, rel=0.01)


@pytest.mark.parametrize("stall_s, mtbf_s, expected_s", [
    (300, 24 * 3600, 7200.0),                      # sqrt(2*300*86400) = 7200 exactly
    (30, 3 * 3600, math.sqrt(648_000)),            # 804.98 s
    (60, 24 * 3600, math.sqrt(10_368_000)),        # 3219.9 s
])
def test_young_matches_hand_worked_values(stall_s, mtbf_s, expected_s):
    assert iv.young_interval(stall_s, mtbf_s) == pytest.approx(expected_s)


def test_young_overshoots_daly_more_as_the_stall_grows_relative_to_mtbf():
    ratios = [iv.young_interval(300, m) / iv.daly_interval(300, m).interval_s for m in (86400, 21600, 900)]
    assert ratios == sorted(ratios)
    assert ratios[-1] == pytest.approx(12.247 / 9.141, rel=0.01)  # ~34% too long at C/M = 0.33


def test_daly_takes_the_t_equals_m_branch_when_the_stall_reaches_twice_the_mtbf():
    result = iv.daly_interval(2 * 600.0, 600.0)
    assert result.capped and result.interval_s == 600.0
    assert not iv.daly_interval(2 * 600.0 - 1, 600.0).capped


def test_expected_waste_splits_into_stall_rework_and_restart_with_the_persist_term():
    w = iv.expected_waste(interval_s=1000, stall_s=10, mtbf_s=10_000, restart_s=200, persist_s=60)
    assert w.checkpoint == pytest.approx(10 / 1000)
    assert w.rework == pytest.approx((500 + 60) / 10_000)
    assert w.restart == pytest.approx(200 / 10_000)
    assert w.total == pytest.approx(0.01 + 0.056 + 0.02)


def test_daly_interval_minimises_the_waste_near_young():
    c, m, r = 30.0, 3 * 3600.0, 120.0
    best = iv.daly_interval(c, m).interval_s
    at = lambda t: iv.expected_waste(interval_s=t, stall_s=c, mtbf_s=m, restart_s=r).total  # noqa: E731
    assert at(best) < at(best * 0.7) and at(best) < at(best * 1.4)


def test_record_scales_to_the_gang_because_any_failure_stops_the_job():
    # Llama 3: 419 unexpected interruptions over 54 days on 16,384 GPUs -> 3.09 h job MTBF
    mtbf = iv.job_mtbf_from_record(failures=419, over_s=54 * 86400, on_gpus=16384, gpus=16384)
    assert mtbf / 3600 == pytest.approx(3.093, rel=1e-3)
    half = iv.job_mtbf_from_record(failures=419, over_s=54 * 86400, on_gpus=16384, gpus=8192)
    assert half == pytest.approx(2 * mtbf)


def test_spares_are_the_smallest_count_with_overflow_risk_below_one_percent():
    # Poisson(1): P(X > 3) = 0.019, P(X > 4) = 0.0037 -> 4 spares
    assert iv.recommended_spares(node_failures_per_s=1 / 3600, replace_s=3600) == 4
    assert iv.poisson_tail(1.0, 3) == pytest.approx(0.01899, rel=1e-3)
    assert iv.recommended_spares(node_failures_per_s=0.0, replace_s=3600) == 0
    big = iv.recommended_spares(node_failures_per_s=1.0, replace_s=2000)  # mean 2000: no underflow
    assert 2000 < big < 2200 and iv.poisson_tail(2000.0, big) < 0.01 <= iv.poisson_tail(2000.0, big - 1)


def test_spot_break_even_is_where_spot_stops_paying():
    kwargs = dict(gpu_mtbf_s=45000 * 3600.0, gpus_per_node=8, stall_s=30.0, restart_s=300.0, persist_s=0.0,
                  preemptions_per_node_s=0.05 / 86400, discount=0.6)
    even = iv.spot_break_even_gpus(**kwargs)
    assert even > 0 and even % 8 == 0

    def useful_cost(gpus, discount, preempt):
        mtbf = kwargs["gpu_mtbf_s"] / gpus
        m = 1 / (1 / mtbf + gpus / 8 * preempt)
        res = iv.evaluate(iv.Strategy(mtbf_s=m, stall_s=30.0, restart_s=300.0))
        return iv.cost_per_useful_hour(1 - discount, min(1.0, res.waste.total))

    at = useful_cost(even, 0.6, kwargs["preemptions_per_node_s"])
    past = useful_cost(even + 8, 0.6, kwargs["preemptions_per_node_s"])
    assert at <= useful_cost(even, 0.0, 0.0)
    assert past > useful_cost(even + 8, 0.0, 0.0)


def test_spot_never_pays_when_preemptions_are_constant():
    assert iv.spot_break_even_gpus(gpu_mtbf_s=1e9, gpus_per_node=8, stall_s=600.0, restart_s=600.0, persist_s=0.0,
                                   preemptions_per_node_s=100 / 86400, discount=0.1) == 0


def test_async_interval_is_raised_to_the_persist_time_so_saves_do_not_queue():
    res = iv.evaluate(iv.Strategy(mtbf_s=3600.0, stall_s=1.0, restart_s=60.0, persist_s=600.0))
    assert res.persist_bound and res.interval_s == 600.0 and res.interval_daly_s < 600.0


@pytest.mark.parametrize("call", [
    lambda: iv.young_interval(0, 100), lambda: iv.daly_interval(10, -1),
    lambda: iv.expected_waste(interval_s=0, stall_s=1, mtbf_s=1, restart_s=0),
    lambda: iv.expected_waste(interval_s=1, stall_s=1, mtbf_s=1, restart_s=-1),
    lambda: iv.job_mtbf_from_record(failures=0, over_s=10, on_gpus=8, gpus=8),
    lambda: iv.daly_interval(float("nan"), 10),
])
def test_impossible_values_are_refused(call):
    with pytest.raises(ConfigError):
        call()
