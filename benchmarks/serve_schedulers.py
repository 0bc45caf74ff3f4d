"""The continuous-batching scheduler against the closed-batch one it replaced, under the same open-loop load.

python benchmarks/serve_schedulers.py --old ../old15 --bundle artifacts/bundles/smollm2-135m \
  --arrival-rates 0.25,0.5,1 --duration 60 --out artifacts/results/serve-schedulers-smollm2.json

--old is a checkout of the commit before the change (git worktree add ../old15 2d9b807): its server runs with
PYTHONPATH pointing there. For each rate the two servers run one after the other (old first at even rates, new
first at odd ones), each a fresh `serve_load.py --bundle ... --arrival-rates RATE` with the same seed, so machine
drift hits both. Prints a table and writes every run's JSON row to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("requests_per_s", "generated_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
           "e2e_p99_s", "queue_depth_max", "errors")  # fmt: skip


def run(which: str, old: Path, rate: float, a, extra: list[str]) -> dict:
    out = Path(tempfile.mkstemp(prefix=f"sched_{which}_", suffix=".json")[1])
    env, cwd = dict(os.environ), None
    if which == "closed-batch":  # the server runs `python -m infinigen_rt.cli` from the old checkout
        env["PYTHONPATH"], cwd = str(old.resolve()), old.resolve()
    cmd = [sys.executable, str(HERE / "serve_load.py"), "--bundle", str(Path(a.bundle).resolve()),
           "--arrival-rates", str(rate), "--duration", str(a.duration), "--seed", str(a.seed), "--out", str(out),
           *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["runs"][0]
    return {"scheduler": which, "rate": rate, **row}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="checkout of the closed-batch scheduler's commit")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--arrival-rates", default="0.25,0.5,1")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-tokens", default="16:256", help="LO:HI, for serve_load.py")
    ap.add_argument("--max-tokens", default="16:128", help="N or LO:HI, for serve_load.py")
    ap.add_argument("--out", default="serve-schedulers.json")
    a, extra = ap.parse_known_args()  # the rest goes to serve_load.py as well (--policy, --max-batch, ...)
    extra = ["--prompt-tokens", a.prompt_tokens, "--max-tokens", a.max_tokens, *extra]
    rows = []
    for i, rate in enumerate(float(r) for r in a.arrival_rates.split(",")):
        order = ("closed-batch", "continuous") if i % 2 == 0 else ("continuous", "closed-batch")
        for which in order:
            rows.append(run(which, Path(a.old), rate, a, extra))
            print(json.dumps({k: rows[-1].get(k) for k in ("scheduler", "rate", *COLUMNS)}), flush=True)
            Path(a.out).write_text(json.dumps({"args": vars(a), "extra": extra, "runs": rows}, indent=2) + "\n")
    print(f"\n{'rate':>5} {'scheduler':13}" + "".join(f"{c:>14}" for c in COLUMNS))
    for r in rows:
        cells = "".join(f"{r.get(c) if not isinstance(r.get(c), float) else round(r[c], 3):>14}" for c in COLUMNS)
        print(f"{r['rate']:>5} {r['scheduler']:13}{cells}")


if __name__ == "__main__":
    main()
