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
    from ckptsup.supervisor.job.interval_tuner import IntervalTuner

    config = Config()
    config.supervisor.nodes, config.supervisor.nproc_per_node, config.sbatch.gpus_per_node = 2, 3, 8
    assert IntervalTuner(config, gpus_per_node=4)._adaptive.devices == 8   # 2 nodes x the allocation's 4
    assert IntervalTuner(config)._adaptive.devices == 6                    # no GPU: 2 nodes x 3 ranks
    config.supervisor.nproc_per_node = "auto"                              # unresolved: one a node
    assert IntervalTuner(config)._adaptive.devices == 2


# ---- the memory tier's interval (AdaptiveMemoryInterval, IntervalTuner's memory level) ------------

from ckptsup.planning.adaptive import AdaptiveMemoryInterval  # noqa: E402
from ckptsup.planning.two_level import Level, memory_interval  # noqa: E402

MTBF_S = 3600.0   # a large job's: a failure an hour


def memory_saved(stall, write=0.5, ok=True):
    return {"event": "memory_saved", "step": 10, "ok": ok, "stall_s": stall, "write_s": write, "bytes": 1}


def step_progress(step_time):
    return {"event": "step_progress", "step": 100, "step_time_s": step_time}


def measured(stall, *, write=0.5, step_time=0.2, every=10, nodes=4):
    memory = AdaptiveMemoryInterval(initial_every_steps=every, nodes=nodes)
    assert memory.observe(memory_saved(stall, write)) and memory.observe(step_progress(step_time))
    return memory


def test_without_measurements_the_memory_schedule_stays_the_configured_one():
    memory = AdaptiveMemoryInterval(initial_every_steps=10, nodes=4)
    assert memory.retarget("x", mtbf_s=MTBF_S, disk_interval_s=600.0) is None
    memory.observe(memory_saved(0.05))             # a stall but no step time yet: no seconds -> steps
    assert memory.retarget("x", mtbf_s=MTBF_S, disk_interval_s=600.0) is None
    assert memory.every_steps == 10
    assert not memory.observe({"event": "launch"})  # says nothing about memory saves


def test_the_memory_interval_is_youngs_at_the_memory_levels_failure_rate_in_steps():
    memory = measured(0.05, write=0.5, step_time=0.2)
    steps, seconds, why = memory.retarget("memory_saved", mtbf_s=MTBF_S, disk_interval_s=600.0)
    young = memory_interval(memory=Level(stall_s=0.05, restart_s=0.0, persist_s=0.5), mtbf_s=MTBF_S, nodes=4,
                            disk_interval_s=600.0)
    assert steps == round(young / 0.2) and memory.every_steps == steps and seconds == pytest.approx(steps * 0.2)
    assert young < (2 * 0.05 * MTBF_S) ** 0.5 * 1.1   # a node-and-buddy loss is rare: close to plain Young
    assert "memory_saved" in why and "C_m=" in why and "Young" in why and f"{steps} steps" in why


def test_cheaper_memory_saves_and_more_failures_mean_a_shorter_memory_interval():
    cheap = measured(0.01).target(mtbf_s=MTBF_S, disk_interval_s=600.0)[0]
    dear = measured(0.2).target(mtbf_s=MTBF_S, disk_interval_s=600.0)[0]
    assert cheap < dear
    assert measured(0.2).target(mtbf_s=MTBF_S / 10, disk_interval_s=600.0)[0] < dear


def test_the_memory_interval_is_never_longer_than_the_disk_interval():
    memory = measured(0.5, write=0.0, step_time=0.2)
    steps, seconds, why = memory.retarget("x", mtbf_s=1e9, disk_interval_s=60.0)   # Young would be hours
    assert steps == 300 and seconds == pytest.approx(60.0) and "capped at the disk interval" in why
    assert memory.target(mtbf_s=1e9, disk_interval_s=60.0, disk_every_steps=50)[0] == 50   # disk saves by steps too
    assert measured(0.5, step_time=120.0).target(mtbf_s=1e9, disk_interval_s=60.0)[0] == 1  # at least every step


