"""`infinigen-rt`: the commands (generate, serve, pull, eval, bench), one module each."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from infinigen_rt import __version__
from infinigen_rt.cli.bench import bench_cmd
from infinigen_rt.cli.console import console, new_app, print_json, run_app
from infinigen_rt.cli.eval import eval_cmd
from infinigen_rt.cli.generate import generate
from infinigen_rt.cli.options import JsonOut, Revision
from infinigen_rt.cli.serve import serve

app = new_app("infinigen-rt", "InfiniGen runtime: generate from a bundle with the KV cache policy of your choice.",
              __version__)  # fmt: skip
app.command()(generate)


@app.command()
def pull(
    repo_id: Annotated[str, typer.Argument(help="Hub repo id of a bundle.")],
    revision: Revision = None,
    out: Annotated[Optional[str], typer.Option(
        help="Into this folder instead of the HF cache: a new or empty folder, or a bundle to replace.")] = None,
    json_out: JsonOut = False,
):
    """Download a bundle from the Hub and verify it.

    Examples:
      infinigen-rt pull user/smollm2-135m-infinigen
      infinigen-rt pull user/smollm2-135m-infinigen --revision v1 --out bundles/smol
    """
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.hub import download_bundle, pull_into

    path = download_bundle(repo_id, revision) if out is None else pull_into(repo_id, revision, out)
    b = read_bundle(path, verify=out is None)  # pull_into verified it before moving it into place
    if json_out:
        print_json({"path": str(path), "repo_id": repo_id, "architecture": b.config.arch, "verified": True})
    else:
        console.print(f"[green]pulled[/] {repo_id} -> {path} (verified)")


app.command()(serve)
app.command("eval")(eval_cmd)
app.command("bench")(bench_cmd)


def main():
    run_app(app)
