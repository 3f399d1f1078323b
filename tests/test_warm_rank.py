"""Warm rank interpreters (rankside/warm_rank.py and warm_proxy.py, supervisor/node/warm_pool.py) and the
zygote that forks them and torchrun (rankside/zygote.py, supervisor/node/zygote.py, forked.py) as real
processes: the proxy stands in for the rank exactly — its streams, environment, cwd, argv,
exit status and signals — and starts cold when no warm interpreter is ready; forked children are
ours to wait on, and a broken zygote or interpreter means cold launches, never a wait."""
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ckptsup.env import WARM_DIR
from ckptsup.supervisor.node.agent import MAX_ZYGOTE_FAILURES, Agent, LaunchSpec
from ckptsup.supervisor.node.forked import PR_SET_CHILD_SUBREAPER, is_subreaper, reap_orphans
from ckptsup.supervisor.node.warm_pool import WarmPool
from ckptsup.supervisor.node.zygote import Zygote

pytestmark = pytest.mark.integration

SCRIPT = """
import os, signal, sys, time
import torch
if sys.argv[1] == "wait":   # the handler before the first line: a test signals once it reads it
    # os.write, not print: the signal can come while print's own flush still holds stdout's lock
    # (a print in the handler is then a "reentrant call" RuntimeError, exit 1)
    signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"got SIGTERM\\n"), sys.exit(7)))
print("rank", os.environ["RANK"], "cwd", os.getcwd(), "argv", sys.argv[1:], "torch", "torch" in sys.modules, flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def wait_ready(what, ready, timeout=60):
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} never got ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One zygote for the module, as an agent keeps one for its restarts. This test process is
    the subreaper its children need (as the agent is) until the module ends."""
    z = Zygote.start(env=dict(os.environ), cwd=str(tmp_path_factory.mktemp("zygote")))
    assert z is not None and is_subreaper()
    wait_ready("the zygote", z.ready)
    yield z
    z.close()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    reap_orphans(())


@pytest.fixture
def pool(tmp_path, zygote):
    directory = tmp_path / "sock"
    directory.mkdir(mode=0o700)
    p = WarmPool(directory=directory, size=1, cwd=str(tmp_path))
    p.start(zygote)
    wait_ready("the warm interpreter", p.ready)
    yield p
    p.close()


def proxy(tmp_path, directory, *args, env_extra=None):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "RANK": "3", "LOCAL_RANK": "0", **({WARM_DIR: str(directory)} if directory else {}),
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "ckptsup.rankside.warm_proxy", str(script), *args], env=env,
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_proxy_hands_its_rank_to_the_warm_interpreter_and_takes_its_exit_status(tmp_path, pool):
    warm_pid = pool.procs[0].pid
    assert pool.hand_out() and not pool.procs
    p = proxy(tmp_path, pool.in_use_dir, "5")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 5, err
    assert f"rank 3 cwd {tmp_path / 'work'} argv ['5'] torch True" in out and "to stderr" in err
    assert pool.in_use[0].wait(timeout=30) == 5 and pool.in_use[0].pid == warm_pid


def test_a_signal_to_the_proxy_reaches_the_rank_and_a_killed_proxy_takes_the_rank_with_it(tmp_path, pool):
    pool.hand_out()
    p = proxy(tmp_path, pool.in_use_dir, "wait")
    line = p.stdout.readline()
    assert line.startswith("rank 3"), line
    p.send_signal(signal.SIGTERM)   # torchrun's shutdown: the rank's own handler runs
    assert p.wait(timeout=30) == 7 and "got SIGTERM" in p.stdout.read()
    assert pool.in_use[0].wait(timeout=30) == 7


def test_a_killed_proxy_kills_its_rank(tmp_path, pool):
    pool.hand_out()
    p = proxy(tmp_path, pool.in_use_dir, "wait")
    assert p.stdout.readline().startswith("rank 3")
    p.kill()
    assert pool.in_use[0].wait(timeout=30) == -signal.SIGKILL


