"""Decode speed of each KV policy, side by side, against a floor the benchmark measures itself.

A point is (policy, batch, context): `batch` requests of `context` prompt tokens in a runner over a paged pool,
the path `serve` takes. For each: a real prefill through the policy's caches, warm-up decode steps, then `gen`
timed steps (runner.step: a synchronised clock around each; the step ends with the sampled tokens on the host),
reported as the median. Bytes moved each way come from the caches' own counters of the copies they made.

Each point is set against its floor (floor.py: what memory alone allows); synthetic models: synthetic.py.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from dataclasses import dataclass, replace

import torch

from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import pyplot, save_figure
from infinigen_rt.kv.kernels import GATHER_KERNEL
from infinigen_rt.measure.floor import floor_seconds, memory_needs
from infinigen_rt.measure.perplexity import label
from infinigen_rt.measure.projection import interval_overlap, merged
from infinigen_rt.policies import KVOptions, Policy, configure
from infinigen_rt.runner import BLOCK_TOKENS, Request, Runner, blocks_for, reserved
from infinigen_rt.system import host_available, host_rss

OOM_STATUS = ("oom-device", "oom-host")
SPARE_TOKENS = 4  # tokens a point's requests may hold past its warm-up and --gen (the runner's headroom)


# -------------------------------------------------------------------------------------------- the points
@dataclass(frozen=True)
class Variant:
    """A policy as a point runs it: its name, and for a speculating one the keys and the correction share when they
    differ from the options' defaults (so that two key choices can be timed side by side)."""

    policy: str
    spec_keys: str | None = None
    correct: float | None = None
    reuse: bool | None = None
    shortlist: float | None = None
    graphs: bool = False  # decode steps replayed from CUDA graphs where the policy allows (graphs.py)

    def changes(self) -> dict:
        return {k: v for k, v in (("spec_keys", self.spec_keys), ("correct", self.correct), ("reuse", self.reuse),
                                  ("shortlist", self.shortlist)) if v is not None}  # fmt: skip


@dataclass
class Point:
    model: str
    device: str
    dtype: str
    policy: str
    batch: int
    context: int
    gen: int
    spec_keys: str | None = None  # a speculating policy's keys and correction share (None for the others)
    correct: float | None = None
    shortlist: float | None = None  # and the correction's shortlist, where it has one (KVOptions.shortlist)
    graphs: bool = False  # asked for CUDA graphs (graph_replays: the timed steps replayed from one; 0: all eager)
    graph_replays: int | None = None
    status: str = "ok"  # ok, oom-device, oom-host
    predicted: bool | None = None  # an OOM row: predicted before allocating (True) or caught (False)
    prefill_s: float | None = None
    ms_per_step: float | None = None  # median of the timed steps
    ms_per_step_p90: float | None = None
    tokens_per_s: float | None = None  # batch / median step
    h2d_bytes_per_step: float | None = None
    d2h_bytes_per_step: float | None = None
    h2d_achieved_bytes_per_s: float | None = None  # bytes fetched per step / step time
    h2d_busy_bytes_per_s: float | None = None  # CUDA only: bytes fetched per step / time the copying is busy
    kv_fetched_share: float | None = None
    peak_device_bytes: int | None = None  # side by side (--interleave): includes the other policies' caches
    host_rss_bytes: int | None = None  # the process's resident memory at the end of the point
    floor_ms: float | None = None
    over_floor: float | None = None  # step time / floor
    syncs_per_step: float | None = None  # CUDA only: synchronising calls counted in one step
    sync_sites: list | None = None  # CUDA only: where each of them was made (file:line), when more than one
    copy_overlap: float | None = None  # CUDA only: share of host-to-device copy time under a kernel
    tensor_parallel: int | None = None  # ranks (under torchrun); the bytes above are then totals over them
    h2d_bytes_per_step_per_rank: list | None = None
    allreduce_ms_per_step: float | None = None  # rank 0's time in all-reduces per step (NCCL: enqueueing only)
    error: str | None = None


def is_oom(e: BaseException) -> str | None:
    if isinstance(e, torch.OutOfMemoryError):
        return "oom-device"
    if isinstance(e, MemoryError):
        return "oom-host"
    text = str(e).lower()
    if isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate" in text):
        return "oom-host" if "cpu" in text or "pinned" in text else "oom-device"
    return None


