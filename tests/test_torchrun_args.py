"""torchrun's command line under `ckptsup launch`: the pure interpretation (supervisor/
torchrun_args.py) and the click command that tokenizes it, down to the Job and config the
supervisor gets (the supervisor itself is not started)."""
from __future__ import annotations

import os
import sys

import pytest

from ckptsup import cli
from ckptsup.env import ExitStatus
from ckptsup.supervisor.job import loop
from ckptsup.supervisor.node.agent import Agent
from ckptsup.supervisor.job.placement import Placement
from ckptsup.supervisor.spec import LaunchSpec
from ckptsup.supervisor.torchrun_args import (BY_SPELLING, OPTIONS, TEE_ALL, Handling, TorchrunLine, UsageError,
                                              check_target, interpret, node_count, node_range, normalize, nproc_choice,
                                              resolve_nproc)

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


def test_node_count_is_max_and_an_elastic_range_gives_min_nodes():
    assert node_count(None) is None and node_count("3") == 3 and node_count("2:2") == 2 and node_count("1:4") == 4
    assert node_range("3") == (None, 3) and node_range("2:3") == (2, 3) and node_range(None) == (None, None)
    for raw, words in (("3:2", "MIN 3 must be at least 1 and at most MAX 2"), ("0:2", "MIN 0 must be at least 1")):
        with pytest.raises(UsageError) as err:
            node_range(raw)
        assert str(err.value).startswith(f"--nnodes {raw}: {words}") and "--nnodes MIN:MAX" in str(err.value)
    with pytest.raises(UsageError, match="must be a number of nodes, or MIN:MAX"):
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


def test_every_torchrun_option_is_in_the_table_and_accepted_by_the_command():
    """Against torch's own parser: its 30 options (and -h) are the table's rows, each spelling
    accepted by `ckptsup launch`, the same number of values."""
    run = pytest.importorskip("torch.distributed.run")
    actions = [a for a in run.get_args_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) == 30 == len(OPTIONS)
    accepted = _takes_value()
    for action in actions:
        row = BY_SPELLING[action.option_strings[0]]
        assert row.dest == action.dest and set(row.spellings) == set(action.option_strings), action
        assert row.value == (action.nargs != 0), action   # store_true has nargs 0
        for spelling in action.option_strings:
            assert accepted[spelling] == row.value, spelling


def test_the_checked_choices_are_torchs_own():
    run = pytest.importorskip("torch.distributed.run")
    from torch.distributed.elastic.events import handlers

    from ckptsup.supervisor.torchrun_args import EVENT_LOG_HANDLERS, NUMA_MODES, START_METHODS

    choices = {a.dest: tuple(a.choices) for a in run.get_args_parser()._actions if a.choices}
    assert choices["start_method"] == START_METHODS and choices["numa_binding"] == NUMA_MODES
    assert set(EVENT_LOG_HANDLERS) == set(handlers._log_handlers)


def _launch():
    from ckptsup.supervisor.cli import launch

    return launch


def _takes_value():
    from ckptsup.supervisor.cli import known_options

    return known_options(_launch().params) | {"-h": False, "--help": False}


def norm(*args):
    return normalize(args, _takes_value())


# every option of the table, --opt v and --opt=v, every spelling: the same normalized token
_VALUES = {"nnodes": "1", "nproc_per_node": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1", "rdzv_id": "7",
           "rdzv_conf": "a=1", "max_restarts": "3", "monitor_interval": "0.5", "start_method": "spawn",
           "event_log_handler": "null", "role": "trainer", "log_dir": "/tmp/l", "redirects": "3", "tee": "3",
           "local_ranks_filter": "0,1", "duplicate_stdout_filters": "loss", "duplicate_stderr_filters": "warn",
           "node_rank": "0", "master_addr": "127.0.0.1", "master_port": "29500", "local_addr": "127.0.0.1",
           "logs_specs": "x", "numa_binding": "node", "signals_to_handle": "SIGTERM,SIGUSR1",
           "shutdown_timeout": "30"}