def test_the_write_time_bounds_how_often_a_memory_save_starts():
    # Young ~ 0.85 s, but a save due while the last one is written is skipped: every 3 s at most
    steps, _, why = measured(1e-4, write=3.0, step_time=0.1).retarget("x", mtbf_s=MTBF_S, disk_interval_s=600.0)
    assert steps == 30 and "raised to the write time" in why


def test_noise_around_a_step_boundary_does_not_flip_the_schedule():
    memory = measured(0.05, step_time=0.2)
    first = memory.retarget("x", mtbf_s=MTBF_S, disk_interval_s=600.0)[0]
    for step_time in (0.198, 0.202, 0.199, 0.201, 0.2):
        memory.observe(step_progress(step_time))
        assert memory.retarget("step_progress", mtbf_s=MTBF_S, disk_interval_s=600.0) is None
    assert memory.every_steps == first
    for _ in range(11):   # the steps got 3x slower: the same seconds are a third of the steps
        memory.observe(step_progress(0.6))
    steps = memory.retarget("step_progress", mtbf_s=MTBF_S, disk_interval_s=600.0)[0]
    assert steps == pytest.approx(first / 3, abs=1)


def test_the_supervisors_tuner_sends_the_memory_schedule_with_its_level():
    from ckptsup.config import Config
    from ckptsup.supervisor.job.interval_tuner import IntervalTuner

    config = Config()
    config.supervisor.nodes, config.supervisor.nproc_per_node = 4, 8
    config.cost.gpu_mtbf_hours = 32.0                       # 32 devices: a job MTBF of an hour
    config.memory.enabled, config.memory.every_steps = True, 10
    tuner = IntervalTuner(config)
    assert tuner.memory_every_steps() == 10
    assert tuner.observe(memory_saved(0.05)) == []          # no step time yet
    [change] = tuner.observe(step_progress(0.2))
    assert change.level == "memory" and change.every_steps == tuner.memory_every_steps() != 10
    assert change.command().to_body() == {"memory_every_steps": change.every_steps}
    assert change.event_fields()["level"] == "memory" and change.event_fields()["every_steps"] == change.every_steps
    changes = tuner.observe(commit(30.0))                   # disk first; its new interval bounds the memory one
    assert changes[0].level == "disk" and changes[0].command().to_body() == {"interval_s": round(changes[0].interval_s, 3)}
    assert tuner.memory_every_steps() * 0.2 <= tuner._adaptive.interval_s
    config.memory.enabled = False
    off = IntervalTuner(config)
    assert off.observe(memory_saved(0.05)) == [] and off.observe(step_progress(0.2)) == []
    assert off.memory_every_steps() == 10


def test_the_tuner_starts_a_requeued_run_from_the_memory_costs_it_measured():
    from ckptsup.config import Config
    from ckptsup.supervisor.job.interval_tuner import IntervalTuner
    from test_accounting import with_memory_saves

    config = Config()
    config.memory.enabled, config.memory.every_steps = True, 1
    tuner = IntervalTuner(config)
    tuner.seed(with_memory_saves())          # memory stalls of ~1 s, steps of 10 s
    assert tuner.memory_every_steps() > 1
    assert tuner._memory.nodes == 1 and list(tuner._memory.stalls) == [1.0, 1.0, 1.0, 2.0, 0.5]


def test_a_launch_carries_the_tuned_memory_schedule_so_a_relaunch_keeps_it(tmp_path):
    from ckptsup.config import Config
    from ckptsup.env import MEMORY_EVERY_STEPS, RankEnv
    from ckptsup.supervisor.job.recovery import attempt_timeouts, rank_env

    config = Config()
    args = dict(run_dir=tmp_path, config_json=tmp_path / "c.json", secret_path=tmp_path / "s", ckpt_dir=tmp_path / "ck",
                job_id="7", attempt=1, epoch=1, resume_from="", save_every_s=600.0, preempt_budget_s=0.0,
                timeouts=attempt_timeouts(config, step_times=[], save_s=None))
    assert config.memory.enabled   # on by default
    assert RankEnv.from_environ(rank_env(config, **args, memory_every_steps=7)).memory_every_steps == 7
    config.memory.enabled = False
    assert MEMORY_EVERY_STEPS not in rank_env(config, **args, memory_every_steps=7)   # no memory tier
    config.memory.enabled = True
    assert RankEnv.from_environ(rank_env(config, **args, memory_every_steps=7)).memory_every_steps == 7
    assert rank_env(config, **args)[MEMORY_EVERY_STEPS] == str(config.memory.every_steps)


