"""`infinigen-prep`: convert checkpoints into InfiniGen bundles."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from infinigen_prep import __version__
from infinigen_prep.calibrate import DEFAULT_CALIB
from infinigen_rt.cli.console import console, err_console, new_app, print_json, run_app

app = new_app("infinigen-prep",
              "InfiniGen offline toolkit: convert Hugging Face checkpoints (Hub, folder or GGUF) into bundles.",
              __version__)  # fmt: skip


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
    force: Annotated[
        bool, typer.Option("--force", help="Replace the bundle at --out (only a bundle: anything else is refused).")
    ] = False,
    calib_text: Annotated[
        Optional[str],
        typer.Option(
            # rich reads [..] as markup: escaped, or the help loses them
            help=f"Calibration text: a UTF-8 file or hf://\\[datasets/]OWNER/REPO/PATH \\[default: {DEFAULT_CALIB}]"
        ),
    ] = None,
    calib_tokens: Annotated[int, typer.Option(help="Calibration tokens (capped by the model's positions).")] = 2048,
    partial_ratio: Annotated[float, typer.Option(help="Share of each head's dims kept for speculation.")] = 0.3,
    partial_select: Annotated[
        str, typer.Option(help="Partial columns by qk (query x key energy), query, or auto (measure, keep the better).")
    ] = "auto",
    skew: Annotated[bool, typer.Option(help="SVD skewing; --no-skew writes identity skews (the ablation).")] = True,
    spec_keys: Annotated[str, typer.Option(
        help="The bundle's default speculation keys: auto (int4 unless partial's or int4c's KL divergence from full "
        "past the calibration text is 5 % lower), partial, int4, int2, int4c.")] = "auto",  # fmt: skip
    infinigen: Annotated[
        bool, typer.Option(help="Add the InfiniGen tensors; --no-infinigen converts dense-only (no calibration).")
    ] = True,
    device: Annotated[str, typer.Option(help="Device for calibration: auto, cpu, cuda.")] = "auto",
    push_to: Annotated[Optional[str], typer.Option(help="Then push the bundle to this Hub repo id.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Convert a checkpoint into a bundle, calibrating the InfiniGen skew and partial weights.

    Examples:
      infinigen-prep convert meta-llama/Llama-2-7b-hf --out bundles/llama-2-7b
      infinigen-prep convert ./my-local-hf-checkpoint --out bundles/mine
      infinigen-prep convert ./SmolLM2-135M-Instruct.Q4_1.gguf --out bundles/smol --calib-text macbeth.txt
      infinigen-prep convert ./ckpt --out bundles/dense --no-infinigen
      infinigen-prep convert meta-llama/Llama-2-7b-hf --out bundles/llama-2-7b --push-to me/llama-2-7b-infinigen
    """
    from infinigen_prep.convert import convert as do_convert
    from infinigen_prep.prepare import PrepOptions

    bar, progress = _stage_bars(source, disable=json_out)
    t0 = time.perf_counter()
    with bar:
        prep = PrepOptions(calib_text, calib_tokens, partial_ratio, skew, partial_select, device, spec_keys)
        path = do_convert(
            source,
            out,
            dtype=dtype,
            revision=revision,
            shard_bytes=parse_size(shard_size),
            force=force,
            progress=progress,
            infinigen=infinigen,
            prep=prep,
        )
    summary = bundle_summary(path, time.perf_counter() - t0)
    if push_to:
        from infinigen_prep.push import push

        commit = push(path, push_to)
        summary["pushed"] = {"repo_id": push_to, "commit": getattr(commit, "oid", None), "url": str(commit)}
    if json_out:
        print_json(summary)
        return
    console.print(summary_table(path, summary))


