"""The published accuracy over the split (benchmarks/texts.py): one `infinigen-rt eval` JSON per text in, the
per-text table and the mean over the held-out texts out (JSON, markdown, plot).

    python benchmarks/heldout.py artifacts/results/accuracy-smollm2-{alice,constitution,rst-spec}.json \
        --tuning artifacts/results/accuracy-smollm2-hamlet.json --out artifacts/results/accuracy-heldout-smollm2.json \
        --plot artifacts/results/accuracy-heldout-smollm2.png [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infinigen_rt.measure.perplexity import label

KEY = ("policy", "budget", "alpha", "spec_keys", "correct", "shortlist")  # a row's speculation options (absent in
# older files)


def key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)


def name(row: dict) -> str:
    return label(row["policy"], row.get("spec_keys"), row.get("correct"), row.get("alpha"),
                 shortlist=row.get("shortlist"))


def load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    data["name"] = Path(data["text"]).stem.removesuffix("_gut")
    return data


def mean_rows(texts: list[dict]) -> list[dict]:
    """Per (policy, budget, alpha, spec_keys, correct) present in every text: the mean change vs full and the mean
    shares."""
    out = []
    for k in [key(r) for r in texts[0]["rows"]]:
        rows = [next((r for r in t["rows"] if key(r) == k), None) for t in texts]
        if any(r is None for r in rows):
            continue

        def mean(field, rows=rows):
            vals = [r.get(field) for r in rows]
            return None if any(v is None for v in vals) else round(sum(vals) / len(vals), 6)

        out.append({
            **dict(zip(KEY, k, strict=True)), "delta_pct": mean("delta_pct"),
            "delta_pct_max": max(r["delta_pct"] for r in rows), "kv_fetched_share": mean("kv_fetched_share"),
            "kv_attended_share": mean("kv_attended_share"), "bytes_per_token": mean("bytes_per_token"),
            "kl": mean("kl"),
        })  # fmt: skip
    return out


def pct(x, signed=False):
    return "-" if x is None else (f"{x:+.2f} %" if signed else f"{100 * x:.1f} %")


def markdown(texts: list[dict], tuning: list[dict], mean: list[dict]) -> str:
    """One column per text (change vs full), the held-out mean, its KL from full (where every text has one), and its
    KV shares."""
    cols = [t["name"] for t in tuning] + [t["name"] for t in texts]
    head = ["policy", "budget"] + [f"{c}{' (tuning)' if i < len(tuning) else ''}" for i, c in enumerate(cols)]
    head += ["held-out mean", "KL (mean)", "KV fetched", "KV attended"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full = {t["name"]: next(r["perplexity"] for r in t["rows"] if r["policy"] == "full") for t in tuning + texts}
    cells = " | ".join(f"{full[c]:.3f}" for c in cols)
    lines.append(f"| full | (its perplexity) | {cells} | - | - | 100.0 % | 100.0 % |")
    for m in mean:
        if m["policy"] == "full":
            continue
        cells = []
        for t in tuning + texts:
            r = next((r for r in t["rows"] if key(r) == key(m)), None)
            cells.append(pct(r["delta_pct"], True) if r else "-")
        budget = "-" if m["budget"] is None else f"{m['budget']:g}"
        kl = "-" if m.get("kl") is None else f"{m['kl']:.4f}"
        lines.append(f"| {name(m)} | {budget} | " + " | ".join(cells) + f" | **{pct(m['delta_pct'], True)}** | {kl} | "
                     f"{pct(m['kv_fetched_share'])} | {pct(m['kv_attended_share'])} |")  # fmt: skip
    return "\n".join(lines)


def plot(texts: list[dict], mean: list[dict], path: str) -> None:
    from infinigen_rt.files import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, share, what in ((axes[0], "kv_fetched_share", "fetched"), (axes[1], "kv_attended_share", "attended")):
        for policy in dict.fromkeys(name(m) for m in mean if m["policy"] != "full"):
            pts = sorted((m[share], m["delta_pct"]) for m in mean if name(m) == policy and m[share])
            ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{policy} (mean)")
            for t in texts:
                tp = sorted((r[share], r["delta_pct"]) for r in t["rows"] if name(r) == policy and r[share])
                ax.plot([100 * x for x, _ in tp], [y for _, y in tp], lw=0.6, alpha=0.35,
                        color=ax.lines[-1].get_color() if len(tp) else None)  # fmt: skip
        ax.axhline(0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel(f"share of KV {what} (%)")
        ax.set_ylabel("perplexity change vs full (%)")
        ax.set_yscale("symlog", linthresh=5)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, held-out texts ({', '.join(t['name'] for t in texts)}): mean (bold) and each "
                 "text (thin)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("held_out", nargs="+", help="eval JSON of each held-out text")
    ap.add_argument("--tuning", action="append", default=[], help="eval JSON of a tuning text (shown, not averaged)")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    texts, tuning = [load(p) for p in a.held_out], [load(p) for p in a.tuning]
    for t in texts + tuning:
        if (t["seq_len"], t["score_from"]) != (texts[0]["seq_len"], texts[0]["score_from"]):
            raise SystemExit(f"error: {t['text']} was scored with other lengths; rerun it")
    mean = mean_rows(texts)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "bundle": texts[0]["bundle"], "seq_len": texts[0]["seq_len"], "score_from": texts[0]["score_from"],
            "held_out": [{"name": t["name"], "text_sha256": t["text_sha256"]} for t in texts],
            "tuning": [{"name": t["name"], "text_sha256": t["text_sha256"]} for t in tuning],
            "mean": mean,
        }, indent=2) + "\n")  # fmt: skip
    if a.plot:
        plot(texts, mean, a.plot)
    print(markdown(texts, tuning, mean) if a.markdown else json.dumps(mean, indent=1))


if __name__ == "__main__":
    main()
