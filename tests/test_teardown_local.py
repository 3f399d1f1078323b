"""Every wait has an end (docs/architecture.md §Every wait has an end): ranks that finished and then
hang in teardown are killed `[supervisor] exit_grace_s` later and the run counts complete; a
stopped warm interpreter or pre-imported launcher delays nothing. And ranks you can find: a rank's
process is titled `ckptsup rank R: SCRIPT ARGS`, and `ckptsup status --json` lists its pid.
Real `ckptsup launch` runs (local mode, 2 ranks)."""
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckptsup.env import node_name
from ckptsup.events import read_events

from run_helpers import gone, named, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
WIRE_RANK = ROOT / "tests" / "helpers" / "wire_rank.py"
CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]

# no hooks: rank 0 exits 0, rank 1 leaves a non-daemon thread behind, so its interpreter never exits
UNHOOKED = """
import os, sys, threading, time
for step in range(int(sys.argv[1])):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
if os.environ["RANK"] == "1":
    threading.Thread(target=time.sleep, args=(10**6,), name="forgotten").start()
"""

# a hooked script's start: 2 gloo ranks, a model, its optimizer; argv[1] is the test's out dir
HOOKED_START = """
import os, sys, threading, time
from pathlib import Path
import torch
import torch.distributed as dist
import ckptsup

ckptsup.init_process_group()
rank = dist.get_rank()
out = Path(sys.argv[1])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

# hooks: both ranks step until <out>/go exists (agreed by an all-reduce), close (final checkpoint,
# bye), then rank 1 hangs in teardown the same way
HOOKED = HOOKED_START + """
run = ckptsup.attach(model=model, optimizer=opt, save_every_steps=10**6)
step = run.resume()
while True:
    loss = model(torch.ones(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.step_done(step, loss=loss.detach())
    step += 1
    go = torch.tensor([int((out / "go").exists())])
    dist.all_reduce(go, op=dist.ReduceOp.MAX)
    if go.item():
        break
    time.sleep(0.05)
run.close()
(out / f"closed{rank}").touch()
if rank == 1:
    threading.Thread(target=time.sleep, args=(10**6,), name="forgotten").start()
"""


# hooks: the loop raises on rank 0 at step 6 of the first attempt, inside `with attach()` (its bye
# says FAILURE), and a thread left behind keeps its interpreter from exiting; rank 1 waits for it in
# an all-reduce. The second attempt runs to the end.
RAISES_THEN_STUCK = HOOKED_START + """
first = not (out / "raised").exists()
if rank == 0 and first:
    threading.Thread(target=time.sleep, args=(10**6,), name="forgotten").start()
with ckptsup.attach(model=model, optimizer=opt, save_every_steps=4) as run:
    step = run.resume()
    while step < 12:
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        x = torch.ones(1)
        dist.all_reduce(x)
        run.step_done(step, loss=loss.detach())
        step += 1
        if rank == 0 and first and step == 6:
            (out / "raised").touch()
            raise RuntimeError("injected: the loop raised")
        time.sleep(0.05)
"""

def write_cfg(tmp_path: Path, supervisor: str = "") -> Path:
    path = tmp_path / "job.toml"
    # a port range of its own: other local launches on this machine (the same job id "local") use the default
    port = random.randrange(20000, 40000)
    path.write_text(f"[supervisor]\nhang_min_s = 3.0\nheartbeat_interval_s = 0.5\nrdzv_port = {port}\n" + supervisor +
                    "[checkpoint]\nadaptive_interval = false\nkeep_daily_days = 0\ntest_load_every = 0\n")
    return path


def start(tmp_path: Path, script: Path, *args: str, supervisor: str = "") -> tuple[subprocess.Popen, Path]:
    run = tmp_path / "run"
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(write_cfg(tmp_path, supervisor)),
            "--run-dir", str(run), str(script), *args]
    return subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), run


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def status_json(run: Path) -> dict:
    out = subprocess.run([*CKPTSUP, "status", "--json", str(run)], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def test_an_unhooked_rank_hanging_after_its_peer_exited_0_is_killed_at_the_default_grace(tmp_path):
    """The default exit_grace_s (30 s): sleeping processes cost no CPU, so the real default fits."""
    script = tmp_path / "unhooked.py"
    script.write_text(UNHOOKED)
    t0 = time.monotonic()
    proc, run = start(tmp_path, script, "40")
    out, _ = proc.communicate(timeout=180)
    elapsed = time.monotonic() - t0
    events = read_events(run)
    assert proc.returncode == 0, out[-3000:]
    [hang] = named(events, "teardown_hang")
    assert [(r["rank"], r["node"]) for r in hang["ranks"]] == [(1, node_name())], hang
    assert hang["exit_grace_s"] == 30.0 and 30.0 < hang["waited_s"] < 40.0, hang
    assert gone(hang["ranks"][0]["pid"]), "the hung rank is not dead"
    assert named(events, "run_complete") and not named(events, "failure_detected")
    assert "exit_grace_s" in out and "rank 1" in out
    print(f"unhooked teardown: launch ended after {elapsed:.1f}s in all, {hang['waited_s']:.1f}s after rank 0 "
          f"exited 0 (exit_grace_s=30)")


@pytest.mark.torch
def test_a_hooked_rank_hanging_after_close_is_killed_and_the_run_is_complete_and_findable(tmp_path):
    script, out_dir = tmp_path / "hooked.py", tmp_path / "out"
    script.write_text(HOOKED)
    out_dir.mkdir()
    proc, run = start(tmp_path, script, str(out_dir), supervisor="exit_grace_s = 3.0\n")
    try:
        # ranks you can find: both ranks' pids, live, titled as ranks, in status --json and on the terminal
        st = wait_for(lambda: (s := status_json(run)) and len(s.get("ranks") or []) == 2 and (s.get("step") or 0) >= 2
                      and s, 180, "both ranks stepping, their pids in status --json", proc)   # a step: attach ran
        for entry in st["ranks"]:
            assert entry["node"] == node_name() and psutil.pid_exists(entry["pid"]), entry
            title = cmdline(entry["pid"])
            assert title.startswith(f"ckptsup rank {entry['rank']}: {script}"), title
            assert entry["host_pid"] == entry["pid"]   # no pid namespace here: both views agree
        assert [e["rank"] for e in st["nodes"][node_name()]["pids"]] == [0, 1]
        shown = subprocess.run([*CKPTSUP, "status", str(run)], capture_output=True, text=True, timeout=60).stdout
        assert all(f"{e['rank']}:{e['pid']}" in shown for e in st["ranks"]), shown
        hung_pid = next(e["pid"] for e in st["ranks"] if e["rank"] == 1)
        (out_dir / "go").touch()
        wait_for(lambda: (out_dir / "closed1").exists(), 120, "rank 1's close()", proc)
        closed = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - closed
    finally:
        if proc.poll() is None:
            proc.kill()
    events = read_events(run)
    assert proc.returncode == 0, output[-3000:]
    [hang] = named(events, "teardown_hang")
    named_ranks = {(r["rank"], r["node"], r["pid"]) for r in hang["ranks"]}
    # rank 1 hangs; rank 0 may still be in its own exit then (torch tears its process group down)
    assert (1, node_name(), hung_pid) in named_ranks and named_ranks <= {
        (e["rank"], node_name(), e["pid"]) for e in st["ranks"]}, hang
    assert hang["exit_grace_s"] == 3.0 and 3.0 < hang["waited_s"] < 8.0, hang
    assert elapsed <= 3.0 + 10.0, elapsed
    assert gone(hung_pid)
    committed, [complete] = named(events, "checkpoint_committed"), named(events, "run_complete")
    assert committed and committed[-1]["step"] >= complete["step"], (committed, complete)   # close()'s final save
    assert not named(events, "failure_detected"), [(e["kind"], e["detail"]) for e in named(events, "failure_detected")]
    print(f"hooked teardown: launch ended {elapsed:.1f}s after rank 1's close() with exit 0 (exit_grace_s=3)")


def test_stopped_warm_interpreters_and_zygote_do_not_delay_the_end(tmp_path):
    """SIGSTOP the agent's waiting warm rank interpreters and its zygote (they answer no signal
    but SIGKILL): the run still ends promptly once its ranks finish, and they are gone."""
    out_dir = tmp_path / "out"
    go = out_dir / "go"
    proc, run = start(tmp_path, WIRE_RANK, "--steps", "5", "--step-s", "0.05", "--until", str(go), "--out", str(out_dir))
    try:
        wait_for(lambda: named(read_events(run), "first_step"), 240, "the first step", proc)
        me = psutil.Process(proc.pid)
        def warm_processes() -> list[psutil.Process]:
            """The zygote and both waiting interpreters of the next launch (the first launch's ran its
            ranks; the next ones are forked once it steps, and carry the zygote's command line until titled)."""
            children = me.children(recursive=True)
            zygotes = [p for p in children if "ckptsup.rankside.zygote" in cmdline(p.pid)]
            waiting = [p for p in children if cmdline(p.pid).startswith("ckptsup warm interpreter")]
            return [*zygotes, *waiting] if len(zygotes) == 1 and len(waiting) == 2 else []
        standby = wait_for(warm_processes, 30, "the zygote and 2 waiting interpreters")
        # the first launch too ran from the zygote: its ranks are warm interpreters (the agent's
        # children, not torchrun's), and torchrun is titled as itself, not as the zygote it was forked from
        [agent] = [p for p in me.children() if "ckptsup.cli agent" in cmdline(p.pid)]
        ranks = [p for p in me.children(recursive=True) if cmdline(p.pid).startswith("ckptsup rank ")]
        assert len(ranks) == 2 and all(p.ppid() == agent.pid for p in ranks), [(p.ppid(), cmdline(p.pid)) for p in ranks]
        assert [cmdline(p.pid).startswith("ckptsup torchrun: ") for p in agent.children()].count(True) == 1
        for p in standby:
            p.send_signal(signal.SIGSTOP)
        go.touch()
        t0 = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert named(read_events(run), "run_complete")
    assert elapsed < 15.0, f"a stopped warm process delayed the end: {elapsed:.1f}s"
    assert all(gone(p.pid) for p in standby)
    print(f"stopped warm interpreters: launch ended {elapsed:.1f}s after the go")


def test_a_rank_whose_loop_raised_and_whose_teardown_hangs_is_a_crash_at_the_defaults(tmp_path):
    """At the default settings: rank 0's loop raises inside `with attach()` and its process then
    never exits; rank 1 is left in an all-reduce. The supervisor calls it a crash of rank 0
    within seconds of its goodbye (attempt.FAILED_BYE_EXIT_S), not a hang of rank 1 at the hang
    timeout, and the next attempt resumes and completes."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = tmp_path / "raises.py"
    script.write_text(RAISES_THEN_STUCK)
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[supervisor]\nrdzv_port = {random.randrange(20000, 40000)}\n")   # its own ports; nothing else set
    run = tmp_path / "run"
    proc = subprocess.run([*CKPTSUP, "launch", "--nproc-per-node", "2", "--config", str(cfg), "--run-dir", str(run),
                           str(script), str(out_dir)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    events = read_events(run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [failure] = named(events, "failure_detected")
    assert failure["kind"] == "crash" and failure["rank"] == 0, failure
    assert "said goodbye with a failure" in failure["detail"], failure
    assert named(events, "run_complete")
