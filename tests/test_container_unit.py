"""Containers, the pure parts (docs/containers.md): the plan from `[container]` and the flags, the agents'
srun line for each runtime against golden files written from the runtimes' documented flags (pyxis's
--container-image/-name/-mounts/-env/-workdir; Slurm's --container; `apptainer exec --bind --nv --pwd`),
the checks before a step starts, how an agent finds its node inside a container, why agents that never
started stopped, the version check of an agent's hello, and the dev cluster's oci.conf and bundle.
The real runs are tests/test_container_slurm.py.

Regenerate the golden files after an intended change with
CKPTSUP_UPDATE_GOLDEN=1 pytest tests/test_container_unit.py and review the diff."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptsup import messages
from ckptsup.config import ContainerConfig, load_config
from ckptsup.container import ContainerFlags, Mount, Runtime, bundle_problems, needed_paths, plan, problems
from ckptsup.errors import ConfigError
from ckptsup.slurm.devconf import ClusterSpec, render_bundle_config, render_oci_conf
from ckptsup.supervisor.job.agent_start import hello_problem, start_failure, version_note
from ckptsup.supervisor.job.placement import PER_TASK_VARIABLES, Placement
from ckptsup.supervisor.node.identity import agent_node, node_from_cgroup, shm_warning
from ckptsup.wire import WIRE_VERSION

GOLDEN = Path(__file__).parent / "golden" / "containers"
NEEDED = ["/shared/runs/42", "/home/u/proj", "/home/u/proj", "/shared/runs/42/checkpoints", "/scratch/local"]
SRUN_HELP_PYXIS = "Usage: srun [OPTIONS...]\n      --container=PATH    Path to OCI container bundle\n" \
                  "Options provided by plugins:\n      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n"


def check_golden(name: str, argv: list[str]) -> None:
    text = shlex.join(argv) + "\n"
    path = GOLDEN / name
    if os.environ.get("CKPTSUP_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"the agents' step differs from {path}; see the module docstring"


def config(**values) -> ContainerConfig:
    return ContainerConfig(**values)


def placement_with(box) -> Placement:
    return Placement(job_id="42", nodes=("n1", "n2", "n3"), in_slurm=True, here="n1", gpus_per_node=8, container=box)


def test_pyxis_step_imports_once_by_name_and_mounts_what_the_job_needs_at_its_own_path() -> None:
    box = plan(config(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", mounts=["/data:/data:ro"],
                      env=["NCCL_DEBUG"], workdir="/home/u/proj"), job_id="42", needed_paths=NEEDED)
    # the run dir covers its checkpoints; the user's mount list comes first
    assert [m.spec() for m in box.mounts] == ["/data:/data:ro", "/shared/runs/42:/shared/runs/42",
                                               "/home/u/proj:/home/u/proj", "/scratch/local:/scratch/local"]
    argv = placement_with(box).agent_argv(["n1", "n2"], "/shared/runs/42/attempt-0/launch.json", 0)
    check_golden("pyxis.txt", argv)
    assert "--container-name=ckptsup-42" in argv   # a later step (a spare, a node path) reuses the import
    assert argv[-8:] == ["python3", "-m", "ckptsup.cli", "agent", "--spec", "/shared/runs/42/attempt-0/launch.json",
                         "--attempt", "0"]   # the image's ckptsup, not this host's executable


def test_oci_step_is_srun_container_and_the_bundle_must_mount_the_jobs_paths(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "mounts": [
        {"destination": "/shared"}, {"destination": "/home"}]}))
    box = plan(config(runtime="oci", bundle=str(bundle), python="/opt/venv/bin/python"), job_id="42",
               needed_paths=NEEDED)
    assert box.mounts == ()   # Slurm passes no mounts to a bundle: its config.json holds them
    argv = placement_with(box).agent_argv(["n1"], "/shared/runs/42/attempt-3/launch.json", 3)
    check_golden("oci.txt", [a.replace(str(bundle), "BUNDLE") for a in argv])
    assert bundle_problems(str(bundle), needed=box.needed) == [
        f"OCI bundle {bundle} does not mount /scratch/local, which the job needs at the same path inside; "
        "add a bind mount for each to config.json's mounts"]
    with pytest.raises(ConfigError, match="does not apply to an OCI bundle"):
        plan(config(runtime="oci", bundle=str(bundle), mounts=["/x"]), job_id="42", needed_paths=[])


def test_apptainer_wraps_the_agent_with_binds_and_nv_when_the_allocation_has_gpus() -> None:
    box = plan(config(runtime="apptainer", image="/images/train.sif", workdir="/home/u/proj"), job_id="42",
               needed_paths=NEEDED)
    argv = placement_with(box).agent_argv(["n1", "n2"], "/shared/runs/42/attempt-0/launch.json", 0)
    check_golden("apptainer.txt", argv)
    wrapped = argv[argv.index("apptainer"):]
    assert wrapped[:2] == ["apptainer", "exec"] and "--nv" in wrapped and wrapped.index("/images/train.sif") < \
        wrapped.index("python3")
    cpu_only = Placement(job_id="42", nodes=("n1",), in_slurm=True, gpus_per_node=0, container=box)
    assert "--nv" not in cpu_only.agent_argv(["n1"], "/s.json", 0)


def test_bare_metal_is_unchanged_and_no_task_variable_of_the_batch_host_reaches_a_container(monkeypatch) -> None:
    bare = Placement(job_id="42", nodes=("n1",), in_slurm=True, here="n1")
    assert not any(a.startswith("--container") for a in bare.agent_argv(["n1"], "/s.json", 0))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert bare.agent_env(None)["SLURMD_NODENAME"] == "n1"
    boxed = placement_with(plan(config(runtime="oci", bundle="/b"), job_id="42", needed_paths=[])).agent_env(None)
    assert boxed["CKPTSUP_CONTAINER"] == "oci" and not set(PER_TASK_VARIABLES) & set(boxed)


def test_the_flags_choose_one_runtime_and_go_on_to_the_launch_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    flags = ContainerFlags(image="./train.sqsh", mounts="/data:/data,/x", env="A,B", python="/opt/py")
    assert flags.config_flags() == {"container.runtime": "pyxis", "container.image": str(tmp_path / "train.sqsh"),
                                    "container.mounts": ["/data:/data", "/x"], "container.env": ["A", "B"],
                                    "container.workdir": None, "container.python": "/opt/py"}
    assert ContainerFlags(apptainer="docker://pytorch/pytorch").config_flags()["container.image"] == \
        "docker://pytorch/pytorch"
    assert flags.argv() == ["--container-image", "./train.sqsh", "--container-mounts", "/data:/data,/x",
                            "--container-env", "A,B", "--container-python", "/opt/py"]
    with pytest.raises(ConfigError, match="--container and --apptainer exclude each other"):
        ContainerFlags(bundle="/b", apptainer="/a.sif").config_flags()


@pytest.mark.parametrize(("values", "match"), [
    ({"runtime": "pyxis"}, "needs an image; pass --container-image IMAGE"),
    ({"runtime": "oci"}, "needs a bundle; pass --container /path/to/bundle"),
    ({"image": "x"}, "container.image is set but container.runtime is none"),
])
def test_an_incomplete_plan_is_one_line(values, match) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(config(**values), job_id="1", needed_paths=[])


@pytest.mark.parametrize(("key", "value", "match"), [
    ("runtime", "docker", "must be one of"),
    ("mounts", ["data:/data"], "SRC\\[:DST\\[:FLAGS\\]\\] with absolute paths"),
    ("env", ["NOT A NAME"], "a variable's name"),
    ("image", "two words", "one word"),
])
def test_bad_container_values_are_refused_at_the_edge(tmp_path: Path, key, value, match) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f"[container]\n{key} = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(job_config=job, env={})


def test_what_stops_a_plan_before_any_step_is_named_with_its_fix(tmp_path: Path) -> None:
    pyxis = plan(config(runtime="pyxis", image="/images/missing.sqsh", mounts=[f"{tmp_path}/absent:/a"]),
                 job_id="1", needed_paths=[str(tmp_path)])
    found = problems(pyxis, srun_help=lambda: "Usage: srun\n      --container=PATH\n")
    assert found == ["this cluster's srun has no --container-image option (srun --help): install the pyxis SPANK "
                     "plugin on the cluster, or use --apptainer IMAGE",
                     "container image /images/missing.sqsh does not exist; import it (enroot import -o FILE.sqsh "
                     "docker://...) or pass a registry image such as nvcr.io#nvidia/pytorch:24.05-py3",
                     f"container mount source {tmp_path}/absent does not exist; create it or drop the mount"]
    registry = plan(config(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3"), job_id="1",
                    needed_paths=[str(tmp_path)])
    assert problems(registry, srun_help=lambda: SRUN_HELP_PYXIS) == []
    app = plan(config(runtime="apptainer", image="/nope.sif"), job_id="1", needed_paths=[])
    assert problems(app, srun_help=lambda: "", which=lambda _: None) == [
        "apptainer is not on PATH on the batch host; install Apptainer on the nodes, or load its module before "
        "`ckptsup launch`",
        "apptainer image /nope.sif does not exist; build it (apptainer build train.sif docker://...) or pass a "
        "docker:// URI"]
    assert problems(plan(config(runtime="oci", bundle=str(tmp_path / "none")), job_id="1", needed_paths=[]),
                    srun_help=lambda: SRUN_HELP_PYXIS) == [
        f"OCI bundle {tmp_path}/none is not a directory; pass the directory holding config.json and rootfs"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{not json")
    assert bundle_problems(str(tmp_path / "b")) == [
        f"OCI bundle {tmp_path}/b: config.json unreadable (not JSON); create it with `runc spec` in the bundle"]


def test_the_paths_a_container_needs_come_from_the_config(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[checkpoint]\ndir = "/lustre/ckpt/{job_id}"\n[storage]\nnode_local = "/local/{node}/cache"\n')
    config = load_config(job_config=job, env={}).config
    assert needed_paths(config, run_dir="/runs/7", cwd="/home/u", script="src/train.py", module=False) == [
        "/runs/7", "/home/u", "/home/u/src", "/lustre/ckpt", "/local"]
    assert needed_paths(config, run_dir="/runs/7", cwd="/home/u", script="pkg.train", module=True)[2:] == [
        "/lustre/ckpt", "/local"]


def test_launch_and_sbatch_refuse_a_container_in_one_line(tmp_path: Path, monkeypatch) -> None:
    from ckptsup.cli import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "train.py").write_text("print(1)\n")
    runner = CliRunner()
    local = runner.invoke(cli, ["launch", "--container", str(tmp_path), "train.py"])
    assert "needs a Slurm allocation: local mode runs on this machine's Python" in str(local.exception)
    both = runner.invoke(cli, ["sbatch", "--apptainer", "a.sif", "--container-image", "img", "train.py"])
    assert "exclude each other" in str(both.exception)
    missing = runner.invoke(cli, ["sbatch", "--container", str(tmp_path / "nope"), "train.py"])
    assert "is not a directory" in str(missing.exception)


def test_sbatch_hands_the_container_flags_to_the_launch_line_and_the_template_says_where_the_supervisor_runs() -> None:
    from ckptsup.resources import sbatch_templates_dir
    from ckptsup.slurm.render import SbatchParams, render_sbatch

    text = render_sbatch((sbatch_templates_dir() / "train.sbatch").read_text(),
                         SbatchParams(run_dir="/r/{job_id}", script="/t.py",
                                      container_args=("--container-image", "nvcr.io#nvidia/pytorch:24.05-py3")))
    [launch] = [line for line in text.splitlines() if " launch " in line]
    assert "--container-image 'nvcr.io#nvidia/pytorch:24.05-py3' /t.py" in launch   # quoted: '#' is a comment in bash
    assert "outside any container" in text


# ---- the agent inside: its node, /dev/shm ----------------------------------------------------------

def test_an_agent_finds_its_node_from_the_environment_slurms_container_id_or_the_hostname() -> None:
    assert agent_node({"SLURMD_NODENAME": "n2"}, cgroup_text="", hostname="runc") == ("n2", "SLURMD_NODENAME")
    job = {"SLURM_JOB_ID": "5000001", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[001-004]"}
    cgroup = "9:name=systemd:/gpu003.root.5000001.0.2\n8:pids:/gpu003.root.5000001.0.2\n"
    assert agent_node(job, cgroup_text=cgroup, hostname="runc") == ("gpu003", "container id")
    # another job's or step's id is not ours; a node name may hold dots
    assert node_from_cgroup("0::/n1.root.99.0.0\n", job) is None
    assert node_from_cgroup("0::/system.slice/a.b.c.u.5000001.0.1", job) == "a.b.c"
    assert agent_node(job, cgroup_text="0::/\n", hostname="gpu002.cluster") == ("gpu002", "hostname")
    with pytest.raises(ConfigError, match="cannot tell which node it runs on"):
        agent_node(job, cgroup_text="0::/\n", hostname="runc")
    assert agent_node({}, cgroup_text="", hostname="laptop") == ("laptop", "hostname")   # outside Slurm


def test_an_image_without_torch_is_one_line_that_the_supervisor_recognises() -> None:
    from ckptsup.supervisor.node.identity import torch_missing

    line = torch_missing("pyxis", python="/usr/bin/python3", find=lambda name: None)
    assert line is not None and "/usr/bin/python3" in line
    found = start_failure(f"ckptsup: error: {line}\nsrun: error: n1: task 0: Exited with exit code 2\n")
    assert found is not None and "use an image with PyTorch" in found
    assert torch_missing("", python="python3", find=lambda name: None) is None   # bare metal: torchrun's own error
    assert torch_missing("oci", python="python3") is None   # this interpreter has torch


def test_a_small_dev_shm_in_a_container_is_one_warning_naming_the_fix() -> None:
    line = shm_warning("n1", "oci", 64 << 20)
    assert line is not None and "64 MiB free" in line and "tmpfs at /dev/shm" in line
    assert shm_warning("n1", "", 64 << 20) is None and shm_warning("n1", "pyxis", 32 << 30) is None


# ---- the supervisor: agents that never started, another ckptsup in the image -------------------------

@pytest.mark.parametrize(("log", "says"), [
    ("/opt/venv/bin/python: Error while finding module specification for 'ckptsup.cli' "
     "(ModuleNotFoundError: No module named 'ckptsup')\nsrun: error: n1: task 0: Exited with exit code 1\n",
     "install ckptsup in the image (pip install ckptsup=="),
    ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'\n", "has no torch"),
    ("slurmstepd: error: execve(): python3: No such file or directory\n", "[container] python is not in"),
    ('time="2026-12-06T05:42:33Z" level=error msg="runc run failed: unable to start container process: exec: '
     '\\"/opt/py\\": stat /opt/py: no such file or directory"\nsrun: error: n1: task 0: Exited with exit code 1\n',
     "[container] python is not in"),
    ("ckptsup: error: the agent cannot tell which node it runs on: ...\n", "cannot tell which node"),
    ("pyxis: importing docker image: nvcr.io#nvidia/nope\npyxis: failed to import docker image\n", "pyxis/enroot"),
    ("FATAL:   could not open image /images/x.sif: no such file\n", "apptainer could not start"),
])
def test_agents_that_never_started_are_explained_by_their_log(log, says) -> None:
    found = start_failure(log)
    assert found is not None and says in found


def test_a_node_s_own_trouble_is_not_a_start_failure() -> None:
    assert start_failure("srun: error: Node failure on n2\nsrun: Job step aborted\n") is None
    assert start_failure("") is None


def test_an_agent_of_another_wire_is_refused_and_another_version_of_the_same_wire_is_noted() -> None:
    same = messages.AgentHello(version="0.0.9", wire=WIRE_VERSION)
    assert hello_problem("n1", same) is None
    assert version_note("n1", same) is not None and "the same wire" in version_note("n1", same)
    other = messages.AgentHello(version="9.0.0", wire=WIRE_VERSION + 1)
    problem = hello_problem("n2", other)
    assert problem is not None and "ckptsup 9.0.0 (wire" in problem and "install ckptsup==" in problem


# ---- the dev cluster's containers ------------------------------------------------------------------

def test_dev_cluster_oci_conf_uses_slurms_container_id_and_a_runc_root_of_its_own(tmp_path: Path) -> None:
    spec = ClusterSpec(dir=tmp_path, containers=True)
    text = render_oci_conf(spec)
    assert f'RunTimeRun="runc --root {tmp_path}/runc/%n run %n.%u.%j.%s.%t -b %b"' in text
    assert {line.split("=", 1)[0] for line in text.splitlines() if not line.startswith("#")} == {
        "RunTimeQuery", "RunTimeKill", "RunTimeDelete", "RunTimeRun"}   # the keys 22.05 reads


def test_the_test_bundle_binds_the_host_read_only_and_keeps_runcs_small_dev_shm() -> None:
    config = render_bundle_config(binds=["/work/main"], writable=["/tmp"])
    mounts = {m["destination"]: m for m in config["mounts"]}
    assert mounts["/usr"]["options"] == ["rbind", "ro"] and mounts["/work/main"]["options"] == ["rbind", "ro"]
    assert mounts["/tmp"]["options"] == ["rbind", "rw"] and "size=65536k" in mounts["/dev/shm"]["options"]
    assert {n["type"] for n in config["linux"]["namespaces"]} == {"pid", "ipc", "uts", "mount"}
    assert config["root"] == {"path": "rootfs", "readonly": True}


def test_a_launch_whose_agents_start_in_containers_has_a_container_phase() -> None:
    from ckptsup.supervisor.job.attempt import Marks

    marks = Marks(detect=0.0, killed=1.0, health_done=2.0, launch_sent=2.0, agents_up=5.0, all_hello=6.0,
                  rendezvous_done=7.0, train_start=8.0, first_step=9.0)
    assert marks.phases() == {"kill_s": 1.0, "health_s": 1.0, "container_s": 3.0, "launch_s": 1.0,
                              "rendezvous_s": 1.0, "load_s": 1.0, "first_step_s": 1.0}
    bare = Marks(detect=0.0, killed=1.0, health_done=2.0, launch_sent=2.0, all_hello=6.0, first_step=9.0)
    assert "container_s" not in bare.phases() and bare.phases()["launch_s"] == 4.0


def test_mount_syntax_round_trips() -> None:
    assert Mount.parse("/a").spec() == "/a:/a" and Mount.parse("/a:/b:ro").spec() == "/a:/b:ro"
    assert Runtime("oci") is Runtime.OCI
