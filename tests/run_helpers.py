"""Starting a training script the ways a user does, and reading what its run left: plain torchrun
(the uninterrupted references), `ckptsup launch` (local mode), `ckptsup sbatch --submit` on the dev
cluster, a preemption there; the run's events, the per-rank sample logs (samples_rank{R}.jsonl)
and final parameters (final_rank{R}.pt) of tests/helpers/hf_train.py and lightning_train.py. One
copy for the HF, Lightning and drop-in tests (and the supervisor's dev-cluster tests); the rank
process finders are in drop_in_helpers.py, the environment of a rank (base_env) in hooks_helpers.py."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from ckptsup.events import read_events

from hooks_helpers import base_env, free_port

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
Events = list[dict[str, Any]]


def named(events: Events, name: str) -> Events:
    return [e for e in events if e["event"] == name]


def run_named(run: Path, name: str) -> Events:
    """The run's events called `name` (none while its log does not exist yet)."""
    return named(read_events(run), name) if (run / "events.jsonl").exists() else []


def node_deaths(events: Events) -> Events:
    """Node deaths as the supervisor found them: detected as such (silence), or attributed after the
    kill (the dead node's agent did not answer; a peer's crash was the first symptom)."""
    return [e for e in events if e["event"] in ("failure_detected", "failure_attributed") and e["kind"] == "node_down"]


def ended(run: Path) -> bool:
    """The run completed or gave up."""
    events = read_events(run)
    return bool(named(events, "run_complete") or named(events, "give_up"))


def wait_for(cond: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen | None = None) -> Any:
    """Poll `cond` until true and return what it gave; fail naming `what` after `timeout` s, or at
    once (with its output's end) when `proc`, the run waited on, ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}: {output[-3000:]!s}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def torchrun_argv(script: Path, *args: str) -> list[str]:
    """Plain torchrun, 2 ranks on this host, a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(script), *args]


