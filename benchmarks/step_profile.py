"""Where one decode step's time goes: each policy's runner at one (batch, context) on a synthetic model, its steps
timed with the device synchronized, then a few steps under torch's profiler. Per policy it prints and saves the wall
time a step, the device's busy time (the union of every kernel and copy), the launches, and the top operators by
device time and by host time, so a step that is host-bound (the device idle between launches) shows as such.

    python benchmarks/step_profile.py --preset llama-3.1-8b --batch 1 --context 32768 \
        --policies full,offload,infinigen,infinigen:partial:0 --out profile.json [--trace trace.json]

A policy is NAME[:SPEC_KEYS[:CORRECT[:reuse]]] (e.g. infinigen:int4:0.25:reuse).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from infinigen_rt.measure.bench import Variant, merged, start_runner
from infinigen_rt.measure.synthetic import synthetic_engine
from infinigen_rt.policies import KVOptions, configure


def variant(text: str) -> Variant:
    name, *rest = text.split(":")
    keys = rest[0] if len(rest) > 0 and rest[0] else None
    correct = float(rest[1]) if len(rest) > 1 and rest[1] else None
    return Variant(name, keys, correct, True if len(rest) > 2 and rest[2] == "reuse" else None)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def top(averages, key: str, n: int) -> list[dict]:
    rows = sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:n]
    return [{"name": a.key[:80], "calls": a.count, "device_us": round(getattr(a, "self_device_time_total", 0.0), 1),
             "host_us": round(a.self_cpu_time_total, 1)} for a in rows]  # fmt: skip


def profile_policy(engine, v: Variant, batch: int, context: int, steps: int, budget: float, trace: str | None):
    from torch.profiler import ProfilerActivity, profile

    dev = engine.device
    opts = KVOptions(budget=budget, prefill_chunk=min(context, 131072 if dev.type == "cuda" else 16384))
    policy = configure(engine, v.policy, replace(opts, **v.changes()))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, engine.cfg.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
    runner, _ = start_runner(engine, policy, prompts, 3 * steps + 8, 3)
    try:
        times = []
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            runner.step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                runner.step()
            sync(dev)
        if trace:
            prof.export_chrome_trace(trace)
    finally:
        runner.close()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in device]
    busy = sum(e - s for s, e in merged(spans)) / steps / 1000 if spans else 0.0
    kernels = sum(1 for e in device if "Memcpy" not in e.name and "Memset" not in e.name) / steps
    copies = sum(1 for e in device if "Memcpy" in e.name) / steps
    avg = prof.key_averages()
    label = ":".join(str(x) for x in (v.policy, v.spec_keys or "", v.correct if v.correct is not None else "",
                                      "reuse" if v.reuse else "")).rstrip(":")  # fmt: skip
    return {
        "policy": label, "batch": batch, "context": context,
        "ms_per_step": round(1000 * statistics.median(times), 3),
        "device_busy_ms_per_step": round(busy, 3),
        "kernels_per_step": kernels, "copies_per_step": copies,
        "top_device": top(avg, "self_device_time_total", 12) if dev.type == "cuda" else [],
        "top_host": top(avg, "self_cpu_time_total", 12),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--policies", default="full,offload,infinigen")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, help="a Chrome trace of the last policy's profiled steps")
    a = ap.parse_args()
    dev = torch.device(a.device)
    engine = synthetic_engine(a.preset, dev, getattr(torch, a.dtype))
    names = a.policies.split(",")
    rows = []
    for i, text in enumerate(names):
        row = profile_policy(engine, variant(text), a.batch, a.context, a.steps, a.budget,
                             a.trace if i == len(names) - 1 else None)  # fmt: skip
        rows.append(row)
        print(f"{row['policy']:28} b{a.batch} ctx{a.context}: {row['ms_per_step']:8.2f} ms a step, device busy "
              f"{row['device_busy_ms_per_step']:8.2f} ms, {row['kernels_per_step']:.0f} kernels, "
              f"{row['copies_per_step']:.0f} copies", flush=True)  # fmt: skip
        for k in ("top_device", "top_host"):
            for r in row[k][:8]:
                print(f"   {k[4:]:6} {r['name'][:60]:60} x{r['calls']:<5} dev {r['device_us'] / a.steps:9.0f} us"
                      f"  host {r['host_us'] / a.steps:9.0f} us")  # fmt: skip
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"preset": a.preset, "dtype": a.dtype, "budget": a.budget, "steps": a.steps,
                           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "torch": torch.__version__, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