@pytest.mark.parametrize("spelling", sorted(BY_SPELLING))
def test_every_spelling_normalizes_with_its_value_attached_or_after(spelling):
    row = BY_SPELLING[spelling]
    canonical = "--tee" if row.dest == "tee" else "--redirects" if spelling == "-r" else spelling
    if not row.value:
        assert norm(spelling, "train.py", "--x") == [spelling, "train.py", "--x"]
        return
    value = _VALUES[row.dest]
    want = [f"{canonical}={value}", "train.py", "--x"]
    assert norm(spelling, value, "train.py", "--x") == want
    if spelling.startswith("--"):
        assert norm(f"{spelling}={value}", "train.py", "--x") == want
    else:
        assert norm(f"{spelling}{value}", "train.py", "--x") == want   # argparse's -r3


@pytest.mark.parametrize("args, tokens", [
    (["--tee", "train.py"], [f"--tee={TEE_ALL}", "train.py"]),            # today's meaning: every rank
    (["--tee", "3", "train.py"], ["--tee=3", "train.py"]),
    (["-t", "0:3,1:1", "train.py"], ["--tee=0:3,1:1", "train.py"]),
    (["--tee", "--nproc-per-node", "2", "train.py"], [f"--tee={TEE_ALL}", "--nproc-per-node=2", "train.py"]),
    (["--tee=1", "train.py", "--tee", "3"], ["--tee=1", "train.py", "--tee", "3"]),   # after SCRIPT: the script's
    (["--nproc", "2", "x.py"], None),                                     # ambiguous, as in torchrun
    (["--max_r", "2", "--monitor-i", "1", "x.py"], ["--max_restarts=2", "--monitor-interval=1", "x.py"]),
])
def test_tee_value_or_bare_and_abbreviations(args, tokens):
    if tokens is None:
        with pytest.raises(UsageError, match="ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node"):
            norm(*args)
    else:
        assert norm(*args) == tokens


@pytest.mark.parametrize("args, line", [
    (["--bogus", "x.py"], "unrecognized arguments: --bogus ("),
    (["--nproc-per-nodes=2", "x.py"], "unrecognized arguments: --nproc-per-nodes; did you mean --nproc-per-node?"),
    (["--nproc-per-nod=2", "x.py"], None),   # a unique prefix, as argparse
    (["--log_dirs", "d", "x.py"], "unrecognized arguments: --log_dirs; did you mean --log_dir?"),
    (["--standalon", "x.py"], None),   # a unique prefix: fine
    (["-X", "x.py"], "unrecognized arguments: -X ("),
    (["--log-dir"], "argument --log-dir/--log_dir: expected one argument"),
    (["--log-dir", "--tee", "x.py"], "argument --log-dir/--log_dir: expected one argument"),
    (["--standalone=1", "x.py"], "argument --standalone: ignored explicit argument '1'"),
])
def test_unknown_options_are_torchruns_error_with_did_you_mean(args, line):
    if line is None:
        assert norm(*args)[0] in ("--standalone", "--nproc-per-node=2")
        return
    with pytest.raises(UsageError) as err:
        norm(*args)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_interpret_passes_on_what_torchrun_means_and_relays_the_rest(tmp_path):
    line = interpret({"monitor_interval": "1", "shutdown_timeout": "20", "log_dir": "logs", "redirects": "3",
                      "tee": "3", "local_ranks_filter": "0", "start_method": "spawn", "role": "trainer",
                      "signals_to_handle": "SIGTERM,SIGUSR1", "duplicate_stdout_filters": "loss",
                      "event_log_handler": "null", "standalone": True, "run_path": False}, cwd=tmp_path)
    assert line.monitor_interval_s == 1.0 and line.shutdown_timeout_s == 20 and line.log_dir == str(tmp_path / "logs")
    assert line.passed == ("--start-method=spawn", "--event-log-handler=null", "--role=trainer",
                           "--signals-to-handle=SIGTERM,SIGUSR1", "--duplicate-stdout-filters=loss")
    assert line.tee_all and line.console_local_ranks(2) == [0]
    assert line.infos == ("ckptsup picks the rendezvous ([supervisor] rdzv_backend, rdzv_port); --standalone ignored",)
    assert not line.cold_ranks and interpret({}, cwd=tmp_path) == TorchrunLine()


