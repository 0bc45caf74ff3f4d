"""`infinigen-rt eval`: perplexity of every policy by real decoding, as a table, JSON and a plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from infinigen_rt.cli.console import console, err_console, print_json, results_table
from infinigen_rt.cli.options import floats
from infinigen_rt.files import check_outputs
from infinigen_rt.policies.options import SPEC_KEYS, check_value

if TYPE_CHECKING:
    from rich.table import Table

    from infinigen_rt.measure.perplexity import Row


def eval_cmd(
    bundle: Annotated[str, typer.Argument(help="Bundle folder, or a Hub repo id to pull.")],
    text: Annotated[Path, typer.Option(help="A UTF-8 text: scored (perplexity) or the haystack (needle).")],
    task: Annotated[str, typer.Option(help="perplexity, needle (RULER-style retrieval), or ruler (RULER's tasks).")] = (
        "perplexity"
    ),
    policies: Annotated[str, typer.Option(help="Comma-separated: full, offload, infinigen, h2o, int4, oracle.")] = (
        "full,infinigen,h2o,int4,oracle"
    ),
    budgets: Annotated[str, typer.Option(help="Budgets (share of the context) for infinigen, h2o, oracle.")] = (
        "0.05,0.1,0.2"
    ),
    alphas: Annotated[Optional[str], typer.Option(
        help="Alphas (margins) for infinigen, inf = the budget alone \\[the budget alone].")] = None,  # fmt: skip
    spec_keys: Annotated[Optional[str], typer.Option(
        help=f"infinigen's speculation keys: {', '.join(SPEC_KEYS)} \\[its default].")] = None,  # fmt: skip
    correct: Annotated[Optional[float], typer.Option(
        help="infinigen's correction step: the share of the budget it fetches \\[its default].")] = None,  # fmt: skip
    shortlist: Annotated[Optional[float], typer.Option(
        help="infinigen's correction: the candidates it scores, a multiple of its count (0 = every held slot) "
        "\\[its default].")] = None,  # fmt: skip
    runs: Annotated[str, typer.Option(
        help="needle, ruler: infinigen's speculation in runs of this many consecutive tokens, comma-separated "
        "(1 = single tokens).")] = "1",  # fmt: skip
    layer_budgets: Annotated[Optional[str], typer.Option(
        help="needle, ruler: infinigen's per-layer budgets, the exponents of each layer's key share to compare, "
        "comma-separated (0 = one budget for every layer) \\[the bundle's].")] = None,  # fmt: skip
    seq_len: Annotated[int, typer.Option(help="Tokens of the text used.")] = 2048,
    score_from: Annotated[int, typer.Option(help="Tokens before this are the prompt; the rest are scored.")] = 1024,
    out: Annotated[Optional[Path], typer.Option(help="Write results JSON here (after every row).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip rows already in --out.")] = False,
    recall: Annotated[bool, typer.Option(help="Trace infinigen's attention-mass recall (slower).")] = True,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write the plot (PNG) here.")] = None,
    contexts: Annotated[Optional[str], typer.Option(
        help="needle: prompt lengths \\[1024, 2048, ... up to the model's context]")] = None,  # fmt: skip
    depths: Annotated[str, typer.Option(help="needle: where the needle goes, 0 (start) to 1 (end).")] = (
        "0,0.25,0.5,0.75,1"
    ),
    needles: Annotated[int, typer.Option(help="needle: needles per task, context and depth.")] = 2,
    needle_tasks: Annotated[str, typer.Option(help="needle: single, multikey, multivalue.")] = (
        "single,multikey,multivalue"
    ),
    ruler_tasks: Annotated[str, typer.Option(help="ruler: all, or of niah_single, niah_multikey, niah_multivalue, "
                                             "niah_multiquery, vt, cwe, fwe, qa.")] = "all",
    samples: Annotated[int, typer.Option(help="ruler: samples per task and context.")] = 4,
    seed: Annotated[int, typer.Option(help="needle, ruler: the seed of keys, values and haystack offsets.")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, float16, bfloat16.")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object.")] = False,
):
    """Accuracy of each KV policy against full attention: perplexity by teacher-forced decoding, or needles.

    With --task needle: RULER-style needles (single, multikey, multivalue) at depths of contexts cut from the
    text; each prompt is prefilled once for every policy compared, and each policy's greedy answer is checked.
    With --task ruler: RULER's tasks (needles, variable tracking, common and frequent words, QA over the text's
    passages), scored as RULER scores them; the average over tasks per policy, budget and context.

    Examples:
      infinigen-rt eval artifacts/bundles/smollm2-135m --text hamlet.txt --out results.json --plot results.png
      infinigen-rt eval BUNDLE --text play.txt --policies full,infinigen --budgets 0.1 --alphas 3,5 --json
      infinigen-rt eval BUNDLE --text play.txt --out results.json --resume
      infinigen-rt eval BUNDLE --task needle --text novel.txt --policies full,infinigen,h2o,oracle --budgets 0.1
      infinigen-rt eval BUNDLE --task ruler --text novel.txt --contexts 4096,8192 --budgets 0.02,0.05,0.1 --out r.json
    """
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.policies import POLICIES, KVOptions

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise InfinigenError(f"unknown policy {unknown[0]!r}; available: {', '.join(POLICIES)}")
    budget_list, alpha_list = floats(budgets, "--budgets"), floats(alphas, "--alphas")
    for name, values, flag in (("budget", budget_list, "--budgets"), ("alpha", alpha_list, "--alphas")):
        for v in values:
            check_value(name, v, flag)  # each in the KV option's range (policies/options.py)
    if resume and out is None:
        raise InfinigenError("--resume reads the rows already in --out: pass --out FILE")
    if out is not None and not resume and (out.is_file() or out.is_symlink()):  # (a folder: check_outputs says so)
        raise InfinigenError(f"--out {out} exists: pass --resume to add this run's rows to it, or give a path where "
                             "nothing is (it would be overwritten)")  # fmt: skip
    if task not in ("perplexity", "needle", "ruler"):
        raise InfinigenError(f"--task must be perplexity, needle or ruler, got {task!r}")
    spec = {k: v for k, v in (("spec_keys", spec_keys), ("correct", correct), ("shortlist", shortlist))
            if v is not None}  # fmt: skip
    KVOptions(**spec).check()
    run_list = floats(runs, "--runs")
    if not run_list or any(r != int(r) for r in run_list):
        raise InfinigenError(f"--runs takes whole numbers of tokens, got {runs!r}")
    run_list = [int(r) for r in run_list]
    for r in run_list:
        KVOptions(runs=r).check()
    if run_list != [1] and task == "perplexity":
        raise InfinigenError("--runs applies to --task needle and ruler (perplexity scores single tokens)")
    lb_list = floats(layer_budgets, "--layer-budgets") if layer_budgets is not None else None
    for e in lb_list or []:
        check_value("layer_budget", e, "--layer-budgets")
    if lb_list is not None and task == "perplexity":
        raise InfinigenError("--layer-budgets applies to --task needle and ruler (for perplexity: "
                             "benchmarks/levers.py --levers layer_budget0.5)")  # fmt: skip
    check_outputs(out, plot_path)
    path = resolve_bundle(bundle)
    engine = Engine(read_bundle(path), device=device, dtype=dtype)
    if task == "needle":
        return needle_cmd(engine, path, text, names, budget_list, alpha_list, contexts, depths, needles,
                          needle_tasks, seed, out, resume, plot_path, json_out, spec, run_list, lb_list)  # fmt: skip
    if task == "ruler":
        return ruler_cmd(engine, path, text, names, budget_list, alpha_list, contexts, samples, ruler_tasks, seed,
                         out, resume, plot_path, json_out, spec, run_list, lb_list)  # fmt: skip
    perplexity_cmd(engine, path, text, names, budget_list, alpha_list, seq_len, score_from, out, resume, recall,
                   plot_path, json_out, spec)  # fmt: skip


def perplexity_cmd(engine, path, text: Path, names, budgets, alphas, seq_len, score_from, out, resume, recall,
                   plot_path, json_out, spec: dict) -> None:  # fmt: skip
    """--task perplexity: the sweep of every (policy, budget, alpha) on the text, saved after every row."""
    from infinigen_rt.measure.perplexity import configs, load_done, plot, run_sweep, save, text_ids
    from infinigen_rt.policies import POLICIES

    if any("alpha" in POLICIES[p].sweep for p in names) and not alphas:  # the default: the budget alone
        alphas = [None]
    ids, sha = text_ids(engine, text, seq_len, score_from)
    meta = {"bundle": str(path), "text": str(text), "text_sha256": sha, "seq_len": seq_len, "score_from": score_from,
            "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}  # fmt: skip
    done = load_done(out, meta) if resume and out else []
    todo = configs(names, budgets, alphas)

    bar = _progress_bar(json_out)
    tasks: dict[str, int] = {}

    def progress(label, d, t):
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=t)
        bar.update(tasks[label], completed=d)

    with bar:
        rows = run_sweep(engine, ids, score_from, todo, done, recall=recall, progress=progress,
                         on_row=(lambda rs: save(out, meta, rs)) if out else None, spec=spec)  # fmt: skip
    if plot_path:
        plot(rows, plot_path, f"{Path(str(path)).name}: {text.name}, {seq_len} tokens, scored from {score_from}")
    if json_out:
        from dataclasses import asdict

        print_json({**meta, "rows": [asdict(r) for r in rows]})
        return
    console.print(eval_table(rows, f"perplexity on {text.name} ({seq_len} tokens, scored from {score_from})"))


def eval_table(rows: list[Row], title: str) -> Table:
    """The rows as a table that reads at 80 columns (the alpha column only where a row has one); seconds per row and
    the exact bytes are in --json/--out."""
    from infinigen_rt.measure.perplexity import label

    alpha = any(r.alpha is not None for r in rows)
    table = results_table(title, ["policy", "budget", *(["alpha"] * alpha), "ppl", "vs full", "KL", "fetched",
                                  "attended", "recall", "MB/tok"])  # fmt: skip

    def f(x, fmt, scale=1.0):
        return "-" if x is None else format(x / scale, fmt)

    for r in rows:
        table.add_row(label(r.policy, r.spec_keys, r.correct, short=True), f(r.budget, ".2f"),
                      *([f(r.alpha, "g")] * alpha), f(r.perplexity, ".3f"),
                      "-" if r.delta_pct is None else f"{r.delta_pct:+.2f}%", f(r.kl, ".4f"),
                      f(r.kv_fetched_share, ".1%"), f(r.kv_attended_share, ".1%"), f(r.recall, ".3f"),
                      f(r.bytes_per_token, ".2f", 1e6))  # fmt: skip
    return table


def _progress_bar(disable: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True, disable=disable)  # fmt: skip


def needle_cmd(engine, path, text: Path, names, budgets, alphas, contexts, depths, per_cell, tasks, seed, out,
               resume, plot_path, json_out, spec: dict, runs: list[int] | None = None,
               layer_budgets: list[float] | None = None) -> None:  # fmt: skip
    """eval --task needle: build the cases, answer them with every policy, print, save, plot."""

    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.files import read_utf8
    from infinigen_rt.measure import needle
    from infinigen_rt.measure.perplexity import check_text_file, load_finished

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_list or any(t not in needle.TASKS for t in task_list):
        raise InfinigenError(f"--needle-tasks takes {', '.join(needle.TASKS)}, got {tasks!r}")
    depth_list = floats(depths, "--depths")
    if not depth_list or any(not 0 <= d <= 1 for d in depth_list):
        raise InfinigenError(f"--depths must be in [0, 1], got {depths!r}")
    if per_cell < 1:
        raise InfinigenError(f"--needles must be >= 1, got {per_cell}")
    limit = engine.cfg.max_position_embeddings - max(needle.MAX_NEW[t] for t in task_list)
    if contexts:
        context_list = [int(c) for c in floats(contexts, "--contexts")]
        if any(c > limit for c in context_list):
            positions = engine.cfg.max_position_embeddings
            raise InfinigenError(f"--contexts must be at most {limit} for this model (its {positions} positions "
                                 "less the answer's tokens)")  # fmt: skip
    else:  # 1k, 2k, 4k, ... up to the model's context, the last cut to leave room for the answer
        context_list, c = [], 1024
        while c < limit:
            context_list.append(c)
            c *= 2
        context_list.append(limit)
    alpha = alphas[0] if alphas else None
    if len(alphas) > 1:
        raise InfinigenError("--task needle takes one --alphas value (or none: the budget alone)")
    check_text_file(text)
    hay, sha = read_utf8(text, f"--text {text}")
    cases = needle.build_cases(engine.tokenizer, hay, task_list, context_list, depth_list, per_cell, seed)
    keys = engine.speculation.defaults.spec_keys if engine.speculation else None  # the bundle's default keys
    todo = needle.configs(names, budgets or [0.1], alpha, spec, keys, runs, layer_budgets, _layer_budget(engine))
    meta = {"task": "needle", "bundle": str(path), "text": text.name, "text_sha256": sha, "seed": seed,
            "tasks": task_list, "contexts": context_list, "depths": depth_list, "needles": per_cell,
            "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}  # fmt: skip
    done = load_finished(out, meta, "results", lambda r: needle.Result(**r), "a needle",
                         ("bundle", "text_sha256", "seed")) if resume else []  # fmt: skip

    results = _answer_cases(engine, cases, todo, done, out, json_out, "needles",
                            lambda results: needle.as_json(meta, results))  # fmt: skip
    if plot_path:
        needle.heatmaps(results, plot_path, f"{Path(str(path)).name}: needles in {text.name} "
                        f"({', '.join(task_list)}; {per_cell} per cell and task)")  # fmt: skip
    if json_out:
        print_json(needle.as_json(meta, results))
        return
    console.print(needle_table(needle.summary(results), f"needle accuracy in {text.name} (seed {seed})"))


def _layer_budget(engine) -> float:
    """The bundle's per-layer budget exponent (0: one budget for every layer; a bundle without speculation: 0)."""
    return engine.speculation.defaults.layer_budget if engine.speculation else 0.0


