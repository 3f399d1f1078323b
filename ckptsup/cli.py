"""The `ckptsup` command: a thin click group. Each subsystem owns its commands in its own
`cli.py` (loaded lazily, so `ckptsup plan` never imports the supervisor and nothing imports
torch); this module only parses, calls and renders errors as one line."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from .errors import CkptsupError
from .textsafe import literal

# command name -> "module:attribute"; loaded on first use.
COMMANDS: dict[str, str] = {
    "launch": "ckptsup.supervisor.cli:launch",
    "agent": "ckptsup.supervisor.cli:agent",
    "log": "ckptsup.supervisor.ops.cli_ops:log",
    "watchdog": "ckptsup.supervisor.ops.cli_ops:watchdog",
    "requeue": "ckptsup.supervisor.ops.cli_ops:requeue",
    "save-now": "ckptsup.supervisor.ops.cli_control:save_now",
    "stop": "ckptsup.supervisor.ops.cli_control:stop",
    "replace": "ckptsup.supervisor.ops.cli_control:replace",
    "status": "ckptsup.supervisor.ops.cli_status:status",
    "plan": "ckptsup.planning.cli:plan",
    "simulate": "ckptsup.planning.cli:simulate",
    "report": "ckptsup.planning.cli:report",
    "ckpt": "ckptsup.checkpoint.cli:ckpt",
    "sbatch": "ckptsup.slurm.cli:sbatch",
    "dev-cluster": "ckptsup.slurm.cli:dev_cluster",
    "config": "ckptsup.supervisor.ops.cli_ops:config",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, _, attr = target.partition(":")
        if module_name == __name__:
            return globals()[attr]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and err.name.startswith("ckptsup"):
                return _not_yet(name)
            raise
        return getattr(module, attr, None) or _not_yet(name)


def _not_yet(name: str) -> click.Command:
    @click.command(name=name, help=f"(not implemented yet: `ckptsup {name}` lands with its issue)",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def stub() -> None:
        raise CkptsupError(f"`ckptsup {name}` is not implemented yet")
    return stub


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptsup")
def cli() -> None:
    """ckptsup: a Slurm-native supervisor and checkpoint library for PyTorch training."""


def main(argv: list[str] | None = None) -> Any:
    """Entry point: every expected error is one line on stderr and a pinned exit status."""
    try:
        return cli.main(args=argv, prog_name="ckptsup", standalone_mode=False)
    except CkptsupError as err:
        click.echo(f"ckptsup: error: {literal(err)}", err=True)   # it quotes paths, Slurm, ranks
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("ckptsup: aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":   # a bare group: its help, as click shows it
            err.show()
            sys.exit(err.exit_code)
        # Usage errors too are one line (click's own rendering is a usage block plus a hint).
        ctx = getattr(err, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if isinstance(err, click.UsageError) and ctx is not None else ""
        click.echo(f"ckptsup: error: {literal(err.format_message())}{hint}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
