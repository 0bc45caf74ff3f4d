"""What each speculation key store keeps of the attention: on a real model and text, per speculated layer, the share
of the exact attention (the mean over query heads, of the softmax over every token held) that a selection of the
budget's tokens holds when it is made by scoring a store's keys, with layer j's true query and with the speculative
one (from layer j-1's input, as infinigen speculates). Beside it, each layer's outlier channels: the largest key
channel's RMS over the median one's (first KV head; Qwen's key biases make a few channels huge).

The stores are the runtime's own (policies/speculation.py), written as a decode writes them: the first half of the
text at once, then a token at a time (ChannelKeys quantizes a run again as it fills); a query position is scored
once its own token is in. No correction, no sinks or recent rows: the keys alone.

python benchmarks/key_mass.py BUNDLE TEXT --seq-len 2048 --budget 0.1 --every 16 --out key-mass.json"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.kv.store import Solo
from infinigen_rt.measure.perplexity import text_ids
from infinigen_rt.models import llama
from infinigen_rt.policies import configure
from infinigen_rt.policies.speculation import spec_keys

STORES = ("exact", "int4", "int4c", "partial")


def capture(engine: Engine, ids: list[int]) -> dict:
    """One prefill under `full`: per layer its attention input x [S, hidden], post-RoPE queries [H, S, D] (times
    the model's query scale) and keys [Hkv, S, D]."""
    got, forward = {}, llama.Attention.forward

    def tapped(self, x, cos, sin, cache):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
        got[self.layer] = (x[0], q[0] * self.query_scale, k[0])
        return forward(self, x, cos, sin, cache)

    llama.Attention.forward = tapped
    try:
        policy = configure(engine)
        cache = Solo(engine, policy, len(ids))
        engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache.prompt)
        cache.close()
    finally:
        llama.Attention.forward = forward
    return got


def kept(p_exact: torch.Tensor, scores: torch.Tensor, hkv: int, n: int) -> float:
    """The exact attention's share (mean over query heads) on the n tokens each KV head's group chooses by scores
    [H, t] (the group's softmax probabilities summed, as infinigen's default)."""
    agg = torch.softmax(scores, -1).view(hkv, -1, scores.shape[-1]).sum(1)
    keep = torch.zeros_like(agg, dtype=torch.bool).scatter_(1, agg.topk(n, -1).indices, True)
    return float((p_exact.view(hkv, -1, p_exact.shape[-1]) * keep[:, None]).sum(-1).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("text")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--every", type=int, default=16, help="score every this many query positions of the second half")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(read_bundle(a.bundle), device="cpu", dtype="float32")
    ids, sha = text_ids(engine, a.text, a.seq_len, a.seq_len // 2)
    cfg, spec = engine.cfg, engine.speculator
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    g = cfg.num_attention_heads // hkv
    with torch.inference_mode():
        taps = capture(engine, ids)
        layers = list(range(engine.dense_layers, cfg.num_hidden_layers))
        stores = {n: spec_keys(n, spec, layers, 1, a.seq_len, "cpu", torch.float32) for n in STORES[1:]}
        half = a.seq_len // 2
        cos, sin = spec.rope(torch.arange(a.seq_len)[None], torch.float32)
        rows = []
        for j in layers:
            x_prev, q, k = taps[j - 1][0], taps[j][1], taps[j][2]
            rms = k[0].pow(2).mean(0).sqrt()
            for st in stores.values():
                st.write(j, k[None, :, :half], 0)
            sums = {f"{w}/{n}": 0.0 for w in ("true", "spec") for n in STORES}
            count = 0
            for p in range(half, a.seq_len):
                for st in stores.values():
                    st.write(j, k[None, :, p : p + 1], p)
                if (p - half) % a.every:
                    continue
                t, n = p + 1, max(1, math.floor(a.budget * (p + 1)))
                qt = q[:, p].view(1, hkv, g, d)
                exact = torch.softmax((qt @ k[None, :, :t].transpose(-1, -2)).flatten(0, 2) / math.sqrt(d), -1)
                cs = (cos[:, :, p : p + 1], sin[:, :, p : p + 1])
                for name in STORES:
                    full = name != "partial"
                    for which, query in (("true", spec.keys_side(j, qt, full)),
                                         ("spec", spec.query(j, x_prev[None, p : p + 1], cs, True, full))):  # fmt: skip
                        if name == "exact":
                            s = query @ k[None, :, :t].transpose(-1, -2)
                        else:
                            s = stores[name].scores(j, query, t)
                        sums[f"{which}/{name}"] += kept(exact, s.flatten(0, 2), hkv, n)
                count += 1
            row = {"layer": j, "outlier_rms_ratio": round(float(rms.max() / rms.median()), 1),
                   **{k_: round(100 * v / count, 2) for k_, v in sums.items()}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    mean = {k_: round(sum(r[k_] for r in rows) / len(rows), 2) for k_ in rows[0] if "/" in k_}
    print("mean", json.dumps(mean))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bundle": a.bundle, "text": a.text, "text_sha256": sha, "seq_len": a.seq_len,
                       "budget": a.budget, "every": a.every, "rows": rows, "mean": mean,
                       "seconds": round(time.perf_counter() - t0, 1)}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
