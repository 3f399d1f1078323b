"""Timeout tuning: the supervisor's hang timeout and the exported TORCH_NCCL_* / collective
timeouts stay consistent (the supervisor's detection always fires first)."""

from __future__ import annotations

import pytest

from ckptsup.config import Config
from ckptsup.env import NAMES
from ckptsup.supervisor.job import nccl


def cfg(**sections) -> Config:
    config = Config()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config


# the save and hang terms of the collective timeout, without the busy limit above them
QUICK = {"busy_limit_s": 1.0}


def test_auto_hang_timeout_is_floor_before_any_step_is_measured() -> None:
    assert nccl.derive_timeouts(Config(), step_times=[]).hang.s == 10.0


def test_auto_hang_timeout_is_three_times_p99_step_when_that_is_larger() -> None:
    steps = [1.0] * 98 + [5.0, 6.0]  # p99 (nearest rank) = 5.0
    assert nccl.derive_timeouts(Config(), step_times=steps).hang.s == pytest.approx(15.0)


def test_auto_hang_timeout_ignores_non_finite_and_negative_samples() -> None:
    assert nccl.derive_timeouts(Config(), step_times=[float("nan"), float("inf"), -1.0, 0.5]).hang.s == 10.0


def test_configured_hang_timeout_wins_over_auto() -> None:
    assert nccl.derive_timeouts(cfg(supervisor={"hang_timeout_s": 12.0}), step_times=[100.0]).hang.s == 12.0


def test_steady_collective_timeout_exceeds_hang_and_save_deadlines_by_the_dump_margin() -> None:
    config = cfg(supervisor={"hang_min_s": 30.0, **QUICK})
    t = nccl.derive_timeouts(config, step_times=[0.2] * 50, save_times=[4.0, 6.0])
    assert t.hang.s == 30.0
    assert t.save_allowance_s == pytest.approx(30.0)  # 3 x 6 s = 18 s < hang
    margin = 2 * config.supervisor.heartbeat_interval_s + nccl.DUMP_WAIT_S + config.supervisor.kill_grace_s
    assert t.collective_s == pytest.approx(max(t.hang.s, t.save_allowance_s) + margin)
    assert t.collective_s > t.hang.s + t.dump_wait_s + config.supervisor.kill_grace_s
    assert t.collective_s < 600  # far below NCCL's 10 min default


def test_slow_saves_raise_the_save_allowance_and_the_collective_timeout_with_it() -> None:
    t = nccl.derive_timeouts(cfg(supervisor=QUICK), step_times=[0.2] * 50, save_times=[40.0])
    assert t.save_allowance_s == pytest.approx(120.0)
    assert t.collective_s == pytest.approx(120.0 + t.margin_s)


def test_save_allowance_is_capped_by_save_timeout() -> None:
    t = nccl.derive_timeouts(cfg(supervisor={"save_timeout_s": 100.0}), step_times=[1.0], save_times=[500.0])
    assert t.save_allowance_s == 100.0
    assert t.collective_s > 100.0


def test_without_measured_steps_the_steady_timeout_equals_the_init_timeout() -> None:
    t = nccl.derive_timeouts(Config())
    assert t.collective_s == t.collective_init_s
    assert any("no step measured" in n for n in t.notes)


def test_init_collective_timeout_is_lifted_above_init_and_load_allowances() -> None:
    config = cfg(nccl={"collective_timeout_init_s": 60.0}, supervisor={"load_timeout_s": 400.0})
    t = nccl.derive_timeouts(config, step_times=[0.1])
    assert t.collective_init_s == pytest.approx(400.0 + t.margin_s)
    assert any("collective_timeout_init_s" in n for n in t.notes)


def test_explicit_steady_timeout_below_the_hang_timeout_is_lifted_with_a_note() -> None:
    config = cfg(nccl={"collective_timeout_s": 10.0}, supervisor={"hang_timeout_s": 40.0, **QUICK})
    t = nccl.derive_timeouts(config, step_times=[0.1], save_times=[1.0])
    assert t.collective_s == pytest.approx(40.0 + t.margin_s)
    assert any("lifted" in n for n in t.notes)


def test_before_any_save_is_measured_the_steady_timeout_covers_the_full_save_allowance() -> None:
    t = nccl.derive_timeouts(cfg(supervisor=QUICK), step_times=[0.1])
    assert t.save_allowance_s == Config().supervisor.save_timeout_s
    assert t.collective_s == pytest.approx(t.save_allowance_s + t.margin_s)


