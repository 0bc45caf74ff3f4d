"""Markdown tables from the results JSON that `infinigen-rt eval` and `infinigen-rt bench` write, as published in
docs/accuracy.md and docs/performance.md (tests/test_docs.py checks the docs hold exactly these).

python benchmarks/tables.py artifacts/results/accuracy-smollm2-hamlet.json artifacts/results/bench-cpu-smollm2.json
"""

from __future__ import annotations

import json
import sys

from infinigen_rt.measure.perplexity import label


def pct(x, digits=1):
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def accuracy(d: dict) -> str:
    out = ["| policy | budget | perplexity | vs full | KV fetched | KV attended (all layers) | bytes moved / token |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in d["rows"]:
        delta = "-" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f} %"
        moved = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e6:.2f} MB"
        name = label(r["policy"], r.get("spec_keys"), r.get("correct"), r.get("alpha"))
        out.append(f"| {name} | {r['budget'] or '-'} | {r['perplexity']:.3f} | {delta} | "
                   f"{pct(r['kv_fetched_share'])} | {pct(r.get('kv_attended_share'))} | {moved} |")  # fmt: skip
    return "\n".join(out)


def bench(d: dict) -> str:
    """The points; the batch column only when the run has more than one batch size."""
    batches = len({p["batch"] for p in d["points"]}) > 1
    head = "| policy | batch " if batches else "| policy "
    out = [head + "| context | prefill s | ms / step | tokens/s | KV moved / step | KV fetched | floor ms | x floor |",
           "|---" * (10 if batches else 9) + "|"]  # fmt: skip
    for p in d["points"]:
        name = label(p["policy"], p.get("spec_keys"), p.get("correct"), short=True)  # keys: bench --spec-keys
        cells = [name, *([p["batch"]] if batches else []), p["context"]]
        if p["status"] != "ok":
            out.append("| " + " | ".join(map(str, cells)) + f" | {p['status']} | | | | | | |")
            continue
        moved = "-" if not p["h2d_bytes_per_step"] else f"{p['h2d_bytes_per_step'] / 1e6:.1f} MB"
        cells += [f"{p['prefill_s']:.1f}", f"{p['ms_per_step']:.1f}", f"{p['tokens_per_s']:.2f}", moved,
                  pct(p["kv_fetched_share"]), f"{p['floor_ms']:.1f}", f"{p['over_floor']:.2f}"]  # fmt: skip
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


def _pair(points: list[dict]) -> dict:
    """bench --rehearse's or --replay's points: {(model, policy, spec_keys, correct, batch, context): {graphs: p}}."""
    out: dict = {}
    for p in points:
        key = (p["model"], p["policy"], p.get("spec_keys"), p.get("correct"), p["batch"], p["context"])
        out.setdefault(key, {})[bool(p.get("graphs"))] = p
    return out