def test_a_rank_killed_by_a_signal_kills_its_proxy_the_same_way(tmp_path, pool):
    pool.hand_out()
    p = proxy(tmp_path, pool.in_use_dir, "wait")
    assert p.stdout.readline().startswith("rank 3")
    pool.in_use[0].send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


def test_without_a_ready_warm_interpreter_the_proxy_starts_the_rank_cold(tmp_path):
    empty = tmp_path / "none"
    empty.mkdir(mode=0o700)
    for directory in (None, empty):
        p = proxy(tmp_path, directory, "4")
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 4 and "rank 3" in out


def test_a_stopped_rank_is_killed_with_its_launch(tmp_path, pool):
    pool.hand_out()
    p = proxy(tmp_path, pool.in_use_dir, "wait")
    assert p.stdout.readline().startswith("rank 3")
    rank = pool.in_use[0]
    rank.send_signal(signal.SIGSTOP)   # it would not notice its proxy's death
    p.kill()
    pool.kill_in_use()
    assert rank.wait(timeout=30) == -signal.SIGKILL and not pool.in_use


def test_the_pool_applies_torchruns_thread_rule_and_gives_up_on_interpreters_that_die(tmp_path, zygote):
    assert WarmPool.rank_env({}, 2)["OMP_NUM_THREADS"] == "1"
    assert WarmPool.rank_env({"OMP_NUM_THREADS": "4"}, 2)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in WarmPool.rank_env({}, 1)
    directory = tmp_path / "sock"
    directory.mkdir(mode=0o700)
    dying = WarmPool(directory=directory, size=1, cwd=str(tmp_path))
    for _ in range(dying.MAX_FAILED):
        dying.start(zygote)
        dying.procs[0].kill()   # it dies while waiting for its rank
        dying.procs[0].wait(timeout=30)
        dying.reap()
    assert dying.failed == dying.MAX_FAILED and not dying.procs
    dying.start(zygote)
    assert not dying.procs and not dying.hand_out()   # warming stops; launches start cold
    assert zygote.ready()   # the zygote itself is unharmed


def test_a_zygote_that_cannot_start_forks_nothing_and_its_pool_gives_up(tmp_path):
    broken = Zygote.start(env={**os.environ, "PYTHONHOME": "/nonexistent"}, cwd="/")   # python cannot start
    assert broken is not None
    broken.proc.wait(timeout=30)
    assert broken.dead() and not broken.ready()
    directory = tmp_path / "sock"
    directory.mkdir(mode=0o700)
    pool = WarmPool(directory=directory, size=2, cwd=str(tmp_path))
    for _ in range(pool.MAX_FAILED + 1):
        pool.start(broken)
    assert pool.failed == pool.MAX_FAILED and not pool.procs and not pool.hand_out()
    assert broken.fork_torchrun(argv=["--help"], env=dict(os.environ), cwd="/") is None
    broken.close()


def test_a_forked_torchrun_is_our_child_with_its_output_and_exit_status(tmp_path, zygote):
    child = zygote.fork_torchrun(argv=["--nproc-per-node", "1", "--no-python", "sh", "-c", "echo out; echo err >&2; exit 3"],
                                 env={**os.environ, "TEST_MARK": "x"}, cwd=str(tmp_path))
    assert child is not None and psutil.Process(child.pid).ppid() == os.getpid()   # reparented to us
    out = child.stdout.read().decode()
    assert child.wait(timeout=60) == 1, out   # torchrun's status for a failed worker
    assert "out" in out and "err" in out and "exitcode  : 3" in out, out
    child.stdout.close()


def test_a_waiting_interpreter_is_titled_with_its_local_rank_and_socket(pool):
    with open(f"/proc/{pool.procs[0].pid}/cmdline", "rb") as fh:
        title = fh.read().rstrip(b"\0").decode().rstrip()
    assert title == f"ckptsup warm interpreter 0: {pool.socket(0)}", title
    assert psutil.Process(pool.procs[0].pid).cwd() == pool.cwd


