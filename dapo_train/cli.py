"""Command line: parses arguments, builds the config, calls one function. No logic lives here.

Bad input (config, paths, columns, reward plugins) is a `UserError`: one line on stderr and exit
code 2, with the traceback only under `--debug`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
import yaml

from dapo_train.config import config_to_dict, describe_keys, load_config
from dapo_train.errors import UserError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="DAPO fine-tuning of causal LMs on math word problems with rule rewards.",
)

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors.")) -> None:
    _state["debug"] = debug


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [KEY=VALUE ...]` -> (config path or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


@app.command("config")
def config_cmd(
    args: list[str] = typer.Argument(None, metavar="[CONFIG] [KEY=VALUE]...", help="YAML config and dotted overrides."),
    keys: bool = typer.Option(False, "--keys", help="List every config key with its default and help."),
) -> None:
    """Print the resolved config (defaults <- CONFIG <- KEY=VALUE) without loading anything."""
    if keys:
        for key, default, text in describe_keys():
            typer.echo(f"{key} = {default}\n    {text}")
        return
    config_path, overrides = split_config_args(args or [])
    cfg = load_config(config_path, overrides)
    typer.echo(yaml.safe_dump(config_to_dict(cfg), allow_unicode=True, sort_keys=False).rstrip())


def main() -> None:
    """Console-script entry point: turns UserError into one line and exit code 2."""
    try:
        app()
    except UserError as exc:
        if _state["debug"]:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


__all__ = ["app", "main", "split_config_args", "Path"]
