"""The agent's rank socket and command channel: private, authenticated, replay-proof (in-process,
no torchrun: the agent's selector is pumped by hand)."""
import os
import socket
import stat
from pathlib import Path

import pytest

from ckptsup import messages, wire
from ckptsup.supervisor.node.agent import Agent, LaunchSpec

SECRET = b"k" * 64


@pytest.fixture
def agent(tmp_path):
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    spec = LaunchSpec(script="x.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="127.0.0.1:1",
                      rdzv_id="t", node_addrs={"n1": "127.0.0.1"}, env={}, log_dir=str(tmp_path))
    a = Agent(spec=spec, node="n1", secret=SECRET, out=os.fdopen(out_w, "wb"), inp=os.fdopen(in_r, "rb"), attempt=0)
    a.test_out = os.fdopen(out_r, "rb")
    a.test_in = os.fdopen(in_w, "wb")
    os.set_blocking(out_r, False)
    yield a
    a.shutdown()


def relayed(agent) -> list[tuple[str, dict]]:
    agent._pump(0.2)
    data = agent.test_out.read() or b""
    frames = [wire.decode(line, secret=SECRET) for line in data.splitlines() if line.strip()]
    return [(m, body) for m, _, body in frames]


def rank_socket(agent, *, hello: bool = True) -> socket.socket:
    """A connection to the rank socket; with `hello`, already a rank (rank 0, sequence 0): only a
    connection that said an authenticated hello counts as one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(agent.ranks.path))
    agent._pump(0.1)  # accept
    if hello:
        sock.sendall(wire.encode("hello", {"rank": 0, "pid": 3_000_000_001}, seq=0, secret=SECRET))
        assert [m for m, _ in relayed(agent)] == ["hello"]
    return sock


def test_rank_socket_lives_in_a_private_directory(agent):
    assert stat.S_IMODE(os.stat(agent.ranks.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(agent.ranks.path).st_mode) == 0o600


def test_valid_rank_frames_are_relayed_with_the_node_added(agent):
    sock = rank_socket(agent)
    sock.sendall(wire.encode("step", {"rank": 0, "step": 3, "step_time_s": 0.1}, seq=1, secret=SECRET))
    [(m, body)] = relayed(agent)
    assert m == "step" and body["step"] == 3 and body["node"] == "n1" and body["agent"] == agent.instance
    assert agent.last_step == 3


def test_forged_and_replayed_rank_frames_are_dropped(agent):
    sock = rank_socket(agent)
    sock.sendall(wire.encode("step", {"rank": 0, "step": 1}, seq=1, secret=b"wrong" * 10))
    sock.sendall(wire.encode("step", {"rank": 0, "step": 2}, seq=5, secret=SECRET))
    sock.sendall(wire.encode("step", {"rank": 0, "step": 9}, seq=5, secret=SECRET))  # replayed seq
    sock.sendall(b"not a frame at all\n")
    assert [body["step"] for m, body in relayed(agent)] == [2]
    assert agent.dropped == 3


def test_forged_supervisor_commands_are_ignored(agent):
    agent.test_in.write(wire.encode("exit", {}, seq=1, secret=b"x" * 32))
    agent.test_in.flush()
    relayed(agent)
    assert not agent.exit_requested and agent.dropped == 1
    agent.test_in.write(wire.encode("exit", {}, seq=2, secret=SECRET))
    agent.test_in.flush()
    relayed(agent)
    assert agent.exit_requested


def test_commands_for_other_nodes_are_ignored_and_rank_commands_are_forwarded(agent):
    sock = rank_socket(agent)
    agent.test_in.write(wire.encode("exit", {"nodes": ["n2"]}, seq=1, secret=SECRET))
    agent.test_in.write(wire.encode("set_interval", {"interval_s": 42.0}, seq=2, secret=SECRET))
    agent.test_in.flush()
    relayed(agent)
    assert not agent.exit_requested
    sock.settimeout(2)
    m, _, body = wire.decode(sock.recv(65536).splitlines()[0], secret=SECRET)
    assert m == "set_interval" and body == {"interval_s": 42.0}


def test_a_rank_that_vanishes_without_bye_is_reported_as_an_exit(agent):
    class FakeTorchrun:
        pid = os.getpid()

        def poll(self):
            return None

    agent.torchrun = FakeTorchrun()
    sock = rank_socket(agent, hello=False)
    sock.sendall(wire.encode("hello", {"rank": 1, "pid": 999999}, seq=1, secret=SECRET))
    relayed(agent)
    sock.close()
    agent._pump(0.1)
    import time
    time.sleep(0.35)
    agent._check_processes()
    exits = [body for m, body in relayed(agent) if m == "rank_exit"]
    agent.torchrun = None
    assert len(exits) == 1 and exits[0]["rank"] == 1 and exits[0]["rc"] is None


def test_a_dead_ranks_exit_status_is_read_from_its_zombie():
    import signal
    import subprocess
    import sys
    import time

    from ckptsup.supervisor.processes import GONE, RUNNING, zombie_status

    done = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert zombie_status(killed.pid) == RUNNING
    killed.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (zombie_status(done.pid) == RUNNING or zombie_status(killed.pid) == RUNNING):
        time.sleep(0.01)
    assert zombie_status(done.pid) == 3
    assert zombie_status(killed.pid) == -signal.SIGKILL
    done.wait()
    killed.wait()
    assert zombie_status(done.pid) == GONE


def test_socket_dirs_of_killed_agents_on_this_host_are_swept_and_no_others(tmp_path) -> None:
    import tempfile

    from ckptsup.supervisor.node.rank_socket import socket_dir_prefix, sweep_stale_socket_dirs

    def make(host, pid, pidns="7"):
        return Path(tempfile.mkdtemp(prefix=socket_dir_prefix(host, pid, pidns), dir=tmp_path))

    dead, live = make("n1", 111), make("n1", 222)
    other_host, dashed_host = make("n2", 111), make("n1-2", 111)
    other_namespace = make("n1", 111, pidns="8")   # another dev cluster's n1: its pid 111 is not ours
    (dead / "ranks.sock").write_text("")
    removed = sweep_stale_socket_dirs(tmp_path, host="n1", alive=lambda pid: pid == 222, pidns="7")
    assert removed == [dead] and not dead.exists()
    assert live.exists() and other_host.exists() and dashed_host.exists() and other_namespace.exists()


def test_memory_peers_set_every_buddy_and_a_bad_body_is_one_ignored_command(tmp_path, capfd):
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    spec = LaunchSpec(script="x.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="127.0.0.1:1",
                      rdzv_id="t", node_addrs={"n1": "127.0.0.1"}, env={}, log_dir=str(tmp_path), memory_keep=2,
                      memory_addrs={"n1": "127.0.0.1"})
    a = Agent(spec=spec, node="n1", secret=SECRET, out=os.fdopen(out_w, "wb"), inp=os.fdopen(in_r, "rb"), attempt=0)
    a.test_out, a.test_in = os.fdopen(out_r, "rb"), os.fdopen(in_w, "wb")
    os.set_blocking(out_r, False)
    try:
        bodies = [{"buddies": ["10.0.0.2:7000", "[fd00::3]:7001"], "sources": {"4": ["10.0.0.2:7000"]}},
                  {"buddies": "10.0.0.2:7000"}, {"buddies": ["a:1", "b:2", "c:3", "d:4"]},
                  {"buddies": ["10.0.0.2:" + "9" * 5000]}, {"buddies": [7000]}]
        for seq, body in enumerate(bodies, start=1):
            a.test_in.write(wire.encode("memory_peers", body, seq=seq, secret=SECRET))
        a.test_in.flush()
        relayed(a)
        assert a.memory.peers.buddies == ["10.0.0.2:7000", "[fd00::3]:7001"] and a.memory.peers.sources == {4: ["10.0.0.2:7000"]}
        assert a.dropped == 4
        ignored = [line for line in capfd.readouterr().err.splitlines() if "ignored a memory_peers command" in line]
        assert len(ignored) == 4 and all("`buddies` must be a list of at most 3 host:port" in line for line in ignored)
    finally:
        a.shutdown()


def test_a_kill_with_report_names_the_live_rank_processes_and_heartbeats_list_their_pids(agent):
    """The teardown kill (docs/architecture.md §Every wait has an end): which ranks were left, then
    the whole tree killed; `ckptsup status` gets the same pids from every heartbeat."""
    import subprocess
    import sys

    torchrun = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen("
                                 "[sys.executable, '-c', 'import time; time.sleep(60)']); print(p.pid, flush=True); "
                                 "time.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
    rank_pid = int(torchrun.stdout.readline())
    agent.torchrun, agent.procs.rank_pids = torchrun, {1: rank_pid}
    agent.heartbeat()
    [hb] = [body for m, body in relayed(agent) if m == "hb"]
    assert messages.unpack_pids(hb["pids"]) == {1: {"pid": rank_pid, "host_pid": rank_pid}}
    agent.test_in.write(wire.encode("kill", {"grace": 0, "report": True}, seq=1, secret=SECRET))
    agent.test_in.flush()
    [killed] = [body for m, body in relayed(agent) if m == "killed"]
    [survivor] = killed["survivors"]
    assert (survivor["rank"], survivor["pid"], survivor["host_pid"]) == (1, rank_pid, rank_pid), survivor
    assert torchrun.wait(timeout=10) == -9
    import time

    from ckptsup.supervisor.processes import RUNNING, zombie_status
    deadline = time.monotonic() + 5
    while zombie_status(rank_pid) is RUNNING:   # SIGKILL is delivered asynchronously
        assert time.monotonic() < deadline, "the rank outlived the kill"
        time.sleep(0.01)


def test_a_clean_exit_of_a_rank_without_hooks_goes_up_as_rank_exit_0_and_a_failure_does_not(agent):
    import subprocess
    import sys
    import time

    class FakeTorchrun:
        pid = os.getpid()

        def poll(self):
            return None

    clean = subprocess.Popen([sys.executable, "-c", "pass"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent.torchrun, agent.procs.rank_pids = FakeTorchrun(), {0: clean.pid, 1: alive.pid, 2: failed.pid}
        from ckptsup.supervisor.processes import RUNNING, zombie_status
        deadline = time.monotonic() + 10
        while RUNNING in (zombie_status(clean.pid), zombie_status(failed.pid)):   # zombies: statuses readable
            assert time.monotonic() < deadline
            time.sleep(0.01)
        agent._check_processes()
        agent._check_processes()   # once per rank
        exits = [body for m, body in relayed(agent) if m == "rank_exit"]
        assert [(e["rank"], e["rc"]) for e in exits] == [(0, 0)], exits
    finally:
        agent.torchrun = None
        alive.kill()
        for proc in (clean, failed, alive):
            proc.wait()


def test_a_new_attempts_variables_keep_the_zygote_and_an_import_time_one_replaces_it():
    """What the supervisor exports per attempt (CKPTSUP_*, the NCCL/flight-recorder variables, whose
    paths name the attempt) is read when a rank attaches or creates its process group, never at
    import: a new attempt forks from the same zygote (a clean-clone run showed ~2.5 zygotes an agent,
    one a restart, before this); OMP_NUM_THREADS is read at torch's import: a change needs a new one."""
    from ckptsup.supervisor.node.zygote import Zygote

    fr = "TORCH_FR_DUMP_TEMP_FILE"   # the supervisor's, per attempt: <run>/attempt-N/flight_recorder/rank_
    zygote = Zygote(proc=None, control=None,  # type: ignore[arg-type]
                    env={"OMP_NUM_THREADS": "1", "CKPTSUP_ATTEMPT": "0", fr: "/run/attempt-0/fr/rank_"})
    spec_env = {"CKPTSUP_ATTEMPT": "3", fr: "/run/attempt-3/fr/rank_"}   # what the new attempt's spec exports
    assert zygote.imported_with({"OMP_NUM_THREADS": "1", "CKPTSUP_RESUME_FROM": "/ck/step_9", **spec_env},
                                per_attempt=spec_env)
    assert not zygote.imported_with({"OMP_NUM_THREADS": "1", **spec_env})   # not the spec's: read at import?
    assert not zygote.imported_with({"OMP_NUM_THREADS": "2", **spec_env}, per_attempt=spec_env)
    assert not zygote.imported_with(spec_env, per_attempt=spec_env)


