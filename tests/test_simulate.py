"""Monte-Carlo: agrees with the analytic waste where C << M, with the scalar loop, and is fast."""

import json
import time

import pytest

from ckptsup.cli import main
from ckptsup.errors import ConfigError
from ckptsup.planning import interval as iv
from ckptsup.planning import simulate as sm


@pytest.mark.parametrize("stall_s, mtbf_s, restart_s, persist_s", [
    (30.0, 24 * 3600.0, 300.0, 0.0),
    (10.0, 6 * 3600.0, 120.0, 0.0),
    (5.0, 12 * 3600.0, 600.0, 60.0),
])
def test_simulated_waste_is_within_5_percent_of_analytic_when_stall_is_small(stall_s, mtbf_s, restart_s, persist_s):
    interval = iv.daly_interval(stall_s, mtbf_s).interval_s
    inp = sm.SimInputs(interval_s=interval, stall_s=stall_s, restart_s=restart_s, mtbf_s=mtbf_s,
                       persist_s=persist_s, runs=10_000, days=30, seed=3)
    sim = sm.simulate(inp).summary()["waste_fraction"]
    analytic = sm.analytic(inp)["waste_fraction"]
    assert sim == pytest.approx(analytic, rel=0.05)


def test_every_second_is_useful_stall_lost_or_restart():
    inp = sm.SimInputs(interval_s=600, stall_s=20, restart_s=100, mtbf_s=3600, persist_s=30, runs=500, days=5,
                       spares=1, replace_s=7200)
    r = sm.simulate(inp)
    assert (r.stall + r.lost + r.restart) == pytest.approx(r.waste)


def test_vectorised_and_scalar_loops_agree():
    inp = sm.SimInputs(interval_s=900, stall_s=30, restart_s=300, mtbf_s=3 * 3600, persist_s=60, runs=4000, days=10)
    vec = sm.simulate(inp).summary()["waste_fraction"]
    py = sm.simulate_python(inp, 1000)
    assert sum(py) / len(py) == pytest.approx(vec, rel=0.03)


def test_ten_thousand_30_day_runs_take_seconds():
    inp = sm.SimInputs(interval_s=800, stall_s=30, restart_s=300, mtbf_s=3 * 3600, runs=10_000, days=30)
    started = time.perf_counter()
    sm.simulate(inp)
    assert time.perf_counter() - started < 10


def test_youngs_interval_drifts_from_dalys_as_the_gang_grows():
    base = sm.SimInputs(interval_s=1000, stall_s=120, restart_s=300, mtbf_s=3600, runs=2000, days=10)
    rows = sm.extrapolate(base, gpu_mtbf_s=45000 * 3600, gang_sizes=(1024, 16384), runs=2000)
    drift = [r["interval_young_s"] / r["interval_daly_s"] for r in rows]
    assert drift[1] > drift[0] > 1
    assert rows[1]["sim_waste_daly"] <= rows[1]["sim_waste_young"] + 0.002
    assert rows[1]["analytic_waste_fraction"] > rows[0]["analytic_waste_fraction"]


def test_weibull_failures_keep_the_mean_and_change_the_spread():
    common = dict(interval_s=900, stall_s=30, restart_s=300, mtbf_s=3 * 3600, runs=3000, days=30)
    expo = sm.simulate(sm.SimInputs(**common)).summary()
    weib = sm.simulate(sm.SimInputs(**common, distribution="weibull", weibull_shape=0.7)).summary()
    assert weib["failures_per_run"] == pytest.approx(expo["failures_per_run"], rel=0.1)
    assert (weib["waste_p95"] - weib["waste_p05"]) > (expo["waste_p95"] - expo["waste_p05"])


def test_spares_cut_the_wait_for_replacement_nodes():
    common = dict(interval_s=900, stall_s=30, restart_s=300, mtbf_s=3 * 3600, runs=2000, days=30, replace_s=12 * 3600)
    none = sm.simulate(sm.SimInputs(**common, spares=0)).summary()["waste_restart_fraction"]
    some = sm.simulate(sm.SimInputs(**common, spares=8)).summary()["waste_restart_fraction"]
    assert some < none / 10


@pytest.mark.parametrize("changes", [dict(runs=0), dict(mtbf_s=0), dict(distribution="lognormal"),
                                     dict(weibull_shape=0), dict(spares=-1), dict(stall_s=-1),
                                     dict(days=float("nan")), dict(days=float("inf")), dict(restart_s=float("inf")),
                                     dict(weibull_shape=float("inf")), dict(runs=10**12), dict(spares=10**6),
                                     dict(runs=100_000, spares=4000), dict(mtbf_s=1e-3),
                                     dict(days=1e9)])
def test_bad_simulation_inputs_are_refused(changes):
    base = dict(interval_s=900, stall_s=30, restart_s=300, mtbf_s=3600)
    base.update(changes)
    with pytest.raises(ConfigError):
        sm.simulate(sm.SimInputs(**base))


def test_cli_json_reports_simulated_and_analytic_waste(capsys):
    try:
        main(["simulate", "--gpus", "1024", "--mtbf", "8h", "--stall", "30s", "--restart", "5m", "--runs", "2000",
              "--scale-to", "1024,16384", "--json"])
    except SystemExit as exit_:
        assert exit_.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulated"]["runs"] == 2000
    assert data["simulated"]["waste_fraction"] == pytest.approx(data["analytic"]["waste_fraction"], rel=0.05)
    assert [row["gpus"] for row in data["extrapolation"]] == [1024, 16384]
    assert data["young_vs_daly"]["young_over_daly"] > 1


def test_cli_refuses_a_bad_scale_list_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--mtbf", "8h", "--stall", "30s", "--restart", "5m", "--scale-to", "lots"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scale-to" in err[0]