def count_syncs(fn, sites: list | None = None) -> int:
    """Synchronising CUDA calls made by fn() (torch's sync debug mode, counted); each one's file:line appended to
    `sites` if given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice on the first set_sync_debug_mode of a process ("Synchronization debug mode is a prototype
    # feature...") is not a sync: only the warnings its sync checks raise are counted
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    if sites is not None:
        sites += [f"{w.filename}:{w.lineno}" for w in syncs]
    return len(syncs)


def profile_spans(events) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(host-to-device copying, compute) spans of a profile's CUDA events, each (start, end): DMA copies from the
    host and the row-gather kernel (it reads pinned host memory) are copying; every other kernel is compute."""
    copies, kernels = [], []
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        if "HtoD" in ev.name or ev.name.split("(")[0] == GATHER_KERNEL:
            copies.append(span)
        elif "Memcpy" not in ev.name and "Memset" not in ev.name:
            kernels.append(span)
    return copies, kernels


def copy_profile(step) -> tuple[float | None, float | None]:
    """Run one decode step under the profiler: (the share of its host-to-device copying that overlaps compute,
    the seconds the copying is busy). See profile_spans."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    copies, kernels = profile_spans(prof.events())
    if not copies:
        return None, None
    busy = sum(e - s for s, e in merged(copies))  # the union of the copies' spans
    return round(interval_overlap(copies, kernels), 4), busy / 1e6  # profiler times are in microseconds


@torch.inference_mode()
def run_points(
    engine: Engine, model_name: str, policies: list[str | Variant], batch: int, context: int, gen: int, bw: dict, *,
    budget: float = 0.1, max_kv: int | None = None, alpha: float | None = None, warmup: int = 3,
    chunk: int | None = None, prompt: list[int] | None = None, seed: int = 0, trace: bool = True,
) -> list[Point]:  # fmt: skip
    """Several policies at one (batch, context), timed side by side: each prefills its own runner's requests, then
    every timed round runs one step of each policy's runner (the order rotating), so a machine whose speed drifts
    (a shared VM) slows them alike. With one policy this is the plain sequential measurement."""
    dev = engine.device
    if chunk is None:  # the whole prompt at once (no history to re-fetch) unless its activations are too large
        chunk = min(context, 131072 if dev.type == "cuda" else 16384)
    variants = [p if isinstance(p, Variant) else Variant(p) for p in policies]
    opts = KVOptions(alpha=alpha, budget=budget, max_kv=max_kv, prefill_chunk=chunk)
    configured = [configure(engine, v.policy, replace(opts, **v.changes())) for v in variants]
    points = []
    for v, pol in zip(variants, configured, strict=True):
        spec = "spec_keys" in pol.cls.knobs
        points.append(Point(model_name, str(dev), str(engine.dtype).removeprefix("torch."), v.policy, batch, context,
                            gen, pol.opts.spec_keys if spec else None, pol.opts.correct if spec else None,
                            (pol.opts.shortlist or None) if spec and pol.opts.correct else None,
                            v.graphs))  # fmt: skip
    _predict_oom(engine, points, [memory_needs(engine, p, batch, context, gen, chunk) for p in configured])
    if all(pt.status != "ok" for pt in points):
        return points
    if prompt is not None and len(prompt) < context:
        raise InfinigenError(f"the text has {len(prompt)} tokens, fewer than --context {context}")
    g = torch.Generator().manual_seed(seed)
    prompts = [list(prompt[:context]) if prompt is not None
               else torch.randint(3, engine.cfg.vocab_size, (context,), generator=g).tolist()
               for _ in range(batch)]  # fmt: skip
    tp, runs = engine.tp, {}  # index -> (runner, times, report before)
    reduce_s = [0.0] * len(points)  # time in all-reduces during the timed steps, per point
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for i, (pt, policy) in enumerate(zip(points, configured, strict=True)):
            if pt.status == "ok":
                try:
                    runner, pt.prefill_s = start_runner(engine, policy, prompts, warmup + gen + SPARE_TOKENS, warmup,
                                                        pt.graphs)  # fmt: skip
                    runs[i] = runner, [], runner.live_report()
                except Exception as ex:
                    _out_of_memory(pt, ex, dev)
        for r in range(gen):
            order = list(runs)
            for i in order[r % len(order) :] + order[: r % len(order)] if order else []:
                try:
                    r0 = tp.reduce_s if tp else 0.0
                    t0 = time.perf_counter()
                    runs[i][0].step()
                    runs[i][1].append(time.perf_counter() - t0)
                    reduce_s[i] += tp.reduce_s - r0 if tp else 0.0
                except Exception as ex:
                    runs.pop(i)[0].close()
                    _out_of_memory(points[i], ex, dev)
        for i, (runner, times, before) in runs.items():
            _finish(points[i], engine, configured[i], runner, times, before, bw, trace)
            if tp is not None:
                _per_rank(points[i], tp, reduce_s[i] / len(times))
    finally:
        for runner, *_ in runs.values():
            runner.close()
        runs = None  # free the pools and device buffers before the next point
        _free(dev)
    return points


def _predict_oom(engine: Engine, points: list[Point], needs: list[dict]) -> None:
    """Mark the points that would not fit (side by side, with the others) as predicted out-of-memory rows."""
    dev = engine.device
    dev_total = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    dev_sum, host_sum = sum(n["device"] for n in needs), sum(n["host"] for n in needs)
    for pt, need in zip(points, needs, strict=True):
        if dev_total is not None and (need["device"] > 0.97 * dev_total or dev_sum > 0.97 * dev_total):
            pt.status, pt.predicted = "oom-device", True
        elif max(need["host"], host_sum) + (dev_sum if dev.type == "cpu" else 0) > 0.9 * host_available():
            pt.status, pt.predicted = "oom-host", True
        if pt.status != "ok":
            dev_gib, host_gib = need["device"] / 2**30, need["host"] / 2**30
            pt.error = f"needs ~{dev_gib:.1f} GiB on the compute device and {host_gib:.1f} GiB of host pool"
            if len(points) > 1:
                pt.error += f" ({len(points)} policies side by side: measure them one at a time)"
    tp = engine.tp
    if tp is not None:  # a point runs on every rank or on none (else their collectives would not meet)
        oks = tp.reduce_counts(*[float(pt.status == "ok") for pt in points])
        for pt, ok in zip(points, oks, strict=True):
            if pt.status == "ok" and ok < tp.size:
                pt.status, pt.predicted = "oom-host", True
                pt.error = "another tensor-parallel rank predicted it does not fit"


def start_runner(engine: Engine, policy: Policy, prompts: list[list[int]], new: int, warmup: int,
                 graphs: bool = False) -> tuple[Runner, float]:  # fmt: skip
    """A runner over a paged pool of exactly the blocks its requests take, every prompt prefilled, then `warmup`
    decode steps (the first is the one the step finishing the prefills makes): its every `step` now decodes the whole
    batch (greedy requests of `new` tokens that ignore end-of-sequence); `graphs`: replayed from CUDA graphs where
    the policy allows (graphs.py). Returns (the runner, prefill seconds)."""
    context, chunk = len(prompts[0]), policy.opts.prefill_chunk
    pool = blocks_for(reserved(policy, context, new, chunk)) * len(prompts) * BLOCK_TOKENS
    # positions past the model's trained context compute the same work: bench measures any length
    runner = Runner(engine, policy, max_batch=len(prompts), prefill_chunk=None, kv_tokens=pool,
                    max_positions=context + new, graphs=graphs)  # fmt: skip
    try:
        for p in prompts:
            runner.add(Request(p, new, ignore_eos=True))
        while any(s.done < context for s in [*runner.waiting, *runner.running]):
            runner.step()
        prefill_s = round(runner.stats.prefill_s, 4)
        for _ in range(warmup - 1):
            runner.step()
        return runner, prefill_s
    except BaseException:
        runner.close()
        raise


def _finish(pt: Point, e: Engine, policy: Policy, runner: Runner, times: list[float], before, bw: dict,
            trace: bool) -> None:  # fmt: skip
    dev, gen, batch = e.device, len(times), pt.batch
    after = runner.live_report()
    if pt.graphs:  # (the warm-up's captures before the timed steps)
        pt.graph_replays = runner.step_graphs.stats.replayed if runner.step_graphs is not None else 0
    med = statistics.median(times)
    pt.ms_per_step = round(1000 * med, 3)
    pt.ms_per_step_p90 = round(1000 * sorted(times)[int(0.9 * (len(times) - 1))], 3)
    pt.tokens_per_s = round(batch / med, 2)
    h2d = (after.bytes_h2d - before.bytes_h2d) / gen
    pt.h2d_bytes_per_step = round(h2d, 1)
    pt.d2h_bytes_per_step = round((after.bytes_d2h - before.bytes_d2h) / gen, 1)
    pt.h2d_achieved_bytes_per_s = round(h2d / med, 1) if h2d else None
    pt.kv_fetched_share = after.kv_fetched_share
    floor = floor_seconds(e, policy, batch, pt.context, h2d, bw)
    pt.floor_ms, pt.over_floor = round(1000 * floor, 3), round(med / floor, 2)
    if dev.type == "cuda":
        pt.peak_device_bytes = torch.cuda.max_memory_allocated(dev)
        sites = []
        pt.syncs_per_step = count_syncs(runner.step, sites)
        pt.sync_sites = sites if len(sites) > 1 else None
        if trace:
            pt.copy_overlap, busy = copy_profile(runner.step)
            if busy and h2d:  # bytes over the time the copying is busy, not over the step
                pt.h2d_busy_bytes_per_s = round(h2d / busy, 1)
    pt.host_rss_bytes = host_rss()


def _per_rank(pt: Point, tp, reduce_s: float) -> None:
    """Under tensor parallelism: each rank's bytes per step, their total, and the all-reduce time per step."""
    mine = [0.0] * tp.size
    mine[tp.rank] = pt.h2d_bytes_per_step or 0.0
    per_rank = tp.reduce_counts(*mine, pt.d2h_bytes_per_step or 0.0)
    pt.tensor_parallel = tp.size
    pt.h2d_bytes_per_step_per_rank = [round(x, 1) for x in per_rank[:-1]]
    pt.h2d_bytes_per_step, pt.d2h_bytes_per_step = round(sum(per_rank[:-1]), 1), round(per_rank[-1], 1)
    pt.allreduce_ms_per_step = round(1000 * reduce_s, 3)


