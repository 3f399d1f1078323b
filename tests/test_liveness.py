"""Busy or hung (supervisor/job/liveness.py): the pure verdict in milliseconds, the attempt tracker's
stacks round in-process, and the evidence sources against real processes — /proc readings of a
computing and a sleeping process, and a faulthandler dump taken from a process blocked in C."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ckptsup import messages
from ckptsup.config import SupervisorConfig
from ckptsup.stack_dump import STACK_SIGNAL, stack_file
from ckptsup.supervisor.node import evidence
from ckptsup.supervisor.job.agent_step import Message
from ckptsup.env import ExitStatus
from ckptsup.supervisor.job.attempt import FAILED_BYE_EXIT_S, AttemptTracker
from ckptsup.supervisor.job.observations import FailureKind
from ckptsup.supervisor.job.liveness import (CPU_FLOOR, STALE_S, ChildSeen, Hung, Leaving, NeedStacks, RankEvidence, Where, Working, data_hang, judge,
                                        parse_stack)
from ckptsup.wire import MessageKind

WAITING_DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/work/ckptsup/hooks/rank_link.py", line 40 in _loop

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/job/train.py", line 70 in main
  File "/job/train.py", line 90 in <module>
"""
SLEEPING_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 71 in main
  File "/job/train.py", line 90 in <module>
"""


def idle(rank, node="n1", state="S", cpu_per_s=0.005, io_per_s=0, until=110):
    ev = RankEvidence(rank=rank, node=node)
    for t in range(0, until - 99):
        ev.add(100.0 + t, 5.0 + cpu_per_s * t, 1000 + io_per_s * t, state)
    return ev


BACKWARD_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 625 in backward
  File "/job/train.py", line 66 in main
"""


