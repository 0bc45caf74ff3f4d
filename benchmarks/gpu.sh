#!/usr/bin/env bash
# Everything that needs a GPU, in one call on a lent machine (the library's `device` tool runs this from the
# repository root; results land under $OUT and come back):
#   1. the CUDA tests (tests/rt/test_gpu.py: tokens equal the CPU's per policy, a bench point's sync count)
#   2. `infinigen-rt bench` on the Llama-2-7B shape, fp16: batch 8 over 2k/8k/32k context for offload,
#      infinigen (fetch share pinned at 10 %) and full; then batch 1/4/16 at 8k
#   3. the peer: transformers' offloaded cache on the same shapes (benchmarks/peer_transformers.py)
# The machine has torch, transformers and pytest but cannot reach a registry: nothing is installed, the
# project runs from the tree (PYTHONPATH). Budget: one call of at most 10 minutes; each step has a timeout.
set -uo pipefail
OUT=${OUT:-artifacts/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
GEN=${GEN:-32}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } | tee "$OUT/machine.txt"

timeout 150 $PY -m pytest -q -p no:cacheprovider tests/rt/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"

bench() { timeout "$1" $PY -m infinigen_rt.cli bench --synthetic llama-2-7b --device cuda --gen "$GEN" --warmup 3 \
  --budget 0.1 "${@:2}" 2>"$OUT/bench-stderr-$RANDOM.txt"; }
bench 200 --batch 8 --context 2048,8192,32768 --policies offload,infinigen,full \
  --out "$OUT/bench-llama-2-7b-context.json" --plot "$OUT/bench-llama-2-7b-context.png"
bench 150 --batch 1,4,16 --context 8192 --policies offload,infinigen \
  --out "$OUT/bench-llama-2-7b-batch.json" --plot "$OUT/bench-llama-2-7b-batch.png"

timeout 120 $PY benchmarks/peer_transformers.py synthetic llama-2-7b --batch 8 --context 8192 --gen "$GEN" \
  --out "$OUT/peer-transformers-offloaded.json" 2>&1 | tail -3

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    bw = d["bandwidth"]
    print(f.name, d["device_name"], f"device {bw['device_bytes_per_s']/1e9:.0f} GB/s, h2d {bw['h2d_bytes_per_s']/1e9:.1f} GB/s")
    for p in d["points"]:
        if p["status"] != "ok":
            print(f"  {p['policy']:9} b{p['batch']:<3} ctx{p['context']:<6} {p['status']}")
            continue
        print(f"  {p['policy']:9} b{p['batch']:<3} ctx{p['context']:<6} {p['ms_per_step']:8.2f} ms {p['tokens_per_s']:8.1f} tok/s "
              f"x{p['over_floor']:.2f} floor, syncs {p['syncs_per_step']}, overlap {p['copy_overlap']}")
for f in sorted(out.glob("peer-*.json")):
    for r in json.loads(f.read_text())["rows"]:
        print("  peer", r.get("cache"), r["batch"], r["context"], r.get("ms_per_step"), r.get("tokens_per_s"), r["status"])
EOF
