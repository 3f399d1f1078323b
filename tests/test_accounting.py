"""Goodput accounting on hand-written event logs with known answers.

The main log (see `faulted_run`): 2 active nodes x 4 GPUs + 1 hot spare node; a crash, an
in-allocation restart, a preemption with an emergency checkpoint, a requeue (written by a
requeuer on another host, whose monotonic clock is unrelated), 300 s in the queue, and a second
attempt on another host that resumes and completes. Times below are seconds after T0.

As the hooks write them, `step_progress.step` / `first_step.step` are 0-based indices of the step
just completed (index 19 done = 20 steps done) and a checkpoint's `step` / `resume_step` count
steps done; step 19 completes at t=260, so a resume from checkpoint 20 loses everything after 260.
"""

import datetime as dt
import json

import pytest

from ckptsup.events import EVENTS_FILE, read_events
from ckptsup.planning.accounting import CATEGORIES, account

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def ev(t, name, *, attempt, mono_base, job="J1", **fields):
    return {"event": name, "ts": (T0 + dt.timedelta(seconds=t)).isoformat(), "mono": mono_base + t,
            "job_id": job, "attempt": attempt, **fields}


def faulted_run():
    a1 = dict(attempt=1, mono_base=1000.0)
    a2 = dict(attempt=2, mono_base=50_000.0 - 1230)  # another host: its own monotonic clock
    return [
        ev(0, "supervisor_start", **a1),
        ev(0, "allocation", nodes=2, gpus_per_node=4, spares=1, **a1),
        ev(0, "launch", nodes=2, path="initial", **a1),
        ev(60, "first_step", step=0, **a1),                       # startup 60 s
        ev(160, "step_progress", step=9, step_time_s=10.0, **a1),
        ev(260, "step_progress", step=19, step_time_s=10.0, **a1),
        ev(265, "checkpoint_committed", step=20, stall_s=5.0, write_s=4.0, bytes=1_000_000, **a1),
        ev(365, "step_progress", step=29, step_time_s=10.0, **a1),
        ev(465, "step_progress", step=39, step_time_s=10.0, **a1),
        # crash at 500, detected at 520; work after step 20 (t=260) is lost
        ev(520, "failure_detected", kind="crash", node="n2", rank=5, detect_s=20.0, **a1),
        ev(600, "restart_done", restart_s=80.0, resume_step=20,
           phases={"kill_s": 10.0, "health_s": 15.0, "launch_s": 20.0, "rendezvous_s": 5.0, "load_s": 20.0,
                   "first_step_s": 10.0}, **a1),
        ev(700, "step_progress", step=29, step_time_s=10.0, **a1),
        ev(705, "checkpoint_committed", step=30, stall_s=5.0, write_s=4.0, bytes=1_000_000, **a1),
        ev(805, "step_progress", step=39, step_time_s=10.0, **a1),
        # preempted at 900; emergency checkpoint of step 49 (reached at 895), requeue at 930
        ev(900, "failure_detected", kind="preempted", node="n1", rank=0, detect_s=0.0, **a1),
        ev(910, "checkpoint_committed", step=49, stall_s=10.0, write_s=8.0, bytes=1_000_000, **a1),
        {**ev(930, "requeue", reason="preempted", **a1), "mono": 7.0},  # the requeuer's own clock
        # 300 s in the queue, then attempt 2 on another host, without the spare
        ev(1230, "supervisor_start", **a2),
        ev(1230, "allocation", nodes=2, gpus_per_node=4, spares=0, **a2),
        ev(1320, "restart_done", restart_s=90.0, resume_step=49,
           # the requeued job's agents started in containers: 12 s of the 30 before its ranks said hello
           phases={"container_s": 12.0, "launch_s": 18.0, "rendezvous_s": 10.0, "load_s": 40.0, "first_step_s": 10.0},
           **a2),
        ev(1420, "step_progress", step=58, step_time_s=10.0, **a2),
        ev(1425, "checkpoint_committed", step=59, stall_s=5.0, write_s=4.0, bytes=1_000_000, **a2),
        ev(1525, "step_progress", step=68, step_time_s=10.0, **a2),
        ev(1530, "run_complete", **a2),
    ]


# device-seconds, worked by hand (8 active devices; 4 spare devices during attempt 1)
EXPECTED = {
    "useful": (200 + 290 + 205) * 8,        # steps 0-20, 20-49 (minus stall), 49-69 (minus stall)
    "checkpoint_stall": (5 + 5 + 10 + 5) * 8,
    "memory_stall": 0,
    "lost_progress": (235 + 5) * 8,         # 260->500 minus the 5 s stall; 895->900
    "detection": 20 * 8,
    "restart_kill": 10 * 8, "restart_health": 15 * 8, "restart_container": 12 * 8, "restart_launch": (20 + 18) * 8,
    "restart_rendezvous": (5 + 10) * 8, "restart_load": (20 + 40) * 8, "restart_first_step": (10 + 10) * 8,
    "startup": 60 * 8,
    "teardown": 20 * 8,                     # 900->930 minus the 10 s emergency stall
    "idle_spares": 4 * 930,
    "other": 0,
}
PAID = (8 + 4) * 930 + 8 * 300


