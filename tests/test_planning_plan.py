"""`ckptsup plan`: the pure plan() result and the command line (JSON keys, one-line refusals)."""

import json

import pytest

from ckptsup.cli import main
from ckptsup.errors import ConfigError
from ckptsup.planning import interval as iv
from ckptsup.planning.plan import PlanInputs, plan

REQUIRED_KEYS = {
    "job_mtbf_s", "interval_young_s", "interval_daly_s", "waste_fraction", "waste_checkpoint_fraction",
    "waste_rework_fraction", "waste_restart_fraction", "paid_usd_per_month", "lost_usd_per_month",
    "storage_bytes", "write_bandwidth_bytes_per_s", "recommended_spares",
}


def run_cli(capsys, *args):
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prices_the_waste_at_daly_interval():
    r = plan(PlanInputs(gpus=1024, mtbf_s=4 * 3600, stall_s=30, restart_s=300, price_per_gpu_hour=2.5,
                        ckpt_size_bytes=140e9, upload_s=600))
    daly = iv.daly_interval(30, 4 * 3600).interval_s
    assert r["interval_daly_s"] == pytest.approx(daly)
    assert r["waste_fraction"] == pytest.approx(30 / daly + (daly / 2 + 300) / (4 * 3600))
    assert r["waste_fraction"] == pytest.approx(
        r["waste_checkpoint_fraction"] + r["waste_rework_fraction"] + r["waste_restart_fraction"])
    assert r["paid_usd_per_month"] == pytest.approx(1024 * 730 * 2.5)
    assert r["lost_usd_per_month"] == pytest.approx(r["waste_fraction"] * 1024 * 730 * 2.5)
    assert r["storage_bytes"] == pytest.approx(140e9 * 17)  # keep 3 last + 14 daily
    assert r["write_bandwidth_bytes_per_s"] == pytest.approx(140e9 / 600)


def test_persist_time_adds_to_the_rework_term_only():
    sync = plan(PlanInputs(gpus=64, mtbf_s=3600, stall_s=5, restart_s=60))
    async_ = plan(PlanInputs(gpus=64, mtbf_s=3600, stall_s=5, restart_s=60, persist_s=120))
    assert async_["waste_rework_fraction"] - sync["waste_rework_fraction"] == pytest.approx(120 / 3600)
    assert async_["waste_checkpoint_fraction"] == sync["waste_checkpoint_fraction"]


def test_failure_record_is_scaled_to_the_gang():
    r = plan(PlanInputs(gpus=8192, failures=419, over_s=54 * 86400, on_gpus=16384, stall_s=30, restart_s=300))
    assert r["job_mtbf_s"] == pytest.approx(54 * 86400 * 16384 / 419 / 8192)


def test_compare_shows_what_async_buys():
    r = plan(PlanInputs(gpus=2048, mtbf_s=2 * 3600, stall_s=5, persist_s=60, restart_s=300,
                        compare_stall_s=300, ckpt_size_bytes=1e12))
    cmp = r["compare"]
    assert REQUIRED_KEYS <= set(cmp)
    assert cmp["waste_fraction"] > r["waste_fraction"]
    assert r["savings_usd_per_month_vs_compare"] == pytest.approx(cmp["lost_usd_per_month"] - r["lost_usd_per_month"])


def test_stall_past_twice_the_mtbf_follows_the_t_equals_m_branch_with_a_warning():
    r = plan(PlanInputs(gpus=8, mtbf_s=600, stall_s=1800, restart_s=60))
    assert r["interval_daly_s"] == 600
    assert any("T = M" in w for w in r["warnings"])
    assert r["waste_fraction"] == 1.0


def test_spot_fields_say_whether_spot_pays_and_the_break_even():
    r = plan(PlanInputs(gpus=64, mtbf_s=45000 * 3600 / 64, stall_s=10, restart_s=120,
                        spot_discount=0.6, preemptions_per_node_day=0.2))
    assert r["spot_pays"] is True
    assert r["spot_break_even_gpus"] >= 64
    assert r["spot_job_mtbf_s"] < r["job_mtbf_s"]
    big = plan(PlanInputs(gpus=r["spot_break_even_gpus"] + 8 * 64, mtbf_s=45000 * 3600 / (r["spot_break_even_gpus"] + 512),
                          stall_s=10, restart_s=120, spot_discount=0.6, preemptions_per_node_day=0.2))
    assert big["spot_pays"] is False


