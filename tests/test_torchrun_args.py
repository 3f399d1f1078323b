"""torchrun's command line under `ckptsup launch`: the pure interpretation (supervisor/
torchrun_args.py) and the click command that tokenizes it, down to the Job and config the
supervisor gets (the supervisor itself is not started)."""
from __future__ import annotations

import os

import pytest

from ckptsup import cli
from ckptsup.env import ExitStatus
from ckptsup.supervisor import loop
from ckptsup.supervisor.agent import Agent
from ckptsup.supervisor.placement import Placement
from ckptsup.supervisor.spec import LaunchSpec
from ckptsup.supervisor.torchrun_args import (REFUSED, UsageError, check_target, check_tee, node_count,
                                              nproc_choice, refusal, resolve_nproc)

from hooks_helpers import capture_supervisor


# ---- pure ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, choice", [(None, None), ("4", 4), ("gpu", "gpu"), ("auto", "auto"), ("GPU", "gpu"),
                                         ("0", 0), ("-3", -3)])
def test_nproc_choice_is_a_number_or_a_word_resolved_later(raw, choice):
    assert nproc_choice(raw) == choice  # a number's bounds are the config's (supervisor.nproc_per_node)


@pytest.mark.parametrize("raw, message", [
    ("cpu", "--nproc-per-node cpu: ckptsup sets ranks per node from the allocation; pass a number, gpu"),
    ("xpu", "--nproc-per-node xpu: ckptsup sets ranks per node"),
    ("two", "--nproc-per-node 'two' must be a number, gpu or auto"),
])
def test_nproc_words_torchrun_has_and_ckptsup_does_not_are_one_line(raw, message):
    with pytest.raises(UsageError, match=message) as err:
        nproc_choice(raw)
    assert err.value.exit_code == ExitStatus.USAGE


def test_node_count_is_fixed_and_min_max_is_refused_naming_nodes():
    assert node_count(None) is None and node_count("3") == 3 and node_count("2:2") == 2
    with pytest.raises(UsageError) as err:
        node_count("1:4")
    assert str(err.value).startswith("--nnodes 1:4: ckptsup fixes the node count") and "use --nodes N" in str(err.value)
    with pytest.raises(UsageError, match="must be a number of nodes"):
        node_count("many")


@pytest.mark.parametrize("choice, gpus, ranks", [(3, 8, 3), ("gpu", 2, 2), ("auto", 4, 4), ("auto", 0, 1)])
def test_gpu_and_auto_resolve_from_the_allocation(choice, gpus, ranks):
    assert resolve_nproc(choice, gpus, in_slurm=True)[0] == ranks


@pytest.mark.parametrize("in_slurm, fix", [(True, "submit with --gpus-per-node N"),
                                           (False, "set CUDA_VISIBLE_DEVICES (e.g. 0,1)")])
def test_gpu_without_gpus_is_one_line_with_the_fix(in_slurm, fix):
    with pytest.raises(UsageError) as err:
        resolve_nproc("gpu", 0, in_slurm=in_slurm)
    assert str(err.value).startswith("--nproc-per-node gpu: ") and fix in str(err.value)
    assert "or pass --nproc-per-node N" in str(err.value)


def test_every_torchrun_option_is_accepted_or_refused_by_name():
    """Against torch's own parser: no torchrun flag falls through to "unknown option"."""
    run = pytest.importorskip("torch.distributed.run")
    accepted = {o for p in _launch().params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}
    for action in run.get_args_parser()._actions:
        for option in action.option_strings:
            assert option in accepted or option in REFUSED, f"torchrun's {option} is neither accepted nor refused"


def _launch():
    from ckptsup.supervisor.cli import launch

    return launch


@pytest.mark.parametrize("option, says", [
    ("--monitor-interval", "heartbeat_interval_s"),
    ("--log-dir", "ranks-<node>.log"),
    ("-t", "use --tee (it takes no value)"),
])
def test_refusals_name_the_flag_and_what_ckptsup_does_instead(option, says):
    message = str(refusal(option))
    assert message.startswith(option.split("=")[0] + ": ") and says in message and "\n" not in message


def test_an_unknown_option_is_one_line_pointing_at_help():
    assert str(refusal("--frobnicate=3")).startswith("unknown option --frobnicate before SCRIPT; `ckptsup launch --help`")


def test_tee_takes_no_value():
    check_tee(True, "train.py")
    check_tee(False, "3")
    with pytest.raises(UsageError, match="--tee takes no value under ckptsup .*drop the 0:3,1:0"):
        check_tee(True, "0:3,1:0")


def test_a_script_file_becomes_absolute_a_module_stays_a_name(tmp_path):
    (tmp_path / "train.py").write_text("pass\n")
    assert check_target("train.py", module=False, no_python=False, cwd=tmp_path).script == str(tmp_path / "train.py")
    target = check_target("pkg.train", module=True, no_python=False, cwd=tmp_path)
    assert target.script == "pkg.train" and target.module  # not a file: never looked for