def _out_of_memory(pt: Point, ex: BaseException, dev: torch.device) -> None:
    """An allocation that did not fit is a row, not a crash; anything else propagates."""
    if (kind := is_oom(ex)) is None:
        raise ex
    pt.status, pt.predicted, pt.error = kind, False, str(ex).splitlines()[0][:200]
    _free(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def point_label(p: dict) -> str:
    """A point's policy in tables and plots ("infinigen int4 c0.25"; "full graphs": replayed from CUDA graphs; files
    from before the keys had no field)."""
    name = label(p["policy"], p.get("spec_keys"), p.get("correct"), short=True, shortlist=p.get("shortlist"))
    return f"{name} graphs" if p.get("graph_replays") else name


def plot(points: list[dict], path, title: str) -> None:
    """Decode throughput vs context (one panel per batch) and vs batch (one panel per context), per policy."""
    plt = pyplot()
    ok = [p for p in points if p["status"] == "ok"]
    batches = sorted({p["batch"] for p in points})
    contexts = sorted({p["context"] for p in points})
    policies = list(dict.fromkeys(point_label(p) for p in points))
    cols = max(len(batches), len(contexts))
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7), squeeze=False)
    for row, (fixed, xs, xkey, xlabel) in enumerate(
        ((batches, contexts, "context", "context (tokens)"), (contexts, batches, "batch", "batch"))
    ):
        fkey = "batch" if xkey == "context" else "context"
        for i in range(cols):
            ax = axes[row][i]
            if i >= len(fixed):
                ax.axis("off")
                continue
            for pol in policies:
                pts = sorted((p[xkey], p["tokens_per_s"]) for p in ok if point_label(p) == pol and p[fkey] == fixed[i])
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"{fkey} {fixed[i]}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if i == 0:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
