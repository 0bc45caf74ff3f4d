"""What a CUDA graph costs on this GPU, for measure/projection.py's graph mode (H100.graph_launch_s, graph_gap_s,
kernel_s): a chain of N tiny kernels (a one-element add) issued one by one, and the same chain captured in a graph
and replayed. Prints and writes (--out) per N: the eager time a kernel (the host's launch), a replayed graph's time a
kernel (the kernel and the device's gap after it) and the host's time to issue one replay. Then the selection's
top-k at Llama-3.1-8B's shapes (8 KV heads a sequence, 32k slots, a tenth taken), torch's sorted top-k against
kernels.top_rows (projection.TOPK prices ours as torch's until this measures it): each one's time a call, replayed
from a graph, and the kernels a call launches, as the profiler counts them. Then the int4 scoring kernel's rate at
the same shapes, a 16-bit query's one product against the float32 query's three (see `scoring`).

    python benchmarks/graph_probe.py --out graph-probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def seconds(fn, reps: int) -> float:
    """fn() reps times, the device synchronised before and after: the median of 5 such runs, a call."""
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / reps)
    return sorted(runs)[2]


def probe(n: int) -> dict:
    x = torch.zeros(1, device="cuda")

    def chain():
        for _ in range(n):
            x.add_(1)

    chain()  # (warm: the kernel loaded)
    eager = seconds(chain, 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # (a warm-up on the capturing stream, as torch's docs advise)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    replay = seconds(graph.replay, 20)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        graph.replay()
    issue = (time.perf_counter() - t) / 20  # the host's time a replay (the device catches up after)
    torch.cuda.synchronize()
    return {"kernels": n, "eager_s_per_kernel": eager / n, "graph_s_per_kernel": replay / n,
            "replay_host_s": issue}  # fmt: skip


def top_k(batch: int, t: int = 32768, heads: int = 8, share: float = 0.1) -> dict:
    """torch.topk(sorted) and kernels.top_rows over [batch, heads, t] float32 scores, k = share of t: time a call
    (a graph of 10 calls replayed) and kernels a call (the profiler's CUDA kernels)."""
    from infinigen_rt.kv.kernels import top_rows  # (registers the op)

    x = torch.rand(batch, heads, t, device="cuda")
    k = int(t * share)
    count = torch.full((batch, 1), k, device="cuda")
    calls = {"torch": lambda: x.topk(k, -1, sorted=True), "top_rows": lambda: top_rows(x, k, count)}
    same = torch.equal(calls["torch"]()[1].sort(-1).values, calls["top_rows"]()[1].sort(-1).values)
    point = {"batch": batch, "rows": batch * heads, "t": t, "k": k, "same_set": same}
    for name, fn in calls.items():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        point[f"{name}_s"] = seconds(graph.replay, 5) / 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        point[f"{name}_kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return point


def scoring(batch: int, t: int = 32768) -> dict:
    """The int4 scoring at Llama-3.1-8B's shapes through the store's slot table, t slots a sequence, at the shipped
    launch configuration (benchmarks/score_sweep.py's inputs, launch and timing): a float16 query's one product in
    its dtype (HALF, the shipped kernel for a 16-bit query) against the three tf32 products of the same query in
    float32 (the kernel the H100 profiled: projection.H100.scoring_bytes_per_s). Time a call, the bytes it moves
    over that time as fake CUDA counts them (codes, scales, query, slots, scores), and whether both give the same
    scores."""
    from score_sweep import BITS, HKV, SETS, D, G, inputs, run, time_us  # (beside this script)

    from infinigen_rt.kv import quant

    gen = torch.Generator().manual_seed(batch)
    made = [inputs(batch, t, gen, "cuda", torch.float16) for _ in range(SETS)]
    sets, group = [m[0] for m in made], made[0][1]
    wide = [[s[0].float(), *s[1:]] for s in sets]  # the same query in float32: the three products
    moved = sum(x.numel() * x.element_size() for x in sets[0]) + batch * HKV * G * t * 4  # (the scores: float32)
    shipped = quant.score_meta(G, D, group, BITS)
    cfg = (shipped["SPLIT"], shipped["TOKENS"], shipped["num_warps"])
    point = {"batch": batch, "t": t, "bytes": moved}
    for name, variant in (("tf32x3", wide), ("half", sets)):
        us = time_us(variant, group, cfg)
        point[f"{name}_s"], point[f"{name}_gb_per_s"] = us / 1e6, round(moved / us / 1e3, 1)
    point["same_scores"] = bool(torch.allclose(run(*sets[0], group, *cfg), run(*wide[0], group, *cfg), rtol=1e-5,
                                               atol=1e-3))  # fmt: skip
    return point


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="100,1000,4000", help="chain lengths, comma-separated")
    p.add_argument("--out", help="write the results JSON here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        result = {"status": "no GPU: nothing measured (a rehearsal, or a CPU build of torch)"}
    else:
        result = {"status": "ok", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "points": [probe(int(n)) for n in a.kernels.split(",")]}  # fmt: skip
        for key, probe_of in (("top_k", top_k), ("scoring", scoring)):  # (apart: a failure keeps the rest)
            try:
                result[key] = [probe_of(b) for b in (1, 4, 8)]
            except Exception as e:  # noqa: BLE001 - reported in the file, for the session that reads it
                result[key] = {"error": f"{type(e).__name__}: {e}"}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
