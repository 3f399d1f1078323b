"""A real spare's agent (`ckptsup agent` in standby, the supervisor's real AgentStep channel): it
warms up at once, refuses a launch without its node, and starts the launch that takes its node
over from its warm interpreters."""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest

from hooks_helpers import free_port

from ckptsup import messages
from ckptsup.env import NODE, SECRET_FILE
from ckptsup.rundir import RunDir
from ckptsup.supervisor.job.agent_step import AgentStep, CommandSender, Inbox, Message, StepSignal
from ckptsup.supervisor.job.placement import agent_command
from ckptsup.supervisor.spec import LaunchSpec
from ckptsup.wire import MessageKind


def spec_for(tmp: Path, node: str, script: Path, run: RunDir) -> LaunchSpec:
    return LaunchSpec(script=str(script), script_args=[], nproc_per_node=1, nnodes=1,
                      rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="t", node_addrs={node: "127.0.0.1"},
                      env={SECRET_FILE: str(run.secret_path), "OMP_NUM_THREADS": "1"}, log_dir=str(tmp),
                      heartbeat_interval_s=0.5, cwd=str(tmp))


def wait_for_message(inbox: Inbox, kind: MessageKind, timeout: float) -> Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = inbox.get(timeout=0.1)
        except queue.Empty:
            continue
        if got.m is kind:
            return got
        assert got.m is not StepSignal.EOF, f"the agent exited waiting for {kind.value}"
    raise AssertionError(f"no {kind.value} in {timeout} s")


@pytest.mark.torch
def test_a_spares_agent_warms_up_at_once_and_its_node_starts_warm_when_a_launch_takes_it(tmp_path):
    run = RunDir.create(tmp_path / "run")
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'on', os.environ['CKPTSUP_NODE'])\n")
    first = spec_for(tmp_path, "n1", script, run)
    path = tmp_path / "launch.json"
    first.write(path)
    inbox = Inbox()
    secret = run.read_secret()
    step = AgentStep(argv=agent_command(str(path), 0), env={**os.environ, NODE: "n2"}, nodes=("n2",), secret=secret,
                     sender=CommandSender(secret), inbox=inbox, log_path=tmp_path / "agents.log")
    try:
        wait_for_message(inbox, MessageKind.HB, 30)
        ready = wait_for_message(inbox, MessageKind.WARM_READY, 120)   # a spare warms up without any launch
        assert ready.node == "n2" and ready.body.interpreters == 1
        step.send(messages.Restart(attempt=1, spec=first.to_json()))   # n1's launch, not n2's
        take_over = spec_for(tmp_path, "n2", script, run)
        step.send(messages.Restart(attempt=2, spec=take_over.to_json()))
        launched = wait_for_message(inbox, MessageKind.LAUNCHED, 30)
        assert launched.body.attempt == 2 and launched.body.warm is True
        ended = wait_for_message(inbox, MessageKind.TORCHRUN_EXIT, 60)
        assert ended.body.rc == 0
    finally:
        step.close(5)
    assert "ignored a restart command: n2 is not a node of that launch" in (tmp_path / "agents.log").read_text()
    assert "rank 0 on n2" in (tmp_path / "ranks-n2.log").read_text()
