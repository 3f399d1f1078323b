"""env.py is the single source of truth for environment variables: RankEnv both ways, one
node_name, a constant per variable, and no CKPTSUP_* literal in the code outside env.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from ckptsup import env
from ckptsup.env import EXTERNAL_VARS, NAMES, PREFIX, VARS, RankEnv, node_name

PACKAGE = Path(env.__file__).resolve().parent

FULL = RankEnv(run_dir="/runs/7", job_id="7", attempt=3, epoch=5, config_json="/runs/7/config.json",
               checkpoint_dir="/runs/7/checkpoints", node_local_dir="/local/7", resume_from="/runs/7/checkpoints/step_40",
               save_every_steps=20, save_every_s=123.25, rank_socket="/tmp/ckptsup-n1-x/ranks.sock",
               secret_file="/runs/7/secret", node="n1", collective_timeout_init_s=600.0,
               collective_timeout_s=97.125, fr_dump_dir="/runs/7/attempt-3/flight_recorder", preempt_budget_s=30.5,
               memory_socket="/tmp/ckptsup-n1-x/memory.sock", memory_every_steps=15)
EMPTY = RankEnv(run_dir=None, job_id="local", attempt=0, epoch=0, config_json=None, checkpoint_dir=None,
                node_local_dir=None, resume_from=None, save_every_steps=None, save_every_s=None, rank_socket=None,
                secret_file=None, node="n2", collective_timeout_init_s=None, collective_timeout_s=None,
                fr_dump_dir=None, preempt_budget_s=None)


@pytest.mark.parametrize("rank_env", [FULL, EMPTY], ids=["full", "mostly-empty"])
def test_rank_env_round_trips_through_the_environment(rank_env: RankEnv) -> None:
    environ = rank_env.to_environ()
    assert all(isinstance(v, str) for v in environ.values())
    assert RankEnv.from_environ(environ) == rank_env


def test_a_number_out_of_range_is_refused_at_the_environment_edge() -> None:
    from ckptsup.errors import ConfigError

    with pytest.raises(ConfigError, match=r"CKPTSUP_MEMORY_EVERY_STEPS=.0. must be >= 1; unset it or fix the value"):
        RankEnv.from_environ({"CKPTSUP_MEMORY_EVERY_STEPS": "0"})
    with pytest.raises(ConfigError, match=r"CKPTSUP_ATTEMPT=.x. is not a int"):
        RankEnv.from_environ({"CKPTSUP_ATTEMPT": "x"})
    assert RankEnv.from_environ({"CKPTSUP_MEMORY_EVERY_STEPS": "3"}).memory_every_steps == 3


def test_to_environ_leaves_out_unset_fields_and_uses_contract_names() -> None:
    assert EMPTY.to_environ() == {"CKPTSUP_JOB_ID": "local", "CKPTSUP_ATTEMPT": "0", "CKPTSUP_EPOCH": "0",
                                  "CKPTSUP_NODE": "n2"}
    assert FULL.to_environ()["CKPTSUP_SAVE_EVERY_S"] == "123.25"


def test_every_rank_env_field_is_a_contract_variable() -> None:
    assert all(getattr(FULL, f.name) is not None for f in dataclasses.fields(RankEnv))  # FULL sets all
    assert len(FULL.to_environ()) == len(dataclasses.fields(RankEnv))
    assert set(FULL.to_environ()) <= NAMES


def test_node_name_prefers_ckptsup_node_then_slurmd_nodename_then_hostname(monkeypatch) -> None:
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    assert node_name({"CKPTSUP_NODE": "n1", "SLURMD_NODENAME": "s1"}) == "n1"
    assert node_name({"SLURMD_NODENAME": "s1"}) == "s1"
    assert node_name({"CKPTSUP_NODE": "", "SLURMD_NODENAME": ""}) == "host-a"
    assert node_name({}) == "host-a"
    monkeypatch.setenv("CKPTSUP_NODE", "from-os-environ")
    assert node_name() == "from-os-environ"
    assert RankEnv.from_environ({"SLURMD_NODENAME": "s1"}).node == "s1"


def test_local_placement_and_health_checks_name_the_node_through_node_name(monkeypatch, tmp_path) -> None:
    """Before: Placement.local ignored SLURMD_NODENAME, the health checks ignored CKPTSUP_NODE."""
    import sys

    from ckptsup.config import Config
    from ckptsup.rundir import RunDir
    from ckptsup.supervisor.health.health import CheckPaths, run_local_checks
    from ckptsup.supervisor.job.placement import Placement

    monkeypatch.delenv("CKPTSUP_NODE", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "s1")
    assert Placement.local().nodes == ("s1",)
    monkeypatch.setenv("CKPTSUP_NODE", "n7")
    assert Placement.local().nodes == ("n7",)
    config = Config()
    config.health.check_gpus = "off"
    config.health.commands = [f"{sys.executable} -c \"import os; print(os.environ['CKPTSUP_NODE'])\""]
    config.storage.min_free_gb = 0.001
    run = RunDir.create(tmp_path / "run").path
    results = run_local_checks(config, CheckPaths(run_dir=run, tiers={}))
    assert results[0].detail == "n7"


def test_every_variable_has_a_constant_and_every_constant_a_table_row() -> None:
    for var in VARS:
        assert var.name.startswith(PREFIX)
        assert getattr(env, var.name.removeprefix(PREFIX)) == var.name, var.name
    for var in EXTERNAL_VARS:
        assert not var.name.startswith(PREFIX)
        assert getattr(env, var.name) == var.name, var.name
    tabled = NAMES | {v.name for v in EXTERNAL_VARS}
    constants = {name: value for name, value in vars(env).items()
                 if name.isupper() and isinstance(value, str) and value.isupper() and value != PREFIX}
    assert set(constants.values()) == tabled, "a constant in env.py without a row in VARS / EXTERNAL_VARS"
    assert len(tabled) == len(VARS) + len(EXTERNAL_VARS), "a variable listed twice"


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the Constant nodes that are module, class or function docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def ckptsup_literals(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """file:line of every string constant (f-string parts included) naming a CKPTSUP_ variable."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstrings(tree)
    rel = path.relative_to(root)
    return [f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PREFIX in node.value
            and id(node) not in docstrings]