def test_known_log_splits_paid_time_exactly_by_category():
    acc = account(faulted_run())
    assert acc.paid_device_s == pytest.approx(PAID)
    assert acc.useful_device_s == pytest.approx(EXPECTED["useful"])
    for category in CATEGORIES:
        assert acc.badput_device_s[category] == pytest.approx(EXPECTED[category]), category
    assert acc.useful_device_s + sum(acc.badput_device_s.values()) == pytest.approx(acc.paid_device_s, rel=1e-12)


def with_memory_saves():
    """faulted_run with memory saves (rank 0's memory_saved, written after the bundle reached the
    agent, write_s after the stall): two before the crash's resume point (t=260), one after it, one
    in the restarted span, and a failed one in attempt 2 — its stall was paid all the same."""
    a1, a2 = dict(attempt=1, mono_base=1000.0), dict(attempt=2, mono_base=50_000.0 - 1230)
    saves = [ev(112, "memory_saved", step=6, ok=True, stall_s=1.0, write_s=2.0, bytes=10, **a1),
             ev(212, "memory_saved", step=16, ok=True, stall_s=1.0, write_s=2.0, bytes=10, **a1),
             ev(312, "memory_saved", step=26, ok=True, stall_s=1.0, write_s=2.0, bytes=10, **a1),
             ev(762, "memory_saved", step=36, ok=True, stall_s=2.0, write_s=2.0, bytes=10, **a1),
             ev(1472, "memory_saved", step=64, ok=False, stall_s=0.5, write_s=0.1, bytes=0, reason="agent gone", **a2)]
    events = faulted_run()
    for save in saves:
        at = next(i for i, e in enumerate(events) if e["ts"] > save["ts"])
        events.insert(at, save)
    return events


def test_memory_save_stalls_are_their_own_overhead_and_priced_like_disk_stalls():
    acc = account(with_memory_saves())
    assert acc.badput_device_s["memory_stall"] == pytest.approx((1 + 1 + 1 + 2 + 0.5) * 8)
    # the stall after the resume point was lost time before; now it is memory stall, once
    assert acc.badput_device_s["lost_progress"] == pytest.approx((235 - 1 + 5) * 8)
    assert acc.useful_device_s == pytest.approx(EXPECTED["useful"] - (1 + 1 + 2 + 0.5) * 8)
    for category in CATEGORIES:
        if category not in ("memory_stall", "lost_progress"):
            assert acc.badput_device_s[category] == pytest.approx(EXPECTED[category]), category
    assert acc.useful_device_s + sum(acc.badput_device_s.values()) == pytest.approx(PAID, rel=1e-12)
    data = acc.to_dict(price_per_gpu_hour=3.6)
    assert data["badput_usd"]["memory_stall"] == pytest.approx(5.5 * 8 / 3600 * 3.6)
    assert data["measured_memory_stall_s"] == pytest.approx(5.5 / 5) and data["memory_saves"] == 5
    assert data["measured_memory_write_s"] == pytest.approx(2.0)    # the successful saves' writes
    assert data["measured_stall_s"] == pytest.approx(25 / 4)         # the disk's own, unchanged


def test_queue_time_after_a_requeue_is_reported_and_not_paid():
    acc = account(faulted_run())
    assert acc.queue_s == pytest.approx(300)
    assert acc.wall_s == pytest.approx(930 + 300)
    assert acc.requeues == 1 and acc.attempts == 2 and acc.end_reason == "run_complete"


def test_observed_mtbf_and_measured_costs():
    data = account(faulted_run()).to_dict(price_per_gpu_hour=3.6)
    assert data["failures"] == {"crash": 1, "preempted": 1}
    assert data["observed_job_mtbf_s"] == pytest.approx(1230 / 1)  # the crash; a preemption is no failure of the hardware
    assert data["measured_stall_s"] == pytest.approx(25 / 4)
    assert data["measured_restart_s"] == pytest.approx(85)
    assert data["measured_detect_s"] == pytest.approx(10)
    assert data["paid_usd"] == pytest.approx(PAID / 3600 * 3.6)
    assert data["goodput_fraction"] == pytest.approx(EXPECTED["useful"] / PAID)