# ---- issue 20 part 4: the memory interval never passes the job's real disk schedule --------------

from ckptsup.planning.adaptive import disk_cap_steps  # noqa: E402


def test_the_cap_is_the_disk_schedule_in_steps_whichever_comes_first():
    assert disk_cap_steps(disk_every_steps=20, disk_interval_s=1800.0, step_s=None) == 20    # steps need no step time
    assert disk_cap_steps(disk_every_steps=0, disk_interval_s=1800.0, step_s=None) is None   # seconds do
    assert disk_cap_steps(disk_every_steps=0, disk_interval_s=6.0, step_s=0.3) == 20         # 6.0 / 0.3 = 19.999...
    assert disk_cap_steps(disk_every_steps=20, disk_interval_s=3.0, step_s=0.3) == 10        # the time schedule is sooner
    assert disk_cap_steps(disk_every_steps=20, disk_interval_s=21600.0, step_s=0.3) == 20    # the step schedule is sooner
    assert disk_cap_steps(disk_every_steps=0, disk_interval_s=1.0, step_s=5.0) == 1          # at least every step
    assert disk_cap_steps(disk_every_steps=0, disk_interval_s=float("inf"), step_s=0.3) is None


def test_a_disk_step_schedule_caps_the_tuned_memory_interval_the_issues_848():
    # Young's at a small job's MTBF is hours; the disk tuner's own Daly interval (6 h) would allow
    # 848+ steps, but the job saves to disk every 20: a memory save must come at least as often
    memory = measured(0.05, write=0.01, step_time=0.3, nodes=2)
    assert memory.target(mtbf_s=1e8, disk_interval_s=21600.0)[0] > 848
    steps, seconds, why = memory.retarget("step_progress", mtbf_s=1e8, disk_interval_s=21600.0, disk_every_steps=20)
    assert (steps, memory.every_steps) == (20, 20) and seconds == pytest.approx(6.0) and "capped" in why


def test_before_any_measurement_the_default_count_is_held_to_a_shorter_disk_step_schedule():
    memory = AdaptiveMemoryInterval(initial_every_steps=10, nodes=2)
    assert memory.retarget("hello", mtbf_s=MTBF_S, disk_interval_s=1800.0, disk_every_steps=20) is None   # 10 <= 20
    steps, seconds, why = memory.retarget("hello", mtbf_s=MTBF_S, disk_interval_s=1800.0, disk_every_steps=4)
    assert (steps, seconds, memory.every_steps) == (4, None, 4) and "every 4 steps" in why   # no step time: no seconds
    assert memory.retarget("hello", mtbf_s=MTBF_S, disk_interval_s=1800.0, disk_every_steps=4) is None


def small_job_tuner(provenance=None, **checkpoint):
    from ckptsup.config import Config
    from ckptsup.supervisor.job.interval_tuner import IntervalTuner

    config = Config()
    config.supervisor.nodes, config.supervisor.nproc_per_node = 2, 1   # MTBF of years: Young's is hours
    config.memory.enabled = True
    for key, value in checkpoint.items():
        setattr(config.checkpoint, key, value)
    return IntervalTuner(config, provenance=provenance)


def feed(tuner, *events):
    return [change for event in events for change in tuner.observe(event)]


def test_the_tuner_caps_the_memory_schedule_at_the_save_every_steps_a_rank_says_in_its_hello():
    # the supervisor's config does not know attach(save_every_steps=20): only the hello says it
    unaware = small_job_tuner()
    feed(unaware, memory_saved(0.05, 0.01), step_progress(0.3))
    assert unaware.memory_every_steps() > 20        # what the issue's relaunch got (848)
    tuner = small_job_tuner()
    assert tuner.learn_schedule({"rank": 0, "save_every_steps": 20, "save_every_s": 1800.0}) == \
        {"rank_save_every_steps": 20, "rank_save_every_s": 1800.0}
    assert tuner.retune("hello") == []              # the default 10 is within 20 steps
    changes = feed(tuner, memory_saved(0.05, 0.01), step_progress(0.3), commit(0.5))
    assert [c.every_steps for c in changes if c.level == "memory"] == [20]
    assert tuner.memory_every_steps() == 20         # what the next launch's CKPTSUP_MEMORY_EVERY_STEPS says


