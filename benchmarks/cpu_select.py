"""The CPU's selection side by side at one layer's shapes: the native kernels (kv/_cpu_kernels.c) against torch's
ops for what a speculated layer does after scoring: the softmax summed over a KV head's query heads with the counts
within alpha (speculation.group_softmax), the top-k of the speculation (7.5 % of the slots: the defaults' budget
less the correction's quarter) and of the correction (2.5 %), and the gather of the chosen K and V rows from the
pool (rows.copy_rows). Every kernel's result is checked against torch's before it is timed.

    python benchmarks/cpu_select.py --out artifacts/results/cpu-select-kernel.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from infinigen_rt.kv import cpu, rows
from infinigen_rt.policies.speculation import group_softmax, top_k

sys.path.insert(0, str(Path(__file__).parent))
from cpu_score import median_ms, save  # noqa: E402

# (name, batch, KV heads, query heads a KV head, head_dim): fp32 rows
SHAPES = [("smollm2-135m", 1, 3, 3, 64), ("smollm2-135m", 8, 3, 3, 64), ("llama-3.1-8b", 1, 8, 4, 128)]


def gather(src_k, src_v, picked, out_k, out_v):
    rows.copy_rows(src_k, src_v, picked, None, out_k, out_v, False)
    n = picked.shape[-1]
    return out_k[:, :, :n].clone(), out_v[:, :, :n].clone()


def torch_way(fn):
    def run():
        with cpu.disabled():
            return fn()

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if cpu.library() is None:
        raise SystemExit(f"no CPU kernels: {cpu.reason()}")
    rows = []
    for name, b, hkv, g, d in SHAPES:
        gen = torch.Generator().manual_seed(0)
        t = a.context
        s = torch.randn(b, hkv, g, t, generator=gen) * 3
        agg = s.softmax(-1).sum(2)
        src_k, src_v = (torch.randn(b * t + 64, d, generator=gen) for _ in "kv")
        spec, corr = int(0.075 * t), int(0.025 * t)
        picked = torch.randint(0, src_k.shape[0], (b, hkv, spec), generator=gen)
        out_k, out_v = (torch.empty(b, hkv, spec + corr + 1, d) for _ in "kv")

        parts = {
            "group softmax + counts": partial(group_softmax, s, 5.0),
            f"top-k {spec} unsorted": partial(top_k, agg, spec, False),
            f"top-k {spec} sorted": partial(top_k, agg, spec, True),
            f"top-k {corr} unsorted": partial(top_k, agg, corr, False),
            "row gather (K and V)": partial(gather, src_k, src_v, picked, out_k, out_v),
        }
        for part, fn in parts.items():
            got, want = fn(), torch_way(fn)()
            if "softmax" in part:
                assert torch.allclose(got[0], want[0], rtol=2e-6, atol=1e-7) and torch.equal(got[1].sum(-1),
                                                                                           want[1].sum(-1))  # fmt: skip
            elif "top-k" in part:
                assert torch.equal(got[0].sort(-1).values, want[0].sort(-1).values)
            else:
                assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
            kernel, plain = median_ms(fn, a.repeat), median_ms(torch_way(fn), a.repeat)
            rows.append({"shape": name, "batch": b, "kv_heads": hkv, "group": g, "head_dim": d, "context": t,
                         "part": part, "kernel_ms": round(kernel, 4), "torch_ms": round(plain, 4)})  # fmt: skip
            print(f"{name:14} b{b} {part:24} kernel {kernel:7.3f} ms  torch {plain:7.3f} ms  ({plain / kernel:.1f}x)")
    save(rows, a.out)


if __name__ == "__main__":
    main()
