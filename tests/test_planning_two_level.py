"""Two-level checkpointing (planning/two_level.py, the two-level simulator, `plan`/`simulate`
flags): the optimum is a minimum, the model reduces to the single-level one, the Monte-Carlo agrees
with the first-order maths, and bad flags are one line."""

import json
import math

import pytest

from ckptsup.errors import ConfigError
from ckptsup.planning import interval as iv
from ckptsup.planning import two_level as tl
from ckptsup.planning.simulate import MemoryLevel, SimInputs, simulate
from test_planning_plan import run_cli

# the mission's case: 1,024 GPUs (128 nodes) failing every 44.5 h; disk saves stall 30 s and a
# restart from disk takes 10 min; a memory save stalls 2 s, its replica is on the buddy 10 s later,
# a restart from memory takes 1 min
MISSION_MTBF = 54 * 86400 * 16384 / 466 / 1024
MISSION = tl.TwoLevelInputs(mtbf_s=MISSION_MTBF, nodes=128,
                            memory=tl.Level(stall_s=2, restart_s=60, persist_s=10),
                            disk=tl.Level(stall_s=30, restart_s=600))


def test_the_fallback_probability_is_a_buddy_failure_within_one_disk_interval_or_a_miss():
    assert tl.fallback_probability(disk_interval_s=3600, node_mtbf_s=3600 * 100) == pytest.approx(1 - math.exp(-0.01))
    assert tl.fallback_probability(disk_interval_s=3600, node_mtbf_s=1e9, miss=1.0) == 1.0
    assert tl.fallback_probability(disk_interval_s=0, node_mtbf_s=1e9, miss=0.25) == pytest.approx(0.25)


def test_the_optimum_is_a_minimum_in_both_intervals():
    best = tl.optimize(MISSION)
    k, t_m = best.memory_saves_per_disk_save, best.memory_interval_s
    assert best.disk_interval_s == pytest.approx(k * t_m)
    total = best.waste.total
    for factor in (0.9, 0.97, 1.03, 1.1):
        assert tl.waste(MISSION, memory_interval_s=t_m * factor, saves_per_disk=k).total >= total
    for other_k in (max(1, k - 5), k + 5, k * 2):
        assert tl.waste(MISSION, memory_interval_s=t_m * k / other_k, saves_per_disk=other_k).total >= total
    # the memory level takes most failures and cuts the waste several-fold against disk saves alone
    disk_only = iv.evaluate(iv.Strategy(mtbf_s=MISSION_MTBF, stall_s=30, restart_s=600)).waste.total
    assert best.fallback_probability < 0.01 and total < disk_only / 3
    assert best.memory_interval_s < iv.daly_interval(30, MISSION_MTBF).interval_s < best.disk_interval_s


def test_with_every_failure_on_disk_the_model_is_the_single_level_one():
    same = tl.TwoLevelInputs(mtbf_s=10_000, nodes=4, miss=1.0, memory=tl.Level(stall_s=30, restart_s=300),
                             disk=tl.Level(stall_s=30, restart_s=300, persist_s=20))
    two = tl.waste(same, memory_interval_s=900, saves_per_disk=1)
    one = iv.expected_waste(interval_s=900, stall_s=30, mtbf_s=10_000, restart_s=300, persist_s=20)
    assert two.total == pytest.approx(one.total)
    assert two.memory_checkpoint == 0 and two.disk_checkpoint == pytest.approx(one.checkpoint)


def test_replicas_that_take_longer_than_youngs_interval_bound_the_memory_interval():
    slow = tl.TwoLevelInputs(mtbf_s=MISSION_MTBF, nodes=128, memory=tl.Level(stall_s=0.01, restart_s=60, persist_s=600),
                             disk=tl.Level(stall_s=30, restart_s=600))
    assert tl.optimize(slow).memory_interval_s >= 600


@pytest.mark.parametrize("bad, flag", [
    (dict(miss=1.5), "--memory-miss"), (dict(nodes=0), "nodes"),
    (dict(memory=tl.Level(stall_s=0, restart_s=60)), "--memory-stall"),
    (dict(memory=tl.Level(stall_s=1, restart_s=math.inf)), "--memory-restart"),
])
def test_impossible_inputs_are_one_line(bad, flag):
    values = {"mtbf_s": 1e5, "nodes": 8, "memory": tl.Level(stall_s=1, restart_s=60),
              "disk": tl.Level(stall_s=30, restart_s=600), **bad}
    with pytest.raises(ConfigError, match=flag):
        tl.optimize(tl.TwoLevelInputs(**values))


def test_the_two_level_simulation_agrees_with_the_first_order_model():
    best = tl.optimize(MISSION)
    sim = simulate(SimInputs(interval_s=best.memory_interval_s, stall_s=30, restart_s=600, mtbf_s=MISSION_MTBF,
                             days=30, runs=4000, memory=MemoryLevel(
                                 stall_s=2, restart_s=60, persist_s=10, saves_per_disk=best.memory_saves_per_disk_save,
                                 fallback_probability=best.fallback_probability))).summary()
    assert sim["waste_fraction"] == pytest.approx(best.waste.total, rel=0.05)
    assert sim["waste_fraction"] == pytest.approx(
        sim["waste_checkpoint_fraction"] + sim["waste_rework_fraction"] + sim["waste_restart_fraction"], rel=1e-9)


