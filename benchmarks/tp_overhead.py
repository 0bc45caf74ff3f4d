"""Tensor parallelism's cost on a CPU: `generate` with N gloo ranks (torchrun) against one process, alternated.

    python benchmarks/tp_overhead.py --bundle artifacts/bundles/smollm2-135m --ranks 3 --rounds 3 \
        --out artifacts/results/tp-overhead-cpu-smollm2.json

One process gets every core's thread; N ranks one thread each (--threads-per-rank). The prompt is a slice of a
Shakespeare play; greedy, so every run yields the same tokens (checked)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--prompt-chars", type=int, default=4000)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--text", default=str(ROOT / "artifacts/cache/shakespeare/henry_viii_gut.txt"))
    ap.add_argument("--out")
    a = ap.parse_args()
    prompt = Path(a.text).read_text()[20000 : 20000 + a.prompt_chars]
    gen = ["-m", "infinigen_rt.cli", "generate", a.bundle, prompt, "-n", str(a.n), "--device", "cpu", "--json",
           "--policy", a.policy, "--dtype", "float32"]  # fmt: skip
    one = [sys.executable, *gen]
    tp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks), *gen]
    rows = []
    for i in range(a.rounds):
        order = [("1 process", one, os.cpu_count()), (f"{a.ranks} ranks", tp, a.threads_per_rank)]
        for name, cmd, threads in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out = run(cmd, threads)
            s = out["stats"]
            rows.append({
                "setup": name, "round": i, "wall_s": round(time.perf_counter() - t0, 2),
                "prefill_tokens": s["prefill_tokens"], "prefill_s": s["prefill_s"], "ms_per_step": s["ms_per_step"],
                "decode_tokens_per_s": s["decode_tokens_per_s"], "allreduces": s.get("allreduces"),
                "allreduce_s": s.get("allreduce_s"), "token_ids": out["token_ids"],
            })  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "token_ids"}), flush=True)
    assert len({tuple(r["token_ids"]) for r in rows}) == 1, "the setups generated different tokens"
    if a.out:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        meta = {"machine": platform.node(), "cpus": os.cpu_count(), "args": vars(a), "commit": head}
        Path(a.out).write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