@pytest.mark.parametrize("given, console", [
    ({}, None), ({"redirects": "3"}, []), ({"redirects": "0:3"}, [1]), ({"redirects": "3", "tee": "0:1"}, [0]),
    ({"local_ranks_filter": "1,0"}, [0, 1]), ({"local_ranks_filter": "1", "redirects": "1:3"}, []),
])
def test_console_local_ranks_follow_redirects_tee_and_the_filter(tmp_path, given, console):
    assert interpret(given, cwd=tmp_path).console_local_ranks(2) == console


@pytest.mark.parametrize("given, says", [
    ({"tee": "4"}, "-t/--tee '4': a value is 0-3"),
    ({"tee": "10:3"}, "-t/--tee '10:3': a value is 0-3"),   # torchrun's regex: one-digit local ranks
    ({"redirects": "0:1,x"}, "-r/--redirects '0:1,x': a value is 0-3"),
    ({"local_ranks_filter": "a"}, "--local-ranks-filter 'a': pass local ranks"),
    ({"monitor_interval": "0"}, "--monitor-interval '0' must be seconds > 0"),
    ({"shutdown_timeout": "1.5"}, "--shutdown-timeout '1.5' must be a whole number"),
    ({"start_method": "thread"}, "--start-method 'thread': pass one of spawn, fork, forkserver"),
    ({"numa_binding": "all"}, "--numa-binding 'all': pass one of node, socket"),
    ({"event_log_handler": "file"}, "--event-log-handler 'file': torch 2.13 has console, dynamic_rendezvous, null"),
    ({"signals_to_handle": "SIGTERM,SIGFOO"}, "--signals-to-handle: 'SIGFOO' is not a signal name"),
    ({"logs_specs": "mine"}, "--logs-specs 'mine': no torchrun.logs_specs entry point of that name is installed"),
])
def test_values_that_would_change_the_training_or_fail_torchrun_are_one_line(tmp_path, given, says):
    with pytest.raises(UsageError) as err:
        interpret(given, cwd=tmp_path, logs_specs_installed=lambda: ["default"])
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_harmless_values_are_info_lines(tmp_path):
    line = interpret({"numa_binding": "node", "logs_specs": "default", "log_dir": "d", "tee": "1", "run_path": True},
                     cwd=tmp_path, logs_specs_installed=lambda: ["default"])
    assert line.cold_ranks and line.run_path and "--numa-binding=node" in line.passed
    joined = " | ".join(line.infos)
    for says in ("--run-path ignored", "--log-dir gets every local rank's stdout.log and stderr.log",
                 "--numa-binding: every launch starts cold ranks", "--logs-specs default: it must keep torchrun's tee"):
        assert says in joined, joined
    assert interpret({"virtual_local_rank": True}, cwd=tmp_path).passed == ("--virtual-local-rank",)


def test_the_table_has_one_handling_per_option_and_docs_show_it():
    from pathlib import Path

    from ckptsup.supervisor.torchrun_args import options_table

    assert {o.handling for o in OPTIONS} == set(Handling)
    assert all(o.does and "\n" not in o.does for o in OPTIONS)
    page = (Path(__file__).resolve().parents[1] / "docs" / "drop-in.md").read_text()
    assert options_table() in page, "docs/drop-in.md's option table is not torchrun_args.options_table()"


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
    code, seen = launched("--nnodes", "1:1", "train.py")   # torchrun's MIN:MAX: MIN is supervisor.min_nodes
    assert code == 0 and seen["resolved"].config.supervisor.min_nodes == 1
    assert seen["resolved"].provenance["supervisor.min_nodes"] == "flag supervisor.min_nodes"


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


