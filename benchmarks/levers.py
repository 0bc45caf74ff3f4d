"""Measure the speculation levers on a real model: perplexity change vs full for each KV option set.

python benchmarks/levers.py BUNDLE TEXT --seq-len 1024 --score-from 512 --budget 0.1 --out levers.json
Prints one line per configuration and writes them all as JSON (numbers measured by this script)."""

from __future__ import annotations

import argparse
import json
import math
import time

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.measure.perplexity import perplexity, text_ids
from infinigen_rt.policies import KVOptions, configure

INF = float("inf")
PAPER = {"sinks": 0, "recent": 0, "renorm": False, "group_agg": "max"}  # the reference's speculation
LEVERS = {  # each relative to KVOptions' defaults (every winning lever on)
    "paper": PAPER,
    "sinks4+recent8": {**PAPER, "sinks": 4, "recent": 8},
    "sinks+recent+sum": {**PAPER, "sinks": 4, "recent": 8, "group_agg": "sum"},
    "sinks+recent+renorm": {**PAPER, "sinks": 4, "recent": 8, "renorm": True},
    "defaults": {},
    "no_renorm": {"renorm": False},
    "group_max": {"group_agg": "max"},
    "no_sinks_recent": {"sinks": 0, "recent": 0},
    "sinks8+recent16": {"sinks": 8, "recent": 16},
    "per_head": {"per_head": True},
    "dense1": {"dense_layers": 1},
    "dense3": {"dense_layers": 3},
    "dense4": {"dense_layers": 4},
    "layer_budget0.5": {"layer_budget": 0.5},  # per-layer budgets from the calibration's attention spread
    "layer_budget1": {"layer_budget": 1.0},
    "layer_alpha": {"layer_alpha": True},  # per-layer margins calibrated at convert time (needs --alphas "")
    # the count rule (alpha = inf: the budget alone), the speculation keys at about equal device bytes, and the
    # correction step (a share of the budget fetched with layer j's true query); a lever's alpha beats --alphas
    "budget_only": {"alpha": INF},
    "int4": {"spec_keys": "int4"},
    "int4_budget": {"spec_keys": "int4", "alpha": INF},
    "int2_budget": {"spec_keys": "int2", "alpha": INF},
    "correct25_budget": {"correct": 0.25, "alpha": INF},
    "correct50_budget": {"correct": 0.5, "alpha": INF},
    "correct75_budget": {"correct": 0.75, "alpha": INF},
    "int4_correct25_budget": {"spec_keys": "int4", "correct": 0.25, "alpha": INF},
    "int4_correct50_budget": {"spec_keys": "int4", "correct": 0.5, "alpha": INF},
    "int2_correct25_budget": {"spec_keys": "int2", "correct": 0.25, "alpha": INF},
    "int4_correct25": {"spec_keys": "int4", "correct": 0.25},
    # the paper's keys (the partial skewed columns), without and with the correction
    "partial": {"spec_keys": "partial", "correct": 0.0},
    "partial_correct25": {"spec_keys": "partial", "correct": 0.25},
    # every column at 4 bits with a scale per channel over each 16 slots (KIVI's layout for keys)
    "int4c": {"spec_keys": "int4c", "correct": 0.0},
    "int4c_correct25": {"spec_keys": "int4c", "correct": 0.25},
    # the correction's shortlist: it scores speculation's next-ranked slots only, this many times its count
    "shortlist2": {"shortlist": 2.0},
    "shortlist4": {"shortlist": 4.0},
    "shortlist8": {"shortlist": 8.0},
}
ORACLES = ("oracle", "oracle-per-head")  # the bound at equal bytes, and the published per-query-head one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("text")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--score-from", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--alphas", default="", help="comma list of alphas (inf = budget only); empty = bundle's")
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--equal-bytes-oracle-only", action="store_true", help="not oracle-per-head")
    a = ap.parse_args()
    engine = Engine(read_bundle(a.bundle), device="cpu", dtype="float32")
    ids, _ = text_ids(engine, a.text, a.seq_len, a.score_from)
    rows = []
    full, _, _ = perplexity(engine, configure(engine), ids, a.score_from)
    print(f"full ppl {full:.4f}", flush=True)
    alphas = [float(x) for x in a.alphas.split(",")] if a.alphas else [None]
    oracles = [] if a.no_oracle else ORACLES[:1] if a.equal_bytes_oracle_only else ORACLES
    runs = [(o, None) for o in oracles] + [(n, al) for al in alphas for n in a.levers.split(",")]
    for name, alpha in runs:
        t0 = time.perf_counter()
        if name in ORACLES:
            policy = configure(engine, name, KVOptions(budget=a.budget))
        else:
            opts = {"alpha": alpha, **LEVERS[name]}
            alpha = opts["alpha"]
            policy = configure(engine, "infinigen", KVOptions(budget=a.budget, **opts))
        ppl, rep, _ = perplexity(engine, policy, ids, a.score_from)
        row = {
            "lever": name,
            "budget": a.budget,
            "alpha": None if alpha is None else "inf" if math.isinf(alpha) else alpha,  # None: the bundle's
            "perplexity": round(ppl, 4),
            "delta_pct": round(100 * (ppl / full - 1), 2),
            "kv_fetched_share": rep.kv_fetched_share,
            "kv_corrected_share": rep.kv_corrected_share,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        json.dump(
            {"full": full, "seq_len": a.seq_len, "score_from": a.score_from, "rows": rows}, open(a.out, "w"), indent=2
        )


if __name__ == "__main__":
    main()
