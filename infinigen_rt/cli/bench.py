"""`infinigen-rt bench`: decode speed of every policy over batches and contexts, against a measured floor."""

from __future__ import annotations

import json
import os
import platform
import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from infinigen_rt.cli.console import console, err_console, human_bytes, print_json, print_wide, results_table
from infinigen_rt.cli.options import kv_option
from infinigen_rt.files import check_outputs, write_atomic
from infinigen_rt.policies.options import DEFAULTS, OPTS, check_value, flag


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} takes integers separated by commas, got {text!r}") from None
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{name} takes integers >= 1, got {text!r}")
    return out


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def save(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n", "--out")


# the options of `bench`
Bundle = Annotated[Optional[str], typer.Argument(help="Bundle folder or Hub repo id (or use --synthetic).")]
Synthetic = Annotated[
    Optional[str],
    typer.Option(help="Random weights of real shapes: llama-2-7b, llama-3.1-8b, opt-13b, smollm2-135m, "
                 "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m, gemma-3-4b."),
]
Batch = Annotated[str, typer.Option(help="Batch sizes, comma-separated.")]
Context = Annotated[str, typer.Option(help="Context lengths (prompt tokens), comma-separated.")]
Gen = Annotated[int, typer.Option(help="Timed decode steps per point (after the warm-up).")]
Warmup = Annotated[int, typer.Option(help="Untimed decode steps first.")]
Policies = Annotated[str, typer.Option(help="Comma-separated: full, offload, infinigen, h2o, int4.")]
# the KV options bench takes: their help and checks are the KV options' (policies/options.py); bench's budget
# default is its own (0.1), and it sweeps the speculation keys and the correction share as lists
Budget = Annotated[float, kv_option("budget")]


def _list_help(name: str, what: str) -> str:
    help = OPTS[name].help.rstrip(".")
    if DEFAULTS[name] is None:  # "[bundle default]" already closes the help
        return f"{help.removesuffix(' [bundle default]')}, comma-separated; {what} [default: the bundle's]."
    return f"{help}, comma-separated; {what} [default: {DEFAULTS[name]}]."


SpecKeys = Annotated[Optional[str], kv_option("spec_keys", help=_list_help(
    "spec_keys", "several time one point each, side by side with --interleave"))]  # fmt: skip
Correct = Annotated[Optional[str], kv_option("correct", help=_list_help("correct", "every key choice runs with each"))]
Shortlist = Annotated[Optional[str], kv_option("shortlist", help=_list_help(
    "shortlist", "every correction share runs with each"))]  # fmt: skip
MaxKv = Annotated[Optional[int], kv_option("max_kv")]
Reuse = Annotated[bool, kv_option("reuse")]
Alpha = Annotated[Optional[float], kv_option("alpha")]
Text = Annotated[
    Optional[Path], typer.Option(help="Prompt from this UTF-8 text (a bundle) [random tokens].")
]
PrefillChunk = Annotated[Optional[int], kv_option("prefill_chunk")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda.")]
Dtype = Annotated[
    str, typer.Option(help="auto (fp16 synthetic on GPU, fp32 on CPU), float32, float16, bfloat16.")
]
Seed = Annotated[int, typer.Option(help="Seed of the synthetic weights and prompts.")]
Probe = Annotated[
    Optional[int], typer.Option(help="Bytes each bandwidth probe moves [1 GiB on a GPU, 256 MiB on a CPU].")
]
Trace = Annotated[bool, typer.Option(help="CUDA: profile one step per point for copy/compute overlap.")]
Interleave = Annotated[
    bool, typer.Option(help="Time the policies side by side: per (batch, context) all caches at once, one "
                       "decode step of each in turn (for a machine whose speed drifts).")
]
Out = Annotated[Optional[Path], typer.Option(help="Write results JSON here (after every point).")]
PlotPath = Annotated[Optional[Path], typer.Option("--plot", help="Write the plot (PNG) here.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the results as one JSON object.")]
Wide = Annotated[
    bool,
    typer.Option(
        "--wide",
        help="Table: every column (prefill, floor, H2D rate, syncs, overlap, memory), at full "
        "width, even past the terminal's.",
    ),
]
Rehearse = Annotated[bool, typer.Option(
    help="Project each point's decode step on an H100 from the ops the GPU path issues (fake CUDA, meta tensors: "
         "any CPU, nothing computed) against its floor, instead of timing it; needs --synthetic.")]  # fmt: skip
Replay = Annotated[Optional[list[Path]], typer.Option(
    help="Project recorded decode steps (a trace file, or a folder of them: benchmarks/record_trace.py) with this "
         "tree's projection, eager and from a CUDA graph, instead of running anything; repeatable.")]  # fmt: skip
Graphs = Annotated[str, typer.Option(
    help="CUDA: decode steps replayed from CUDA graphs where the policy's step allows it (full): off, on, or both "
         "(every point eager and graphed; side by side with --interleave).")]  # fmt: skip
Tp = Annotated[
    int, typer.Option("--tp", help="Tensor-parallel ranks: starts this many processes (torchrun); needs a BUNDLE.")
]


def bench_cmd(
    bundle: Bundle = None,
    synthetic: Synthetic = None,
    batch: Batch = "1,4,16",
    context: Context = "2048,8192,32768",
    gen: Gen = 128,
    warmup: Warmup = 3,
    policies: Policies = "full,offload,infinigen,h2o,int4",
    budget: Budget = 0.1,
    max_kv: MaxKv = None,
    alpha: Alpha = None,
    spec_keys: SpecKeys = None,
    correct: Correct = None,
    shortlist: Shortlist = None,
    reuse: Reuse = False,
    text: Text = None,
    prefill_chunk: PrefillChunk = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    seed: Seed = 0,
    probe: Probe = None,
    trace: Trace = True,
    interleave: Interleave = False,
    out: Out = None,
    plot_path: PlotPath = None,
    json_out: JsonOut = False,
    wide: Wide = False,
    tp: Tp = 1,
    rehearse: Rehearse = False,
    replay: Replay = None,
    graphs: Graphs = "off",
):
    """Decode speed of each KV policy for every batch x context, with bytes moved, memory and the floor.

    Examples:
      infinigen-rt bench --synthetic llama-2-7b --batch 8 --context 8192 --policies offload,infinigen
      infinigen-rt bench artifacts/bundles/smollm2-135m --device cpu --batch 1 --context 8192 --gen 32
      infinigen-rt bench --synthetic smollm2-135m --batch 1,4 --context 1024,4096 --out bench.json --plot bench.png
      infinigen-rt bench --synthetic llama-3.1-8b --batch 1,8 --context 32768 --policies full,infinigen --rehearse
      infinigen-rt bench --replay artifacts/results/gpu-h100-2026-11-26/traces --json
    """
    import math

    from infinigen_rt.cli.launch import launch
    from infinigen_rt.tp import check_tp_option, follower_env

    if replay:
        _replay(replay, out, json_out)
        return
    names, batches, contexts = _check(bundle, synthetic, policies, batch, context, gen, warmup, probe, text, tp)
    for name, value in (("budget", budget), ("max_kv", max_kv), ("alpha", alpha), ("prefill_chunk", prefill_chunk)):
        check_value(name, value)
    variants = _variants(names, spec_keys, correct, reuse, shortlist)
    if graphs not in ("off", "on", "both"):
        from infinigen_rt.errors import InfinigenError

        raise InfinigenError(f"--graphs takes off, on or both, got {graphs!r}")
    if graphs != "off":
        from dataclasses import replace

        variants = [w for v in variants for w in ([v] if graphs == "both" else []) + [replace(v, graphs=True)]]
    check_outputs(out, plot_path)
    if rehearse:
        from infinigen_rt.errors import InfinigenError

        if synthetic is None or tp > 1:
            raise InfinigenError("--rehearse projects a synthetic model's step: give --synthetic PRESET (no bundle, no "
                                 "--tp)")  # fmt: skip
        if plot_path is not None:
            raise InfinigenError("--rehearse draws no plot: drop --plot")
        _rehearse(synthetic, dtype, variants, batches, contexts, dict(budget=budget, max_kv=max_kv, alpha=alpha,
                  seed=seed), out, json_out)  # fmt: skip
        return
    if check_tp_option(tp):
        raise typer.Exit(launch(tp, sys.argv[1:], bundle))
    quiet = json_out or follower_env()
    with console.status("building the model", spinner="dots") if not quiet else nullcontext():
        engine, model_name, tp = _load(bundle, synthetic, device, dtype, seed)
        if synthetic is None:  # (a synthetic model's random weights time any position alike)
            _check_positions(engine.cfg.max_position_embeddings, max(contexts), gen, warmup)
        prompt = None
        if text is not None:
            from infinigen_rt.measure.perplexity import text_ids

            prompt, _ = text_ids(engine, text, max(contexts), max(contexts) - 1, "the largest --context")
        from infinigen_rt.measure.floor import measure_bandwidths

        bw = measure_bandwidths(engine.device, probe)
    shown = None if alpha is None or math.isinf(alpha) else alpha
    meta = _meta(engine, model_name, bw, tp, budget=budget, max_kv=max_kv, alpha=shown, gen=gen, warmup=warmup,
                 interleave=interleave, prompt=str(text) if text else "random tokens")  # fmt: skip
    if not quiet:
        err_console.print(
            f"[dim]{meta['device_name']}: device copy {bw['device_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"host-to-device {bw['h2d_bytes_per_s'] / 1e9:.1f} GB/s (measured)[/]"
        )
    groups = [variants] if interleave else [[v] for v in variants]
    todo = [(g, b, c) for c in contexts for b in batches for g in groups]
    follower = tp is not None and tp.rank != 0  # under torchrun: every rank runs every point, rank 0 reports
    kw = dict(budget=budget, max_kv=max_kv, alpha=alpha, warmup=warmup, chunk=prefill_chunk, prompt=prompt, seed=seed,
              trace=trace)  # fmt: skip
    _sweep(engine, model_name, bw, todo, gen, kw, meta, None if follower else out, quiet)
    if follower:
        return
    if plot_path:
        from infinigen_rt.measure.bench import plot

        plot(meta["points"], plot_path, f"{model_name} on {meta['device_name']} ({meta['dtype']})")
    if json_out:
        print_json(meta)
        return
    table = bench_table(meta["points"], wide)
    print_wide(table) if wide else console.print(table)


def _rehearse(preset: str, dtype: str, variants: list, batches: list[int], contexts: list[int], kw: dict, out,
              json_out: bool) -> None:  # fmt: skip
    """bench --rehearse: every point projected (measure/rehearse.py), printed as a table or JSON, saved to `out`."""
    import torch

    from infinigen_rt import __version__
    from infinigen_rt.measure.projection import H100
    from infinigen_rt.measure.rehearse import rehearse, rows
    from infinigen_rt.system import resolve_dtype

    dt = torch.bfloat16 if dtype == "auto" else resolve_dtype(dtype, torch.bfloat16, torch.device("cuda"))
    meta = {"model": f"synthetic:{preset}", "dtype": str(dt).removeprefix("torch."), "infinigen": __version__,
            "rehearsal": "fake CUDA, meta tensors: one decode step's ops replayed (measure/projection.py)",
            "hardware": asdict(H100), **kw, "points": []}  # fmt: skip
    todo = [(b, c) for c in contexts for b in batches]
    bar = _progress(json_out)
    with bar:
        task = bar.add_task("rehearse", total=len(todo))
        for b, c in todo:
            bar.update(task, description=f"batch {b} context {c}")
            meta["points"] += rows(rehearse(preset, dt, variants, b, c, **kw))
            if out:
                save(out, meta)
            bar.advance(task)
    if json_out:
        print_json(meta)
        return
    console.print(rehearse_table(meta["points"]))


def _replay(paths: list[Path], out, json_out: bool) -> None:
    """bench --replay: recorded steps projected (measure/rehearse.py's replay), printed and saved as --rehearse's."""
    from infinigen_rt import __version__
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.measure.projection import H100
    from infinigen_rt.measure.rehearse import replay, rows

    files = []
    for p in paths:
        found = sorted(p.glob("*.json.gz")) if p.is_dir() else [p] if p.exists() else []
        if not found:
            raise InfinigenError(f"--replay {p}: {'no *.json.gz trace in it' if p.is_dir() else 'no such file'}")
        files += found
    check_outputs(out, None)
    meta = {"infinigen": __version__, "replay": [str(f) for f in files], "hardware": asdict(H100),
            "points": rows(replay(files, H100))}  # fmt: skip
    if out:
        save(out, meta)
    if json_out:
        print_json(meta)
        return
    console.print(rehearse_table(meta["points"]))


def rehearse_table(points: list[dict]):
    """The projected points: launches a step, the projected step, the host's share of it, the floor and the ratio,
    the bytes across PCIe and the share of their transfer under compute."""
    table = results_table("projected decode step (H100, from the ops issued)",
                          ["policy", "batch", "context", "graphs", "launches", "ms", "issue ms", "floor ms",
                           "x floor", "PCIe", "overlap"])  # fmt: skip
    for p in points:
        if p["status"] != "ok":
            table.add_row(point_label(p), str(p["batch"]), str(p["context"]), "", f"[yellow]{p['status']}[/]")
            continue
        table.add_row(point_label(p), str(p["batch"]), str(p["context"]), "yes" if p.get("graphs") else "no",
                      f"{p['launches']:,}", f"{p['projected_ms']:.1f}", f"{p['issue_ms']:.1f}",
                      f"{p['floor_ms']:.1f}", f"{p['over_floor']:.2f}", human_bytes(p["pcie_bytes"]),
                      _fmt(p.get("overlap"), ".0%"))  # fmt: skip
    return table


def _check(bundle, synthetic, policies: str, batch: str, context: str, gen: int, warmup: int, probe, text,
           tp: int) -> tuple[list[str], list[int], list[int]]:  # fmt: skip
    """One-line errors for arguments that cannot work, before anything loads: (policies, batches, contexts)."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.measure.synthetic import PRESETS
    from infinigen_rt.policies import RUNTIME_POLICIES
    from infinigen_rt.tp import world_size

    if tp > 1 and synthetic is not None:
        raise InfinigenError("bench --tp needs a BUNDLE (each rank reads its slices of it), not --synthetic")
    if world_size() > 1 and synthetic is not None:
        raise InfinigenError("bench under torchrun needs a BUNDLE (each rank reads its slices of it), not --synthetic")
    if (bundle is None) == (synthetic is None):
        raise InfinigenError("give a BUNDLE or --synthetic PRESET (one of them)")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in names if p not in RUNTIME_POLICIES]
    if bad or not names:
        what = bad[0] if bad else policies
        raise InfinigenError(f"unknown policy {what!r}; available: {', '.join(RUNTIME_POLICIES)}")
    batches, contexts = _ints(batch, "--batch"), _ints(context, "--context")
    if gen < 1 or warmup < 0:
        raise InfinigenError(f"--gen must be >= 1 and --warmup >= 0, got {gen} and {warmup}")
    if probe is not None and probe < 1 << 16:
        raise InfinigenError(f"--probe must be at least 65536 bytes, got {probe}")
    if synthetic is not None and synthetic not in PRESETS:
        raise InfinigenError(f"unknown --synthetic preset {synthetic!r}; available: {', '.join(PRESETS)}")
    if text is not None and synthetic is not None:
        raise InfinigenError("--text needs a BUNDLE (a synthetic model has no tokenizer)")
    return names, batches, contexts


def _variants(names: list[str], spec_keys: str | None, correct: str | None, reuse: bool = False,
              shortlist: str | None = None) -> list:  # fmt: skip
    """The points' policies: a speculating policy once per key choice, correction share and shortlist given, with
    `reuse` if asked (the others once each)."""
    from infinigen_rt.cli.options import floats
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.measure.bench import Variant
    from infinigen_rt.policies import POLICIES

    keys = [k.strip() for k in spec_keys.split(",") if k.strip()] if spec_keys is not None else [None]
    shares = [None] if correct is None else floats(correct, "--correct")
    lists = [None] if shortlist is None else floats(shortlist, "--shortlist")
    for name, given, values in (("spec_keys", spec_keys, keys), ("correct", correct, shares),
                                ("shortlist", shortlist, lists)):  # fmt: skip
        if not values:
            raise InfinigenError(f"{flag(name)} takes values separated by commas, got {given!r}")
        for v in values:
            check_value(name, v)
    out = []
    for n in names:
        spec = "spec_keys" in POLICIES[n].knobs
        out += [Variant(n, k, c, reuse or None, s) for k in keys for c in shares for s in lists] if spec else [
            Variant(n)]
    return out


def _check_positions(positions: int, context: int, gen: int, warmup: int) -> None:
    """A point's prompt and every token it decodes (its warm-up, --gen, and a few spare) fit the model's positions:
    past them a bundle's model gives numbers that mean nothing."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.measure.bench import SPARE_TOKENS

    room = positions - warmup - gen - SPARE_TOKENS
    if context > room:
        raise InfinigenError(f"--context {context} is past what the model's {positions:,} positions hold with --gen "
                             f"{gen} and --warmup {warmup}: give contexts of at most {room:,}")  # fmt: skip


def _load(bundle, synthetic, device: str, dtype: str, seed: int):
    """(engine, the model's name in the results, this rank's tensor-parallel group under torchrun or None)."""
    import torch

    from infinigen_rt.system import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if synthetic is not None:
        from infinigen_rt.measure.synthetic import synthetic_engine

        engine = synthetic_engine(synthetic, dev, resolve_dtype(dtype, torch.float16, dev), seed)
        return engine, f"synthetic:{synthetic}", None
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.tp import from_env

    path = resolve_bundle(bundle)
    b = read_bundle(path)
    tp = from_env(dev, b.config)
    return Engine(b, device=str(dev), dtype=dtype, tp=tp), Path(str(path)).name, tp


def _meta(engine, model_name: str, bw: dict, tp, **run) -> dict:
    """The results file's head: the model, the machine and the run's settings; its points follow."""
    import torch

    from infinigen_rt import __version__

    meta = {"model": model_name, "device": str(engine.device), "device_name": device_name(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."), "torch": torch.__version__, "infinigen": __version__,
            "bandwidth": bw, **run, "points": []}  # fmt: skip
    if tp is not None:
        meta["tensor_parallel"] = tp.size
    return meta


def _sweep(engine, model_name: str, bw: dict, todo, gen: int, kw: dict, meta: dict, out, quiet: bool) -> None:
    """Every (policies, batch, context) of `todo`, its points added to meta (and saved to `out` after each)."""
    from infinigen_rt.measure.bench import run_points

    bar = _progress(quiet)
    with bar:
        task = bar.add_task("bench", total=len(todo))
        for g, b, c in todo:
            bar.update(task, description=f"{','.join(v.policy for v in g)} batch {b} context {c}")
            meta["points"] += [asdict(pt) for pt in run_points(engine, model_name, g, b, c, gen, bw, **kw)]
            if out:
                save(out, meta)
            bar.advance(task)


def _progress(quiet: bool):
    """The bar over a run's points (on stderr, gone when done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True, disable=quiet)  # fmt: skip


def point_label(p: dict) -> str:
    from infinigen_rt.measure.bench import point_label

    return point_label(p)


def _fmt(x, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x / scale, fmt)


# (header, how a point's cell reads, in the default table); --wide shows every column
COLUMNS = (
    ("policy", lambda p: point_label(p), True),
    ("batch", lambda p: str(p["batch"]), True),
    ("context", lambda p: str(p["context"]), True),
    ("prefill s", lambda p: _fmt(p["prefill_s"], ".2f"), False),
    ("ms/step", lambda p: _fmt(p["ms_per_step"], ".1f"), True),
    ("tok/s", lambda p: _fmt(p["tokens_per_s"], ".1f"), True),
    ("H2D/step", lambda p: human_bytes(p["h2d_bytes_per_step"]), True),
    ("all-reduce ms", lambda p: _fmt(p.get("allreduce_ms_per_step"), ".2f"), False),
    ("H2D GB/s", lambda p: _fmt(p["h2d_achieved_bytes_per_s"], ".2f", 1e9), False),
    ("fetched", lambda p: _fmt(p["kv_fetched_share"], ".1%"), True),
    ("floor ms", lambda p: _fmt(p["floor_ms"], ".2f"), False),
    ("x floor", lambda p: _fmt(p["over_floor"], ".2f"), True),
    ("syncs", lambda p: _fmt(p["syncs_per_step"], ".0f"), False),
    ("overlap", lambda p: _fmt(p["copy_overlap"], ".0%"), False),
    ("dev GiB", lambda p: _fmt(p["peak_device_bytes"], ".1f", 2**30), False),
    ("host GiB", lambda p: _fmt(p["host_rss_bytes"], ".1f", 2**30), False),
)


def bench_table(points: list[dict], wide: bool = False):
    """The points as a table: policy, batch, context, step time, tokens/s, bytes fetched per step, the fetched
    share and time over the floor (fits 80 columns); `wide` adds prefill, the floor, the achieved host-to-device
    rate, CUDA syncs and copy overlap, and memory."""
    cols = [c for c in COLUMNS if wide or c[2]]
    table = results_table("decode speed (median step)", [c[0] for c in cols])
    table.caption = None if wide else "--wide: every column; --json or --out: every field"
    for p in points:
        if p["status"] != "ok":  # an out-of-memory row: the status where the step time would be
            cells = [point_label(p), str(p["batch"]), str(p["context"])]
            table.add_row(*cells, *[f"[yellow]{p['status']}[/]" if c[0] == "ms/step" else "" for c in cols[3:]])
            continue
        table.add_row(*[c[1](p) for c in cols])
    return table