def test_tee_sets_supervisor_tee_bare_or_with_a_value(launched):
    for args in (["--tee"], ["--tee", "3"], ["-t", "3"], ["-t3"], ["-t", "0:0,1:2"]):
        code, seen = launched(*args, "train.py")
        assert code == 0 and seen["resolved"].config.supervisor.tee is True, args
    code, seen = launched("-t", "0", "train.py")   # tees nothing: the default console (rank 0)
    assert code == 0 and seen["resolved"].config.supervisor.tee is False
    for args in (["--local-ranks-filter", "1"], ["-r", "0:3"]):   # torchrun's console: every rank, less these
        code, seen = launched(*args, "train.py")
        assert code == 0 and seen["resolved"].config.supervisor.tee is True, args
    code, seen = launched("train.py")
    assert seen["resolved"].config.supervisor.tee is False


def test_pass_options_reach_the_job_and_cold_ranks_turn_warm_off(launched, tmp_path):
    code, seen = launched("--monitor-interval=1", "--log_dir", "logs", "--numa-binding", "node", "-r", "3", "train.py")
    line = seen["job"].torchrun
    assert code == 0 and line.monitor_interval_s == 1.0 and line.log_dir == str(tmp_path / "logs")
    assert line.passed == ("--numa-binding=node",) and line.redirects == "3"
    assert seen["resolved"].config.supervisor.warm_ranks is False


@pytest.mark.parametrize("args, line", [
    (["--nnodes", "1:4", "train.py"], "--nnodes 4 active nodes requested but local mode runs 1 node; pass --nnodes 1"),
    (["--nnodes", "2:1", "train.py"], "--nnodes 2:1: MIN 2 must be at least 1 and at most MAX 1"),
    (["--nnodes", "1", "--config", "min2.toml", "train.py"],
     "supervisor.min_nodes = 2 (job:min2.toml) is more than supervisor.nodes = 1 (flag supervisor.nodes)"),
    (["--nnodes", "2", "train.py"], "--nnodes 2 active nodes requested but local mode runs 1 node; pass --nnodes 1"),
    (["--nodes=2", "train.py"], "--nodes 2 active nodes requested but local mode runs 1 node; pass --nodes 1"),
    (["--nproc-per-node", "gpu", "train.py"], "--nproc-per-node gpu: this machine names no GPU"),
    (["-m", "train.py"], "-m train.py names a file; pass its module name (train), or drop -m"),
    (["-X", "train.py"], "unrecognized arguments: -X"),
    (["--bogus", "train.py"], "unrecognized arguments: --bogus"),
    (["--rdzv", "c10d", "train.py"], "ambiguous option: --rdzv could match --rdzv-backend, --rdzv_backend"),
    (["--start-method", "thread", "train.py"], "--start-method 'thread': pass one of"),
])
def test_refused_command_lines_are_one_line_and_exit_usage(launched, capsys, tmp_path, args, line):
    (tmp_path / "min2.toml").write_text("[supervisor]\nmin_nodes = 2\n")
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
    for flag in ("--nproc_per_node N|gpu|auto", "--nnodes N", "-m, --module", "--no-python", "-t, --tee",
                 "--spares"):
        assert flag in out, flag
    assert "--gpus-per-node" not in out  # set by `ckptsup sbatch` only


# ---- down to torchrun's argv --------------------------------------------------------------------

def spec(**kw):
    base = dict(script="pkg.train", script_args=["--lr", "3"], nproc_per_node=2, nnodes=1,
                rdzv_endpoint="127.0.0.1:29555", rdzv_id="x", node_addrs={"n1": "127.0.0.1"}, env={}, log_dir="/tmp")
    return LaunchSpec(**{**base, **kw})


