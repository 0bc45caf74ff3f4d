"""`bench --rehearse`: a decode step on an H100 projected from the operations the GPU path issues, run on any
CPU under fake CUDA with meta tensors (fakecuda.py; nothing is computed, the shapes are real).

Per point (policy, batch, context): a runner over a paged pool of `batch` requests of `context` prompt tokens, as
bench runs them; the prompts prefilled and two decode steps taken, one more decode step is recorded op by op and
replayed by projection.py, eager and from a CUDA graph (two points, `graphs` false and true), against the same
step's physical floor: the weights and the device-resident KV read at HBM speed beside the rows it fetched over
PCIe. `bench --replay` projects steps recorded earlier (benchmarks/record_trace.py: a tree that is gone, such as
the one a GPU measured) the same way."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from infinigen_rt.errors import InfinigenError
from infinigen_rt.measure.projection import H100, Hardware, project, read_trace

# `reuse`: the share of a layer's selected rows that the step before selected too, as measured on real text (which
# rows is a value, which the meta tensors here lack): speculation's own rows kept from step to step at 32k and a
# budget of 0.1, Gemma 3 270M on Hamlet (benchmarks/overlap.py, artifacts/results/overlap-gemma3-32k.json; no
# larger model runs here): 59.6 % with int4 keys and the correction, 68.5 % with the partial columns without it.
# The other variants take the lower.
REUSED = {("int4", True): 0.596, ("partial", False): 0.685}
NEW_TOKENS = 6  # what each request asks for: its prefill's token, two warm-up steps, the recorded one, spare
PREFILL_CHUNK = 4096


@dataclass
class Projected:
    model: str
    policy: str
    batch: int
    context: int
    spec_keys: str | None
    correct: float | None
    hardware: str
    reuse: bool | None = None  # rows reused across steps, at the share `reused` held
    reused: float | None = None
    shortlist: float | None = None  # the correction's shortlist, where it has one (as bench's Point)
    graphs: bool = False  # the step replayed from one CUDA graph (else issued op by op, eager)
    status: str = "ok"  # or oom-device: the point does not fit the device (fake CUDA's capacity, 80 GiB)
    launches: int | None = None
    projected_ms: float | None = None
    issue_ms: float | None = None  # the host's time issuing the launches (within projected_ms)
    floor_ms: float | None = None
    over_floor: float | None = None
    hbm_bytes: int | None = None
    pcie_bytes: int | None = None
    syncs: int | None = None
    streams: int | None = None
    overlap: float | None = None  # host-to-device transfer under compute, as bench's copy_overlap (None: none moved)
    error: str | None = None


def rehearse(preset: str, dtype: torch.dtype, variants: list, batch: int, context: int, *, budget: float = 0.1,
             max_kv: int | None = None, alpha: float | None = None, seed: int = 0,
             hw: Hardware = H100) -> list[Projected]:  # fmt: skip
    """The projected decode step of every variant (measure.bench.Variant) at one (batch, context) of `preset`."""
    from infinigen_rt.measure.bench import start_runner
    from infinigen_rt.measure.fakecuda import FakeCuda, available
    from infinigen_rt.measure.floor import floor_seconds
    from infinigen_rt.measure.synthetic import synthetic_engine
    from infinigen_rt.policies import KVOptions, configure

    why = available()
    if why:
        raise InfinigenError(f"--rehearse runs the GPU path under fake CUDA, which cannot run here: {why}")
    bw = {"device_bytes_per_s": hw.hbm_bytes_per_s, "h2d_bytes_per_s": hw.pcie_bytes_per_s}
    out = []
    with FakeCuda(values=False, host_memory=1 << 50) as gpu:
        engine = synthetic_engine(preset, torch.device("cuda"), dtype, seed)
        cfg = engine.cfg
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, context + NEW_TOKENS)
        opts = KVOptions(alpha=alpha, budget=budget, max_kv=max_kv)
        for v in variants:
            policy = configure(engine, v.policy, replace(opts, **v.changes()))
            spec = "spec_keys" in policy.cls.knobs
            point = Projected(f"synthetic:{preset}", v.policy, batch, context, policy.opts.spec_keys if spec else None,
                              policy.opts.correct if spec else None, hw.name)  # fmt: skip
            point.shortlist = (policy.opts.shortlist or None) if spec and policy.opts.correct else None
            if spec and policy.opts.reuse:
                point.reuse = True
                point.reused = REUSED.get((policy.opts.spec_keys, policy.opts.correct > 0), min(REUSED.values()))
            gpu.reused = point.reused
            out.append(point)
            prompts = [[3 + i] * context for i in range(batch)]
            # each prompt prefilled whole (one pass of ops under meta tensors, whatever its length); where that does
            # not fit (h2o's score matrix of a whole 32k prompt), in chunks of PREFILL_CHUNK: the decode step
            # recorded is the same either way
            for chunk in dict.fromkeys([context, min(context, PREFILL_CHUNK)]):
                try:
                    runner, _ = start_runner(engine, replace(policy, opts=replace(policy.opts, prefill_chunk=chunk)),
                                             prompts, NEW_TOKENS, warmup=3)  # fmt: skip
                    try:
                        with gpu.recording() as ops:
                            runner.step()
                    finally:
                        runner.close()
                        del runner
                    point.status, point.error = "ok", None
                    break
                except torch.OutOfMemoryError as e:
                    point.status, point.error = "oom-device", str(e).split(". ")[0]
            if point.status != "ok":
                continue
            floor = floor_seconds(engine, policy, batch, context, sum(op.pcie_bytes for op in ops if op.launch), bw)
            out[-1:] = [priced(point, ops, hw, floor, graphs) for graphs in (False, True)]
        del engine
    return out


def priced(point: Projected, ops: list, hw: Hardware, floor: float, graphs: bool) -> Projected:
    """`point` with its recorded step's ops projected on `hw`, eager or from a CUDA graph, against `floor` (s)."""
    p = project(ops, hw, graphs)
    return replace(point, graphs=graphs, launches=p.launches, projected_ms=round(1000 * p.seconds, 3),
                   issue_ms=round(1000 * p.issue_s, 3), floor_ms=round(1000 * floor, 3),
                   over_floor=round(p.seconds / floor, 3), hbm_bytes=p.hbm_bytes, pcie_bytes=p.pcie_bytes,
                   syncs=p.syncs, streams=p.streams, overlap=p.overlap)  # fmt: skip


def replay(paths: list, hw: Hardware = H100) -> list[Projected]:
    """`bench --replay`: recorded steps (benchmarks/record_trace.py) projected with today's projection, each eager
    and from a CUDA graph, against the floor their recording gave (the device's bytes at HBM's copy rate beside the
    fetched rows at the DMA engine's)."""
    out = []
    for path in paths:
        try:
            rec, ops = read_trace(path)
            point = Projected(rec["model"], rec["policy"], rec["batch"], rec["context"], rec.get("spec_keys"),
                              rec.get("correct"), hw.name)  # fmt: skip
            floor = max(rec["floor_device_bytes"] / hw.hbm_bytes_per_s,
                        rec["floor_fetched_bytes"] / hw.pcie_bytes_per_s)  # fmt: skip
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            raise InfinigenError(f"{path}: not a recorded step ({type(e).__name__}: {e}); record one with "
                                 f"benchmarks/record_trace.py") from None  # fmt: skip
        out += [priced(point, ops, hw, floor, graphs) for graphs in (False, True)]
    return out


def rows(points: list[Projected]) -> list[dict]:
    return [asdict(p) for p in points]
