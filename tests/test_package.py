"""Package-level contracts: cheap import, exit-status table, CLI wiring."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptsup.env import ExitStatus, RankEnv, should_requeue
from ckptsup.errors import ConfigError


def test_import_ckptsup_and_cli_does_not_import_torch() -> None:
    code = "import sys, ckptsup, ckptsup.cli, ckptsup.config, ckptsup.events; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(("rc", "requeue"), [
    (ExitStatus.DONE, False), (ExitStatus.USAGE, False), (ExitStatus.GIVE_UP, False),
    (ExitStatus.FAILURE, True), (ExitStatus.REQUEUE, True), (ExitStatus.PREEMPTED, True),
    (137, True), (143, True), (99, True),
])
def test_requeue_decision_follows_exit_status_table(rc: int, requeue: bool) -> None:
    assert should_requeue(int(rc)) is requeue


def test_rank_env_defaults_outside_supervisor() -> None:
    env = RankEnv.from_environ({})
    assert env.job_id == "local" and env.attempt == 0 and not env.supervised


def test_rank_env_bad_number_is_config_error() -> None:
    with pytest.raises(ConfigError, match="CKPTSUP_ATTEMPT='x' is not a int"):
        RankEnv.from_environ({"CKPTSUP_ATTEMPT": "x"})


def test_every_contract_command_has_help() -> None:
    from ckptsup.cli import COMMANDS

    for name in ["launch", "agent", "plan", "simulate", "log", "report", "ckpt", "config", "sbatch", "dev-cluster"]:
        assert name in COMMANDS
    proc = subprocess.run([sys.executable, "-m", "ckptsup.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ["launch", "plan", "report", "dev-cluster"]:
        assert name in proc.stdout


def test_contracts_doc_renders_both_env_tables_and_every_exit_status() -> None:
    from pathlib import Path

    from ckptsup.env import EXTERNAL_VARS, VARS

    text = (Path(__file__).resolve().parent.parent / "docs" / "contracts.md").read_text()
    own, _, external = text.partition("`ckptsup.env.EXTERNAL_VARS`")
    for table, section in ((VARS, own), (EXTERNAL_VARS, external)):
        for var in table:  # the doc's row is env.py's row, word for word
            assert f"| `{var.name}` | {var.set_by} | {var.read_by} | {var.meaning} |" in section, var.name
    for status in ExitStatus:
        assert f"| {int(status)} | {status.name} |" in text