def test_the_warm_rank_is_titled_as_its_rank_for_ps_and_py_spy(tmp_path, pool):
    """docs/supervisor.md §Finding a rank: ps shows the rank in the warm interpreter, not its proxy's argv."""
    pool.hand_out()
    p = proxy(tmp_path, pool.in_use_dir, "wait")
    assert p.stdout.readline().startswith("rank 3")
    with open(f"/proc/{pool.in_use[0].pid}/cmdline", "rb") as fh:
        title = fh.read().rstrip(b"\0").decode()
    assert title.rstrip() == f"ckptsup rank 3: {tmp_path / 's.py'} wait", title   # not cut to the zygote's argv
    p.kill()


def test_a_stopped_waiting_interpreter_is_not_handed_out_and_is_replaced(tmp_path, pool):
    stopped = pool.procs[0]
    stopped.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(stopped.pid).status() != psutil.STATUS_STOPPED:   # the signal is delivered asynchronously
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pool.ready() and not pool.hand_out()   # the launch starts cold at once
    pool.reap()
    assert stopped.wait(timeout=10) == -signal.SIGKILL and not pool.procs and pool.failed == 1


def test_a_proxy_facing_a_stopped_interpreter_starts_the_rank_cold_and_kills_it(tmp_path, pool):
    """Stopped between the agent's check and the proxy's connect: the hello never comes, so the
    proxy gives up after HELLO_TIMEOUT_S, kills it (a late wake-up must not run the rank twice)."""
    from ckptsup.rankside.warm_proxy import HELLO_TIMEOUT_S

    assert pool.hand_out()
    stopped = pool.in_use[0]
    stopped.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    p = proxy(tmp_path, pool.in_use_dir, "5")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 5 and "rank 3" in out, err
    assert stopped.wait(timeout=10) == -signal.SIGKILL
    assert time.monotonic() - t0 < HELLO_TIMEOUT_S + 60   # the timeout, then a cold start with its torch import