@pytest.mark.parametrize("changes, fragment", [
    (dict(gpus=4), "fewer than one node"),
    (dict(stall_s=0), "--stall"),
    (dict(restart_s=-1), "--restart"),
    (dict(mtbf_s=None), "no failure rate"),
    (dict(failures=3), "not both"),
    (dict(mtbf_s=None, failures=3), "go together"),
    (dict(keep_last=0), "--keep-last"),
    (dict(spot_discount=0.5), "go together"),
    (dict(spot_discount=1.5, preemptions_per_node_day=1), "between 0 and 1"),
    (dict(gpus_per_node=0), "--gpus-per-node"),
])
def test_impossible_plans_are_refused_with_one_line(changes, fragment):
    base = dict(gpus=64, mtbf_s=3600.0, stall_s=10.0, restart_s=60.0)
    base.update(changes)
    with pytest.raises(ConfigError) as info:
        plan(PlanInputs(**base))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_cli_json_has_every_documented_key(capsys):
    code, out, _ = run_cli(capsys, "plan", "--gpus", "16384", "--failures", "419", "--over", "54d",
                           "--on-gpus", "16384", "--ckpt-size", "14TB", "--stall", "30s", "--restart", "5m",
                           "--persist-time", "1m", "--compare-stall", "5m", "--price", "2",
                           "--spot-discount", "0.6", "--preemptions-per-node-day", "0.05", "--json")
    assert code == 0
    data = json.loads(out)
    assert REQUIRED_KEYS <= set(data) and REQUIRED_KEYS <= set(data["compare"])
    assert {"spot_pays", "spot_break_even_gpus"} <= set(data)
    assert data["job_mtbf_s"] / 3600 == pytest.approx(3.09, rel=0.01)


def test_cli_table_renders(capsys):
    code, out, _ = run_cli(capsys, "plan", "--gpus", "1024", "--mtbf", "8h", "--stall", "30s", "--restart",
                           "5m", "--ckpt-size", "140GB", "--price", "2", "--compare-stall", "4m")
    assert code == 0
    assert "Daly interval" in out and "lost per month" in out and "hot spares" in out