@pytest.mark.parametrize("script, module, no_python, message", [
    ("missing.py", False, False, "script missing.py does not exist"),
    ("pkg/train", True, False, "-m 'pkg/train' is not a module name"),
    ("pkg/train.py", True, False, "-m pkg/train.py names a file"),
    ("pkg..train", True, False, "is not a module name"),
    ("x", True, True, "-m and --no-python exclude each other"),
    ("./missing.sh", False, True, "--no-python: ./missing.sh does not exist"),
    ("no-such-program-here", False, True, "--no-python: no-such-program-here is not on PATH"),
])
def test_bad_targets_are_one_line(tmp_path, script, module, no_python, message):
    with pytest.raises(UsageError, match=message.replace(".", r"\.")):
        check_target(script, module=module, no_python=no_python, cwd=tmp_path)


def test_no_python_takes_an_executable_file_or_a_program_on_path(tmp_path):
    tool = tmp_path / "run.sh"
    tool.write_text("#!/bin/sh\n")
    with pytest.raises(UsageError, match="run.sh is not executable; chmod \\+x it"):
        check_target("./run.sh", module=False, no_python=True, cwd=tmp_path)
    tool.chmod(0o755)
    assert check_target("./run.sh", module=False, no_python=True, cwd=tmp_path).script == str(tool)
    found = check_target("run.sh", module=False, no_python=True, cwd="/", which=lambda name: str(tool))
    assert found.script == str(tool) and found.no_python


# ---- through the command ----------------------------------------------------------------------