def test_event_order_within_an_allocation_does_not_matter():
    """Writers interleave (forwarded rank events arrive late); each supervisor_start still opens
    its allocation, as the append-only file guarantees."""
    import random

    events = faulted_run()
    cut = next(i for i, e in enumerate(events) if e["event"] == "supervisor_start" and i > 0)
    first, second = events[1:cut], events[cut + 1:]
    random.Random(7).shuffle(first)
    random.Random(8).shuffle(second)
    shuffled = [events[0], *first, events[cut], *second]
    assert account(shuffled).useful_device_s == pytest.approx(EXPECTED["useful"])


def test_torn_and_foreign_lines_in_a_real_file_are_skipped(tmp_path):
    lines = [json.dumps(e) for e in faulted_run()]
    lines.insert(5, "not json at all")
    lines.insert(7, json.dumps({"event": "step_progress"}))  # missing required fields
    text = "\n".join(lines) + "\n" + '{"event": "step_progress", "ts": "2026-01-01T00:30'  # torn tail
    (tmp_path / EVENTS_FILE).write_text(text)
    acc = account(read_events(tmp_path))
    assert acc.paid_device_s == pytest.approx(PAID)
    assert acc.useful_device_s == pytest.approx(EXPECTED["useful"])


def test_gpu_less_nodes_count_their_ranks_as_devices():
    a = dict(attempt=1, mono_base=0.0)
    events = [ev(0, "allocation", nodes=3, gpus_per_node=0, ranks_per_node=2, spares=1, **a),
              ev(10, "first_step", step=0, **a),
              ev(110, "step_progress", step=10, step_time_s=10.0, **a),
              ev(110, "run_complete", **a)]
    acc = account(events)
    assert acc.paid_device_s == pytest.approx((6 + 2) * 110)
    assert acc.badput_device_s["idle_spares"] == pytest.approx(2 * 110)
    assert acc.badput_device_s["startup"] == pytest.approx(6 * 10)
    assert acc.useful_device_s == pytest.approx(6 * 100)


def test_missing_fields_still_sum_to_paid():
    a = dict(attempt=1, mono_base=0.0)
    events = [ev(0, "allocation", nodes=2, gpus_per_node=8, **a),
              ev(30, "first_step", **a),
              ev(100, "checkpoint_committed", step=5, **a),          # no stall_s
              ev(200, "failure_detected", kind="hang", **a),          # no detect_s
              ev(260, "restart_done", **a),                           # no phases, no resume_step
              ev(300, "step_progress", step="junk", **a),
              ev(400, "give_up", reason="crash loop", **a)]
    acc = account(events)
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert total == pytest.approx(acc.paid_device_s) and acc.paid_device_s == pytest.approx(16 * 400)
    assert acc.badput_device_s["other"] == pytest.approx(16 * 60)  # a restart no phase explains
    assert all(v >= 0 for v in acc.badput_device_s.values())


def test_a_run_without_checkpoints_loses_everything_before_the_failure():
    a = dict(attempt=1, mono_base=0.0)
    events = [ev(0, "allocation", nodes=1, gpus_per_node=4, **a),
              ev(0, "first_step", step=0, **a),
              ev(50, "step_progress", step=5, step_time_s=10.0, **a),
              ev(100, "failure_detected", kind="crash", detect_s=0.0, **a),
              ev(110, "restart_done", resume_step=0, restart_s=10.0, phases={"launch_s": 10.0}, **a),
              ev(160, "step_progress", step=5, step_time_s=10.0, **a),
              ev(160, "run_complete", **a)]
    acc = account(events)
    assert acc.badput_device_s["lost_progress"] == pytest.approx(4 * 100)
    assert acc.useful_device_s == pytest.approx(4 * 50)


def test_an_empty_log_accounts_nothing():
    acc = account([])
    assert acc.paid_device_s == 0 and acc.notes