def test_cli_uses_the_site_price_and_prior_when_not_given(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site.toml"
    site.write_text("[cost]\nprice_per_gpu_hour = 3.0\ngpu_mtbf_hours = 10000.0\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    code, out, err = run_cli(capsys, "plan", "--gpus", "80", "--stall", "30s", "--restart", "5m", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["price_per_gpu_hour"] == 3.0
    assert data["job_mtbf_s"] == pytest.approx(10000 * 3600 / 80)


@pytest.mark.parametrize("args, fragment", [
    (["--gpus", "4", "--mtbf", "3h"], "fewer than one node"),
    (["--gpus", "16", "--mtbf", "3x"], "unknown unit"),
    (["--gpus", "16", "--mtbf", "0h"], "greater than zero"),
    (["--gpus", "16", "--mtbf", "-3h"], "negative"),
    (["--gpus", "16", "--mtbf", "3h", "--ckpt-size", "3 parsecs"], "unknown unit"),
    (["--gpus", "16", "--mtbf", "3h", "--failures", "2", "--over", "1d", "--on-gpus", "8"], "not both"),
])
def test_cli_refusals_are_one_line_with_exit_status_2(capsys, args, fragment):
    code, out, err = run_cli(capsys, "plan", *args, "--stall", "30s", "--restart", "5m", "--price", "2")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("ckptsup: error:")
    assert out == ""


@pytest.mark.parametrize("args, fragment", [
    (["plan", "--gpus", "abc", "--stall", "1s", "--restart", "1s"], "not a valid integer"),
    (["plan", "--gpus", "8", "--mtbf", "1h", "--restart", "1s"], "Missing option '--stall'"),
    (["plan", "--gpus", "8", "--mtbf", "1h", "--stall", "1s", "--restart", "1s", "--bogus", "3"], "No such option"),
    (["simulate", "--stall", "1s"], "Missing option '--restart'"),
    (["report"], "Missing argument 'RUN_DIR'"),
])
def test_usage_errors_are_one_line_too(capsys, args, fragment):
    code, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0] and "--help" in lines[0]


def test_plan_prices_continuing_on_one_node_fewer_against_a_requeue():
    # 3 nodes, one lost: 30 s restart + 1/3 of a 30 min horizon = 630 s < 15 min queue + 30 s = 930 s
    base = dict(gpus=24, gpus_per_node=8, mtbf_s=6 * 3600, stall_s=5, restart_s=30, price_per_gpu_hour=2.0,
                min_nodes=2, queue_wait_s=900.0)
    r = plan(PlanInputs(**base, shrink_horizon_s=1800.0))["shrink"]
    assert (r["nodes"], r["survivors"], r["allowed"], r["choice"]) == (3, 2, True, "continue")
    assert r["continue_cost_s"] == pytest.approx(630.0) and r["requeue_cost_s"] == pytest.approx(930.0)
    assert r["break_even_horizon_s"] == pytest.approx(2700.0)   # (930 - 30) x 3 / 1
    assert r["continue_usd"] == pytest.approx(630 * 24 * 2.0 / 3600)
    assert r["saved_usd_per_lost_node"] == pytest.approx(300 * 24 * 2.0 / 3600)
    longer = plan(PlanInputs(**base, shrink_horizon_s=3600.0))["shrink"]   # past the break-even: requeue
    assert longer["choice"] == "requeue" and longer["continue_cost_s"] == pytest.approx(1230.0)
    floor = plan(PlanInputs(**{**base, "min_nodes": 3}, shrink_horizon_s=60.0))["shrink"]
    assert (floor["allowed"], floor["choice"], floor["saved_usd_per_lost_node"]) == (False, "requeue", 0.0)
    assert "shrink" not in plan(PlanInputs(gpus=24, mtbf_s=6 * 3600, stall_s=5, restart_s=30))
    slow_start = plan(PlanInputs(**base, shrink_horizon_s=3600.0, requeue_restart_s=400.0))["shrink"]
    assert slow_start["requeue_cost_s"] == pytest.approx(1300.0) and slow_start["choice"] == "continue"


def test_cli_prices_fewer_nodes_with_the_config_knobs_by_default(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site.toml"
    site.write_text("[supervisor]\nrequeue_wait_s = 120.0\nshrink_horizon_s = 60.0\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    code, out, _ = run_cli(capsys, "plan", "--gpus", "24", "--mtbf", "6h", "--stall", "5s", "--restart", "10s",
                           "--price", "2", "--min-nodes", "2", "--json")
    shrink = json.loads(out)["shrink"]
    assert code == 0 and (shrink["queue_wait_s"], shrink["horizon_s"]) == (120.0, 60.0) and shrink["choice"] == "continue"
    code, out, _ = run_cli(capsys, "plan", "--gpus", "24", "--mtbf", "6h", "--stall", "5s", "--restart", "10s",
                           "--price", "2", "--min-nodes", "2", "--queue-wait", "1s", "--shrink-horizon", "1h")
    assert code == 0 and "requeue" in out and "a node lost with no spare left" in out


@pytest.mark.parametrize("args, fragment", [
    (["--min-nodes", "4"], "--min-nodes 4 must be at least 1 and at most the job's 3 nodes"),
    (["--min-nodes", "0"], "--min-nodes 0 must be at least 1"),
    (["--queue-wait", "5m"], "--queue-wait, --shrink-horizon and --requeue-restart price fewer nodes: give --min-nodes"),
    (["--requeue-restart", "5m"], "give --min-nodes N with them"),
    (["--min-nodes", "2", "--shrink-horizon", "0"], "--shrink-horizon"),
])
def test_cli_fewer_nodes_refusals_are_one_line(capsys, args, fragment):
    code, out, err = run_cli(capsys, "plan", "--gpus", "24", "--mtbf", "6h", "--stall", "5s", "--restart", "10s",
                             "--price", "2", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