def test_the_first_launch_waits_for_the_zygote_at_most_its_cap_and_a_kill_before_it_cancels_it(agent, monkeypatch):
    """The first launch starts from the zygote once it is ready; not before, unless FIRST_LAUNCH_WAIT_S
    passed (then cold) or no zygote can start here. A kill that comes first cancels it: the
    supervisor decides what runs next."""
    import time

    from ckptsup.supervisor.node import agent as agent_module

    started = []
    monkeypatch.setattr(agent, "start_torchrun", lambda env: (started.append(env), setattr(agent, "first_launch_by", None)))
    agent.warming = True                      # the zygote is still importing
    agent.first_launch_by = time.monotonic() + 60
    agent._first_launch()
    assert started == []
    agent.first_launch_by = time.monotonic() - 1   # its cap passed: cold
    agent._first_launch()
    assert started == [{}]
    agent.zygote_failures = agent_module.MAX_ZYGOTE_FAILURES   # no zygote can start here: at once
    agent.first_launch_by = time.monotonic() + 60
    agent._first_launch()
    assert started == [{}, {}]
    agent.first_launch_by = time.monotonic() - 1
    agent.kill_torchrun(0)
    agent._first_launch()
    assert started == [{}, {}]


def test_the_next_launchs_ranks_are_forked_at_launch_and_a_torch_import_waits_for_the_first_step(agent, monkeypatch):
    """A zygote that imported torch with the ranks' environment forks the next launch's warm
    interpreters as soon as a launch starts (an attempt that fails before its first step restarts
    warm; clean-clone runs restarted 110-127 ranks a suite cold before this); one that must import
    anew waits until the attempt steps, not to slow the ranks' start."""
    import time

    from ckptsup.supervisor.node.zygote import Zygote

    class ReadyZygote(Zygote):
        def dead(self) -> bool:
            return False

        def ready(self) -> bool:
            return True

    zygote = ReadyZygote(proc=None, control=None, env=agent._zygote_env())  # type: ignore[arg-type]
    agent.zygote = zygote
    agent.launched_at = time.monotonic()      # the launch just started, no step yet
    agent._warm_standby()
    assert agent.warming and agent.launched_at is None
    agent.warming = False
    zygote.env = {**zygote.env, "OMP_NUM_THREADS": "7"}   # imported with another environment: a new import is due
    agent.launched_at = time.monotonic()
    agent._warm_standby()
    assert not agent.warming and agent.launched_at is not None
    agent.last_step = 0                        # the attempt stepped: now the import may run
    agent._warm_standby()
    assert agent.warming
    agent.zygote = None


