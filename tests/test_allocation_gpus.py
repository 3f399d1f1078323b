"""GPUs per node come from the allocation (slurm/allocation.py), not from the config: Slurm's
environment, `scontrol show job -d`, CUDA_VISIBLE_DEVICES locally. Pure parsers on literal text."""
from __future__ import annotations

import pytest

from ckptsup.errors import CkptsupError, ConfigError, SlurmCommandError
from ckptsup.slurm.allocation import (allocation_from_env, count_devices, gpus_from_env, gpus_from_scontrol,
                                      local_gpus, node_gpus)
from ckptsup.slurm.client import CommandResult, SlurmClient
from ckptsup.supervisor.job.placement import Placement

# `scontrol show job -d` of a `--gpus-per-node=2` job on the dev cluster (Slurm 22.05.8), trimmed
GPU_JOB = """\
JobId=1 JobName=g.sh
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=n[1-2]
   BatchHost=n1
   NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,node=2,billing=2
   JOB_GRES=gpu:4
     Nodes=n[1-2] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   TresPerNode=gres:gpu:2
"""
# the same cluster, a job that asked for no GPU
CPU_JOB = """\
JobId=2 JobName=g.sh
   NodeList=n1
   JOB_GRES=(null)
     Nodes=n1 CPU_IDs=0 Mem=0 GRES=
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
"""


@pytest.mark.parametrize("raw, count", [
    ("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("0,-1,2", 1), ("NoDevFiles", 0),
    ("GPU-8e5a4c1f-aaaa,GPU-77b0c9d2-bbbb", 2), ("MIG-GPU-1/0/0", 1), (" 0 , 1 ", 2),
])
def test_a_device_list_counts_as_cuda_reads_it(raw, count):
    assert count_devices(raw) == count


def test_gpus_on_node_wins_then_the_job_gpu_list_then_nothing():
    assert gpus_from_env({"SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GPUS": "0,1,2,3"}) == 2
    assert gpus_from_env({"SLURM_JOB_GPUS": "0,1,2"}) == 3
    assert gpus_from_env({"SLURM_GPUS_ON_NODE": "", "SLURM_JOB_GPUS": ""}) is None
    assert gpus_from_env({}) is None
    assert gpus_from_env({"SLURM_GPUS_ON_NODE": "0"}) == 0


def test_a_garbled_gpus_on_node_is_one_line_naming_the_variable():
    with pytest.raises(ConfigError, match="SLURM_GPUS_ON_NODE='two' is not an integer"):
        gpus_from_env({"SLURM_GPUS_ON_NODE": "two"})


def test_the_allocation_carries_the_environment_figure():
    alloc = allocation_from_env({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "2"})
    assert alloc.gpus_on_node == 2
    assert allocation_from_env({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"}).gpus_on_node is None


def test_scontrol_per_node_gres_line_gives_gpus_per_node_not_the_job_total():
    assert gpus_from_scontrol(GPU_JOB) == 2
    assert gpus_from_scontrol(GPU_JOB, "n2") == 2
    assert gpus_from_scontrol(CPU_JOB) == 0


@pytest.mark.parametrize("line, count", [
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu(IDX:0-1)", 2),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu:a100:3(IDX:0-1,3)", 3),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu:a100:2(IDX:0-1),nic:1(IDX:0)", 2),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=nic:1(IDX:0)", 0),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu:4(IDX:N/A)", 4),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu:3g.20gb:1(IDX:0)", 1),
    ("     Nodes=n1 CPU_IDs=0-7 Mem=0 GRES=gpu:h100:4(IDX:0-3),gpu:a100:1(IDX:4)", 5),
])
def test_scontrol_gres_spellings(line, count):
    assert gpus_from_scontrol(f"JobId=9\n{line}\n") == count


def test_scontrol_picks_the_named_nodes_line_of_a_mixed_allocation():
    text = ("JobId=9\n     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:4(IDX:0-3)\n"
            "     Nodes=n[2-3] CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)\n")
    assert gpus_from_scontrol(text, "n3") == 8 and gpus_from_scontrol(text, "n1") == 4
    assert gpus_from_scontrol(text, "n9") == 4  # unknown node: the first line