COLD = ["--no-python", sys.executable, "-u", "-m", "ckptsup.rankside.cold_rank"]   # rankside/cold_rank.py


@pytest.mark.parametrize("kw, before", [({"module": True}, [*COLD, "--ckptsup-module"]),
                                        ({"no_python": True}, ["--no-python"]), ({}, COLD)])
def test_torchrun_gets_module_or_no_python_right_before_the_script(kw, before):
    """A cold python rank runs through cold_rank (its stack dump installed first); a binary as it is."""
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
    from ckptsup.supervisor.job.nccl import derive_timeouts

    written, path = sv._spec(("n1",), "", derive_timeouts(resolved.config, step_times=[], save_times=[]))
    assert LaunchSpec.read(path).module is True and not written.no_python  # what every agent reads


def test_pass_options_reach_torchrun_before_ckptsups_tee_and_log_dir():
    agent = Agent.__new__(Agent)
    agent.spec, agent.node = spec(monitor_interval_s=1.0, shutdown_timeout_s=20, torchrun_log_dir="/logs",
                                  torchrun_options=["--start-method=spawn", "--virtual-local-rank"]), "n1"
    argv = agent.torchrun_argv()
    assert argv[argv.index("--monitor-interval") + 1] == "1" and argv[argv.index("--shutdown-timeout") + 1] == "20"
    at = argv.index("--tee")
    assert argv[at - 2:at + 4] == ["--start-method=spawn", "--virtual-local-rank", "--tee", "3", "--log-dir", "/logs"]
    assert argv.count("--tee") == 1 and "--redirects" not in " ".join(argv)   # the relay reads every rank
    default = Agent.__new__(Agent)
    default.spec, default.node = spec(), "n1"
    argv = default.torchrun_argv()
    assert argv[argv.index("--monitor-interval") + 1] == "0.1" and argv[argv.index("--log-dir") + 1] == "/tmp/torchrun-n1"


@pytest.mark.parametrize("field, value, says", [
    ("torchrun_options", ["--log-dir=/x"], "a list of torchrun options ckptsup passes on"),
    ("torchrun_options", ["--role"], "a list of torchrun options ckptsup passes on"),
    ("torchrun_options", ["--nproc-per-node=9"], "a list of torchrun options ckptsup passes on"),
    ("console_local_ranks", [-1], "null or a list of local ranks"),
    ("monitor_interval_s", 0, "a number of seconds > 0"),
])
def test_the_spec_checks_the_torchrun_fields(field, value, says):
    from ckptsup.errors import ConfigError

    data = spec(torchrun_options=["--role=trainer", "--virtual-local-rank"], console_local_ranks=[0]).to_json()
    assert LaunchSpec.from_json(data).torchrun_options == ["--role=trainer", "--virtual-local-rank"]
    with pytest.raises(ConfigError, match=says):
        LaunchSpec.from_json({**data, field: value})


def test_the_loop_hands_the_launch_lines_torchrun_options_to_the_spec(tmp_path, monkeypatch):
    from ckptsup.config import load_config
    from ckptsup.rundir import RunDir
    from ckptsup.supervisor.job.nccl import derive_timeouts

    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(tmp_path / "site.toml"))
    (tmp_path / "site.toml").write_text("")
    resolved = load_config(flags={"supervisor.nproc_per_node": 2})
    line = interpret({"monitor_interval": "2", "shutdown_timeout": "7", "log_dir": "L", "role": "r",
                      "local_ranks_filter": "1"}, cwd=tmp_path)
    job = loop.Job(script="pkg.train", script_args=[], cwd=str(tmp_path), nodes_needed=1, module=True, torchrun=line)
    sv = loop.Supervisor(resolved=resolved, job=job, run_dir=RunDir.create(tmp_path / "run"),
                         placement=Placement(job_id="1", nodes=("n1",), addrs={"n1": "127.0.0.1"}))
    written, path = sv._spec(("n1",), "", derive_timeouts(resolved.config, step_times=[], save_times=[]))
    read = LaunchSpec.read(path)
    assert (read.monitor_interval_s, read.shutdown_timeout_s, read.torchrun_log_dir) == (2.0, 7.0, str(tmp_path / "L"))
    assert read.torchrun_options == ["--role=r"] and read.console_local_ranks == [1]