def test_the_zygotes_ready_line_wakes_the_agents_loop_instead_of_a_tick(agent):
    """While the first launch waits for the zygote's import, the loop sleeps in its selector (TICK_S),
    not in 5 ms ticks: the zygote's `ready` line wakes it, and the line is read in that pass."""
    import subprocess
    import time

    from ckptsup.supervisor.node.zygote import Zygote

    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    proc = subprocess.Popen(["sleep", "60"])
    agent._replace_zygote(Zygote(proc, ours, env={}))
    try:
        assert agent.zygote_watched
        t0 = time.monotonic()
        agent._pump(0.3)
        assert time.monotonic() - t0 >= 0.25 and agent.zygote_watched   # nothing said: it slept
        theirs.sendall(b'{"ready": true}\n')
        t0 = time.monotonic()
        agent._pump(5.0)
        assert time.monotonic() - t0 < 2.0 and not agent.zygote_watched
        assert agent._ready_zygote() is agent.zygote
    finally:
        agent._replace_zygote(None)
        theirs.close()
    assert proc.wait(timeout=10) is not None and agent.zygote is None


class _Handle:
    """A warm interpreter's handle as the agent holds it (supervisor/node/forked.ForkedChild): its
    pid and the status its poll() kept once it reaped the process."""

    def __init__(self, pid: int, rc: int | None) -> None:
        self.pid, self.rc = pid, rc

    def poll(self) -> int | None:
        return self.rc


def test_a_killed_warm_rank_is_a_crash_at_once_and_before_the_peer_that_exits_on_its_broken_collective():
    """Rank 1's warm interpreter is SIGKILLed; the agent reaped it already (its handle keeps the
    status, /proc has nothing left). Its lost connection is a crash at once, not after
    EXIT_CONFIRM_S: rank 0, which exits 1 on the broken collective a moment later, is never the
    one reported first (seen in a clean-clone run: the fast path blamed rank 0)."""
    from ckptsup.supervisor.node.rank_processes import RankProcesses

    gone_pid, peer_pid = 3_999_999_001, 3_999_999_002   # no such processes: /proc says GONE
    procs = RankProcesses()
    procs.lost(1, gone_pid, 100.0)
    procs.lost(0, peer_pid, 100.05)
    warm = [_Handle(gone_pid, -9), _Handle(peer_pid, None)]   # rank 0 still exiting
    [crash] = procs.confirm(None, 100.06, 5, warm)
    assert (crash.rank, crash.rc) == (1, -9) and "killed by signal 9" in crash.detail
    assert [rank for _, rank, _ in procs.pending] == [0]   # rank 0 waits for its own status