def test_no_verdict_before_the_stacks_then_a_rank_that_computes_makes_the_attempt_busy():
    ranks = {0: idle(0, cpu_per_s=0.9), 1: idle(1)}
    assert isinstance(judge(ranks, {}, now=110.0, stacks_asked_at=None, stacks_answered=False), NeedStacks)
    assert isinstance(judge(ranks, {}, now=110.0, stacks_asked_at=109.5, stacks_answered=False), NeedStacks)
    verdict = judge(ranks, {}, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
    assert isinstance(verdict, Working) and verdict.ranks == (0,) and "rank 0 (0.90 cores" in verdict.detail
    verdict = judge({0: idle(0, io_per_s=64 << 10), 1: idle(1)}, {}, now=110.0, stacks_asked_at=109.5,
                    stacks_answered=True)
    assert isinstance(verdict, Working) and verdict.ranks == (0,)   # reading a file: I/O, no CPU
    # a backward that computes is work (only a c10d call outweighs CPU time)
    verdict = judge(ranks, {0: BACKWARD_DUMP}, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
    assert isinstance(verdict, Working) and verdict.ranks == (0,)
    # a busy spell's stacks go stale: asked again
    assert isinstance(judge(ranks, {}, now=140.0, stacks_asked_at=109.5, stacks_answered=True), NeedStacks)


def test_the_rank_not_in_the_collective_its_peers_wait_in_is_named_and_no_node_suspected():
    ranks = {0: idle(0), 1: idle(1, node="n2")}
    stacks = {0: WAITING_DUMP, 1: SLEEPING_DUMP}
    assert isinstance(judge(ranks, {0: WAITING_DUMP}, now=110.0, stacks_asked_at=109.5, stacks_answered=False), NeedStacks)
    verdict = judge(ranks, stacks, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
    assert isinstance(verdict, Hung) and verdict.culprits == (1,) and verdict.node_evidence == ()
    assert verdict.detail == ("rank 1 on n2: at train.py:71 in main; "
                              "rank 0 waiting in all_reduce (distributed_c10d.py:2800)")
    # every rank's evidence, for failure_detected.ranks_seen (ckptsup log --json)
    assert [r.to_record() for r in verdict.ranks] == [
        {"rank": 0, "node": "n1", "where": "waiting", "top": "waiting in all_reduce (distributed_c10d.py:2800)",
         "state": "S", "cores": 0.005, "io_bps": 0},
        {"rank": 1, "node": "n2", "where": "elsewhere", "top": "at train.py:71 in main", "state": "S", "cores": 0.005,
         "io_bps": 0}]


def test_a_rank_spinning_inside_a_collective_is_waiting_not_working():
    verdict = judge({0: idle(0, cpu_per_s=1.0), 1: idle(1)}, {0: WAITING_DUMP, 1: SLEEPING_DUMP}, now=110.0,
                    stacks_asked_at=109.0, stacks_answered=True)
    assert isinstance(verdict, Hung) and verdict.culprits == (1,)


def test_without_a_python_stack_the_kernel_wait_channel_tells_sleeping_from_waiting():
    verdict = judge({0: idle(0), 1: idle(1)}, {}, now=110.0, stacks_asked_at=109.0, stacks_answered=True,
                    wchan={0: "futex_do_wait", 1: "hrtimer_nanosleep"})
    assert isinstance(verdict, Hung) and verdict.culprits == (1,)
    assert verdict.detail == "rank 1 on n1: sleeping in the kernel (hrtimer_nanosleep); rank 0 waiting in the kernel (futex_do_wait)"


def test_a_rank_in_uninterruptible_io_points_at_its_node_and_no_evidence_names_nobody():
    verdict = judge({0: idle(0), 1: idle(1, node="n2", state="D")}, {}, now=110.0, stacks_asked_at=109.0,
                    stacks_answered=True, wchan={0: "futex_do_wait", 1: "nfs_wait_bit_killable"})
    assert isinstance(verdict, Hung) and verdict.culprits == (1,) and verdict.node_evidence == ("n2",)
    assert "state D" in verdict.detail
    late = judge({0: idle(0, until=114), 1: idle(1, until=114)}, {}, now=114.0, stacks_asked_at=109.0, stacks_answered=False)
    assert isinstance(late, Hung) and late.culprits == () and "no stack" in late.detail   # waited STACK_WAIT_S


def test_ranks_whose_processes_left_their_agents_lists_are_leaving_not_hung():
    """The end-of-run false hang (BENCHMARKS §Liveness soak): the ranks exited and torchrun reaped
    them but had not exited itself 10 s after the last step; the agents stopped sampling them
    and no stack came. "No evidence" was counted as "not working" and rank 0 was blamed."""
    gone = {0: idle(0, state="R"), 1: idle(1, state="R")}   # last samples at 110
    now = 110.0 + STALE_S + 1.0
    verdict = judge(gone, {}, now=now, stacks_asked_at=now - 5.0, stacks_answered=True)
    assert isinstance(verdict, Leaving) and "ranks 0, 1: no longer running" in verdict.detail
    # one rank still there and idle is the hang: the one that left is no excuse
    verdict = judge({0: idle(0, until=115), 1: idle(1, state="R")}, {}, now=115.0, stacks_asked_at=110.0,
                    stacks_answered=True)
    assert isinstance(verdict, Hung)
    # a stack from any rank: judged as before
    verdict = judge(gone, {1: SLEEPING_DUMP}, now=now, stacks_asked_at=now - 5.0, stacks_answered=True)
    assert isinstance(verdict, Hung)


def test_the_tracker_waits_for_ranks_that_left_up_to_the_busy_limit():
    t = tracker()
    for second in range(0, 8):
        now = float(second)
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1], evidence=[[0, 1.0, 500, "R"], [1, 1.0, 500, "R"]]))
        t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=second))
    for second in range(8, 700):   # the ranks are gone: heartbeats without evidence
        now = float(second)
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[], evidence=[]))
        answer_stacks(t, now)
        failure = t.check(now)
        if failure is not None:
            break
    assert failure is not None and now - 7 >= SupervisorConfig().busy_limit_s   # not at the hang timeout (10 s)
    assert "no longer running" in failure.detail and failure.suspects == ()


def test_a_restarted_rank_process_starts_its_evidence_over_and_too_short_a_window_proves_nothing():
    ev = idle(0)
    ev.add(111.0, 0.1, 0, "S")   # CPU time went down: another process
    assert list(ev.samples) == [(111.0, 0.1, 0, 0.0)] and ev.rates(111.0) is None


def tracker(**config):
    return AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=SupervisorConfig(**config), started=0.0,
                          expect_hello=False)


def msg(t, m, **body):
    if isinstance(body.get("evidence"), list):   # as rows here; packed on the wire (messages.pack_evidence)
        body["evidence"] = messages.pack_evidence(body["evidence"])
    return Message.received(recv=t, m=m, body={"node": "n1", **body}, step_id=1)