def test_scontrol_without_per_node_lines_falls_back_to_tres_per_node():
    assert gpus_from_scontrol("JobId=9\n   TresPerNode=gres:gpu:2\n") == 2
    assert gpus_from_scontrol("JobId=9\n   TresPerNode=gres/gpu:a100=4\n") == 4
    assert gpus_from_scontrol("JobId=9\n   NodeList=n1\n") == 0


@pytest.mark.parametrize("value, count", [(None, 0), ("", 0), ("-1", 0), ("0", 1), ("0,1,2,3", 4)])
def test_local_gpus_are_cuda_visible_devices(value, count):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert local_gpus(env) == count
    assert Placement.local(env).gpus_per_node == count


def test_a_health_check_step_counts_the_devices_slurm_gave_it():
    assert node_gpus({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}) == 2
    assert node_gpus({"SLURM_JOB_ID": "1", "SLURM_STEP_GPUS": "0,1,2"}) == 3
    assert node_gpus({"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "8"}) == 2  # not in an allocation
    assert node_gpus({"SLURM_JOB_ID": "1"}) == 0


class FakeSlurm:
    """The one seam: answers scontrol by argv, records every call."""

    def __init__(self, job_text: str | None):
        self.job_text, self.calls = job_text, []

    def __call__(self, argv, timeout_s, env):
        self.calls.append(argv)
        if argv[:3] == ["scontrol", "show", "job"]:
            if self.job_text is None:
                return CommandResult(argv=argv, returncode=1, stdout="", stderr="slurm_load_jobs error: Invalid job id")
            return CommandResult(argv=argv, returncode=0, stdout=self.job_text, stderr="")
        if argv[:3] == ["scontrol", "show", "node"]:
            return CommandResult(argv=argv, returncode=0, stdout=f"NodeName={argv[-1]} NodeAddr=127.0.0.1", stderr="")
        return CommandResult(argv=argv, returncode=0, stdout="", stderr="")


def placement_with(monkeypatch, env, job_text):
    fake = FakeSlurm(job_text)
    monkeypatch.setattr(SlurmClient, "from_config",
                        classmethod(lambda cls, cfg, **kw: cls(runner=fake, retry_budget_s=0.1, **kw)))
    from ckptsup.config import SlurmConfig

    return Placement.from_slurm(env, SlurmConfig()), fake


def test_placement_in_slurm_reads_the_environment_and_asks_scontrol_only_when_it_is_silent(monkeypatch):
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"}
    placement, fake = placement_with(monkeypatch, {**env, "SLURM_GPUS_ON_NODE": "2"}, GPU_JOB)
    assert placement.gpus_per_node == 2 and not any(c[:3] == ["scontrol", "show", "job"] for c in fake.calls)
    placement, fake = placement_with(monkeypatch, env, GPU_JOB)
    assert placement.gpus_per_node == 2 and ["scontrol", "show", "job", "-d", "1"] in fake.calls
    placement, _ = placement_with(monkeypatch, env, CPU_JOB)
    assert placement.gpus_per_node == 0


def test_placement_counts_no_gpu_when_scontrol_fails_and_says_so_on_one_line(monkeypatch, capsys):
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1"}
    placement, _ = placement_with(monkeypatch, env, None)
    assert placement.gpus_per_node == 0
    [line] = [x for x in capsys.readouterr().err.splitlines() if "GPUs" in x]
    assert line.startswith("ckptsup: GPUs of job 1 unknown (scontrol show job failed")


def test_scontrol_failure_is_a_ckptsup_error():
    client = SlurmClient(runner=FakeSlurm(None), retry_budget_s=0.1)
    with pytest.raises(SlurmCommandError) as err:
        client.job_gpus_per_node("1")
    assert isinstance(err.value, CkptsupError)


def test_only_a_step_of_several_tasks_is_an_srun_in_front_of_launch():
    from ckptsup.slurm.allocation import srun_task

    assert srun_task({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}) is None   # the batch script: no step id
    assert srun_task({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None  # srun --pty bash
    assert srun_task({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}) == (1, 2)
    assert srun_task({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "two"}) is None