def _answer_cases(engine, cases, todo, done, out, json_out, what: str, as_json) -> list:
    """needle.run over `cases` with a progress bar, `as_json(results)` written to --out after each case; the results
    of these cases (--out may hold other cases' too: this run's policies and earlier ones')."""
    import json

    from infinigen_rt.files import write_atomic
    from infinigen_rt.measure import needle

    def save(results, _seconds):
        write_atomic(out, json.dumps(as_json(results), indent=2) + "\n", "--out")

    bar = _progress_bar(json_out)
    with bar:
        job = bar.add_task(f"{what} x {len(todo)} policies", total=len(cases))
        results = needle.run(engine, cases, todo, done, on_case=save if out else None,
                             progress=lambda d, t: bar.update(job, completed=d))  # fmt: skip
    if out:  # (again: a resumed run with nothing left to answer may still have rescored what it read)
        save(results, 0.0)
    cells = {k.cell() for k in cases}
    return [r for r in results if r.cell() in cells]


def ruler_cmd(engine, path, text: Path, names, budgets, alphas, contexts, samples, tasks, seed, out, resume,
              plot_path, json_out, spec: dict, runs: list[int] | None = None,
              layer_budgets: list[float] | None = None) -> None:  # fmt: skip
    """eval --task ruler: build the cases, answer them with every policy (needle.run), print, save, plot."""

    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.files import read_utf8
    from infinigen_rt.measure import needle, ruler
    from infinigen_rt.measure.perplexity import check_text_file, load_finished

    task_list = list(ruler.TASKS) if tasks.strip() == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_list or any(t not in ruler.TASKS for t in task_list):
        raise InfinigenError(f"--ruler-tasks takes all, or of {', '.join(ruler.TASKS)}; got {tasks!r}")
    if samples < 1:
        raise InfinigenError(f"--samples must be >= 1, got {samples}")
    limit = engine.cfg.max_position_embeddings - max(ruler.MAX_NEW[t] for t in task_list)
    context_list = [int(c) for c in floats(contexts or "4096,8192,16384,32768", "--contexts")]
    if not contexts:  # the default lengths this model holds
        context_list = [c for c in context_list if c <= limit] or [limit]
    if any(c > limit for c in context_list):
        raise InfinigenError(f"--contexts must be at most {limit} for this model (its "
                             f"{engine.cfg.max_position_embeddings} positions less the answer's tokens)")  # fmt: skip
    if len(alphas) > 1:
        raise InfinigenError("--task ruler takes one --alphas value (or none: the budget alone)")
    check_text_file(text)
    hay, sha = read_utf8(text, f"--text {text}")
    cases = ruler.build_cases(engine.tokenizer, hay, task_list, context_list, samples, seed)
    keys = engine.speculation.defaults.spec_keys if engine.speculation else None  # the bundle's default keys
    todo = needle.configs(names, budgets or [0.1], alphas[0] if alphas else None, spec, keys, runs, layer_budgets,
                          _layer_budget(engine))  # fmt: skip
    meta = {"task": "ruler", "bundle": str(path), "text": text.name, "text_sha256": sha, "seed": seed,
            "tasks": task_list, "contexts": context_list, "samples": samples,
            "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}  # fmt: skip
    done = load_finished(out, meta, "results", lambda r: needle.Result(**r), "a ruler",
                         ("bundle", "text_sha256", "seed")) if resume else []  # fmt: skip
    done = ruler.rescore(done, cases)  # (word-task answers saved before the score within the count asked)
    def as_json(results):
        """The results with the meta of what they hold: --out keeps earlier runs' contexts and tasks beside this
        run's (whatever --contexts and --ruler-tasks it names), and its meta lists them all."""
        held = {"contexts": sorted({r.context for r in results} | set(context_list)),
                "tasks": [t for t in ruler.TASKS if t in task_list or any(r.task == t for r in results)]}  # fmt: skip
        return {**meta, **held, "summary": ruler.summary(results), "results": [asdict(r) for r in results]}

    results = _answer_cases(engine, cases, todo, done, out, json_out, "RULER cases", as_json)
    rows = ruler.summary(results)
    if plot_path:
        ruler.plot(rows, plot_path, f"{Path(str(path)).name}: RULER over {text.name} ({len(task_list)} tasks, "
                   f"{samples} sample{'' if samples == 1 else 's'} a task and context)")  # fmt: skip
    if json_out:
        print_json(as_json(results))
        return
    table = results_table(f"RULER in {text.name} (seed {seed})",
                          ["policy", "budget", "context", "cases", *task_list, "average", "vs full",
                           "within asked"])  # fmt: skip
    from infinigen_rt.measure.perplexity import label

    for r in rows:
        table.add_row(label(r["policy"], r["spec_keys"], r["correct"], short=True, runs=r.get("runs"),
                            layer_budget=r.get("layer_budget")),
                      "-" if r["budget"] is None else f"{r['budget']:.2f}", str(r["context"]), str(r["cases"]),
                      *(f"{r['tasks'][t]:.0%}" if t in r["tasks"] else "-" for t in task_list), f"{r['score']:.1%}",
                      "-" if r["vs_full"] is None else f"{r['vs_full']:.1%}",
                      "-" if r["asked"] is None else f"{r['asked']:.1%}")  # fmt: skip
    console.print(table)


def needle_table(rows: list[dict], title: str) -> Table:
    from infinigen_rt.measure.perplexity import label

    table = results_table(title, ["policy", "budget", "context", "cases", "accuracy", "vs full", "fetched"])
    for r in rows:
        name = label(r["policy"], r["spec_keys"], r["correct"], short=True, runs=r.get("runs"),
                     layer_budget=r.get("layer_budget"))  # fmt: skip
        table.add_row(name, "-" if r["budget"] is None else f"{r['budget']:.2f}", str(r["context"]), str(r["cases"]),
                      f"{r['accuracy']:.1%}", "-" if r["vs_full"] is None else f"{r['vs_full']:.1%}",
                      "-" if r["kv_fetched_share"] is None else f"{r['kv_fetched_share']:.1%}")  # fmt: skip
    return table
