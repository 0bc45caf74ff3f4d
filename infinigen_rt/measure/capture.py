"""Whether a decode step could be captured once in a CUDA graph and replayed: two steps of one batch, one after the
other (two context lengths), recorded under fake CUDA with every launch's arguments (fakecuda.py's
`recording(detail=True)`), and what would stop one graph from replaying both.

A graph replays the same kernels with the same arguments: the same ops in the same order on the same streams,
the same shapes and scalar arguments (a length that changes from step to step must be read from device memory),
and every buffer from outside the step at the same address (static inputs, tables and pools, written before the
replay). Inside the step there may be no host synchronisation and no copy from pageable host memory (not allowed
while capturing) or from a host buffer the step made (gone when the graph replays). Buffers the step allocates
itself are the graph's own and may differ in address, not in shape. `breaks` names each difference once, with how
often it occurs; an empty list is a step one graph replays."""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import replace

import torch

from infinigen_rt.measure.projection import Op


def breaks(a: list[Op], b: list[Op]) -> list[str]:
    """What stops one CUDA graph from replaying both recorded steps `a` and `b` (see the module docstring): one line
    per kind of difference and op, with how many times it occurs, the most frequent first."""
    found: Counter = Counter()
    for step in (a, b):
        for op in step:
            if op.kind == "sync":
                found[f"a host sync inside the step ({op.name})"] += 1
            if op.kind == "copy" and op.pcie_bytes and any(_where(x) in ("host", "step") for x in op.detail[1:2]):
                found["a copy to the device from a host buffer made in the step, or pageable"] += 1
    la, lb = [op for op in a if op.launch], [op for op in b if op.launch]
    if len(la) != len(lb):
        found[f"the steps launch {len(la)} and {len(lb)} ops"] += 1
    for x, y in zip(la, lb, strict=False):
        if (x.kind, x.name, x.stream) != (y.kind, y.name, y.stream):
            found[f"the ops differ from here: {x.name} on {x.stream} against {y.name} on {y.stream}"] += 1
            break  # (what follows is out of step)
        for what in _differences(x.detail, y.detail):
            found[f"{x.name}: {what}"] += 1
    return [f"{what} (x{n})" for what, n in found.most_common()]


def _where(d):
    """A described tensor's place (fakecuda.described), or None for anything else."""
    return d[3] if isinstance(d, tuple) and len(d) == 4 and d[0] == "tensor" else None


def _differences(x: tuple, y: tuple) -> set[str]:
    """How two launches' described arguments differ, as a graph sees it."""
    out: set[str] = set()

    def walk(u, v):
        if isinstance(u, tuple) and u[:1] == ("tensor",) and isinstance(v, tuple) and v[:1] == ("tensor",):
            if u[1:3] != v[1:3]:
                out.add("a tensor's shape or dtype changes with the context")
            wu, wv = u[3], v[3]
            if isinstance(wu, int) != isinstance(wv, int) or (isinstance(wu, int) and wu != wv):
                out.add("a buffer from outside the step is another one (or is made in it) the next step")
            return
        if isinstance(u, tuple) and isinstance(v, tuple) and len(u) == len(v):
            for p, q in zip(u, v, strict=True):
                walk(p, q)
            return
        if u != v:
            out.add("a scalar argument changes with the context")

    walk(x, y)
    return out


def two_steps(preset: str, dtype: torch.dtype, variant, batch: int, context: int, *, budget: float = 0.1,
              seed: int = 0) -> tuple[list[Op], list[Op]]:  # fmt: skip
    """The model's forward of two consecutive decode steps (the part a graph would hold: not the sampling, not the
    runner's host work around it) of `variant` (measure.bench.Variant) at `batch` requests of `context` prompt
    tokens, recorded with detail under fake CUDA with meta tensors."""
    import infinigen_rt.runner as runner_module
    from infinigen_rt.measure.bench import start_runner
    from infinigen_rt.measure.fakecuda import FakeCuda
    from infinigen_rt.measure.synthetic import synthetic_engine
    from infinigen_rt.policies import KVOptions, configure

    steps: list[list[Op]] = []
    forward = runner_module.decode_step
    with FakeCuda(values=False, host_memory=1 << 50) as gpu:
        engine = synthetic_engine(preset, torch.device("cuda"), dtype, seed)
        engine.cfg.max_position_embeddings = max(engine.cfg.max_position_embeddings, context + 16)
        policy = configure(engine, variant.policy, replace(KVOptions(budget=budget), **variant.changes()))
        runner, _ = start_runner(engine, policy, [[3 + i] * context for i in range(batch)], 8, warmup=3)

        def recorded(*args, **kw):
            with gpu.recording(detail=True) as ops:
                out = forward(*args, **kw)
            steps.append(ops)
            return out

        runner_module.decode_step = recorded
        try:
            runner.step()
            runner.step()
        finally:
            runner_module.decode_step = forward
            runner.close()
            del runner, engine
            gc.collect()  # (the pool's pinned pages released while fake CUDA is still there to take them)
    return steps[0], steps[1]


def main(argv: list[str] | None = None) -> None:
    """python -m infinigen_rt.measure.capture [--synthetic PRESET] [--batch B] [--context T] [--policies ...]: what
    stops each policy's decode step from replaying one CUDA graph, on this CPU (fake CUDA, meta tensors)."""
    import argparse

    from infinigen_rt.measure.bench import Variant

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--synthetic", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--policies", default="full,offload,infinigen")
    a = p.parse_args(argv)
    for name in a.policies.split(","):
        found = breaks(*two_steps(a.synthetic, torch.float16, Variant(name, None, None), a.batch, a.context))
        print(f"{name}: {len(found)} kinds of break" + "".join(f"\n  {line}" for line in found))


if __name__ == "__main__":
    main()
