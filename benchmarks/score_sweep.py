"""On a GPU: the int4 scoring kernel (kv/_quant_kernel.py:score_codes_kernel) at one layer of Llama-3.1-8B's shapes
(8 KV heads, 4 query heads each, head_dim 128) over a context, through the store's slot tables, for each launch
configuration (slots a program reads, tokens it holds at once, warps). (Its results in
artifacts/results/gpu-h200-2026-11-26 were measured by the version of this script that also timed the kernel's first
version, `fma`; the current kernel is the one they call `dot`, for a float32 query.) `--dtype float16`: a query in
the model's dtype, whose products the kernel takes in it (HALF). Prints each configuration's microseconds a launch
and the bytes it reads over that time, checked against the torch path's scores.

    python benchmarks/score_sweep.py --context 32768 --batch 1,4 --dtype float16 --out sweep.json

Eight input sets in turn, so that the codes are read from HBM and not from the L2 cache.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from infinigen_rt.kv import quant
from infinigen_rt.kv._quant_kernel import score_codes_kernel
from infinigen_rt.policies.speculation import key_group

HKV, G, D, BITS, BLOCK, SETS = 8, 4, 128, 4, 16, 8


def inputs(b: int, t: int, gen: torch.Generator, dev, dtype=torch.float32):
    group = key_group(D, BITS)
    n_slots = b * t
    codes = torch.randint(0, 255, (1, HKV, n_slots, D * BITS // 8), dtype=torch.uint8, generator=gen)
    meta = (torch.rand(1, HKV, n_slots, 2, D // group, generator=gen) + 0.1).half()
    blocks = torch.randperm(n_slots // BLOCK, generator=gen).view(b, t // BLOCK)  # each request its own blocks
    slots = (blocks[..., None] * BLOCK + torch.arange(BLOCK)).view(b, t)
    q = torch.randn(b, HKV, G, D, generator=gen).to(dtype)
    return [x.to(dev) for x in (q, codes, meta, slots)], group


def run(q, codes, meta, slots, group, split, tokens, warps):
    b, t = slots.shape
    out = torch.empty(b, HKV, G, t, device=q.device)
    shipped = quant.score_meta(G, D, group, BITS, half=q.dtype != torch.float32)  # (HALF for a 16-bit query)
    score_codes_kernel[(b, HKV, triton.cdiv(t, split))](
        q, codes, meta, slots, out, t, codes.shape[2], 0, BATCH_ROWS=False, HKV=HKV, HAS_SLOTS=True,
        **{**shipped, "SPLIT": split, "TOKENS": tokens, "num_warps": warps})  # fmt: skip
    return out


def time_us(sets, group, cfg) -> float:
    for s in sets:  # compile and warm
        run(*s, group, *cfg)
    torch.cuda.synchronize()
    times = []
    for _ in range(9):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in sets:
            run(*s, group, *cfg)
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1000 / len(sets))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        gen = torch.Generator().manual_seed(b)
        sets, group = [], None
        for _ in range(SETS):
            s, group = inputs(b, a.context, gen, dev, getattr(torch, a.dtype))
            sets.append(s)
        nbytes = sum(x.numel() * x.element_size() for x in sets[0][1:3]) * 1.0
        want = quant.scores(*(x.cpu() for x in sets[0]), group, BITS)  # the torch path
        for split, tokens, warps in itertools.product([256, 512, 1024], [32, 64, 128], [4, 8]):
            if tokens > split:
                continue
            got = run(*sets[0], group, split, tokens, warps).cpu()
            ok = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-2))
            us = time_us(sets, group, (split, tokens, warps))
            rows.append({"batch": b, "context": a.context, "dtype": a.dtype, "split": split, "tokens": tokens,
                         "warps": warps, "us": round(us, 2), "gb_per_s": round(nbytes / us / 1e3, 1),
                         "same_scores": ok})  # fmt: skip
        best = min((r for r in rows if r["batch"] == b and r["same_scores"]), key=lambda r: r["us"])
        ship = next(r for r in rows if r["batch"] == b and (r["split"], r["tokens"], r["warps"]) ==
                    (quant.SPLIT, quant.TOKENS, 4))  # fmt: skip
        print(f"b{b} ctx{a.context}: {nbytes / 1e6:.1f} MB a launch; shipped {ship['us']:.1f} us "
              f"({ship['gb_per_s']} GB/s); best {best}", flush=True)  # fmt: skip
        for r in sorted((r for r in rows if r["batch"] == b), key=lambda r: r["us"])[:6]:
            print("  ", r)
        del sets
        torch.cuda.empty_cache()
        if a.out:  # after each batch: a call cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump({"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                           "triton": triton.__version__, "rows": rows}, f, indent=1)  # fmt: skip
    bad = [r for r in rows if not r["same_scores"]]
    print(f"{len(rows)} configurations, {len(bad)} with other scores")


if __name__ == "__main__":
    main()
