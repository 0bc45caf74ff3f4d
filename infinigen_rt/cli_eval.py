"""`infinigen-rt eval`: perplexity of every policy by real decoding, as a table, JSON and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from infinigen_rt.console import console, err_console, print_json, results_table
from infinigen_rt.files import check_outputs

if TYPE_CHECKING:
    from rich.table import Table

    from infinigen_rt.eval import Row


def _floats(text: str | None, name: str) -> list[float]:
    if not text:
        return []
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} takes numbers separated by commas, got {text!r}") from None


def eval_cmd(
    bundle: Annotated[str, typer.Argument(help="Bundle folder, or a Hub repo id to pull.")],
    text: Annotated[Path, typer.Option(help="A UTF-8 text to score (e.g. a play).")],
    policies: Annotated[str, typer.Option(help="Comma-separated: full, offload, infinigen, h2o, int4, oracle.")] = (
        "full,infinigen,h2o,int4,oracle"
    ),
    budgets: Annotated[str, typer.Option(help="Budgets (share of the context) for infinigen, h2o, oracle.")] = (
        "0.05,0.1,0.2"
    ),
    alphas: Annotated[Optional[str], typer.Option(help="Alphas for infinigen [the bundle's default].")] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens of the text used.")] = 2048,
    score_from: Annotated[int, typer.Option(help="Tokens before this are the prompt; the rest are scored.")] = 1024,
    out: Annotated[Optional[Path], typer.Option(help="Write results JSON here (after every row).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip rows already in --out.")] = False,
    recall: Annotated[bool, typer.Option(help="Trace infinigen's attention-mass recall (slower).")] = True,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write the plot (PNG) here.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, float16, bfloat16.")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object.")] = False,
):
    """Perplexity of each KV policy by teacher-forced decoding, against full attention.

    Examples:
      infinigen-rt eval artifacts/bundles/smollm2-135m --text hamlet.txt --out results.json --plot results.png
      infinigen-rt eval BUNDLE --text play.txt --policies full,infinigen --budgets 0.1 --alphas 3,5 --json
      infinigen-rt eval BUNDLE --text play.txt --out results.json --resume
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.eval import configs, load_done, plot, run_sweep, save, text_ids
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.policies import POLICIES

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise InfinigenError(f"unknown policy {unknown[0]!r}; available: {', '.join(POLICIES)}")
    budget_list, alpha_list = _floats(budgets, "--budgets"), _floats(alphas, "--alphas")
    if any(not 0 < b <= 1 for b in budget_list):
        raise InfinigenError(f"--budgets must be in (0, 1], got {budgets}")
    if resume and out is None:
        raise InfinigenError("--resume reads the rows already in --out: pass --out FILE")
    check_outputs(out, plot_path)
    path = resolve_bundle(bundle)
    engine = Engine(read_bundle(path), device=device, dtype=dtype)
    if any("alpha" in POLICIES[p].sweep for p in names) and not alpha_list:  # the bundle's (a one-line error
        alpha_list = [engine.speculation()[1]["alpha"]]  # for a bundle converted with --no-infinigen)
    ids, sha = text_ids(engine, text, seq_len, score_from)
    meta = {"bundle": str(path), "text": str(text), "text_sha256": sha, "seq_len": seq_len, "score_from": score_from,
            "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}  # fmt: skip
    done = load_done(out, meta) if resume and out else []
    todo = configs(names, budget_list, alpha_list)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err_console, transient=True, disable=json_out)  # fmt: skip
    tasks: dict[str, int] = {}

    def progress(label, d, t):
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=t)
        bar.update(tasks[label], completed=d)

    with bar:
        rows = run_sweep(engine, ids, score_from, todo, done, recall=recall, progress=progress,
                         on_row=(lambda rs: save(out, meta, rs)) if out else None)  # fmt: skip
    if plot_path:
        plot(rows, plot_path, f"{Path(str(path)).name}: {text.name}, {seq_len} tokens, scored from {score_from}")
    if json_out:
        from dataclasses import asdict

        print_json({**meta, "rows": [asdict(r) for r in rows]})
        return
    console.print(eval_table(rows, f"perplexity on {text.name} ({seq_len} tokens, scored from {score_from})"))


def eval_table(rows: list[Row], title: str) -> Table:
    """The rows as a table that reads at 80 columns; seconds per row and the exact bytes are in --json/--out."""
    table = results_table(title, ["policy", "budget", "alpha", "ppl", "vs full", "fetched", "attended", "recall",
                                  "MB/tok"])  # fmt: skip

    def f(x, fmt, scale=1.0):
        return "-" if x is None else format(x / scale, fmt)

    for r in rows:
        table.add_row(r.policy, f(r.budget, ".2f"), f(r.alpha, "g"), f(r.perplexity, ".3f"),
                      "-" if r.delta_pct is None else f"{r.delta_pct:+.2f}%", f(r.kv_fetched_share, ".1%"),
                      f(r.kv_attended_share, ".1%"), f(r.recall, ".3f"), f(r.bytes_per_token, ".2f", 1e6))  # fmt: skip
    return table