def test_the_tracker_asks_for_stacks_then_names_the_rank_and_suspects_no_node():
    t = tracker()
    for second in range(0, 30):
        now = float(second)
        cpu = 1.0 + 0.005 * second
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1],
                         evidence=[[0, cpu, 500, "S"], [1, cpu, 500, "S"]]))
        if second <= 5:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=second))
        assert t.check(now) is None
        if t.want_stacks:
            break
    assert t.want_stacks and second == 16   # the last line at 5 s, hang_min_s = 10
    t.asked_for_stacks(16.0, {"n1"})
    assert t.check(16.1) is None   # waiting for the answer
    t.on_message(msg(16.2, MessageKind.STACKS_TAKEN, stacks=[[0, WAITING_DUMP], [1, SLEEPING_DUMP]], wchan=[]))
    failure = t.check(16.3)
    assert failure.rank == 1 and failure.suspects == () and "rank 1 on n1: at train.py:71 in main" in failure.detail


def answer_stacks(t, now):
    """What the loop and an agent do when the tracker asks: the agent's answer (no stacks here)."""
    if t.want_stacks:
        t.asked_for_stacks(now, {"n1"})
        t.on_message(msg(now, MessageKind.STACKS_TAKEN, stacks=[], wchan=[]))


def test_the_tracker_records_one_busy_spell_and_keeps_its_gap_out_of_the_step_times():
    t = tracker()
    for second in range(0, 40):
        now = float(second)
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1],
                         evidence=[[0, 1.0 + 0.9 * second, 500, "R"], [1, 1.0, 500, "S"]]))
        if second <= 5 or second >= 30:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=second))
        assert t.check(now) is None
        answer_stacks(t, now)
    assert [w.ranks for w in t.busy_news] == [(0,)] and t.busy is None   # over once progress came back
    assert t.step_window.p99() == 1.0   # the 25 s gap is no step


