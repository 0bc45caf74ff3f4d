"""The CPU's ways to score queries against low-bit keys, side by side at one layer's shapes: the native kernel
(kv/_cpu_kernels.c) and the torch path (quant.score_span: scale * (q . codes) + minimum * sum(q) on unpacked codes;
for the per-channel keys, int4c, a span of keys formed from their run's scales and one product), each checked
against float64 on the dequantized keys. Slots through block-permuted tables, as the store holds them. The kernels'
variant in use is recorded (`isa`): the per-channel kernel takes its 16-keys-a-run path only in the AVX-512 one.

    python benchmarks/cpu_score.py --out artifacts/results/cpu-score-kernel.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import torch

from infinigen_rt.kv import cpu, quant
from infinigen_rt.policies.speculation import key_group

# (name, batch, KV heads, query heads a KV head, head_dim, bits): SmolLM2-135M, Llama-3.1-8B, two bits
SHAPES = [("smollm2-135m", 1, 3, 3, 64, 4), ("smollm2-135m", 8, 3, 3, 64, 4), ("llama-3.1-8b", 1, 8, 4, 128, 4),
          ("smollm2-135m int2", 1, 3, 3, 64, 2)]  # fmt: skip
# the per-channel keys (int4c, what convert chose for SmolLM2, Qwen and Gemma 3): (name, batch, KV heads, query
# heads a KV head, head_dim)
CHANNEL_SHAPES = [("smollm2-135m int4c", 1, 3, 3, 64), ("smollm2-135m int4c", 8, 3, 3, 64),
                  ("qwen2.5-coder-0.5b int4c", 1, 2, 7, 64), ("gemma3-270m int4c", 1, 1, 4, 256),
                  ("llama-3.1-8b int4c", 1, 8, 4, 128)]  # fmt: skip


def score(way: str, q, codes, meta, at, t: int, group: int, bits: int):
    if way == "torch":
        with cpu.disabled():
            return quant.scores(q, codes, meta, at, group, bits)
    return cpu.score_codes(q, codes, meta, at, t, group, bits)


def torch_channel(store, q, at, t: int):
    with cpu.disabled():
        return store.scores_at(0, q, at)


def kernel_channel(store, q, at, t: int):
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS

    return cpu.score_channel(q, store.codes[0], store.meta[0], at, t, CHANNEL_TOKENS)


def channel_rows(context: int, repeat: int) -> list[dict]:
    """The per-channel keys' kernel and torch path at CHANNEL_SHAPES (slots through a block-permuted table)."""
    from types import SimpleNamespace

    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, ChannelKeys

    rows = []
    for name, b, hkv, g, d in CHANNEL_SHAPES:
        gen = torch.Generator().manual_seed(0)
        n_slots = b * context + 64
        store = ChannelKeys(SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv)), [0], 1, n_slots,
                            "cpu", torch.float32)  # fmt: skip
        store.write(0, torch.randn(1, hkv, n_slots, d, generator=gen) * torch.linspace(0.1, 4, d), 0)
        q = torch.randn(b, hkv, g, d, generator=gen)
        blocks = torch.randperm(n_slots // 16, generator=gen)[: b * context // 16]
        at = (blocks[:, None] * 16 + torch.arange(16)).view(b, context).contiguous()
        codes, meta = store.codes[0][0], store.meta[0][0]
        keys = store._keys(codes[:, at], meta[:, at // CHANNEL_TOKENS]).double().transpose(0, 1)
        ref = q.double() @ keys.transpose(-1, -2)
        for way in ("kernel", "torch"):
            run = functools.partial(torch_channel if way == "torch" else kernel_channel, store, q, at, context)
            out = run()
            if out is None:
                rows.append({"shape": name, "way": way, "status": cpu.reason()})
                continue
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ms = median_ms(run, repeat)
            rows.append({"shape": name, "batch": b, "kv_heads": hkv, "group": g, "head_dim": d, "bits": 4,
                         "context": context, "way": way, "ms": round(ms, 3), "rel_err_vs_float64": float(f"{err:.3g}")})
            print(f"{name:26} b{b} {way:6} {ms:8.3f} ms  rel err {err:.2e}")
    return rows


def median_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[n // 2]


def save(rows: list[dict], path: str | None) -> None:
    """The rows, with the machine, torch's threads and version, as JSON at path (None: nowhere)."""
    out = {"machine": platform.processor() or platform.machine(), "isa": cpu.isa(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}  # fmt: skip
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for name, b, hkv, g, d, bits in SHAPES:
        gen = torch.Generator().manual_seed(0)
        t, group = a.context, key_group(d, bits)
        n_slots = b * t + 64
        c, scale, lo = quant.quantize(torch.randn(1, hkv, n_slots, d, generator=gen), group, bits)
        meta = torch.stack([scale, lo], -2).contiguous()
        q = torch.randn(b, hkv, g, d, generator=gen)
        blocks = torch.randperm(n_slots // 16, generator=gen)[: b * t // 16]
        at = (blocks[:, None] * 16 + torch.arange(16)).view(b, t).contiguous()
        keys = quant.dequantize(c, scale, lo, group, torch.float64, bits)[0][:, at].permute(1, 0, 2, 3)
        ref = q.double() @ keys.transpose(-1, -2)
        for way in ("kernel", "torch"):
            run = functools.partial(score, way, q, c, meta, at, t, group, bits)
            out = run()
            if out is None:
                rows.append({"shape": name, "way": way, "status": cpu.reason()})
                continue
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ms = median_ms(run, a.repeat)
            rows.append({"shape": name, "batch": b, "kv_heads": hkv, "group": g, "head_dim": d, "bits": bits,
                         "context": t, "way": way, "ms": round(ms, 3), "rel_err_vs_float64": float(f"{err:.3g}")})
            print(f"{name:18} b{b} {way:6} {ms:8.3f} ms  rel err {err:.2e}")
    rows += channel_rows(a.context, a.repeat)
    save(rows, a.out)


if __name__ == "__main__":
    main()