def test_the_literal_finder_sees_f_strings_and_skips_docstrings(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""CKPTSUP_RUN_DIR in the module docstring."""\n'
                      'class C:\n    """CKPTSUP_NODE in a class docstring."""\n'
                      'def f(x):\n    """CKPTSUP_NODE in a function docstring."""\n'
                      '    return f"CKPTSUP_{x}", "CKPTSUP_NODE"  # CKPTSUP_EPOCH in a comment\n')
    assert sorted(ckptsup_literals(sample, root=tmp_path)) == ["sample.py:6: 'CKPTSUP_'", "sample.py:6: 'CKPTSUP_NODE'"]


# rankside/warm_proxy.py runs as a file under `python -S` (no site: the package is not importable
# there), so it keeps copies of the names it reads; tests/test_warm_proxy_start.py holds them equal
OWN_COPIES = {PACKAGE / "env.py", PACKAGE / "rankside" / "warm_proxy.py"}


def test_no_ckptsup_variable_name_is_spelled_outside_env_py() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path not in OWN_COPIES
             for hit in ckptsup_literals(path)]
    assert not found, "use the constants of ckptsup/env.py instead of:\n" + "\n".join(found)


def test_variables_is_the_one_writer_of_rank_variables_and_blanks_what_it_unsets() -> None:
    """The supervisor writes part of a rank's environment through RankEnv.variables (recovery.rank_env,
    the preemption budget): the names and formats from_environ reads; None as "" so that a value
    inherited from the agent's environment cannot outlive a fresh start."""
    out = RankEnv.variables(resume_from=None, attempt=3, save_every_s=600.0)
    assert out == {"CKPTSUP_RESUME_FROM": "", "CKPTSUP_ATTEMPT": "3", "CKPTSUP_SAVE_EVERY_S": "600.0"}
    back = RankEnv.from_environ(out)
    assert (back.resume_from, back.attempt, back.save_every_s) == (None, 3, 600.0)
    with pytest.raises(TypeError, match="not a RankEnv field: resume"):
        RankEnv.variables(resume="x")


def test_the_supervisors_rank_env_reads_back_as_what_it_was_given(tmp_path) -> None:
    from ckptsup.config import Config
    from ckptsup.supervisor.job.recovery import attempt_timeouts, rank_env

    config = Config()
    env = rank_env(config, run_dir=tmp_path, config_json=tmp_path / "c.json", secret_path=tmp_path / "s",
                   ckpt_dir=tmp_path / "ck", job_id="7", attempt=2, epoch=1, resume_from="", save_every_s=612.5,
                   preempt_budget_s=27.25, timeouts=attempt_timeouts(config, step_times=[], save_s=None))
    assert env["CKPTSUP_RESUME_FROM"] == ""   # a fresh start hides an inherited value
    got = RankEnv.from_environ({**env, "CKPTSUP_NODE": "n1"})
    assert (got.run_dir, got.job_id, got.attempt, got.epoch, got.resume_from) == (str(tmp_path), "7", 2, 1, None)
    assert (got.save_every_s, got.preempt_budget_s, got.checkpoint_dir) == (612.5, 27.2, str(tmp_path / "ck"))
    assert got.memory_every_steps == config.memory.every_steps and got.collective_timeout_s is not None
