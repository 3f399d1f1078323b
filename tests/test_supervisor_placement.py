"""Where agents run: argv of the agent step, rendezvous endpoints, torchrun argv (pure)."""
import sys

import pytest

from ckptsup.config import PORT_SPREAD
from ckptsup.errors import ConfigError
from ckptsup.supervisor.node.agent import Agent, LaunchSpec
from ckptsup.supervisor.job.placement import Placement


def slurm_placement(**kw):
    return Placement(job_id="42", nodes=("n1", "n2", "n3"), addrs={"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"},
                     in_slurm=True, here="n9", **kw)


def test_agents_start_as_one_overlapping_srun_step_with_stdin_to_every_task():
    argv = slurm_placement().agent_argv(["n1", "n3"], "/run/attempt-2/launch.json", 2)
    # never -u: it cuts long lines anywhere (step_lines.py)
    assert argv[0] == "srun" and "-u" not in argv and "--overlap" in argv and "--input=all" in argv
    assert "--jobid=42" in argv and "--nodes=2" in argv and "--ntasks=2" in argv and "--ntasks-per-node=1" in argv
    assert "--nodelist=n[1,3]" in argv and "--kill-on-bad-exit=0" in argv
    assert argv[-5:] == ["agent", "--spec", "/run/attempt-2/launch.json", "--attempt", "2"]


def test_local_mode_runs_one_agent_child_with_this_interpreter():
    local = Placement(job_id="local", nodes=("box",), addrs={"box": "127.0.0.1"})
    assert local.agent_argv(["box"], "/r/launch.json", 0)[:4] == [sys.executable, "-m", "ckptsup.cli", "agent"]
    with pytest.raises(ConfigError):
        local.agent_argv(["a", "b"], "/r/launch.json", 0)


def test_rendezvous_port_differs_per_attempt_on_a_remote_first_node():
    p = slurm_placement()
    a, b = p.rdzv_endpoint("n1", 29500, 3), p.rdzv_endpoint("n1", 29500, 4)
    assert a.startswith("10.0.0.1:") and b.startswith("10.0.0.1:") and a != b


def test_local_rendezvous_port_is_free_and_inside_the_documented_range():
    import socket
    local = Placement(job_id="local", nodes=("box",), addrs={"box": "127.0.0.1"})
    base = 40000
    first = int(local.rdzv_endpoint("box", base, 0).rpartition(":")[2])
    assert base <= first <= base + PORT_SPREAD
    with socket.socket() as busy:  # the port it would pick is taken: it moves on, still in range
        busy.bind(("127.0.0.1", first))
        busy.listen()
        second = int(local.rdzv_endpoint("box", base, 0).rpartition(":")[2])
    assert second != first and base <= second <= base + PORT_SPREAD


def test_rendezvous_port_falls_back_to_the_spread_port_when_the_address_is_not_local():
    p = Placement(job_id="7", nodes=("n1",), addrs={"n1": "192.0.2.1"})  # TEST-NET: never ours
    port = int(p.rdzv_endpoint("n1", 29500, 2).rpartition(":")[2])
    assert port == 29500 + (sum(map(ord, "7")) * 97 + 2) % (PORT_SPREAD + 1)


def spec(**kw):
    base = dict(script="train.py", script_args=["--steps", "5"], nproc_per_node=4, nnodes=2,
                rdzv_endpoint="10.0.0.1:29555", rdzv_id="ckptsup-42-3",
                node_addrs={"n1": "10.0.0.1", "n3": "10.0.0.3"}, env={}, log_dir="/tmp", shutdown_timeout_s=130)
    base.update(kw)
    return LaunchSpec(**base)


def torchrun_argv(s, node):
    agent = Agent.__new__(Agent)  # only the argv builder is exercised: no socket, no process
    agent.spec, agent.node = s, node
    return agent.torchrun_argv()


def test_static_rendezvous_takes_node_ranks_from_the_supervisor():
    argv = torchrun_argv(spec(), "n3")
    joined = " ".join(argv)
    assert "--rdzv-backend static --master-addr 10.0.0.1 --master-port 29555 --node-rank 1" in joined
    assert "--local-addr 10.0.0.3" in joined and "--max-restarts 0" in joined
    assert "--shutdown-timeout 130" in joined and argv[-3:] == ["train.py", "--steps", "5"]


def test_c10d_rendezvous_uses_the_endpoint_and_the_nodes_own_address():
    joined = " ".join(torchrun_argv(spec(rdzv_backend="c10d"), "n1"))
    assert "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29555 --rdzv-id ckptsup-42-3" in joined
    assert "--local-addr 10.0.0.1" in joined
