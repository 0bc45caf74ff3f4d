"""The `infinigen-rt` command line: main.py holds the app, each command has a module of its own, options.py the
option types they share, console.py the terminal output (also the prep CLI's)."""

from infinigen_rt.cli.main import app, main

__all__ = ["app", "main"]