def test_a_schedule_learned_after_the_tuning_brings_the_memory_schedule_back_under_it():
    tuner = small_job_tuner()
    feed(tuner, memory_saved(0.05, 0.01), step_progress(0.3))
    assert tuner.memory_every_steps() > 20
    tuner.learn_schedule({"save_every_steps": 20})
    [change] = tuner.retune("hello")
    assert change.level == "memory" and change.every_steps == 20 == tuner.memory_every_steps()
    assert change.command().to_body() == {"memory_every_steps": 20}


def test_a_time_based_disk_schedule_caps_it_in_steps_and_follows_the_disk_tuner():
    tuner = small_job_tuner()
    tuner.learn_schedule({"save_every_steps": 0, "save_every_s": 6.0})   # attach(save_every_s=6)
    feed(tuner, memory_saved(0.05, 0.01), step_progress(0.3))
    assert tuner.memory_every_steps() == 20                               # 6 s of 0.3 s steps
    disk = feed(tuner, commit(0.5))                                       # Daly: hours; the ranks take it
    assert disk[0].level == "disk" and tuner.memory_every_steps() > 20


def test_the_config_step_schedule_caps_the_first_launch_before_any_hello():
    tuner = small_job_tuner(save_every_steps=4)
    assert tuner.memory_every_steps() == 4


def test_a_malformed_schedule_in_a_hello_is_ignored():
    from ckptsup.supervisor.job.interval_tuner import rank_schedule

    for body in ({}, {"save_every_steps": True, "save_every_s": False}, {"save_every_steps": -1, "save_every_s": 0},
                 {"save_every_steps": 2.5, "save_every_s": float("nan")}, {"save_every_steps": "20", "save_every_s": "6"},
                 {"save_every_steps": 10**12, "save_every_s": 1e30}, {"save_every_steps": None, "save_every_s": None}):
        assert rank_schedule(body) == {}, body
    assert rank_schedule({"save_every_steps": 0, "save_every_s": 30}) == {"save_every_steps": 0, "save_every_s": 30.0}
    tuner = small_job_tuner(save_every_steps=4)
    assert tuner.learn_schedule({"save_every_steps": "x"}) == {} and tuner.memory_every_steps() == 4


@pytest.mark.parametrize("source", ["site:/etc/ckptsup/site.toml", "job:/job.toml", "flag memory.every_steps", "env"])
def test_an_every_steps_the_user_set_wins_over_the_tuner(source):
    tuner = small_job_tuner({"memory.every_steps": source})
    tuner.learn_schedule({"save_every_steps": 5})
    assert tuner.retune("hello") == []
    assert feed(tuner, memory_saved(0.05, 0.01), step_progress(0.3), memory_saved(0.01, 0.0)) == []
    assert tuner.memory_every_steps() == 10          # the configured count, untouched


def test_the_shipped_default_toml_is_the_built_in_default_so_the_tuner_moves_it():
    from ckptsup.config import shipped_default_config

    tuner = small_job_tuner({"memory.every_steps": f"site:{shipped_default_config()}"})
    tuner.learn_schedule({"save_every_steps": 5})
    assert [c.every_steps for c in tuner.retune("hello")] == [5]


@pytest.mark.parametrize("earlier", [[], [step_progress(0.3)]], ids=["no-events", "no-memory-save-measured"])
def test_the_next_allocation_starts_under_the_kept_disk_schedule_before_any_memory_save_is_measured(earlier):
    # state.json kept the ranks' 4 steps; without a measured memory save the seed has no target,
    # so the first launch must still not say the default 10
    tuner = small_job_tuner()
    tuner.learn_schedule({"save_every_steps": 4})
    tuner.seed(earlier)
    assert tuner.memory_every_steps() == 4