def run_blocked(tmp_path: Path, body: str, *, install: bool = True) -> tuple[subprocess.Popen, Path]:
    path = stack_file(tmp_path, 0, 3)
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        from ckptsup.stack_dump import install
        {"install()" if install else ""}
        threading.Thread(target=threading.Event().wait, name="helper", daemon=True).start()
        print("ready", flush=True)
        {body}
        """))
    env = {**os.environ, "CKPTSUP_RUN_DIR": str(tmp_path), "CKPTSUP_ATTEMPT": "0", "RANK": "3"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, path


def test_a_process_blocked_in_c_dumps_its_main_thread_on_the_signal_and_is_not_harmed(tmp_path):
    proc, path = run_blocked(tmp_path, "time.sleep(120)")
    try:
        deadline = time.monotonic() + 10   # past its print, into the sleep (the line after "ready")
        while "sleep" not in Path(f"/proc/{proc.pid}/wchan").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert evidence.catches(proc.pid, STACK_SIGNAL) and path.exists()
        got = evidence.take_stacks({3: proc.pid}, {3: path})
        stack = parse_stack(got[3])
        line = next(i for i, text in enumerate((tmp_path / "blocked.py").read_text().splitlines(), 1) if "sleep(120)" in text)
        assert stack.where is Where.ELSEWHERE and stack.top() == f"at blocked.py:{line} in <module>", got[3]
        assert proc.poll() is None   # still sleeping: the dump did not end it
        assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    finally:
        proc.kill()
        proc.wait()


def test_a_process_without_the_handler_is_never_sent_the_signal(tmp_path):
    proc, path = run_blocked(tmp_path, "time.sleep(120)", install=False)
    try:
        assert not evidence.catches(proc.pid, STACK_SIGNAL)
        assert evidence.take_stacks({3: proc.pid}, {3: path}) == {}
        time.sleep(0.2)
        assert proc.poll() is None   # an unhandled real-time signal would have killed it
    finally:
        proc.kill()
        proc.wait()


def test_proc_readings_tell_a_computing_process_from_a_sleeping_one(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    calm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        first = {p.pid: evidence.sample(p.pid) for p in (busy, calm)}
        # the busy one's CPU time grows by a second however loaded the box (a share of a core: 0.26
        # cores at load 7.7 on 2 cores, 0.10 at load 9); the calm one's not at all meanwhile
        deadline = time.monotonic() + 30
        while (second := {p.pid: evidence.sample(p.pid) for p in (busy, calm)})[busy.pid].cpu_s - first[busy.pid].cpu_s < 1.0:
            assert time.monotonic() < deadline, "the busy process's CPU time did not grow"
            time.sleep(0.2)
        assert second[busy.pid].state == "R"   # runnable, also while another process has the core
        assert second[calm.pid].cpu_s - first[calm.pid].cpu_s < CPU_FLOOR and second[calm.pid].state == "S"
        assert second[calm.pid].io_bytes == first[calm.pid].io_bytes
        assert evidence.sample(2 ** 22 + 12345) is None   # no such process
    finally:
        for p in (busy, calm):
            p.send_signal(signal.SIGKILL)
            p.wait()


def test_status_shows_a_busy_spell_with_its_ranks_its_age_and_the_limit():
    from ckptsup.supervisor.ops.cli_status import render
    from ckptsup.supervisor.job.status import Seen, build_status

    t = tracker()
    for second in range(0, 20):
        t.on_message(msg(float(second), MessageKind.HB, ranks_alive=[0, 1],
                         evidence=[[0, 1.0 + 0.9 * second, 500, "R"], [1, 1.0, 500, "S"]]))
        if second <= 5:
            t.on_message(msg(float(second), MessageKind.PROGRESS, rank=0, step=second))
        t.check(float(second))
        answer_stacks(t, float(second))
    seen = Seen(now_mono=19.0, now_wall=0.0, heard={"n1": 19.0}, has_agent=lambda n: True, warm_nodes=frozenset(),
                checkpoints={}, interval_s=None, last_commit_mono=None)
    st = build_status(job_id="1", attempt=0, epoch=1, run_status="running", active=("n1",), spares=(), excluded={},
                      tracker=t, config=t.config, seen=seen)
    assert st["busy"] == {"ranks": [0], "detail": t.busy.detail, "for_s": 2.0, "limit_s": 600.0}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(st))
    assert "busy for 2s (killed at busy_limit_s 600s): working without progress: rank 0" in console.export_text()


def test_a_restore_is_compared_at_the_same_steps_first_then_with_the_window_and_warns_once():
    from ckptsup.supervisor.job.restore_check import keep, loss_jump

    before = {s: 1.0 - 0.01 * s for s in range(10, 30)}
    assert loss_jump(before, 20, before[20]) is None and loss_jump(before, 20, before[20] * 1.05) is None
    jump = loss_jump(before, 20, 3.0)
    assert jump.basis == "same step" and jump.before == before[20] and "step 20 had loss 0.8" in jump.detail
    assert loss_jump(before, 40, 0.8) is None and loss_jump(before, 40, 0.4) is None   # within the window's noise
    assert loss_jump(before, 40, 2.5).basis == "window" and loss_jump(before, 40, 2.5).before == before[10]
    assert loss_jump(before, 40, 0.05) is None   # far below the window: training, never a bad restore
    assert loss_jump({}, 5, 9.0) is None and loss_jump(before, 20, float("nan")) is None
    assert list(keep({s: 1.0 for s in range(300)}, {299: 2.0})) == list(range(44, 300))
    t = AttemptTracker(attempt=1, nodes=("n1",), nproc_per_node=2, config=SupervisorConfig(), started=0.0,
                       resume_step=20, loss_before=before)
    for step, loss in ((20, before[20]), (21, 9.0), (22, 9.0)):
        t.on_message(msg(1.0, MessageKind.STEP, rank=0, step=step, loss=loss))
        t.on_message(msg(1.0, MessageKind.STEP, rank=1, step=step, loss=99.0))   # only rank 0's counts
    assert [(j.step, j.loss) for j in t.restore_news] == [(21, 9.0)] and t.losses == {20: before[20], 21: 9.0, 22: 9.0}


def test_busy_spells_are_timed_from_their_last_progress_to_progress_again_or_the_failure():
    from ckptsup.planning.phase_time import busy_line, busy_time

    def ev(name, t, **kw):
        return {"event": name, "ts": f"2026-12-03T10:00:{t:06.3f}+00:00", "mono": 1000.0 + t, "job_id": "1",
                "attempt": 0, **kw}

    events = [ev("supervisor_start", 0), ev("launch", 1), ev("first_step", 3),
              ev("busy", 20, ranks=[0], silent_s=15.0), ev("busy_over", 30, ranks=[0], busy_s=25.0),
              ev("busy", 50, ranks=[0, 1], silent_s=16.0), ev("failure_detected", 55, kind="hang", detect_s=21.0),
              ev("busy", 58, ranks=[0], silent_s="junk")]
    got = busy_time(events)
    assert got == {"spells": 3, "busy_s": 25.0 + (55 - 34) + 0.0}   # the last spell is open at the log's end
    assert busy_line(got) == "3 spells, 46.0s in all" and busy_line({}) == "none" and busy_line("junk") == "none"
    import datetime as dt
    later = dt.datetime(2026, 12, 3, 10, 1, 8, tzinfo=dt.timezone.utc).timestamp()   # 10 s after the last event
    assert busy_time(events, until=later)["busy_s"] == 56.0   # a live run's open spell runs on


SIDE_GROUP_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/job/plain_ddp.py", line 138 in main
  File "/job/plain_ddp.py", line 170 in <module>
"""
DDP_BACKWARD_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 625 in backward
  File "/job/plain_ddp.py", line 151 in main
  File "/job/plain_ddp.py", line 170 in <module>
