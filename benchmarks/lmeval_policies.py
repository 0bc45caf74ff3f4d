"""lm-evaluation-harness against `infinigen-rt serve`, one policy after another: a local multiple-choice task built
from held-out texts, its accuracy under each policy, and the time each took.

    python benchmarks/lmeval_policies.py                                     # SmolLM2, the policies below
    python benchmarks/lmeval_policies.py --bundle B --items 48 --context 512 --policies full,infinigen:0.1

The task ("which sentence comes next"): a passage of --context tokens of a held-out text (benchmarks/texts.py:
alice, constitution, rst-spec; no lever was chosen on them), ending at a sentence's end, and four sentences: the
one that follows and three from elsewhere in the same text, of similar length, shuffled (seeded). lm-eval scores
each choice by its log-likelihood after the passage (loglikelihood requests: echo, logprobs, max_tokens 1), which
the server computes by decode steps through the policy for the prompt's last --score-tail tokens (the choice and
the end of the passage): what the policy changes. acc: the gold choice scores highest; acc_norm: per byte.

Each policy gets a fresh server (--port 0); lm-eval runs offline with its default (remote) tokenizer. Writes
artifacts/results/lmeval-mc-<bundle>.json (atomically, after each policy) and prints a table. Needs lm-eval[api]
(the `test` extra)."""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmeval_tasks import write_task
from serve_load import start_server
from texts import DEST as TEXTS
from texts import fetch

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = ("alice", "constitution", "rst-spec")
POLICIES = "full,infinigen:0.1,infinigen:0.2,h2o:0.1,int4"

def sentences(text: str) -> list[tuple[int, str]]:
    """(start offset, sentence) for the text's sentences: split after . ! ? before whitespace."""
    out, start = [], 0
    for m in re.finditer(r"(?<=[.!?])\s+", text):
        out.append((start, text[start : m.start()]))
        start = m.end()
    return [(i, " ".join(s.split())) for i, s in out]


def build_items(tok, names, per_text: int, context: int, seed: int) -> list[dict]:
    """`per_text` items from each text: passages of `context` tokens ending at a sentence's end, four choices."""
    rng, items = random.Random(seed), []
    for name in names:
        text = (TEXTS / f"{name}.txt").read_text()
        sents = [(at, s) for at, s in sentences(text) if 6 <= len(tok.encode(s, add_special_tokens=False)) <= 30]
        starts = [a for a, _ in tok.tok.encode(text, add_special_tokens=False).offsets]  # each token's first char
        spans = [(at, s) for at, s in sents if bisect.bisect_left(starts, at) > context]
        picks = [spans[round(k * (len(spans) - 1) / max(1, per_text - 1))] for k in range(per_text)]
        for at, gold in picks:
            ids = tok.encode(text[:at].rstrip(), add_special_tokens=False)[-context:]
            passage = tok.decode(ids).rstrip()
            window = (at - len(passage) - 2000, at + len(gold) + 2000)  # distractors from outside the passage
            n = len(tok.encode(gold, add_special_tokens=False))
            pool = [s for a, s in sents if not window[0] <= a <= window[1] and 0.5 * n <= len(tok.encode(s, add_special_tokens=False)) <= 1.5 * n]  # noqa: E501
            choices = [gold, *rng.sample(pool, 3)]
            rng.shuffle(choices)
            items.append({"text": name, "context": passage, "choices": choices, "label": choices.index(gold)})
    return items


def run_policy(bundle: str, spec: str, task_dir: Path, task: str, model: str, tail: int, out: Path) -> dict:
    """One policy's server and lm-eval run: acc, acc_norm, the gold choices' mean log-likelihood, seconds."""
    policy, _, budget = spec.partition(":")
    extra = ("--budget", budget) if budget else ()
    proc, url = start_server(bundle, policy, 8, "cpu", None, (*extra, "--score-tail", str(tail), "--model-name", model))
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf")}
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
             f"base_url={url}/v1/completions,model={model},num_concurrent=1,max_retries=1", "--tasks", task,
             "--include_path", str(task_dir), "--output_path", str(out / spec), "--log_samples", "--batch_size", "4"],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    if r.returncode:
        sys.exit(f"lm-eval failed under {spec}:\n{r.stderr[-3000:]}")
    res = json.loads(next((out / spec).rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(x) for f in (out / spec).rglob(f"samples_{task}_*.jsonl") for x in f.read_text().splitlines()]
    gold = [float(s["resps"][s["doc"]["label"]][0][0]) for s in samples]
    return {
        "policy": policy, "budget": float(budget) if budget else None, "acc": res["acc,none"],
        "acc_stderr": res["acc_stderr,none"], "acc_norm": res["acc_norm,none"], "gold_loglik_mean":
        round(sum(gold) / len(gold), 4), "items": len(samples), "seconds": round(seconds, 1),
        "per_text_acc": {n: round(sum(s["acc"] for s in samples if s["doc"]["text"] == n) /
                                  max(1, sum(s["doc"]["text"] == n for s in samples)), 4) for n in HELD_OUT},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default=str(ROOT / "artifacts" / "bundles" / "smollm2-135m"))
    ap.add_argument("--policies", default=POLICIES, help="policy[:budget],... (default %(default)s)")
    ap.add_argument("--items", type=int, default=16, help="items per held-out text (default %(default)s)")
    ap.add_argument("--context", type=int, default=512, help="passage tokens (default %(default)s)")
    ap.add_argument("--score-tail", type=int, default=64, help="serve --score-tail (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.files import write_atomic
    from infinigen_rt.tokenizer import Tokenizer

    fetch(TEXTS, list(HELD_OUT))
    tok = Tokenizer(read_bundle(a.bundle))
    items = build_items(tok, HELD_OUT, a.items, a.context, a.seed)
    name = Path(a.bundle).name
    out_file = a.out or ROOT / "artifacts" / "results" / f"lmeval-mc-{name}.json"
    work = Path(tempfile.mkdtemp(prefix="lmeval_"))
    data = work / "next_sentence.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    task = "infinigen_next_sentence"
    write_task(work / "tasks", task, data)
    meta = {
        "bundle": name, "task": "next sentence among 4 (held-out texts)", "texts": list(HELD_OUT),
        "items": len(items), "context_tokens": a.context, "score": "decode", "score_tail": a.score_tail,
        "seed": a.seed, "lm_eval": _version("lm_eval"), "machine": _machine(), "rows": [],
    }  # fmt: skip
    print(f"{len(items)} items of {a.context} tokens; task and lm-eval output in {work}", flush=True)
    for spec in a.policies.split(","):
        row = run_policy(a.bundle, spec, work / "tasks", task, name, a.score_tail, work)
        meta["rows"].append(row)
        write_atomic(out_file, json.dumps(meta, indent=2) + "\n", "--out")
        print(json.dumps(row), flush=True)
    print(f"{'policy':<18}{'acc':>8}{'acc_norm':>10}{'gold ll':>10}{'seconds':>9}")
    for r in meta["rows"]:
        label = r["policy"] + (f" {r['budget']:.0%}" if r["budget"] else "")
        print(f"{label:<18}{r['acc']:>8.3f}{r['acc_norm']:>10.3f}{r['gold_loglik_mean']:>10.2f}{r['seconds']:>9.0f}")
    print(f"wrote {out_file}")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg.replace("_", "-"))


def _machine() -> str:
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (cpu)"


if __name__ == "__main__":
    main()