def held(replayed: dict, measured: list[dict], held_out: str) -> str:
    """bench --replay's points (the measured tree's recorded steps, projected eager) beside bench's medians on the GPU
    (`measured`: bench files): the projection, the measurement and their ratio; the model `held_out` set no
    constant."""
    ms = {(d["model"], p["policy"], p["batch"], p["context"]): p["ms_per_step"] for d in measured for p in d["points"]}
    out = ["| model | policy | batch x context | projected ms (eager) | measured ms | projected / measured |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for (model, policy, spec, correct, b, c), pts in _pair(replayed["points"]).items():
        p, m = pts[False], ms[(model, policy, b, c)]
        name = model.removeprefix("synthetic:") + (" (held out)" if model.endswith(held_out) else "")
        out.append(f"| {name} | {label(policy, spec, correct, short=True)} | {b} x {c} | {p['projected_ms']:.1f} "
                   f"| {m:.1f} | {p['projected_ms'] / m:.2f} |")  # fmt: skip
    return "\n".join(out)


def graphed(*files: dict) -> str:
    """bench --rehearse's points, eager and from a CUDA graph: launches, the projected ms of each, the floor and each
    one's ratio to it, and the graphed step's share of its host-to-device transfer under compute."""
    out = ["| model | policy | batch x context | launches | eager ms | graphed ms | floor ms | eager x floor "
           "| graphed x floor | overlap (graphed) |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (model, policy, spec, correct, b, c), pts in _pair([p for d in files for p in d["points"]]).items():
        e, g = pts[False], pts[True]
        overlap = "-" if g.get("overlap") is None else f"{g['overlap']:.2f}"
        out.append(f"| {model.removeprefix('synthetic:')} | {label(policy, spec, correct, short=True)} | {b} x {c} "
                   f"| {e['launches']:,} | {e['projected_ms']:.1f} | {g['projected_ms']:.1f} | {e['floor_ms']:.1f} "
                   f"| {e['over_floor']:.2f} | {g['over_floor']:.2f} | {overlap} |")  # fmt: skip
    return "\n".join(out)


def needle(d: dict) -> str:
    """Accuracy per policy (columns) and context (rows), with the share of full's accuracy it keeps."""
    def config(s: dict) -> tuple:
        return s["policy"], s["budget"], s.get("alpha"), s.get("spec_keys"), s.get("correct")

    configs = list(dict.fromkeys(config(s) for s in d["summary"]))
    head = [label(p, k, c, a) + (f" {b:g}" if b is not None else "") for p, b, a, k, c in configs]
    out = ["| context | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    by = {(*config(s), s["context"]): s for s in d["summary"]}
    for c in sorted({s["context"] for s in d["summary"]}):
        cells = []
        for cf in configs:
            p, s = cf[0], by.get((*cf, c))
            if s is None:
                cells.append("-")
            elif p == "full":
                cells.append(f"{pct(s['accuracy'], 0)}")
            else:
                keep = "-" if s["vs_full"] is None else pct(s["vs_full"], 0)
                cells.append(f"{pct(s['accuracy'], 0)} ({keep} of full, {pct(s['kv_fetched_share'])} fetched)")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine(d: dict) -> str:
    """The line above a bench table: model, device, and the bandwidths measured at start."""
    bw = d["bandwidth"]
    return (
        f"{d['model']} on {d['device_name']}, {d['dtype']}; measured: device copy "
        f"{bw['device_bytes_per_s'] / 1e9:.1f} GB/s, host-to-device {bw['h2d_bytes_per_s'] / 1e9:.1f} GB/s"
    )


def ab_merged(files: list[dict]) -> dict[str, dict]:
    """The points of several ab_trees.py files of one bench point (a rerun's rounds added to a run's): each key's
    runs together, its medians over all of them."""
    import statistics

    out: dict[str, dict] = {}
    for d in files:
        for key, p in d["points"].items():
            q = out.setdefault(key, {"a_runs": [], "b_runs": []})
            q["a_runs"] += p["a_runs"]
            q["b_runs"] += p["b_runs"]
    for q in out.values():
        q["a_ms"], q["b_ms"] = statistics.median(q["a_runs"]), statistics.median(q["b_runs"])
        q["a_over_b"] = round(statistics.median(a / b for a, b in zip(q["a_runs"], q["b_runs"], strict=True)), 4)
    return out


def ab(points: dict[str, dict]) -> str:
    """benchmarks/ab_trees.py's points (one file's, or several merged) as rows: this tree's and the baseline's
    median ms a step, their ratio (the median of the pairs'), and the policy's speed against this tree's `full` at
    the same point."""
    lines = ["| policy | batch x context | ms / step | baseline's | ratio | x `full` (speed) | pairs |",
             "|---|---|---|---|---|---|---|"]
    for key, p in points.items():
        policy, point = key.rsplit(" b", 1)
        full = points[f"full b{point}"]["a_ms"]
        pairs = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(p["a_runs"], p["b_runs"], strict=True))
        lines.append(f"| {policy} | {point} | {p['a_ms']:.1f} | {p['b_ms']:.1f} | "
                     f"{p['a_over_b']:.2f} | {full / p['a_ms']:.2f} | {pairs} |")  # fmt: skip
    return "\n".join(lines)


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        print(f"<!-- {path} -->")
        if "a_commit" in d or "b_runs" in next(iter(d.get("points", {}).values()), {}):
            print(ab(d["points"]))
        elif d.get("task") == "needle":
            print(needle(d))
        else:
            print(accuracy(d) if "rows" in d and "points" not in d else f"{machine(d)}\n\n{bench(d)}")
        print()


if __name__ == "__main__":
    main()
