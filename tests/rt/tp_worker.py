"""One rank of a tensor-parallel test run, started by tests/rt/test_tp.py (or alone, with no process group).

    python tests/rt/tp_worker.py OUT.json BUNDLES.json [die-after-first]

Generates PROMPTS under every CASE for every bundle and (rank 0, or alone) writes {"model/case": {tokens, report}}
to OUT.json. `die-after-first`: rank 1 exits abruptly after the first case (the others must fail, not hang)."""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate
from infinigen_rt.policies import KVOptions
from infinigen_rt.tp import from_env

PROMPTS = [list(range(5, 40)), list(range(50, 61))]
CASES = {
    "full": ("full", KVOptions()),
    "offload": ("offload", KVOptions()),
    "int4": ("int4", KVOptions()),
    "h2o": ("h2o", KVOptions(budget=0.5, window=4)),
    "infinigen": ("infinigen", KVOptions(budget=0.3)),
    "infinigen-alpha": ("infinigen", KVOptions(alpha=2.0, budget=0.5, capacity=24, window=4)),
    "infinigen-all": ("infinigen", KVOptions(alpha=math.inf, budget=1.0)),
}


def run(bundles: dict, tp, die: bool = False) -> dict:
    out = {}
    for model, path in bundles.items():
        b = read_bundle(path)
        for name, (policy, kv) in CASES.items():
            e = Engine(b, device="cpu", dtype="float32", tp=tp)
            gens, stats = generate(e, PROMPTS, 8, policy=policy, kv=kv)
            keep = ("bytes_h2d", "bytes_d2h", "kv_fetched_share", "evictions")
            out[f"{model}/{name}"] = {
                "tokens": [g.token_ids for g in gens], **{k: stats.extra.get(k) for k in keep},
            }  # fmt: skip
            if die and tp is not None and tp.rank == 1:
                os._exit(3)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    tp = from_env(torch.device("cpu"))
    result = run(json.loads(open(sys.argv[2]).read()), tp, die=sys.argv[3:] == ["die-after-first"])
    if tp is None or tp.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
