"""Output for both CLIs: rich for people, JSON for scripts, and errors as one line."""

from __future__ import annotations

import json
import os
import sys
import warnings

import typer
from rich.console import Console
from rich.markup import escape

from infinigen_rt.errors import InfinigenError, InfinigenWarning

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
DEBUG_ENV = "INFINIGEN_DEBUG"


def print_json(obj) -> None:
    """One JSON object on stdout (plain print: no rich wrapping or markup)."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def add_version_option(app: typer.Typer, name: str, version: str) -> None:
    """Give `app` a `--version` flag."""

    def show(value: bool):
        if value:
            console.print(f"{name} {version}")
            raise typer.Exit()

    @app.callback()
    def _options(
        version: bool = typer.Option(False, "--version", callback=show, is_eager=True, help="Show the version."),
    ):
        # a plain default, not Annotated: annotations are strings here and `show` is a local
        pass


def show_notices() -> None:
    """Print each InfinigenWarning as one `warning:` line on stderr (other warnings as Python shows them)."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, InfinigenWarning):
            err_console.print(f"[bold yellow]warning:[/] {escape(str(message))}", soft_wrap=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.simplefilter("always", InfinigenWarning)


def run_app(app: typer.Typer) -> None:
    """Run a Typer app; user errors print as one line (INFINIGEN_DEBUG=1 shows the traceback)."""
    show_notices()
    try:
        app(standalone_mode=False)
    except InfinigenError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:  # click usage errors come through here in non-standalone mode
        import click

        # typer may vendor its own click: recognise its usage errors by their shape too
        if isinstance(e, click.ClickException) or (callable(getattr(e, "show", None)) and hasattr(e, "exit_code")):
            e.show()
            sys.exit(e.exit_code)
        raise
