"""Preemption / time-limit budget: whether an emergency save fits, and the budget for ranks."""

from __future__ import annotations

import signal

import pytest

from ckptsup.config import Config
from ckptsup.supervisor.job.preemption import STOP_RESERVE_S, StopKind, plan_stop, stop_kind


def test_usr1_is_a_time_limit_and_term_a_preemption() -> None:
    assert stop_kind(signal.SIGUSR1) is StopKind.TIME_LIMIT
    assert stop_kind(signal.SIGTERM) is StopKind.PREEMPTION


def test_time_limit_budget_is_the_signal_lead_minus_elapsed_stop_step_and_reserve() -> None:
    config = Config()  # signal_lead_s = 120, emergency_margin = 1.5
    plan = plan_stop(kind=StopKind.TIME_LIMIT, config=config, save_s=10.0, elapsed_s=2.0, step_p99_s=1.0)
    assert plan.window_s == 120.0
    assert plan.budget_s == pytest.approx(120.0 - 2.0 - 1.0 - STOP_RESERVE_S)
    assert plan.emergency_save and plan.save_needed_s == pytest.approx(15.0)
    assert plan.env() == {"CKPTSUP_PREEMPT_BUDGET_S": f"{plan.budget_s:.1f}"}


def test_preemption_with_30s_grace_and_a_25s_save_does_not_fit() -> None:
    plan = plan_stop(kind=StopKind.PREEMPTION, config=Config(), save_s=25.0, grace_time_s=30.0)
    assert plan.budget_s == pytest.approx(30.0 - STOP_RESERVE_S)
    assert not plan.emergency_save
    assert "does not fit" in plan.reason


def test_preemption_with_120s_grace_fits_the_same_save() -> None:
    plan = plan_stop(kind=StopKind.PREEMPTION, config=Config(), save_s=25.0, grace_time_s=120.0)
    assert plan.emergency_save and "fits" in plan.reason


def test_margin_is_applied_to_the_measured_save() -> None:
    config = Config()
    config.checkpoint.emergency_margin = 3.0
    plan = plan_stop(kind=StopKind.PREEMPTION, config=config, save_s=10.0, grace_time_s=30.0)
    assert plan.save_needed_s == 30.0 and not plan.emergency_save


def test_unknown_grace_time_means_no_budget_and_no_save() -> None:
    plan = plan_stop(kind=StopKind.PREEMPTION, config=Config(), save_s=0.1, grace_time_s=None)
    assert plan.budget_s == 0.0 and not plan.emergency_save
    assert "GraceTime unknown" in plan.reason


def test_unmeasured_save_never_fits_even_with_a_large_budget() -> None:
    plan = plan_stop(kind=StopKind.TIME_LIMIT, config=Config(), save_s=None)
    assert not plan.emergency_save and plan.save_needed_s is None
    assert plan.budget_s > 100


def test_budget_never_goes_negative_when_the_window_has_passed() -> None:
    plan = plan_stop(kind=StopKind.PREEMPTION, config=Config(), save_s=1.0, grace_time_s=30.0, elapsed_s=90.0)
    assert plan.budget_s == 0.0 and not plan.emergency_save


def test_event_fields_describe_the_decision() -> None:
    fields = plan_stop(kind=StopKind.TIME_LIMIT, config=Config(), save_s=2.0).as_event()
    assert fields["signal"] == "time_limit" and fields["emergency_save"] is True
    assert set(fields) >= {"budget_s", "window_s", "save_needed_s", "why"}
