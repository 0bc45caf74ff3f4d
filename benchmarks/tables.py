"""Markdown tables from the results JSON that `infinigen-rt eval` and `infinigen-rt bench` write (for the README).

python benchmarks/tables.py artifacts/results/accuracy-smollm2.json artifacts/results/bench-cpu-smollm2.json
"""

from __future__ import annotations

import json
import sys


def pct(x, digits=1):
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def accuracy(d: dict) -> str:
    out = ["| policy | budget | perplexity | vs full | KV fetched | KV attended (all layers) | bytes moved / token |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in d["rows"]:
        delta = "-" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f} %"
        moved = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e6:.2f} MB"
        out.append(f"| {r['policy']} | {r['budget'] or '-'} | {r['perplexity']:.3f} | {delta} | "
                   f"{pct(r['kv_fetched_share'])} | {pct(r.get('kv_attended_share'))} | {moved} |")  # fmt: skip
    return "\n".join(out)


def bench(d: dict) -> str:
    bw = d["bandwidth"]
    dev, h2d = bw["device_bytes_per_s"] / 1e9, bw["h2d_bytes_per_s"] / 1e9
    head = f"{d['model']} on {d['device_name']}, {d['dtype']}; measured: device copy {dev:.1f} GB/s, "
    head += f"host-to-device {h2d:.1f} GB/s\n\n"
    out = ["| policy | batch | context | prefill s | ms / step | tokens/s | H2D MB / step | KV fetched | floor ms "
           "| x floor |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in d["points"]:
        if p["status"] != "ok":
            out.append(f"| {p['policy']} | {p['batch']} | {p['context']} | {p['status']} | | | | | | |")
            continue
        out.append(f"| {p['policy']} | {p['batch']} | {p['context']} | {p['prefill_s']:.1f} | {p['ms_per_step']:.1f} | "
                   f"{p['tokens_per_s']:.2f} | {p['h2d_bytes_per_step'] / 1e6:.2f} | {pct(p['kv_fetched_share'])} | "
                   f"{p['floor_ms']:.1f} | {p['over_floor']:.2f} |")  # fmt: skip
    return head + "\n".join(out)


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        print(f"<!-- {path} -->")
        print(accuracy(d) if "rows" in d and "points" not in d else bench(d))
        print()


if __name__ == "__main__":
    main()