def test_explicit_steady_timeout_above_the_floor_is_kept() -> None:
    t = nccl.derive_timeouts(cfg(nccl={"collective_timeout_s": 900.0}), step_times=[0.1], save_times=[1.0])
    assert t.collective_s == 900.0 and not any(n.startswith("collective_timeout_s") for n in t.notes)


def test_the_collective_timeout_outlasts_the_busy_limit() -> None:
    """Ranks waiting in a barrier while rank 0 evaluates are busy, not hung (liveness.py): torch's
    timeout must not end them before the supervisor's busy_limit_s would."""
    config = Config()
    t = nccl.derive_timeouts(config, step_times=[0.1] * 50, save_times=[1.0])
    assert t.hang.s == 10.0 and t.save_allowance_s == 10.0
    assert t.collective_s == pytest.approx(config.supervisor.busy_limit_s + t.margin_s)
    t = nccl.derive_timeouts(cfg(supervisor={"busy_limit_s": 1200.0}), step_times=[0.1], save_times=[1.0])
    assert t.collective_s == pytest.approx(1200.0 + t.margin_s)


@pytest.mark.parametrize("p99", [0.01, 0.5, 3.0, 20.0, 90.0])
def test_ordering_holds_for_any_step_time(p99: float) -> None:
    t = nccl.derive_timeouts(Config(), step_times=[p99] * 10, save_times=[p99 * 2])
    assert p99 < t.hang.s < t.collective_s
    assert t.save_allowance_s < t.collective_s
    assert t.collective_init_s > Config().supervisor.init_timeout_s


def test_env_sets_both_torch_nccl_and_torch_fr_names_into_the_run_dir(tmp_path) -> None:
    env = nccl.nccl_env(Config(), run_dir=tmp_path, attempt=3, step_times=[0.2], save_times=[1.0])
    fr = str(tmp_path / "attempt-3" / "flight_recorder" / "rank_")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == fr
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"
    assert env["CKPTSUP_FR_DUMP_DIR"] == str(tmp_path / "attempt-3" / "flight_recorder")
    assert all(isinstance(v, str) for v in env.values())
    for name in env:
        if name.startswith("CKPTSUP_"):
            assert name in NAMES, f"{name} missing from env.py"


def test_env_collective_timeouts_parse_and_match_the_derivation(tmp_path) -> None:
    t = nccl.derive_timeouts(Config(), step_times=[0.3] * 20, save_times=[2.0])
    env = nccl.nccl_env(Config(), run_dir=tmp_path, attempt=0, timeouts=t)
    assert float(env["CKPTSUP_COLLECTIVE_TIMEOUT_S"]) == pytest.approx(t.collective_s, abs=1e-3)
    assert float(env["CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S"]) == pytest.approx(t.collective_init_s, abs=1e-3)
    assert int(env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) == int(t.dump_wait_s * 1000)


def test_flight_recorder_off_disables_dump_on_timeout(tmp_path) -> None:
    env = nccl.nccl_env(cfg(nccl={"flight_recorder_entries": 0}), run_dir=tmp_path, attempt=0)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_FR_BUFFER_SIZE"] == "0"


def test_async_error_handling_1_with_flight_recorder_gets_a_warning_note() -> None:
    t = nccl.derive_timeouts(cfg(nccl={"async_error_handling": 1}))
    assert any("pytorch#121055" in n for n in t.notes)


def test_derived_rows_show_every_exported_variable_with_its_origin() -> None:
    rows = nccl.derived_rows(Config(), step_times=[0.2], save_times=[1.0])
    keys = {r["key"] for r in rows}
    assert {"env TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "env TORCH_FR_BUFFER_SIZE", "env CKPTSUP_COLLECTIVE_TIMEOUT_S",
            "supervisor.hang_timeout_s (effective)"} <= keys
    assert all(r["source"] for r in rows)


def test_hang_cap_keeps_the_supervisor_first_if_steps_slow_down_mid_attempt() -> None:
    config = cfg(supervisor={"hang_min_s": 30.0, "hang_step_factor": 10.0, **QUICK})
    t = nccl.derive_timeouts(config, step_times=[0.2] * 20, save_times=[1.0])  # launched: hang 30 s
    later_hang = nccl.derive_timeouts(config, step_times=[5.0] * 20).hang.s  # steps slowed to 5 s: auto hang 50 s
    assert later_hang > t.hang_cap_s  # unclamped, torch's timeout would fire first
    assert min(later_hang, t.hang_cap_s) + t.margin_s <= t.collective_s