"""


def test_a_rank_in_a_collective_its_peers_never_enter_is_named_and_no_node_suspected():
    """bench_liveness --faults collective (BENCHMARKS §Liveness, MISSED): rank 1 blocked in a second
    group's all-reduce while rank 0 waits in DDP's (inside backward). Both wait, so nobody was
    'elsewhere': rank 0 was blamed as the furthest behind and its node health-checked."""
    ranks = {0: idle(0), 1: idle(1, node="n2")}
    verdict = judge(ranks, {0: DDP_BACKWARD_DUMP, 1: SIDE_GROUP_DUMP}, now=110.0, stacks_asked_at=109.0,
                    stacks_answered=True)
    assert isinstance(verdict, Hung) and verdict.culprits == (1,) and verdict.node_evidence == ()
    assert verdict.detail.startswith("rank 1 in a collective its peers never enter: rank 1 on n2: waiting in "
                                     "all_reduce (distributed_c10d.py:3252) from plain_ddp.py:138")
    assert "rank 0 waiting in _engine_run_backward (graph.py:979) from plain_ddp.py:151" in verdict.detail
    # 3 ranks: the odd one out by its line, whatever the kind of call
    three = {0: idle(0), 1: idle(1), 2: idle(2)}
    verdict = judge(three, {0: SIDE_GROUP_DUMP, 1: DDP_BACKWARD_DUMP, 2: DDP_BACKWARD_DUMP}, now=110.0,
                    stacks_asked_at=109.0, stacks_answered=True)
    assert isinstance(verdict, Hung) and verdict.culprits == (0,)
    # every rank in the same collective from the same line: not a desync (a peer or the network), no culprit
    same = judge(three, {r: DDP_BACKWARD_DUMP for r in three}, now=110.0, stacks_asked_at=109.0, stacks_answered=True)
    assert isinstance(same, Hung) and same.culprits == ()


def test_the_tracker_suspects_no_node_for_a_desync():
    t = tracker()
    for second in range(0, 30):
        now = float(second)
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1], evidence=[[0, 1.0, 500, "S"], [1, 1.0, 500, "S"]]))
        if second <= 5:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=second))
        t.check(now)
        if t.want_stacks:
            break
    t.asked_for_stacks(now, {"n1"})
    t.on_message(msg(now + 0.1, MessageKind.STACKS_TAKEN, stacks=[[0, DDP_BACKWARD_DUMP], [1, SIDE_GROUP_DUMP]], wchan=[]))
    failure = t.check(now + 0.2)
    assert failure.rank == 1 and failure.suspects == () and "never enter" in failure.detail


def test_a_rank_whose_bye_said_failure_is_a_crash_soon_after_never_a_hang_of_the_peers_it_left():
    """Rank 0's loop raised (its bye says FAILURE) while rank 1 waits in a collective for it; rank
    0's process then hangs in its teardown. A crash FAILED_BYE_EXIT_S after the bye, with rank 0
    named — not a hang of rank 1 at the hang timeout (a field run: an exception seen as a hang)."""
    t = AttemptTracker(attempt=0, nodes=("n1",), nproc_per_node=2, config=SupervisorConfig(), started=0.0)
    for rank in (0, 1):
        t.on_message(msg(0.0, MessageKind.HELLO, rank=rank, local_rank=rank, world_size=2))
    for second in range(10):
        for rank in (0, 1):
            t.on_message(msg(float(second), MessageKind.STEP, rank=rank, step=second, step_time_s=1.0))
    bye_at = 9.5 + SupervisorConfig().hang_min_s   # just before rank 1's silence would be judged
    t.on_message(msg(bye_at, MessageKind.BYE, rank=0, status=int(ExitStatus.FAILURE)))
    now = bye_at
    while now < bye_at + FAILED_BYE_EXIT_S:
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1], evidence=[[0, 1.0, 500, "S"], [1, 1.0, 500, "S"]]))
        assert t.check(now) is None and not t.want_stacks, now   # its exit may still report it, traceback and all
        now += 0.25
    failure = t.check(now)
    assert failure.kind is FailureKind.CRASH and failure.rank == 0 and failure.suspects == ("n1",)
    assert "said goodbye with a failure" in failure.detail and failure.detect_s >= FAILED_BYE_EXIT_S


DATA_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113 in get
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1291 in _try_get_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1459 in _get_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1502 in _next_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 741 in __next__
  File "/job/train.py", line 93 in main
"""
# num_workers=0: the rank reads itself, deep in its own dataset under the loader's frames
READING_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/socket.py", line 706 in readinto
  File "/job/train.py", line 41 in __iter__
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", line 33 in fetch
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 789 in _next_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 741 in __next__
  File "/job/train.py", line 93 in main
