"""Record the operations of the GPU path's decode step, as `bench --rehearse` sees them under fake CUDA, into trace
files that `infinigen-rt bench --replay` projects later with whatever projection the tree then holds.

Runs `infinigen-rt bench ARGS --rehearse` of the tree that is imported (a worktree of an older commit on
PYTHONPATH records that commit's step) and writes one file a point: its fields (model, policy, batch, context, ...)
the floor's bytes (the device's, the fetched rows') and its ops, each a row of FIELDS (projection.Op's), gzipped
JSON. A tree older than Op.site and Op.new_shape gets both from `annotate`, one whose fake CUDA did not count casts
gets them from `casts`.

    PYTHONPATH=../wt-5a5a7e7 python benchmarks/record_trace.py --out DIR -- \\
        --synthetic llama-3.1-8b --batch 1,4 --context 32768 --policies full,offload,infinigen
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

FIELDS = ("kind", "name", "stream", "hbm_bytes", "flops", "pcie_bytes", "event", "streams", "d2h_bytes", "site",
          "new_shape")  # fmt: skip


def annotate(fakecuda) -> None:
    """For a tree whose ops carry no `site` or `new_shape` (before they were recorded): fake CUDA's `note` patched to
    set both as today's fake CUDA does (fakecuda.site; a fused attention's shapes against those the steps
    before the recorded one ran)."""
    package = str(Path(fakecuda.__file__).resolve().parents[1])
    note = fakecuda.FakeCuda.note
    seen: set = set()

    def noted(self, op):
        f = sys._getframe(1)
        if op.name == "fused_attention":
            shapes = (tuple(f.f_locals["q"].shape), tuple(f.f_locals["k"].shape))
            op.new_shape = shapes not in seen
            if self.ops is None:  # (the recorded step's shapes against the steps before it)
                seen.add(shapes)
        while f is not None and not (f.f_code.co_filename.startswith(package)
                                     and "/measure/" not in f.f_code.co_filename):  # fmt: skip
            f = f.f_back
        name = "" if f is None else f.f_code.co_filename
        op.site = "kv" if "/kv/" in name or "/policies/" in name else "model"
        note(self, op)

    fakecuda.FakeCuda.note = noted


def casts(fakecuda) -> None:
    """For a tree whose fake CUDA took every operator that may return a view (`to`, `contiguous`, `reshape`) for one
    even where it copied (before it counted a cast as the kernel it is): its dispatch patched to note those that made
    new memory, as today's fake CUDA does."""
    run = fakecuda._Dispatch.run

    def counted(self, func, args, kwargs, dev, tensors=None):
        out = run(self, func, args, kwargs, dev, tensors)
        info, h = fakecuda._info(func), self.h
        if (info.is_view and dev.type == "cuda" and isinstance(out, fakecuda.torch.Tensor) and args
                and isinstance(args[0], fakecuda.torch.Tensor)
                and fakecuda.storage_key(out) != fakecuda.storage_key(args[0])):  # fmt: skip
            h.note(fakecuda.Op("kernel", info.name, h.current_stream(dev).name, fakecuda._bytes(args[0], out)))
        return out

    fakecuda._Dispatch.run = counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the trace files")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then bench's arguments (no --rehearse, no --json)")
    a = p.parse_args()
    args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    import infinigen_rt
    import infinigen_rt.measure.fakecuda as fakecuda
    import infinigen_rt.measure.floor as floor_module
    from infinigen_rt.cli import main as cli

    tree = Path(infinigen_rt.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    a.out.mkdir(parents=True, exist_ok=True)
    floor = floor_module.floor_seconds
    if not hasattr(fakecuda, "site"):
        annotate(fakecuda)
    if not hasattr(fakecuda, "Graph"):
        casts(fakecuda)

    def floored(engine, policy, batch, context, h2d_bytes, bw):  # (rehearse's loop, its step recorded as `ops`)
        point, step = sys._getframe(1).f_locals["point"], sys._getframe(1).f_locals["ops"]
        name = f"{point.model.split(':')[-1]}-{point.policy}-b{point.batch}-{point.context}.json.gz"
        device = floor(engine, policy, batch, context, 0, {"device_bytes_per_s": 1.0, "h2d_bytes_per_s": 1.0})
        record = {"tree": commit, "model": point.model, "policy": point.policy, "batch": point.batch,
                  "context": point.context, "spec_keys": point.spec_keys, "correct": point.correct,
                  "dtype": str(engine.dtype).removeprefix("torch."), "floor_device_bytes": int(device),
                  "floor_fetched_bytes": int(h2d_bytes), "fields": FIELDS,
                  "ops": [[getattr(op, f, None) for f in FIELDS] for op in step]}  # fmt: skip
        with gzip.open(a.out / name, "wt") as f:
            json.dump(record, f, separators=(",", ":"))
        print(f"{a.out / name}: {sum(op.kind in ('kernel', 'triton', 'copy') for op in step)} launches", flush=True)
        return floor(engine, policy, batch, context, h2d_bytes, bw)

    floor_module.floor_seconds = floored
    sys.argv = ["infinigen-rt", "bench", *args, "--rehearse"]
    cli()


if __name__ == "__main__":
    main()
