"""The host's side of a decode step: the aten ops one step of the GPU path dispatches (under fake CUDA, meta
tensors: any CPU, real shapes), counted by op and by the line of infinigen_rt that issued them. On a GPU every such
op costs host time whether or not its kernel is small (the H200 took 18-27 us a kernel at batch 1:
artifacts/results/gpu-h200-2026-11-26), so this is where a step's launches come from.

    python benchmarks/host_ops.py infinigen --batch 1 --context 2048 [--preset llama-3.1-8b] [--views]

A policy is NAME[:SPEC_KEYS[:CORRECT[:reuse]]] as in step_profile.py. Views, reshapes and allocations are left out
unless --views (they launch nothing).
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infinigen_rt.measure.bench import start_runner
from infinigen_rt.measure.fakecuda import FakeCuda
from infinigen_rt.measure.synthetic import synthetic_engine
from infinigen_rt.policies import KVOptions, configure

sys.path.insert(0, str(Path(__file__).parent))
from step_profile import variant  # noqa: E402

VIEWS = {"view", "reshape", "slice", "transpose", "expand", "unsqueeze", "squeeze", "as_strided", "t", "_unsafe_view",
         "alias", "select", "permute", "unflatten", "flatten", "detach", "split", "chunk", "narrow", "unbind", "empty",
         "empty_strided", "empty_like", "split_with_sizes", "lift_fresh", "_reshape_alias", "view_as"}  # fmt: skip


class Count(TorchDispatchMode):
    """Each dispatched op, by name and by the innermost line of infinigen_rt (fake CUDA's own left out) above it."""

    def __init__(self, views: bool):
        super().__init__()
        self.views, self.by_op, self.by_line, self.n = views, collections.Counter(), collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.views or name not in VIEWS:
            self.n += 1
            self.by_op[name] += 1
            f = sys._getframe(1)
            while f is not None:
                file = f.f_code.co_filename
                if "infinigen_rt" in file and "fakecuda" not in file:
                    self.by_line[f"{file.split('infinigen_rt/')[-1]}:{f.f_lineno} {f.f_code.co_name}"] += 1
                    break
                f = f.f_back
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policy")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--views", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    v = variant(a.policy)
    with FakeCuda(values=False, host_memory=1 << 50):
        engine = synthetic_engine(a.preset, torch.device("cuda"), torch.bfloat16, 0)
        opts = KVOptions(budget=0.1, prefill_chunk=min(a.context, 4096))
        policy = configure(engine, v.policy, replace(opts, **v.changes()))
        runner, _ = start_runner(engine, policy, [[3 + i] * a.context for i in range(a.batch)], 8, warmup=3)
        count = Count(a.views)
        try:
            with count:
                runner.step()
        finally:
            runner.close()
    print(f"{a.policy} at {a.preset}, batch {a.batch}, {a.context} tokens: {count.n} ops a decode step "
          f"({engine.cfg.num_hidden_layers} layers)")  # fmt: skip
    for k, n in count.by_op.most_common(15):
        print(f"{n:7d}  {k}")
    print("by line:")
    for k, n in count.by_line.most_common(a.top):
        print(f"{n:7d}  {k}")


if __name__ == "__main__":
    main()