"""


def with_workers(ev: RankEvidence, children: int, cores: float, until: int = 110) -> RankEvidence:
    """The same rank, its tree now holding `children` workers that use `cores` between them."""
    out = RankEvidence(rank=ev.rank, node=ev.node)
    for (t, cpu, io, _) in ev.samples:
        out.add(t, cpu + cores * (t - 100), io, ev.state, children, cores * (t - 100))
    return out


def test_a_rank_waiting_for_its_data_is_busy_whether_its_workers_compute_or_sit_in_a_read():
    for cores, shown in ((1.6, "(2 workers, 160% CPU)"), (0.0, "(2 workers, 0% CPU)")):
        ranks = {0: with_workers(idle(0), 2, cores), 1: with_workers(idle(1), 2, cores)}
        verdict = judge(ranks, {0: DATA_DUMP, 1: DATA_DUMP}, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
        assert isinstance(verdict, Working) and verdict.ranks == (0, 1) and verdict.data == (0, 1), verdict
        assert f"rank 0 waiting for data {shown}" in verdict.detail, verdict.detail
    assert parse_stack(DATA_DUMP).where is Where.DATA
    assert parse_stack(DATA_DUMP).top() == "waiting for data in _try_get_data (dataloader.py:1291) from train.py:93"
    # no workers: the rank's own read in its dataset, under the loader
    verdict = judge({0: idle(0)}, {0: READING_DUMP}, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
    assert isinstance(verdict, Working) and verdict.data == (0,)
    assert "waiting for data (no worker processes: the rank reads itself" in verdict.detail
    stateful = DATA_DUMP.replace("torch/utils/data/dataloader.py", "torchdata/stateful_dataloader/stateful_dataloader.py")
    assert parse_stack(stateful).where is Where.DATA   # torchdata's StatefulDataLoader (torchtitan's)
    # the frames of the data pipeline decide nothing once the rank is in a collective above them
    assert parse_stack(WAITING_DUMP).where is Where.WAITING and parse_stack(SLEEPING_DUMP).where is Where.ELSEWHERE


def test_a_rank_in_a_collective_while_its_peer_waits_for_data_is_not_blamed_and_past_the_limit_the_peer_is():
    ranks = {0: with_workers(idle(0), 2, 0.0), 1: idle(1, node="n2")}
    stacks = {0: DATA_DUMP, 1: WAITING_DUMP}
    verdict = judge(ranks, stacks, now=110.0, stacks_asked_at=109.5, stacks_answered=True)
    assert isinstance(verdict, Working) and verdict.ranks == (0,) and verdict.data == (0,), verdict
    children = {0: [ChildSeen(pid=4242, state="S", waiting_in="read()"), ChildSeen(pid=4243, state="S", waiting_in="poll()")]}
    hung = data_hang(verdict, ranks, stacks, children, now=110.0, for_s=600.0)
    assert hung.culprits == (0,) and hung.node_evidence == (), hung
    assert hung.detail == ("rank 0 on n1 waiting for data for 600s (waiting for data in _try_get_data "
                           "(dataloader.py:1291) from train.py:93); worker pid 4242 in read(); worker pid 4243 in poll(); "
                           "rank 1 waiting in all_reduce (distributed_c10d.py:2800)")
    assert [r.where for r in hung.ranks] == ["data", "waiting"]
    # a worker in uninterruptible I/O points at its node (a file system), as a rank in D does
    stuck = data_hang(verdict, ranks, stacks, {0: [ChildSeen(pid=4242, state="D", waiting_in="read()")]}, now=110.0,
                      for_s=600.0)
    assert stuck.node_evidence == ("n1",) and "(uninterruptible I/O, state D)" in stuck.detail


def test_the_tracker_keeps_a_data_wait_busy_until_the_limit_then_names_the_rank_and_its_worker():
    t = tracker(busy_limit_s=40.0)
    for second in range(0, 60):
        now = float(second)
        t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1],
                         evidence=[[0, 1.0, 500, "S", 2, 0.5], [1, 1.0, 500, "S", 0, 0.0]]))   # 6-entry rows: the tree
        if second <= 5:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=second))
        failure = t.check(now)
        if failure is not None:
            break
        if t.want_stacks:
            t.asked_for_stacks(now, {"n1"})
            t.on_message(msg(now, MessageKind.STACKS_TAKEN, stacks=[[0, DATA_DUMP], [1, WAITING_DUMP]], wchan=[],
                             children=[[0, 4242, "S", "recvfrom()"]]))
    assert failure is not None and 40.0 <= failure.detect_s <= 42.0, failure
    assert failure.rank == 0 and failure.suspects == (), failure
    assert "rank 0 on n1 waiting for data for 4" in failure.detail and "worker pid 4242 in recvfrom()" in failure.detail
    assert "supervisor.busy_limit_s=40s" in failure.detail
    assert [w.data for w in t.busy_news] == [(0,)]


def busy_spell_ending(after: list, progress_at: float | None) -> tuple:
    """Both ranks wait for data from 5 s (busy), then from 45 s their stacks say `after`; with
    `progress_at`, the step's line arrives then. (failure, the times stacks were asked, the tracker)."""
    t = tracker()
    stacks, asked, failure = [[0, DATA_DUMP], [1, DATA_DUMP]], [], None
    for tenth in range(0, 600):
        now = tenth / 10
        if tenth % 10 == 0:
            t.on_message(msg(now, MessageKind.HB, ranks_alive=[0, 1], evidence=[[0, 1.0, 500, "S"], [1, 1.0, 500, "S"]]))
        if tenth <= 50 and tenth % 10 == 0:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=tenth // 10))
        if now >= 45.0:
            stacks = after
        if progress_at is not None and now >= progress_at:
            t.on_message(msg(now, MessageKind.PROGRESS, rank=0, step=6))
            return t.check(now + 0.1), asked, t
        failure = t.check(now)
        if failure is not None:
            return failure, asked, t
        if t.want_stacks:
            asked.append(now)
            t.asked_for_stacks(now, {"n1"})
            t.on_message(msg(now, MessageKind.STACKS_TAKEN, stacks=stacks, wchan=[]))
    return failure, asked, t


def test_a_busy_spell_that_ends_without_progress_is_judged_again_before_anyone_is_killed():
    """The stacks of a busy spell's re-ask can catch a rank between its batch and its progress line
    (the data came that instant): a hang only if stacks taken RECHECK_S later say so too."""
    failure, asked, t = busy_spell_ending([[0, SLEEPING_DUMP], [1, SLEEPING_DUMP]], progress_at=46.0)
    assert failure is None and t.busy is None and t.busy_over_news, failure
    assert len(asked) == 2 and 45.0 <= asked[1] < 46.0, asked   # hung at 45 from a snapshot: judged again at 47, never reached
    # without progress the second round decides: a hang, RECHECK_S later
    failure, asked, _ = busy_spell_ending([[0, SLEEPING_DUMP], [1, WAITING_DUMP]], progress_at=None)
    assert failure is not None and failure.rank == 0 and len(asked) == 3 and 47.0 <= asked[2] <= 47.5, (asked, failure)