def torchrun(script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Plain torchrun to its end. One still running after `timeout` fails the test with its ranks'
    stacks (SIGUSR2: the helper scripts register faulthandler for it) and leaves no rank behind
    (torchrun and every process under it are killed; subprocess.run's timeout would kill torchrun
    alone and leave the ranks, which hold its pipes open)."""
    argv = torchrun_argv(script, *args)
    proc = subprocess.Popen(argv, env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = psutil.Process(proc.pid).children()
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(signal.SIGUSR2)
        time.sleep(3)   # faulthandler writes the stacks to the stderr torchrun passes on
        # torchrun starts each worker in a session of its own: a group kill would miss them
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"plain torchrun of {script.name} still ran after {timeout:.0f} s (ranks "
                             f"{[r.pid for r in ranks]}); its output, stacks last:\n{out[-2000:]}\n{err[-8000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# torch's gloo teardown at interpreter exit, after the script returned: a worker's threads are
# destroyed joinable and it aborts (docs/integrations.md; seen on 2 of ~10 loaded suite runs, with
# destroy_process_group called). ckptsup itself counts it as a teardown crash that loses nothing.
TEARDOWN_ABORT = "terminate called without an active exception"


def teardown_abort_only(proc: subprocess.CompletedProcess) -> bool:
    """torchrun failed only because workers aborted at exit as above: the abort message is there,
    a worker ended with -6 (SIGABRT), and every other failure it reports is its own SIGTERM (-15)
    to the workers left."""
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr))
    return proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr and "-6" in codes and codes <= {"-6", "-15"}


def uninterrupted(script: Path, *args: str, timeout: float = 300, cwd: Path | None = None) -> None:
    """The reference: `script` uninterrupted under plain torchrun, which must succeed — or end with
    nothing but torch's teardown abort, after the script wrote its output (its callers load that
    output: a save cut short by torchrun's SIGTERM to the other ranks fails there, never silently)."""
    proc = torchrun(script, *args, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0 or teardown_abort_only(proc), proc.stdout[-2000:] + proc.stderr[-3000:]


def config_args(tmp: Path, config: str | None) -> list[str]:
    """`--config tmp/job.toml` holding `config`; none (the defaults) without one."""
    if config is None:
        return []
    (tmp / "job.toml").write_text(config)
    return ["--config", str(tmp / "job.toml")]


def launch(tmp: Path, run: Path, script: Path, *args: str, config: str | None = None,
           launch_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`ckptsup launch` of `script` with 2 local ranks in the background (cwd `tmp`; the job.toml
    there holds `config` when given), its console on stdout as text."""
    argv = [*CKPTSUP, "launch", "--nproc-per-node", "2", *config_args(tmp, config), "--run-dir", str(run),
            *launch_args, str(script), *args]
    return subprocess.Popen(argv, cwd=tmp, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def sbatch_submit(tmp: Path, config: Path, script: Path, *args: str, nodes: int, spares: int,
                  partition: str | None = None, flags: tuple[str, ...] = ()) -> tuple[str, Path]:
    """`ckptsup sbatch --submit` of `script` (one rank per node) on the dev cluster: (job id, run dir);
    `flags`: more of sbatch's own options (a container's)."""
    run = tmp / "run"
    where = ["--partition", partition] if partition else []
    proc = subprocess.run([*CKPTSUP, "sbatch", "--submit", "--json", "--nodes", str(nodes), "--spares", str(spares),
                           *where, *flags, "--nproc-per-node", "1", "--config", str(config), "--run-dir", str(run),
                           str(script),
                           *args], capture_output=True, text=True, timeout=60, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def preempt(dev_cluster: Any, nodes: list[str]) -> str:
    """A short job on the high-priority partition that needs `nodes`: Slurm preempts what runs there."""
    return dev_cluster.submit("#!/bin/bash\nsleep 5\n", "-p", "highprio", "--exclusive", "-N", str(len(nodes)),
                              "-w", ",".join(nodes))


def assert_requeued_not_complete(events: Events, why: str = "") -> Events:
    """A preempted job was requeued and completed once, in its resumed run; returns the supervisor starts."""
    starts = named(events, "supervisor_start")
    assert len(starts) >= 2 and starts[-1]["resumed"], "a preemption must requeue the job"
    first_end = [e for e in events if e["event"] in ("run_complete", "requeue", "give_up")][0]
    assert first_end["event"] != "run_complete", why or first_end
    assert [f for f in named(events, "failure_detected") if f["kind"] == "preempted"]
    assert len(named(events, "run_complete")) == 1 and named(events, "run_complete")[0]["ts"] > starts[-1]["ts"]
    return starts


def assert_completed_on_the_spare(events: Events, first: dict, victim: str) -> dict:
    """The run completed after its node `victim` died, relaunched on the spare(s) of its first
    launch `first`; returns the relaunch."""
    assert named(events, "run_complete"), [e for e in events if e["event"] in ("give_up", "failure_detected")]
    relaunch = named(events, "launch")[-1]
    assert victim not in relaunch["nodes"] and set(first["spares"]) <= set(relaunch["nodes"])
    return relaunch




def node_death_to_the_spare(dev_cluster: Any, run: Path, job: str) -> tuple[Events, dict]:
    """Kill the second node of the job's first launch, wait (at most 240 s) for the job to end:
    (its events, the relaunch on the spare), the dead node reported down."""
    first = named(read_events(run), "launch")[0]
    victim = first["nodes"][1]
    with dev_cluster.revived(victim):
        dev_cluster.kill_node(victim)
        dev_cluster.wait_for(lambda: ended(run), 240, what=f"job {job} to end")
    events = read_events(run)
    relaunch = assert_completed_on_the_spare(events, first, victim)
    down = node_deaths(events)
    assert down and down[-1]["node"] == victim
    return events, relaunch

def samples(out: Path, rank: int) -> dict[int, list[int]]:
    """step -> that step's sample ids on `rank`; after a resume the last line of a step wins (a
    replayed step rewrites it)."""
    steps: dict[int, list[int]] = {}
    for line in (out / f"samples_rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps[rec["step"]] = rec["ids"]
    return steps


def newest_sample_step(out: Path) -> int:
    """The newest step rank 0 has logged samples of (-1: none yet; a line being written is skipped)."""
    try:
        lines = (out / "samples_rank0.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=-1)


def resumed_at(out: Path, rank: int) -> int:
    """The first step of the second run: where the step numbers go back."""
    steps = [json.loads(line)["step"] for line in (out / f"samples_rank{rank}.jsonl").read_text().splitlines()]
    back = [b for a, b in zip(steps, steps[1:]) if b <= a]
    assert len(back) == 1, f"rank {rank}: not exactly one resume in {steps}"
    return back[0]


def assert_same_run(out: Path, reference: Path, steps: int) -> None:
    """Both ranks ran every step 0..steps-1 on the reference run's sample ids and end with its
    parameters, bit for bit."""
    import torch

    for rank in (0, 1):
        got, want = samples(out, rank), samples(reference, rank)
        assert sorted(got) == list(range(steps)), f"rank {rank} ran steps {sorted(got)}"
        assert got == want, f"rank {rank}: steps {[s for s in want if got.get(s) != want[s]]} saw other samples"
        final, expected = torch.load(out / f"final_rank{rank}.pt"), torch.load(reference / f"final_rank{rank}.pt")
        assert final.keys() == expected.keys(), f"rank {rank}: {sorted(final)} != {sorted(expected)}"
        for key in final:
            assert torch.equal(final[key], expected[key]), f"rank {rank}: parameter {key} differs"


def flip_a_bit(path: Path) -> None:
    """One bit in the middle of `path`: the size stays, only a hash can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def gone(pid: int) -> bool:
    """The process exited (a zombie not yet reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
