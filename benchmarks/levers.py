"""Measure the speculation levers on a real model: perplexity change vs full for each KV option set.

python benchmarks/levers.py BUNDLE TEXT --seq-len 1024 --score-from 512 --budget 0.1 --out levers.json
Prints one line per configuration and writes them all as JSON (numbers measured by this script)."""

from __future__ import annotations

import argparse
import json
import time

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.eval import perplexity, text_ids
from infinigen_rt.policies import KVOptions

LEVERS = {
    "baseline": {},
    "renorm": {"renorm": True},
    "sinks4+recent8": {"sinks": 4, "recent": 8},
    "renorm+sinks4+recent8": {"renorm": True, "sinks": 4, "recent": 8},
    "renorm+sinks+recent+per_head": {"renorm": True, "sinks": 4, "recent": 8, "per_head": True},
    "renorm+sinks+recent+group_sum": {"renorm": True, "sinks": 4, "recent": 8, "group_agg": "sum"},
    "sinks+recent+group_sum": {"sinks": 4, "recent": 8, "group_agg": "sum"},
    "renorm+sinks+recent": {"renorm": True, "sinks": 4, "recent": 8},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("text")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--score-from", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=None)
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-oracle", action="store_true")
    a = ap.parse_args()
    engine = Engine(read_bundle(a.bundle), device="cpu", dtype="float32")
    ids, _ = text_ids(engine, a.text, a.seq_len, a.score_from)
    rows = []
    full, _, _ = perplexity(engine, ids, a.score_from)
    print(f"full ppl {full:.4f}", flush=True)
    for name in ([] if a.no_oracle else ["oracle"]) + a.levers.split(","):
        t0 = time.perf_counter()
        if name == "oracle":
            e = engine.with_policy("oracle", KVOptions(budget=a.budget))
        else:
            e = engine.with_policy("infinigen", KVOptions(alpha=a.alpha, budget=a.budget, **LEVERS[name]))
        ppl, rep, _ = perplexity(e, ids, a.score_from)
        row = {
            "lever": name,
            "budget": a.budget,
            "perplexity": round(ppl, 4),
            "delta_pct": round(100 * (ppl / full - 1), 2),
            "kv_fetched_share": rep.get("kv_fetched_share"),
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
