"""The peer: Hugging Face transformers on the same shapes, batch, context and tokens as `infinigen-rt bench`.

Outside `infinigen_rt` on purpose (the runtime never imports transformers). Two modes:

  # GPU: transformers' offloaded KV cache (full KV on the CPU, next layer prefetched) on a synthetic preset
  python benchmarks/peer_transformers.py synthetic llama-2-7b --batch 8 --context 8192 --gen 64 --out peer.json

  # CPU: transformers' own generate vs our `full` policy, same model (the SmolLM2 GGUF), same prompt, one run
  python benchmarks/peer_transformers.py cpu-vs-full GGUF BUNDLE --context 1024 --gen 64 --out cpu.json

Per-step times come from a stopping criterion called once per generated token (transformers syncs there
anyway), median over the steps after the first; numbers are printed and written as JSON, the row rewritten after
every step (status "partial" until it is done), so a run cut short by a time-out keeps the steps it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


class StepClock:
    """A transformers StoppingCriteria that never stops and notes when each step ended (`on_step(clock)` after
    each: the caller can write what it has so far)."""

    def __init__(self, device, on_step=None):
        self.device, self.times, self.on_step = device, [], on_step

    def __call__(self, input_ids, scores, **kw):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(self)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def median_step(self) -> float:
        d = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return statistics.median(d) if d else float("nan")


def hf_generate(model, ids, gen: int, cache: str | None, device, on_step=None) -> dict:
    """transformers' greedy generate of `gen` tokens, timed per step; `on_step(result so far)` after every step."""
    from transformers import StoppingCriteriaList

    t0 = time.perf_counter()

    def result(clock: StepClock) -> dict:
        step = clock.median_step()
        return {
            "steps_done": len(clock.times) - 1,
            "prefill_s": round(clock.times[0] - t0, 4),
            "ms_per_step": round(1000 * step, 3) if step == step else None,  # (NaN before the second step)
            "tokens_per_s": round(ids.shape[0] / step, 2) if step == step else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }

    clock = StepClock(device, None if on_step is None else lambda c: on_step(result(c)))
    kw = {"cache_implementation": cache} if cache else {}
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen,
                   do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0, **kw)  # fmt: skip
    return result(clock)


def synthetic(a) -> list[dict]:
    import transformers

    from infinigen_rt.measure.synthetic import PRESETS

    dev = torch.device(a.device)
    hf = dict(PRESETS[a.preset])
    model_type = hf.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **hf)
    torch.manual_seed(a.seed)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    rows = []
    for b in a.batch:
        for c in a.context:
            ids = torch.randint(3, cfg.vocab_size, (b, c), generator=torch.Generator().manual_seed(a.seed)).to(dev)
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            row = {"peer": "transformers", "cache": a.cache, "model": f"synthetic:{a.preset}", "batch": b,
                   "context": c, "gen": a.gen, "device": name}  # fmt: skip
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            def partial(so_far, row=row):  # after every step: a call cut short keeps the steps it measured
                row.update(status="partial", **so_far)
                save(a, rows + [row])

            try:
                with torch.inference_mode():
                    row.update(status="ok", **hf_generate(model, ids, a.gen, a.cache, dev, partial))
            except torch.OutOfMemoryError as e:
                row.update(status="oom-device", error=str(e).splitlines()[0][:200])
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            save(a, rows)  # row by row: a call cut short keeps what it measured
    return rows


def save(a, rows: list[dict]) -> None:
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"mode": a.mode, "torch": torch.__version__, "rows": rows}, f, indent=2)
        os.replace(tmp, a.out)


def cpu_vs_full(a) -> list[dict]:
    """transformers' generate and our `full` policy on the same GGUF model and prompt, interleaved."""
    from pathlib import Path

    import transformers

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.generate import generate

    torch.set_num_threads(a.threads or torch.get_num_threads())
    gguf = Path(a.gguf)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 dtype=torch.float32).eval()  # fmt: skip
    engine = Engine(read_bundle(a.bundle), device="cpu", dtype="float32")
    text = Path(a.text).read_text() if a.text else "The king said " * 4000
    ids = engine.tokenizer.encode(text)[: a.context]
    if len(ids) < a.context:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --context {a.context}")
    cpu = torch.device("cpu")
    rows = []
    for rep in range(a.repeats):
        with torch.inference_mode():
            hf = hf_generate(hf_model, torch.tensor([ids]), a.gen, None, cpu)
        times: list[float] = []
        t0 = time.perf_counter()
        generate(engine, [ids], max_new_tokens=a.gen, on_step=lambda out, ts=times: ts.append(time.perf_counter()))
        steps = [y - x for x, y in zip(times, times[1:], strict=False)]
        ours = {"prefill_s": round(times[0] - t0, 4), "ms_per_step": round(1000 * statistics.median(steps), 3)}
        ours["tokens_per_s"] = round(1000 / ours["ms_per_step"], 2)
        for who, r in (("transformers", hf), ("infinigen-rt full", ours)):
            row = {"peer": who, "repeat": rep, "context": a.context, "gen": a.gen, "threads": torch.get_num_threads(),
                   "model": gguf.name, **{k: v for k, v in r.items() if v is not None}}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            save(a, rows)
    med = {w: statistics.median(r["ms_per_step"] for r in rows if r["peer"] == w) for w in
           ("transformers", "infinigen-rt full")}  # fmt: skip
    print(json.dumps({"median_ms_per_step": med, "speedup_vs_transformers": round(
        med["transformers"] / med["infinigen-rt full"], 3)}))  # fmt: skip
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("preset")
    s.add_argument("--batch", type=lambda x: [int(v) for v in x.split(",")], default=[8])
    s.add_argument("--context", type=lambda x: [int(v) for v in x.split(",")], default=[8192])
    s.add_argument("--gen", type=int, default=64)
    s.add_argument("--cache", default="offloaded", help="transformers cache_implementation (offloaded, dynamic)")
    s.add_argument("--device", default="cuda")
    s.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("cpu-vs-full")
    c.add_argument("gguf")
    c.add_argument("bundle")
    c.add_argument("--text", default=None)
    c.add_argument("--context", type=int, default=1024)
    c.add_argument("--gen", type=int, default=64)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--threads", type=int, default=None)
    for p in (s, c):
        p.add_argument("--out", default=None)
    a = ap.parse_args()
    synthetic(a) if a.mode == "synthetic" else cpu_vs_full(a)


if __name__ == "__main__":
    main()