def _stage_bars(source: str, disable: bool):
    """A transient progress bar on stderr and the `progress` callback convert feeds it: one bar per stage."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("[dim]{task.fields[tensor]}"),
        console=err_console,
        transient=True,
        disable=disable,
    )
    tasks: dict[str, int] = {}

    def progress(stage, done, total, label):
        if stage not in tasks:  # one bar per stage: weights, calibration, skewing, comparison
            tasks[stage] = bar.add_task(f"{stage} ({Path(source).name})", total=total, tensor="")
        bar.update(tasks[stage], completed=done, total=total, tensor=label)

    return bar, progress


def bundle_summary(path: Path, seconds: float) -> dict:
    """What convert prints: the bundle as written (read back from its manifest), with the InfiniGen figures."""
    from infinigen_rt.bundle import read_bundle

    b = read_bundle(path, verify=False)
    size = sum(f["size"] for f in b.manifest.files.values())
    summary = {
        "path": str(path),
        "architecture": b.config.arch,
        "layers": b.config.num_hidden_layers,
        "heads": b.config.num_attention_heads,
        "kv_heads": b.config.num_key_value_heads,
        "head_dim": b.config.head_dim,
        "dtype": b.manifest.dtype,
        "shards": len(set(b.weight_map.values())),
        "bytes": size,
        "seconds": round(seconds, 2),
        "source": b.manifest.source,
    }
    ig = b.infinigen
    if ig:
        summary.update(
            partial_dim=ig.partial_dim,
            partial_select=ig.partial_select,
            selection_recall=ig.selection_recall,
            energy_share_top=ig.energy_share_top,
            calibration=ig.calibration,
            spec_keys=ig.defaults.spec_keys,
            spec_keys_choice=ig.spec_keys_choice,
        )
    return summary


def summary_table(path: Path, summary: dict):
    """convert's summary as a rich table, sizes in MB and dicts as k=v."""
    from rich.table import Table

    table = Table(title=f"bundle {path}", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # paths and hashes: folded onto more lines, never cut
    for k, v in summary.items():
        if k == "bytes":
            v = f"{v / 1e6:.1f} MB"
        elif isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        table.add_row(k, str(v))
    return table


def _human(n: float, units=("", "K", "M", "B", "T"), base=1000.0) -> str:
    for unit in units[:-1]:
        if abs(n) < base:
            return f"{n:.3g}{unit}" if unit else f"{n:g}"
        n /= base
    return f"{n:.3g}{units[-1]}"


def _compact(v) -> str:
    """A value as text: dicts as k=v, lists joined (a long list as its length); the table folds long lines."""
    import json

    if isinstance(v, dict):
        return ", ".join(f"{k}={_compact(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_compact(x) for x in v) + "]" if len(v) <= 8 else f"[{len(v)} items]"
    return v if isinstance(v, str) else json.dumps(v)


@app.command("inspect")
def inspect_cmd(
    bundle: Annotated[Path, typer.Argument(help="Bundle folder.")],
    verify: Annotated[bool, typer.Option(
        "--verify", help="Re-hash every file against bundle.json and check every weight is finite.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Show what a bundle holds: model, config, files, provenance and InfiniGen parameters.

    Examples:
      infinigen-prep inspect bundles/smol
      infinigen-prep inspect bundles/smol --verify
      infinigen-prep inspect bundles/smol --json
    """
    from infinigen_prep.inspect import inspect_bundle

    report = inspect_bundle(bundle, verify=verify)
    if json_out:
        print_json(report)
        return
    for part in report_tables(report):
        console.print(part)


def report_tables(r: dict) -> list:
    """inspect's report as rich tables; a value too long for the terminal folds onto more lines, never cut."""
    from rich.table import Table

    def kv_table(title: str, rows: dict) -> Table:
        t = Table(title=title, show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column(overflow="fold")
        for k, v in rows.items():
            t.add_row(k, _compact(v) if v is not None else "-")
        return t

    out = [
        kv_table(
            f"bundle {r['path']}",
            {
                "architecture": r["architecture"],
                "model_type": r["model_type"],
                "format version": r["format_version"],
                "dtype": r["dtype"],
                "parameters": f"{r['parameters']:,} ({_human(r['parameters'])})",
                "tensors": r["tensors"],
                "size": f"{_human(r['total_bytes'])}B ({r['total_bytes']:,} bytes)",
                "verified": "yes (sha256 of every listed file, every weight finite)" if r["verified"]
                else "sizes only (--verify re-hashes)",
            },
        ),
        kv_table("config", r["config"]),
    ]
    files = Table(title="files", title_justify="left")
    files.add_column("file", overflow="fold")
    files.add_column("bytes", justify="right")
    files.add_column("sha256")
    for name, f in r["files"].items():
        digest = (
            f["sha256"][:16] + "..." if f["sha256"] else "(the manifest)" if name == "bundle.json" else "(not hashed)"
        )
        files.add_row(name, f"{f['size']:,}", digest)
    out.append(files)
    out.append(kv_table("source / provenance", {"source": r["source"], "converter": r["converter"], **r["tokenizer"]}))
    if r["infinigen"]:
        out.append(kv_table("InfiniGen parameters", r["infinigen"]))
    else:
        out.append("[bold]InfiniGen parameters[/]: none (a dense-only bundle, converted with --no-infinigen)")
    return out


@app.command("push")
def push_cmd(
    bundle: Annotated[Path, typer.Argument(help="Bundle folder.")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo, OWNER/NAME (created when missing).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private (when it is new).")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created from main when missing).")] = None,
    commit_message: Annotated[Optional[str], typer.Option(help="Commit message.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Verify a bundle and upload it to a Hub model repo in one commit.

    Examples:
      infinigen-prep push bundles/smol my-user/smollm2-135m-infinigen
      infinigen-prep push bundles/smol my-user/smollm2-135m-infinigen --private
      infinigen-prep push bundles/smol my-user/smollm2-135m-infinigen --revision v2 --commit-message "re-skew"
    """
    from infinigen_prep.push import push

    info = push(bundle, repo_id, private=private, revision=revision, commit_message=commit_message)
    branch = revision or "main"
    if json_out:
        print_json({"repo_id": repo_id, "revision": branch, "commit": info.oid, "commit_url": info.commit_url})
        return
    url = str(info.repo_url) + (f"/tree/{revision}" if revision else "")
    console.print(f"[green]pushed[/] {bundle} -> {url}")
    console.print(f"revision {branch} at commit {info.oid} ({info.commit_url})")


def main():
    run_app(app)


if __name__ == "__main__":
    main()
