"""Node health checks, run for real on this machine (site commands, free space, shared FS probe,
GPU visibility), and the per-node result parsing of the srun step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ckptsup.config import Config, Resolved, write_config_json
from ckptsup.rundir import RunDir
from ckptsup.supervisor.health import health
from ckptsup.supervisor.health.health import CheckPaths, NodeHealth, check_paths, parse_node_results, run_local_checks


def config(**health_kw) -> Config:
    c = Config()
    for k, v in health_kw.items():
        setattr(c.health, k, v)
    c.storage.min_free_gb = 0.001
    return c


def paths(tmp_path: Path) -> CheckPaths:
    run = RunDir.create(tmp_path / "run").path
    return CheckPaths(run_dir=run, tiers={"shared": run / "checkpoints"})


def by_name(results):
    return {r.name: r for r in results}


def test_healthy_node_passes_every_builtin_check(tmp_path) -> None:
    results = run_local_checks(config(check_gpus="off"), paths(tmp_path), node="n1")
    assert [r.name for r in results] == ["free_space:shared", "shared_fs"]
    assert all(r.ok for r in results)
    assert not any(p.name.startswith(".health") for p in (tmp_path / "run").iterdir())  # probe removed


def test_failing_site_command_marks_the_node_unhealthy_with_its_stderr(tmp_path) -> None:
    cmd = f"{sys.executable} -c \"import sys; sys.stderr.write('ECC errors: 12'); sys.exit(3)\""
    results = by_name(run_local_checks(config(commands=["true", cmd], check_gpus="off"), paths(tmp_path)))
    assert results["site:true"].ok
    bad = results[f"site:{cmd}"]
    assert not bad.ok and bad.detail == "exit 3: ECC errors: 12"


def test_site_command_is_not_run_through_a_shell(tmp_path) -> None:
    marker = tmp_path / "pwned"
    results = run_local_checks(config(commands=[f"echo hi; touch {marker}"], check_gpus="off"), paths(tmp_path))
    assert results[0].ok and "hi; touch" in results[0].detail  # echo printed the rest as text
    assert not marker.exists()


def test_site_command_timeout_and_missing_program_fail_the_check(tmp_path) -> None:
    c = config(commands=["sleep 5", "/nonexistent/check"], timeout_s=0.3, check_gpus="off")
    results = by_name(run_local_checks(c, paths(tmp_path)))
    assert not results["site:sleep 5"].ok and "timed out after 0.3s" in results["site:sleep 5"].detail
    assert results["site:sleep 5"].duration_s < 2
    assert not results["site:/nonexistent/check"].ok and "cannot run" in results["site:/nonexistent/check"].detail


def test_site_command_sees_the_node_name(tmp_path) -> None:
    cmd = f"{sys.executable} -c \"import os; print(os.environ['CKPTSUP_NODE'])\""
    results = run_local_checks(config(commands=[cmd], check_gpus="off"), paths(tmp_path), node="n3")
    assert results[0].detail == "n3"


def test_too_little_free_space_fails(tmp_path) -> None:
    c = config(check_gpus="off")
    c.storage.min_free_gb = 1e9  # an exabyte
    results = by_name(run_local_checks(c, paths(tmp_path)))
    assert not results["free_space:shared"].ok and "minimum 1e+09 GB" in results["free_space:shared"].detail


def test_unwritable_run_dir_fails_the_shared_fs_check(tmp_path) -> None:
    p = paths(tmp_path)
    os.chmod(p.run_dir, 0o500)
    try:
        if os.access(p.run_dir, os.W_OK):  # root ignores modes; use a missing dir instead
            p = CheckPaths(run_dir=tmp_path / "missing", tiers={})
        results = by_name(run_local_checks(config(check_gpus="off"), p))
    finally:
        os.chmod(tmp_path / "run", 0o700)
    assert not results["shared_fs"].ok and "cannot write+fsync" in results["shared_fs"].detail


def test_gpus_required_without_nvidia_smi_fails_and_auto_skips(tmp_path) -> None:
    p = paths(tmp_path)
    required = by_name(run_local_checks(config(check_gpus="require"), p, which=lambda name: None))
    assert not required["gpus"].ok and "nvidia-smi not found" in required["gpus"].detail
    auto = by_name(run_local_checks(config(check_gpus="auto"), p, which=lambda name: None))
    assert "gpus" not in auto


def fake_smi(tmp_path, gpus=2):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {k}: NVIDIA H100 (UUID: GPU-{k})'\n" for k in range(gpus)))
    fake.chmod(0o755)
    return fake


def test_gpu_count_below_the_allocations_gpus_per_node_fails(tmp_path) -> None:
    fake = fake_smi(tmp_path)
    c = config(check_gpus="auto")
    c.sbatch.gpus_per_node = 2  # what was submitted does not count: the allocation's figure does
    result = by_name(run_local_checks(c, paths(tmp_path), which=lambda name: str(fake), gpus_per_node=4))["gpus"]
    assert not result.ok and result.detail == "2 GPU(s) visible (need 4)"
    assert by_name(run_local_checks(c, paths(tmp_path), which=lambda name: str(fake), gpus_per_node=2))["gpus"].ok


def test_auto_without_nvidia_smi_counts_the_devices_slurm_gave_the_step(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    results = by_name(run_local_checks(config(check_gpus="auto"), paths(tmp_path), which=lambda name: None,
                                       gpus_per_node=2))
    assert results["gpus"].ok
    assert results["gpus"].detail == "2 GPU(s) allocated by Slurm here, no nvidia-smi to list them (need 2)"
    node = NodeHealth(node="n1", results=tuple(results.values()))
    assert node.summary() == f"healthy ({results['gpus'].detail})"  # the health_check event shows the GPUs
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    short = by_name(run_local_checks(config(check_gpus="auto"), paths(tmp_path), which=lambda name: None,
                                     gpus_per_node=2))["gpus"]
    assert not short.ok and short.detail.startswith("1 GPU(s) allocated by Slurm here")


def test_auto_skips_the_gpu_check_when_the_allocation_has_none_and_require_still_demands_one(tmp_path) -> None:
    fake = fake_smi(tmp_path, gpus=0)
    auto = by_name(run_local_checks(config(check_gpus="auto"), paths(tmp_path), which=lambda n: str(fake),
                                    gpus_per_node=0))
    assert "gpus" not in auto
    required = by_name(run_local_checks(config(check_gpus="require"), paths(tmp_path), which=lambda n: str(fake),
                                        gpus_per_node=0))["gpus"]
    assert not required.ok and required.detail == "0 GPU(s) visible (need 1)"


def test_without_a_figure_the_node_expects_its_own_allocation(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_GPUS", "0,1,2")
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    fake = fake_smi(tmp_path, gpus=2)
    result = by_name(run_local_checks(config(check_gpus="auto"), paths(tmp_path), which=lambda n: str(fake)))["gpus"]
    assert not result.ok and result.detail == "2 GPU(s) visible (need 3)"


def test_check_paths_expand_node_local_tier(tmp_path) -> None:
    c = Config()
    c.storage.node_local = "file:///scratch/{job_id}/{node}"
    p = check_paths(c, tmp_path, node="n2", job_id="99")
    assert p.tiers == {"shared": tmp_path / "checkpoints", "node_local": Path("/scratch/99/n2")}


def test_parse_node_results_marks_silent_nodes_unhealthy() -> None:
    good = NodeHealth(node="n1", results=(health.CheckResult(name="shared_fs", ok=True),))
    stdout = "srun: some noise\n" + json.dumps(good.to_dict()) + "\nnot json {\n"
    out = parse_node_results(stdout, ["n1", "n2"], failure="srun: error: n2: Communication failure")
    assert out["n1"].ok and not out["n2"].ok
    assert "no health result from n2" in out["n2"].summary() and "Communication failure" in out["n2"].summary()


def test_module_entry_prints_one_json_line_and_exits_1_when_unhealthy(tmp_path) -> None:
    rd = RunDir.create(tmp_path / "run")
    c = config(commands=["false"], check_gpus="off")
    write_config_json(Resolved(config=c, provenance={}), rd.config_json_path)
    proc = subprocess.run([sys.executable, "-m", "ckptsup.supervisor.health.health", "--run-dir", str(rd.path),
                           "--node", "n4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stdout.splitlines()
    data = json.loads(line)
    assert data["node"] == "n4" and data["ok"] is False
    assert {r["name"]: r["ok"] for r in data["results"]}["site:false"] is False


def test_node_checks_argv_is_one_overlapping_step_per_node(tmp_path) -> None:
    argv = health.node_checks_argv(["n1", "n3"], tmp_path, job_id="5")
    assert argv[0] == "srun" and "--overlap" in argv and "--nodelist=n[1,3]" in argv
    assert "--ntasks-per-node=1" in argv and "--jobid=5" in argv
    assert argv[argv.index("-m") + 1:] == ["ckptsup.supervisor.health.health", "--run-dir", str(tmp_path)]
    with_gpus = health.node_checks_argv(["n1"], tmp_path, job_id="5", gpus_per_node=2)
    assert with_gpus[with_gpus.index("-m") + 1:] == ["ckptsup.supervisor.health.health", "--run-dir", str(tmp_path),
                                                     "--gpus", "2"]


def test_the_supervisors_health_checker_hands_every_node_the_allocations_gpus(tmp_path, monkeypatch) -> None:
    from ckptsup.supervisor.job import recovery

    seen = []
    monkeypatch.setattr(health, "check_gpus", lambda mode, expected, *a, **kw: seen.append(expected))
    c = config(check_gpus="auto")
    recovery.health_checker(c, run_dir=RunDir.create(tmp_path / "run").path, job_id="local", in_slurm=False,
                            gpus_per_node=2)(["n1"])
    assert seen == [2]
    popened = []

    class Proc:
        returncode = 0

        def __init__(self, argv, **kw):
            popened.append(argv)

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(health.subprocess, "Popen", Proc)
    recovery.health_checker(c, run_dir=tmp_path / "run", job_id="5", in_slurm=True, gpus_per_node=2)(["n1", "n2"])
    assert [argv[-2:] for argv in popened] == [["--gpus", "2"], ["--gpus", "2"]]


def test_module_entry_checks_the_gpus_it_is_told_of_against_the_step(tmp_path) -> None:
    rd = RunDir.create(tmp_path / "run")
    write_config_json(Resolved(config=config(check_gpus="auto"), provenance={}), rd.config_json_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_"))}
    env.update(SLURM_JOB_ID="5", SLURM_GPUS_ON_NODE="2", PATH=os.path.dirname(sys.executable))  # no nvidia-smi
    for want, rc in (("2", 0), ("4", 1)):
        proc = subprocess.run([sys.executable, "-m", "ckptsup.supervisor.health.health", "--run-dir", str(rd.path),
                               "--node", "n1", "--gpus", want], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == rc, proc.stdout + proc.stderr
        gpus = {r["name"]: r for r in json.loads(proc.stdout)["results"]}["gpus"]
        assert gpus["detail"] == f"2 GPU(s) allocated by Slurm here, no nvidia-smi to list them (need {want})"