def test_log_shaped_like_the_supervisors_writes():
    """As ckptsup.supervisor writes it: `allocation` with the whole allocation in `nodes` and the
    active count in `active`; first_step then restart_done at the same moment; hooks' events
    forwarded (duplicates); a requeue with no failure event; attempt 2 with only first_step."""
    a1, a2 = dict(attempt=0, mono_base=100.0), dict(attempt=1, mono_base=9.0)
    events = [
        ev(0, "supervisor_start", **a1),
        ev(0, "allocation", nodes=3, active=2, spares=1, gpus_per_node=0, ranks_per_node=2, **a1),
        ev(20, "first_step", step=0, since_launch_s=20.0, **a1),
        ev(20.1, "first_step", step=0, rank_ts="x", **a1),                    # forwarded from the hooks
        ev(110, "step_progress", step=9, step_time_s=10.0, **a1),
        ev(210, "step_progress", step=19, step_time_s=10.0, **a1),
        ev(212, "checkpoint_committed", step=20, stall_s=2.0, write_s=1.0, bytes=10, **a1),
        ev(312, "step_progress", step=29, step_time_s=10.0, **a1),
        ev(330, "failure_detected", kind="node_down", node="n2", rank=None, step=30, detect_s=5.0, **a1),
        ev(400, "first_step", step=20, **a1),
        ev(400, "restart_done", restart_s=70.0, resume_step=20, path="node", kind="node_down", nodes=["n1", "n3"],
           phases={"kill_s": 10.0, "health_s": 20.0, "launch_s": 20.0, "rendezvous_s": 5.0, "load_s": 5.0,
                   "first_step_s": 10.0}, **a1),
        ev(500, "step_progress", step=39, step_time_s=10.0, **a1),
        ev(520, "requeue", reason="too few nodes", **a1),
        ev(620, "supervisor_start", **a2),
        ev(620, "allocation", nodes=2, active=2, spares=0, gpus_per_node=0, ranks_per_node=2, **a2),
        ev(680, "first_step", step=20, **a2),                                 # resumed from checkpoint 20
        ev(770, "step_progress", step=29, step_time_s=10.0, **a2),
        ev(780, "run_complete", step=30, **a2),
    ]
    acc = account(events)
    expected = {"idle_spares": 2 * 520, "checkpoint_stall": 2 * 4, "lost_progress": (113 + 120) * 4,
                "detection": 5 * 4, "restart_kill": 40, "restart_health": 80, "restart_launch": 80,
                "restart_rendezvous": 20, "restart_load": 20, "restart_first_step": 40, "startup": (20 + 60) * 4,
                "teardown": 0, "other": 0}
    assert acc.paid_device_s == pytest.approx(6 * 520 + 4 * 160)
    assert acc.useful_device_s == pytest.approx((190 + 100) * 4)
    for category, value in expected.items():
        assert acc.badput_device_s[category] == pytest.approx(value), category
    assert acc.queue_s == pytest.approx(100)


def test_a_dead_node_leaves_the_allocation_and_the_spare_takes_its_place():
    """Hot-spare path: 3 active nodes + 1 spare (8 GPUs each); n2 dies; the relaunch on n1,n3,n4
    makes the spare active, and the dead node stops being paid (Slurm drops it under --no-kill)."""
    a = dict(attempt=0, mono_base=0.0)
    names = ["n1", "n2", "n3", "n4"]
    events = [
        ev(0, "supervisor_start", **a),
        ev(0, "allocation", nodes=4, active=3, spares=1, gpus_per_node=8, node_names=names, **a),
        ev(0, "launch", nodes=["n1", "n2", "n3"], spares=["n4"], path="initial", **a),
        ev(10, "first_step", step=0, **a),
        ev(100, "failure_detected", kind="node_down", node="n2", step=10, detect_s=4.0, **a),
        ev(110, "launch", nodes=["n1", "n3", "n4"], spares=[], path="node", **a),
        ev(130, "first_step", step=5, **a),
        ev(130, "restart_done", resume_step=5, restart_s=30.0,
           phases={"kill_s": 5.0, "launch_s": 10.0, "load_s": 15.0}, **a),
        ev(230, "run_complete", **a),
    ]
    acc = account(events)
    assert acc.badput_device_s["idle_spares"] == pytest.approx(8 * 110)        # n4 idle until the relaunch
    assert acc.paid_device_s == pytest.approx(32 * 110 + 24 * 120)             # n2 no longer paid after 110
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert total == pytest.approx(acc.paid_device_s)


def test_a_node_death_found_after_a_peers_crash_charges_its_silence_before_the_crash_to_detection():
    """The node dies at 97; its peer's rank crashes at 100 (the first symptom); the kill's ack
    window finds the node silent and attributes at 102 (silent 5 s); the restart takes 3 s in all,
    shorter than the silence. Detection is 97 → 100 (3 s); the restart's phases keep their time."""
    a = dict(attempt=0, mono_base=0.0)
    events = [
        ev(0, "supervisor_start", **a),
        ev(0, "allocation", nodes=2, active=2, spares=0, gpus_per_node=1, **a),
        ev(0, "launch", nodes=["n1", "n2"], spares=[], path="initial", **a),
        ev(10, "first_step", step=0, **a),
        ev(100, "failure_detected", kind="crash", node="n1", step=90, detect_s=0.0, **a),
        ev(102, "failure_attributed", kind="node_down", node="n2", was_kind="crash", detect_s=5.0, **a),
        ev(103, "first_step", step=80, **a),
        ev(103, "restart_done", resume_step=80, restart_s=3.0, phases={"kill_s": 2.0, "launch_s": 1.0}, **a),
        ev(200, "run_complete", **a),
    ]
    acc = account(events)
    assert acc.badput_device_s["detection"] == pytest.approx(2 * 3.0)
    assert acc.badput_device_s["restart_kill"] == pytest.approx(2 * 2.0)
    assert acc.badput_device_s["restart_launch"] == pytest.approx(2 * 1.0)
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert total == pytest.approx(acc.paid_device_s)
