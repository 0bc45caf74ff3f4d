"""`infinigen-prep`: convert checkpoints into InfiniGen bundles."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from infinigen_prep import __version__
from infinigen_rt.console import add_version_option, console, err_console, print_json, run_app

app = typer.Typer(
    name="infinigen-prep",
    help="InfiniGen offline toolkit: convert Hugging Face checkpoints (Hub, folder or GGUF) into bundles.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=False,
)


add_version_option(app, "infinigen-prep", __version__)


def parse_size(text: str) -> int:
    """'4GB', '500MB', '1024' -> bytes."""
    units = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    try:
        if unit not in units:
            raise ValueError
        return int(float(num) * units[unit])
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size like 4GB or 500MB") from None


@app.command()
def convert(
    source: Annotated[str, typer.Argument(help="Hub repo id, local checkpoint folder, or .gguf file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle folder to create.")],
    dtype: Annotated[str, typer.Option(help="auto (the source's), float32, float16, bfloat16.")] = "auto",
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or sha).")] = None,
    shard_size: Annotated[str, typer.Option(help="Largest weight shard, e.g. 4GB.")] = "4GB",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle at --out.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Convert a checkpoint into a bundle.

    Examples:
      infinigen-prep convert meta-llama/Llama-2-7b-hf --out bundles/llama-2-7b
      infinigen-prep convert ./my-local-hf-checkpoint --out bundles/mine
      infinigen-prep convert ./SmolLM2-135M-Instruct.Q4_1.gguf --out bundles/smol
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from infinigen_prep.convert import convert as do_convert
    from infinigen_rt.bundle import read_bundle

    t0 = time.perf_counter()
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("[dim]{task.fields[tensor]}"),
        console=err_console,
        transient=True,
        disable=json_out,
    )
    with bar:
        task = bar.add_task(f"converting {source}", total=None, tensor="")

        def progress(done, total, name):
            bar.update(task, completed=done, total=total, tensor=name)

        path = do_convert(
            source,
            out,
            dtype=dtype,
            revision=revision,
            shard_bytes=parse_size(shard_size),
            force=force,
            progress=progress,
        )
    seconds = time.perf_counter() - t0
    b = read_bundle(path, verify=False)
    size = sum(f["size"] for f in b.meta["files"].values())
    summary = {
        "path": str(path),
        "architecture": b.config.arch,
        "layers": b.config.num_hidden_layers,
        "heads": b.config.num_attention_heads,
        "kv_heads": b.config.num_key_value_heads,
        "head_dim": b.config.head_dim,
        "dtype": b.meta["dtype"],
        "shards": len(set(b.weight_map.values())),
        "bytes": size,
        "seconds": round(seconds, 2),
        "source": b.meta["source"],
    }
    if json_out:
        print_json(summary)
        return
    from rich.table import Table

    table = Table(title=f"bundle {path}", show_header=False)
    for k, v in summary.items():
        if k == "bytes":
            v = f"{v / 1e6:.1f} MB"
        elif k == "source":
            v = ", ".join(f"{a}={b_}" for a, b_ in v.items())
        table.add_row(k, str(v))
    console.print(table)


def main():
    run_app(app)


if __name__ == "__main__":
    main()