@pytest.fixture
def launched(tmp_path, monkeypatch):
    """Run `ckptsup launch ARGS` locally (no Slurm, no GPU unless the test sets one) up to the
    supervisor, and return what it was handed; a refusal returns (exit status, stderr line)."""
    for name in [k for k in os.environ if k.startswith("SLURM_") or k == "CUDA_VISIBLE_DEVICES"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(tmp_path / "site.toml"))
    (tmp_path / "site.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    seen = capture_supervisor(monkeypatch)

    def launch(*args):
        seen.clear()
        with pytest.raises(SystemExit) as done:
            cli.main(["launch", "--run-dir", str(tmp_path / "run"), *args])
        return done.value.code, dict(seen)
    return launch


def test_torchrun_spellings_of_ranks_and_nodes(launched):
    for args in (["--nproc_per_node", "3"], ["--nproc-per-node=3"], ["--nproc_per_node=3"]):
        code, seen = launched(*args, "train.py")
        assert code == 0 and seen["resolved"].config.supervisor.nproc_per_node == 3
        assert seen["resolved"].provenance["supervisor.nproc_per_node"] == "flag supervisor.nproc_per_node"
    for args in (["--nnodes", "1"], ["--nnodes=1"], ["--nnodes=1:1"]):
        code, seen = launched(*args, "train.py")
        assert code == 0 and seen["resolved"].config.supervisor.nodes == 1


def test_ranks_per_node_default_to_the_allocations_gpus_else_one(launched, monkeypatch):
    code, seen = launched("train.py")
    assert code == 0 and seen["resolved"].config.supervisor.nproc_per_node == 1
    assert seen["resolved"].provenance["supervisor.nproc_per_node"].startswith("allocation (auto from default")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    code, seen = launched("train.py")
    assert seen["resolved"].config.supervisor.nproc_per_node == 3 and seen["placement"].gpus_per_node == 3
    code, seen = launched("--nproc-per-node", "gpu", "train.py")
    assert seen["resolved"].config.supervisor.nproc_per_node == 3
    assert seen["resolved"].provenance["supervisor.nproc_per_node"] == \
        "allocation (gpu from flag supervisor.nproc_per_node: 3 GPU(s) per node)"


def test_module_and_no_python_reach_the_job(launched, tmp_path):
    code, seen = launched("-m", "pkg.train", "--lr", "3")
    assert code == 0 and seen["job"].module and seen["job"].script == "pkg.train"
    assert seen["job"].script_args == ["--lr", "3"]
    tool = tmp_path / "run.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    code, seen = launched("--no-python", "./run.sh", "-m", "x")
    assert code == 0 and seen["job"].no_python and not seen["job"].module and seen["job"].script == str(tool)
    assert seen["job"].script_args == ["-m", "x"]  # after SCRIPT: the script's


def test_tee_is_ours_and_sets_supervisor_tee(launched):
    code, seen = launched("--tee", "train.py")
    assert code == 0 and seen["resolved"].config.supervisor.tee is True
    code, seen = launched("train.py")
    assert seen["resolved"].config.supervisor.tee is False


@pytest.mark.parametrize("args, line", [
    (["--nnodes", "1:4", "train.py"], "--nnodes 1:4: ckptsup fixes the node count"),
    (["--nproc-per-node", "gpu", "train.py"], "--nproc-per-node gpu: this machine names no GPU"),
    (["--tee", "3", "train.py"], "--tee takes no value"),
    (["-m", "train.py"], "-m train.py names a file; pass its module name (train), or drop -m"),
    (["-X", "train.py"], "unknown option -X before SCRIPT"),
])
def test_refused_command_lines_are_one_line_and_exit_usage(launched, capsys, args, line):
    code, seen = launched(*args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitStatus.USAGE and not seen
    assert len(err) == 1 and err[0].startswith(f"ckptsup: error: {line}"), err


@pytest.mark.parametrize("args, shown", [
    (["--standalone", "--nnodes", "1", "--nproc-per-node", "2"], "--standalone"),
    (["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400",
      "--rdzv-id", "77"], "--rdzv-backend c10d, --rdzv-endpoint localhost:29400, --rdzv-id 77"),
    (["--nnodes=1", "--nproc_per_node=2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master_port=29500"],
     "--master-addr 127.0.0.1, --master-port 29500, --node-rank 0"),
    (["--rdzv_conf=join_timeout=5", "--local-addr", "10.0.0.1"], "--rdzv-conf join_timeout=5, --local-addr 10.0.0.1"),
])
def test_the_rendezvous_group_is_accepted_with_one_info_line(launched, capsys, args, shown):
    """The issue's torchrun command lines: accepted, the rendezvous ckptsup's, said once."""
    code, seen = launched(*args, "train.py", "--lr", "3")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and seen["job"].script_args == ["--lr", "3"]
    assert err == [f"ckptsup: ckptsup picks the rendezvous ([supervisor] rdzv_backend, rdzv_port); {shown} ignored"]
    if "--nproc-per-node" in args or "--nproc_per_node=2" in args:
        assert seen["resolved"].config.supervisor.nproc_per_node == 2 and seen["resolved"].config.supervisor.nodes == 1


def test_no_rendezvous_flag_no_info_line(launched, capsys):
    code, _ = launched("train.py")
    assert code == 0 and capsys.readouterr().err == ""


def test_help_lists_torchruns_flags():
    from click.testing import CliRunner

    out = CliRunner().invoke(_launch(), ["--help"]).output
    for flag in ("--nproc_per_node N|gpu|auto", "--nnodes N", "-m, --module", "--no-python", "--tee", "--spares"):
        assert flag in out, flag
    assert "--gpus-per-node" not in out  # set by `ckptsup sbatch` only


# ---- down to torchrun's argv --------------------------------------------------------------------

def spec(**kw):
    base = dict(script="pkg.train", script_args=["--lr", "3"], nproc_per_node=2, nnodes=1,
                rdzv_endpoint="127.0.0.1:29555", rdzv_id="x", node_addrs={"n1": "127.0.0.1"}, env={}, log_dir="/tmp")
    return LaunchSpec(**{**base, **kw})


@pytest.mark.parametrize("kw, before", [({"module": True}, ["-m"]), ({"no_python": True}, ["--no-python"]), ({}, [])])
def test_torchrun_gets_module_or_no_python_right_before_the_script(kw, before):
    agent = Agent.__new__(Agent)
    agent.spec, agent.node = spec(**kw), "n1"
    argv = agent.torchrun_argv()
    at = argv.index("pkg.train")
    assert argv[at - len(before):at] == before and argv[at:] == ["pkg.train", "--lr", "3"]
    assert argv[at - len(before) - 2] == "--log-dir"   # after every option of torchrun's own


def test_the_launch_spec_carries_module_and_no_python_and_checks_them():
    data = spec(module=True).to_json()
    assert LaunchSpec.from_json(data).module is True
    from ckptsup.errors import ConfigError

    with pytest.raises(ConfigError, match="module must be true or false"):
        LaunchSpec.from_json({**data, "module": "yes"})
    old = {k: v for k, v in data.items() if k not in ("module", "no_python")}
    assert LaunchSpec.from_json(old).module is False  # a spec without them: a script file


def test_the_loop_puts_the_jobs_module_flag_in_the_spec(tmp_path, monkeypatch):
    from ckptsup.config import load_config
    from ckptsup.rundir import RunDir

    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(tmp_path / "site.toml"))
    (tmp_path / "site.toml").write_text("")
    resolved = load_config(flags={"supervisor.nproc_per_node": 2})
    job = loop.Job(script="pkg.train", script_args=[], cwd=str(tmp_path), nodes_needed=1, module=True)
    sv = loop.Supervisor(resolved=resolved, job=job, run_dir=RunDir.create(tmp_path / "run"),
                         placement=Placement(job_id="1", nodes=("n1",), addrs={"n1": "127.0.0.1"}))
    from ckptsup.supervisor.nccl import derive_timeouts

    written, path = sv._spec(("n1",), "", derive_timeouts(resolved.config, step_times=[], save_times=[]))
    assert LaunchSpec.read(path).module is True and not written.no_python  # what every agent reads