def test_adopted_orphans_are_reaped_and_known_children_left_to_their_handle(tmp_path, zygote):
    """The agent is a subreaper (as this module's process is): a dead launcher's orphans become
    its children, and reap_orphans collects them without taking a known child's exit status."""
    known = subprocess.Popen(["sh", "-c", "exit 4"])
    pidfile = tmp_path / "orphan"
    subprocess.run(["sh", "-c", f"sleep 0.3 & echo $! > {pidfile}"], check=True)   # sh exits; its sleep is ours now
    orphan = int(pidfile.read_text())
    assert psutil.Process(orphan).ppid() == os.getpid()
    deadline = time.monotonic() + 10
    while psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE or psutil.Process(known.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    reaped = reap_orphans({known.pid, zygote.pid})   # with any other exited child of this worker's earlier tests
    assert orphan in reaped and known.pid not in reaped, reaped
    assert not psutil.pid_exists(orphan) and known.wait(timeout=5) == 4


def test_an_agent_stops_starting_zygotes_that_die_before_they_are_ready_and_launches_cold(tmp_path, zygote):
    """A zygote that cannot import (here: python cannot start) is replaced once, then no more:
    the agent's launches start cold (torchrun from its own process) instead of waiting."""
    out_r, out_w = os.pipe()
    in_r, _in_w = os.pipe()
    spec = LaunchSpec(script="x.py", script_args=[], nproc_per_node=1, nnodes=1, rdzv_endpoint="127.0.0.1:1",
                      rdzv_id="t", node_addrs={"n1": "127.0.0.1"}, env={"PYTHONHOME": "/nonexistent"},
                      log_dir=str(tmp_path), cwd=str(tmp_path))
    agent = Agent(spec=spec, node="n1", secret=b"k" * 64, out=os.fdopen(out_w, "wb"), inp=os.fdopen(in_r, "rb"), attempt=0)
    try:
        agent.warming = True
        deadline = time.monotonic() + 60
        while agent.zygote_failures < MAX_ZYGOTE_FAILURES:
            assert time.monotonic() < deadline, agent.zygote_failures
            agent._tend_zygote()
            time.sleep(0.05)
        for _ in range(5):
            agent._tend_zygote()
        assert agent.zygote is None and agent.warming and agent._ready_zygote() is None
    finally:
        agent.shutdown()
        os.close(out_r)


def test_ranks_forked_from_one_zygote_draw_different_numpy_numbers(tmp_path, zygote):
    """A fork copies numpy's global generator: without the reseed every warm rank of the node,
    launch after launch, would draw the zygote's same numbers (a cold rank seeds from the OS)."""
    script = tmp_path / "draw.py"
    script.write_text("import numpy\nprint('draw', numpy.random.randint(1 << 62), flush=True)\n")
    draws = []
    for generation in range(2):
        directory = tmp_path / f"sock{generation}"
        directory.mkdir(mode=0o700)
        pool = WarmPool(directory=directory, size=1, cwd=str(tmp_path))
        pool.start(zygote)
        wait_ready("the warm interpreter", pool.ready)
        assert pool.hand_out()
        p = subprocess.Popen([sys.executable, "-m", "ckptsup.rankside.warm_proxy", str(script)], cwd=tmp_path,
                             env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", WARM_DIR: str(pool.in_use_dir)},
                             stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and out.startswith("draw "), out
        draws.append(out.split()[1])
        pool.close()
    assert draws[0] != draws[1], draws


def test_the_zygote_answers_a_bad_request_with_an_error_and_keeps_serving(tmp_path, zygote):
    """Garbage on the zygote's socket (not JSON, an unknown or unhashable kind, torchrun without its
    output fd, warm without its path) gets a one-line error, never a fork, and the zygote serves on."""
    control = zygote.control
    control.setblocking(True)
    control.settimeout(10)
    try:
        reader = control.makefile("rb")
        for raw in (b"not json\n", b'{"kind": ["warm"]}\n', b'{"kind": "exec", "argv": ["sh"]}\n',
                    b'{"kind": "torchrun", "argv": [], "env": {}, "cwd": "/"}\n', b'{"kind": "warm"}\n'):
            control.sendall(raw)
            reply = json.loads(reader.readline())
            assert set(reply) == {"error"} and reply["error"].startswith("bad request"), (raw, reply)
        reader.close()
    finally:
        control.setblocking(False)
    assert zygote.ready()
    child = zygote.fork_warm(listen=tmp_path / "w.sock", local_rank=0, cwd=str(tmp_path))
    assert child is not None
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL


EXIT_SCRIPT = """
import atexit, os, sys, threading, time, weakref
out = sys.argv[1]
log = open(os.path.join(out, "unclosed.txt"), "w")   # never closed: its finaliser must flush it
log.write("written, never flushed")
atexit.register(lambda: open(os.path.join(out, "atexit.txt"), "w").write("ran"))
class Held: pass
held = Held()
weakref.finalize(held, lambda: open(os.path.join(out, "finalize.txt"), "w").write("ran"))
def late():
    time.sleep(0.5)
    open(os.path.join(out, "thread.txt"), "w").write("joined")
threading.Thread(target=late).start()   # not a daemon: python waits for it, so must we
print("no newline at the end", end="")
sys.exit(4)
"""


def test_a_warm_rank_exits_as_python_would_threads_atexit_finalisers_and_unflushed_output(tmp_path, pool):
    """The warm interpreter skips only the teardown of its modules: what a script may count on at
    exit happens, and the exit status is the script's."""
    pool.hand_out()
    script, out = tmp_path / "exit.py", tmp_path / "out"
    script.write_text(EXIT_SCRIPT)
    out.mkdir()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", WARM_DIR: str(pool.in_use_dir)}
    p = subprocess.run([sys.executable, "-m", "ckptsup.rankside.warm_proxy", str(script), str(out)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 4, p.stderr
    assert p.stdout.endswith("no newline at the end")
    assert pool.in_use[0].wait(timeout=30) == 4
    ran = {f.name: f.read_text() for f in out.iterdir()}
    assert ran == {"unclosed.txt": "written, never flushed", "atexit.txt": "ran", "finalize.txt": "ran",
                   "thread.txt": "joined"}, p.stderr