def test_virtual_local_rank_with_a_node_local_cache_is_one_line(launched, capsys, tmp_path):
    (tmp_path / "job.toml").write_text(f'[storage]\nnode_local = "{tmp_path}/local"\n')
    code, seen = launched("--config", str(tmp_path / "job.toml"), "--virtual-local-rank", "train.py")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitStatus.USAGE and not seen
    assert err[-1].startswith("ckptsup: error: --virtual-local-rank makes LOCAL_RANK 0 on every rank")


def test_nnodes_beyond_the_allocation_names_both(launched, capsys, monkeypatch):
    """--nnodes 4 in a 2-node allocation: one line with the request and the allocation's count;
    --nnodes 1 there is 1 active node and 1 hot spare."""
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    monkeypatch.setattr(Placement, "from_slurm", classmethod(
        lambda cls, env, slurm: Placement(job_id="812", nodes=("a", "b"), addrs={"a": "10.0.0.1", "b": "10.0.0.2"})))
    code, seen = launched("--nnodes", "4", "train.py")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitStatus.USAGE and not seen
    assert err == ["ckptsup: error: --nnodes 4 active nodes requested but the allocation has 2 (job 812); "
                   "pass --nnodes 2 or fewer (the rest are hot spares), or allocate more"]
    code, seen = launched("--nnodes=1", "train.py")
    assert code == 0 and seen["job"].nodes_needed == 1


def test_the_probe_reads_which_options_the_installed_torchrun_knows_without_importing_torch():
    import sys

    from ckptsup.supervisor.torchrun_args import installed_torchrun_has

    had_torch = "torch" in sys.modules
    assert installed_torchrun_has("--nproc-per-node") and not installed_torchrun_has("--no-such-option")
    assert ("torch" in sys.modules) == had_torch


def test_an_option_the_installed_torchrun_lacks_is_a_one_line_error_naming_it():
    """torch 2.11's torchrun has no --shutdown-timeout and fails the whole line on it, every attempt."""
    from ckptsup.supervisor.torchrun_args import UsageError, interpret

    with pytest.raises(UsageError, match=r"^--shutdown-timeout: the installed torchrun has no such option") as err:
        interpret({"shutdown_timeout": "90"}, cwd="/tmp", torchrun_has=lambda flag: flag != "--shutdown-timeout")
    assert "\n" not in str(err.value)
    assert interpret({"shutdown_timeout": "90"}, cwd="/tmp", torchrun_has=lambda flag: True).shutdown_timeout_s == 90


@pytest.mark.parametrize("has", [True, False])
def test_torchrun_gets_the_shutdown_timeout_only_when_it_knows_the_option(monkeypatch, has):
    """The GPU machine's torch 2.11: `torchrun: error: unrecognized arguments: --shutdown-timeout`
    on every attempt, a crash loop at step 0."""
    from ckptsup.supervisor.node import agent as agent_module

    monkeypatch.setattr(agent_module, "installed_torchrun_has", lambda flag: has or flag != "--shutdown-timeout")
    agent = Agent.__new__(Agent)
    agent.spec, agent.node = spec(shutdown_timeout_s=75), "n1"
    argv = agent.torchrun_argv()
    assert ("--shutdown-timeout" in argv) is has
    if has:
        assert argv[argv.index("--shutdown-timeout") + 1] == "75"
