"""Output for both CLIs: rich for people, JSON for scripts, and errors as one line."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infinigen_rt.errors import InfinigenError, InfinigenWarning

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
DEBUG_ENV = "INFINIGEN_DEBUG"
RANK_ERRORS_ENV = "INFINIGEN_RANK_ERRORS"  # set by `--tp`'s launcher (cli/launch.py): where each rank writes its error


def print_json(obj) -> None:
    """One JSON object on stdout (plain print: no rich wrapping or markup)."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def human_bytes(n: float | None) -> str:
    """378385920 -> '378 MB', 8822688 -> '8.82 MB', 0 -> '0 B': three significant digits and a unit."""
    if n is None:
        return "-"
    i = 0
    while abs(n) >= 999.5 and i < 3:
        n, i = n / 1000, i + 1
    unit = ("B", "KB", "MB", "GB")[i]
    digits = 0 if unit == "B" or abs(n) >= 99.95 else 1 if abs(n) >= 9.995 else 2
    return f"{n:,.{digits}f} {unit}"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, option: str) -> int:
    """'8GiB' -> 8589934592, '500MB' -> 500000000, '1.5 GB', '4096': a size in bytes (SI or binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise InfinigenError(f"{option}: cannot read {text!r} as a size; write e.g. 8GiB, 500MB or 4096 (bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def results_table(title: str, columns: list[str]) -> Table:
    """A table of result rows that reads at 80 columns: no borders, two spaces between columns, and a cell
    that still does not fit folds onto the next line instead of being cut to an ellipsis."""
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    return t


def print_wide(table: Table) -> None:
    """Print a table at its natural width, wider than the terminal if it must be (for a file, or a wide window)."""
    from rich.measure import Measurement

    width = Measurement.get(console, console.options.update(max_width=10_000), table).maximum
    Console(highlight=False, width=max(width, console.width)).print(table)  # print(width=) caps at the terminal


def new_app(name: str, help: str, version: str) -> typer.Typer:
    """A command-line app as both CLIs make theirs: help on -h too, no completion installer, errors as one line
    (run_app), and a `--version` flag."""
    app = typer.Typer(
        name=name, help=help, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_enable=False, add_completion=False,
    )  # fmt: skip

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

    return app


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


def print_error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def run_app(app: typer.Typer) -> None:
    """Run a Typer app; user errors print as one line (INFINIGEN_DEBUG=1 shows the traceback)."""
    show_notices()
    try:
        code = app(standalone_mode=False)  # click returns a typer.Exit's code here instead of exiting with it
        if type(code) is int and code:
            sys.exit(code)
    except InfinigenError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        if path := os.environ.get(RANK_ERRORS_ENV):  # a rank started by `--tp`: the launcher prints each line once
            with open(path, "a", encoding="utf-8") as f:
                f.write(" ".join(str(e).split()) + "\n")
        else:
            print_error(str(e))
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