def test_a_one_save_period_that_always_falls_back_is_the_single_level_simulation():
    base = dict(interval_s=3000, stall_s=30, restart_s=600, mtbf_s=MISSION_MTBF, persist_s=60, days=30, runs=4000)
    one = simulate(SimInputs(**base)).summary()
    two = simulate(SimInputs(**base, memory=MemoryLevel(stall_s=30, restart_s=600, saves_per_disk=1,
                                                       fallback_probability=1.0))).summary()
    assert two["waste_fraction"] == pytest.approx(one["waste_fraction"], abs=4 * (one["waste_stderr"] + two["waste_stderr"]))


def test_a_fallback_rolls_back_past_earlier_restarts_when_no_disk_save_was_made_since():
    # disk saves never complete (the disk period outlasts the window) and every failure falls back:
    # each failure throws away everything, so only the last segment's work is useful
    sim = simulate(SimInputs(interval_s=600, stall_s=30, restart_s=60, mtbf_s=6 * 3600, days=10, runs=200,
                             memory=MemoryLevel(stall_s=1, restart_s=60, saves_per_disk=10_000,
                                                fallback_probability=1.0)))
    assert (sim.failures > 10).all()
    assert sim.waste.mean() > 0.9
    kept = simulate(SimInputs(interval_s=600, stall_s=30, restart_s=60, mtbf_s=6 * 3600, days=10, runs=200,
                              memory=MemoryLevel(stall_s=1, restart_s=60, saves_per_disk=10_000,
                                                 fallback_probability=0.0)))
    assert kept.waste.mean() < 0.1   # the same failures resumed from memory lose little


def test_plan_json_prices_memory_saves_against_disk_saves_alone(capsys):
    code, out, _ = run_cli(capsys, "plan", "--gpus", "1024", "--failures", "466", "--over", "54d", "--on-gpus", "16384",
                           "--stall", "30s", "--restart", "10m", "--memory-stall", "2s", "--memory-restart", "1m",
                           "--memory-persist-time", "10s", "--price", "2", "--json")
    assert code == 0
    r = json.loads(out)
    t = r["two_level"]
    assert t["waste_fraction"] < r["waste_fraction"] / 3
    assert t["savings_usd_per_month_vs_disk_only"] == pytest.approx(r["lost_usd_per_month"] - t["lost_usd_per_month"])
    assert t["memory_interval_s"] < r["interval_s"] < t["disk_interval_s"]
    assert t["waste_fraction"] == pytest.approx(t["waste_memory_checkpoint_fraction"] + t["waste_disk_checkpoint_fraction"]
                                                + t["waste_rework_fraction"] + t["waste_restart_fraction"])
    code, out, _ = run_cli(capsys, "plan", "--gpus", "1024", "--mtbf", "44h", "--stall", "30s", "--restart", "10m",
                           "--memory-stall", "2s", "--memory-restart", "1m")
    assert code == 0 and "memory + disk" in out


def test_simulate_json_runs_both_levels_and_the_disk_only_baseline(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--gpus", "1024", "--mtbf", "44h", "--stall", "30s", "--restart", "10m",
                           "--memory-stall", "2s", "--memory-restart", "1m", "--runs", "2000", "--scale-to", "1024",
                           "--json")
    assert code == 0
    t = json.loads(out)["two_level"]
    assert t["waste_ratio_vs_disk_only"] < 0.5
    assert t["simulated"]["waste_fraction"] == pytest.approx(t["analytic"]["waste_fraction"], rel=0.1)


@pytest.mark.parametrize("command, args, expected", [
    ("plan", ["--memory-stall", "2s"], "--memory-stall and --memory-restart go together"),
    ("plan", ["--memory-miss", "0.1"], "need --memory-stall"),
    ("plan", ["--memory-stall", "2s", "--memory-restart", "1m", "--memory-miss", "2"], "--memory-miss"),
    ("plan", ["--memory-stall", "0", "--memory-restart", "1m"], "--memory-stall"),
    ("simulate", ["--memory-restart", "1m"], "--memory-stall and --memory-restart go together"),
    ("simulate", ["--memory-stall", "2s", "--memory-restart", "1m", "--memory-saves-per-disk", "0"],
     "--memory-saves-per-disk"),
])
def test_bad_two_level_flags_are_one_line(capsys, command, args, expected):
    code, out, err = run_cli(capsys, command, "--gpus", "1024", "--mtbf", "44h", "--stall", "30s", "--restart", "10m",
                             "--runs", "10", "--scale-to", "1024", *args) if command == "simulate" else \
        run_cli(capsys, command, "--gpus", "1024", "--mtbf", "44h", "--stall", "30s", "--restart", "10m", *args)
    assert code == 2 and expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
