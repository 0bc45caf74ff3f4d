"""Which of the project's files a decode step runs code from: one runner step of a batch under a policy, traced
(sys.setprofile on every thread), on the CPU or on the GPU path (fake CUDA: the GPU's code, on this machine).

    python benchmarks/step_files.py BUNDLE --policy infinigen [--gpu] [--batch 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def traced(fn) -> set[str]:
    """The project's files (relative paths) whose functions ran inside fn(), on any thread."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(str(ROOT / "infinigen_rt")):
                seen.add(str(Path(f).relative_to(ROOT)))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--policy", default="infinigen")
    p.add_argument("--gpu", action="store_true", help="the GPU path under fake CUDA")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from contextlib import nullcontext

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    ctx = nullcontext()
    if a.gpu:
        from infinigen_rt.measure.fakecuda import FakeCuda

        ctx = FakeCuda()
    with ctx, torch.inference_mode():
        e = Engine(read_bundle(a.bundle), device="cuda" if a.gpu else "cpu", dtype="float32")
        run = Runner(e, configure(e, a.policy, KVOptions()), max_batch=a.batch, kv_tokens=4096)
        for i in range(a.batch):
            run.add(Request(list(range(5 + i, 300 + i)), 8))
        for _ in range(3):  # the prompts, then decode steps (warm: every lazy thing made)
            run.step()
        files = traced(run.step)
        run.close()
    if a.json:
        print(json.dumps({"policy": a.policy, "gpu": a.gpu, "files": sorted(files), "count": len(files)}))
    else:
        print(f"{a.policy} ({'GPU path' if a.gpu else 'CPU'}): {len(files)} files")
        for f in sorted(files):
            print("  " + f)


if __name__ == "__main__":
    main()
