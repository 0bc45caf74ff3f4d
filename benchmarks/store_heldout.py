"""Held-out perplexity through the batch's KV store: the runner that `generate` and `serve` decode with, where
`infinigen-rt eval` scores a text through a cache of its own. Every text is one request of one batch, its prompt
scored as eval scores it (the first --score-from tokens prefilled, each later one fed a decode step: the request's
`prompt_logprobs` with `score_tail`), under `full` and the defaults at each budget; with --gathered the defaults
run again with the rows a CPU would read in place gathered first (the selector's `in_place` off).

    python benchmarks/store_heldout.py artifacts/bundles/smollm2-135m --texts alice,constitution,rst-spec,rainbow,\
pytest-fixtures,psf-license --budgets 0.1,0.2 --gathered --out artifacts/results/accuracy-heldout-smollm2-store.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.measure.perplexity import text_ids
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.policies import infinigen as ig
from infinigen_rt.runner import BLOCK_TOKENS, Request, Runner, blocks_for, reserved

TEXTS = Path("artifacts/cache/texts")


def perplexities(engine: Engine, name: str, opts: KVOptions, ids: dict[str, list[int]], score_from: int,
                 in_place: bool = True) -> tuple[dict[str, float], bool | None, float]:  # fmt: skip
    """Each text's perplexity of its tokens from score_from on, the texts one batch of the runner's store; whether
    the rows were read in place (None: a policy without the selector), and the seconds it took."""
    policy = configure(engine, name, opts)
    seen: list[bool] = []
    attach = ig.InfinigenSelector.attach

    def attached(self, store):
        attach(self, store)
        self.in_place = self.in_place and in_place
        seen.append(self.in_place)

    ig.InfinigenSelector.attach = attached
    try:
        n = len(next(iter(ids.values())))
        pool = blocks_for(reserved(policy, n, 0, policy.opts.prefill_chunk)) * len(ids)
        run = Runner(engine, policy, max_batch=len(ids), prefill_chunk=policy.opts.prefill_chunk,
                     kv_tokens=pool * BLOCK_TOKENS)  # fmt: skip
        names = {run.add(Request(t, 0, prompt_logprobs=0, score_tail=n - score_from - 1)): k for k, t in ids.items()}
        out, t0 = {}, time.perf_counter()
        try:
            while run.has_work:
                for o in run.step():
                    if o.finished:
                        lps = [x.logprob for x in o.generation.prompt_logprobs[score_from:]]
                        assert len(lps) == n - score_from
                        out[names[o.id]] = math.exp(-sum(lps) / len(lps))
        finally:
            run.close()
    finally:
        ig.InfinigenSelector.attach = attach
    return out, (seen[0] if seen else None), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--texts", default="alice,constitution,rst-spec,rainbow,pytest-fixtures,psf-license")
    ap.add_argument("--budgets", default="0.1,0.2")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--score-from", type=int, default=1024)
    ap.add_argument("--gathered", action="store_true", help="also the defaults with the rows gathered first")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    engine = Engine(read_bundle(a.bundle), device="cpu", dtype="float32")
    names = [t.strip() for t in a.texts.split(",") if t.strip()]
    ids = {t: text_ids(engine, TEXTS / f"{t}.txt", a.seq_len, a.score_from)[0] for t in names}
    full, _, s = perplexities(engine, "full", KVOptions(), ids, a.score_from)
    print(f"full: {s:.0f} s", {t: round(p, 4) for t, p in full.items()}, flush=True)
    rows = []
    for in_place in (True, False) if a.gathered else (True,):
        for b in (float(x) for x in a.budgets.split(",")):
            ppl, read_in_place, s = perplexities(engine, "infinigen", KVOptions(budget=b), ids, a.score_from, in_place)
            delta = {t: round(100 * (ppl[t] / full[t] - 1), 3) for t in names}
            mean = round(sum(delta.values()) / len(delta), 3)
            rows.append({"policy": "infinigen", "budget": b, "in_place": read_in_place, "delta_pct": delta,
                         "mean": mean, "perplexity": {t: round(p, 4) for t, p in ppl.items()},
                         "seconds": round(s, 1)})  # fmt: skip
            print(f"infinigen {b} in place {read_in_place}: mean {mean:+.3f} %, {s:.0f} s", delta, flush=True)
    if a.out:
        meta = {"bundle": a.bundle, "texts": names, "seq_len": a.seq_len, "score_from": a.score_from,
                "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "torch": torch.__version__}  # fmt: skip
        a.out.write_text(json.dumps({**meta, "full": {t: round(p, 4) for t, p in full.items()}, "rows": rows},
                                    indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
