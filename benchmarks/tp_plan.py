"""Tensor parallelism on paper: per decode step, the all-reduce traffic against the KV fetch and the weight reads,
for a model's shape at TP sizes over NVLink and over PCIe. Every input is an assumption printed with the result
(no GPU here has more than one device); change them with the flags.

    python benchmarks/tp_plan.py                        # Llama-3.1-70B, TP 4 and 8, batch 1 and 32, 32k context
    python benchmarks/tp_plan.py --fetch-share 0.1 --context 131072 --json
"""

from __future__ import annotations

import argparse
import json

LLAMA_70B = {"layers": 80, "hidden": 8192, "kv_heads": 8, "head_dim": 128, "params": 70.6e9}
LINKS = {  # (per-GPU bus bandwidth an all-reduce reaches, latency of one small all-reduce): assumptions
    "NVLink (H100 SXM)": (300e9, 15e-6),
    "PCIe Gen5": (25e9, 40e-6),
}
HBM = 3.35e12  # H100 SXM HBM3, bytes/s: the weight reads' floor
H2D = 25e9  # one GPU's host-to-device copy rate over its own PCIe Gen5 x16 link (achieved, not peak)


def plan(m: dict, tp: int, batch: int, context: int, share: float, link: tuple[float, float], esz: int = 2) -> dict:
    msg = batch * m["hidden"] * esz  # one all-reduce's payload
    n = 2 * m["layers"]  # after attention and after the MLP
    ring = 2 * (tp - 1) / tp * msg  # bytes each GPU sends (and receives) in a ring all-reduce
    bw, lat = link
    allreduce_s = n * (lat + ring / bw)
    kv_token = m["layers"] * m["kv_heads"] * m["head_dim"] * 2 * esz  # K and V of one token, every layer
    fetch = share * batch * context * kv_token / tp  # each GPU fetches its own heads' rows, over its own link
    return {
        "tp": tp, "batch": batch, "context": context, "allreduces": n, "allreduce_mb_per_gpu": round(n * ring / 1e6, 2),
        "allreduce_ms": round(1e3 * allreduce_s, 2), "fetch_gb_per_gpu": round(fetch / 1e9, 3),
        "fetch_ms": round(1e3 * fetch / H2D, 2), "weights_ms": round(1e3 * m["params"] * esz / tp / HBM, 2),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="4,8")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--fetch-share", type=float, default=0.1, help="share of the KV a step fetches (infinigen)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for name, link in LINKS.items():
        for tp in map(int, a.tp.split(",")):
            for b in map(int, a.batch.split(",")):
                r = {"link": name, **plan(LLAMA_70B, tp, b, a.context, a.fetch_share, link)}
                r["bound"] = max(("all-reduce", r["allreduce_ms"]), ("KV fetch", r["fetch_ms"]),
                                 ("weights", r["weights_ms"]), key=lambda x: x[1])[0]  # fmt: skip
                rows.append(r)
    if a.json:
        print(json.dumps({"model": LLAMA_70B, "links": LINKS, "hbm": HBM, "h2d": H2D, "rows": rows}))
        return
    print(f"Llama-3.1-70B shape, fp16, context {a.context}, fetch share {a.fetch_share}; assumed: "
          f"HBM {HBM / 1e12} TB/s, host-to-device {H2D / 1e9:.0f} GB/s per GPU, " +
          ", ".join(f"{k} {bw / 1e9:.0f} GB/s + {lat * 1e6:.0f} us per all-reduce" for k, (bw, lat) in LINKS.items()))
    print("| link | TP | batch | all-reduce MB/GPU | all-reduce ms | KV fetch GB/GPU | KV fetch ms | weights ms "
          "| bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['link']} | {r['tp']} | {r['batch']} | {r['allreduce_mb_per_gpu']} | {r['allreduce_ms']} | "
              f"{r['fetch_gb_per_gpu']} | {r['fetch_ms']} | {r['weights_ms']} | {r['bound']} |")


if __name__ == "__main__":
    main()
