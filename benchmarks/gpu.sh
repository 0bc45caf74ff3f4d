#!/usr/bin/env bash
# What needs a GPU, in parts that each fit one call of the device tool (under 10 minutes, at most 8 files under
# $OUT; every bench and peer file is written row by row, a peer row after every step, so a call cut short keeps
# what it measured):
#   bash benchmarks/gpu.sh tests        CUDA tests: tokens equal the CPU's (--reuse too), one sync per decode
#                                       step, the row gather, int4 key and attention kernels    (~3 min)
#   bash benchmarks/gpu.sh llama2-8k    Llama-2-7B shapes, fp16, batch 8 x 8k: full (it fits, and wins here),
#                                       offload, infinigen (10 % fetched); transformers' offloaded cache  (~5 min)
#   bash benchmarks/gpu.sh llama2-32k   batch 4 x 32k, where only the pool policies fit; the peer   (~6 min)
#   bash benchmarks/gpu.sh llama31-32k  Llama-3.1-8B shapes (GQA), batch 1 and 4 x 32k              (~5 min)
#   bash benchmarks/gpu.sh llama31-128k Llama-3.1-8B shapes, batch 1 x 128k                         (~5 min)
#   bash benchmarks/gpu.sh gather-grid  the defaults at Llama-2-7B b8 x 8k with the row gather from host memory on
#                                       8 programs (the default), a program per 16 rows (INFINIGEN_GATHER_PROGRAMS=0,
#                                       the kernel the H100 measured) and 32: the link's rate, the overlap (~6 min)
#   bash benchmarks/gpu.sh graphs       what a CUDA graph costs here (benchmarks/graph_probe.py): a kernel's eager
#                                       launch, its time replayed from a graph, a replay's host time; the selection's
#                                       top-k, torch's against ours (time and kernels a call); the int4 scoring's
#                                       rate, a 16-bit query's one product against the three profiled; graphed tokens
#                                       against eager; `full` and the defaults eager and graphed at Llama-3.1-8B b1,
#                                       b4 x 32k and Llama-2-7B b8 x 8k (bench --graphs both)        (~7 min)
# Fifteen minutes of device time hold two parts: `graphs` first (the step graphed and eager at the three measured
# points, and the constants the projection still assumes: a graph's costs, our top-k's and the 16-bit scoring's
# rates), then `gather-grid` (the capped gather's rate and overlap); `tests` where a kernel changed since the last.
# The device machine has torch, Triton, transformers and pytest and no network: the project runs from the tree.
#
# REHEARSAL=1 runs a part here, on the CPU: the same commands, files and time-outs, through fake CUDA
# (infinigen_rt/measure/fakecuda.py: every `--device cuda` command runs the GPU code path on CPU tensors) at tiny shapes (the
# smollm2-4l preset, batch <= 2, 64 tokens of context, 1 warm-up and 2 timed steps). tests/test_gpu_sh.py rehearses every part and
# checks that each part's work fits its time-out at the real shapes (a plan from bytes and assumed rates).
set -uo pipefail
PART=${1:-tests}
OUT=${OUT:-artifacts/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTHON=${PYTHON:-python3}
PY=$PYTHON  # the commands of the GPU path (in a rehearsal: through fake CUDA)
GEN=${GEN:-32}
WARMUP=3
REHEARSAL=${REHEARSAL:-}
if [ -n "$REHEARSAL" ]; then  # every step runs each layer's kernels in Triton's interpreter: as few as will do
  PY="$PY -m infinigen_rt.measure.fakecuda"
  GEN=2
  WARMUP=1
fi

tiny() {  # tiny ARGS...: a rehearsal's shapes for bench's arguments (the real ones otherwise)
  local prev=""
  for a in "$@"; do
    if [ -z "$REHEARSAL" ]; then printf '%s\n' "$a"
    elif [ "$prev" = --synthetic ]; then printf '%s\n' smollm2-4l
    elif [ "$prev" = --batch ]; then printf '%s\n' "$(tr ',' '\n' <<<"$a" | awk '{print ($1 > 2 ? 2 : $1)}' | sort -un | paste -sd,)"
    elif [ "$prev" = --context ]; then printf '%s\n' 64
    else printf '%s\n' "$a"; fi
    prev=$a
  done
}
bench() {  # bench SECONDS NAME ARGS...: one JSON, row by row
  local args
  mapfile -t args < <(tiny "${@:3}")
  if [ -n "$REHEARSAL" ]; then args+=(--probe 1048576); fi
  timeout "$1" $PY -m infinigen_rt.cli bench --device cuda --gen "$GEN" --warmup "$WARMUP" --budget 0.1 \
    --out "$OUT/bench-$2.json" "${args[@]}" 2>>"$OUT/log-$PART.txt" | tail -20
}
peer() {  # peer SECONDS NAME PRESET BATCH CONTEXT STEPS: transformers' offloaded cache on the same shapes, STEPS
  # timed steps: each moves the whole KV between host and device (Llama-2-7B at 8 x 8k: 32 GiB each way)
  local preset=$3 batch=$4 context=$5 steps=$6
  if [ -n "$REHEARSAL" ]; then preset=smollm2-4l; batch=$((batch > 2 ? 2 : batch)); context=64; steps=$GEN; fi
  timeout "$1" $PY benchmarks/peer_transformers.py synthetic "$preset" --batch "$batch" --context "$context" \
    --gen "$steps" --out "$OUT/peer-$2.json" 2>>"$OUT/log-$PART.txt" | tail -5
}

case "$PART" in
  tests)
    { if [ -n "$REHEARSAL" ]; then echo "rehearsal: no GPU (fake CUDA)"; else
        nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
      fi
      $PYTHON -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    } | tee "$OUT/machine.txt"
    timeout 420 $PYTHON -m pytest -q -p no:cacheprovider tests/rt/test_gpu.py tests/rt/test_kernels.py \
      tests/rt/test_quant_kernel.py tests/rt/test_attention_kernel.py -k "not sm80 and not fake_cuda" 2>&1 \
      | tail -25 | tee "$OUT/gpu-tests.txt"
    ;;
  llama2-8k)
    bench 330 llama-2-7b-b8-8k --synthetic llama-2-7b --batch 8 --context 8192 --policies full,offload,infinigen
    peer 200 llama-2-7b-b8-8k llama-2-7b 8 8192 8
    ;;
  llama2-32k)
    bench 360 llama-2-7b-b4-32k --synthetic llama-2-7b --batch 4 --context 32768 --policies offload,infinigen,full
    peer 180 llama-2-7b-b4-32k llama-2-7b 4 32768 2
    ;;
  llama31-32k)
    bench 540 llama-3.1-8b-32k --synthetic llama-3.1-8b --batch 1,4 --context 32768 --policies full,offload,infinigen
    ;;
  llama31-128k)
    bench 540 llama-3.1-8b-128k --synthetic llama-3.1-8b --batch 1 --context 131072 --policies offload,infinigen,full
    ;;
  gather-grid)
    unset INFINIGEN_GATHER_PROGRAMS
    bench 150 llama-2-7b-b8-8k-grid8 --synthetic llama-2-7b --batch 8 --context 8192 --policies infinigen
    export INFINIGEN_GATHER_PROGRAMS=0
    bench 150 llama-2-7b-b8-8k-grid0 --synthetic llama-2-7b --batch 8 --context 8192 --policies infinigen
    export INFINIGEN_GATHER_PROGRAMS=32
    bench 150 llama-2-7b-b8-8k-grid32 --synthetic llama-2-7b --batch 8 --context 8192 --policies infinigen
    unset INFINIGEN_GATHER_PROGRAMS
    ;;
  graphs)
    timeout 120 $PYTHON benchmarks/graph_probe.py --out "$OUT/graph-probe.json" 2>>"$OUT/log-$PART.txt" | tail -30
    if [ -z "$REHEARSAL" ]; then  # graphed tokens against eager ones, the fused kernels against torch, on this GPU
      timeout 150 $PYTHON -m pytest -q -p no:cacheprovider tests/rt/test_gpu.py -k "graphed or fused" \
        2>&1 | tail -15 | tee "$OUT/graph-tokens.txt"
    fi
    bench 240 llama-3.1-8b-32k-graphs --synthetic llama-3.1-8b --batch 1,4 --context 32768 --policies full,infinigen --graphs both --interleave
    bench 180 llama-2-7b-b8-8k-graphs --synthetic llama-2-7b --batch 8 --context 8192 --policies full,infinigen --graphs both
    ;;
  *)
    echo "unknown part $PART: tests, llama2-8k, llama2-32k, llama31-32k, llama31-128k, gather-grid, graphs" >&2
    exit 2
    ;;
esac

$PYTHON - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    bw = d["bandwidth"]
    print(f.name, d["device_name"], f"HBM {bw['device_bytes_per_s']/1e9:.0f} GB/s, DMA {bw['h2d_bytes_per_s']/1e9:.1f} GB/s,"
          f" gather {bw.get('gather_bytes_per_s', 0)/1e9:.1f} GB/s")
    for p in d["points"]:
        head = f"  {p['policy']:9} b{p['batch']:<3} ctx{p['context']:<7}"
        if p["status"] != "ok":
            print(head, p["status"], p.get("error") or "")
            continue
        busy = p.get("h2d_busy_bytes_per_s")
        print(head, f"{p['ms_per_step']:8.2f} ms (p90 {p['ms_per_step_p90']:.2f}) {p['tokens_per_s']:8.1f} tok/s "
              f"x{p['over_floor']:.2f} floor, h2d {p['h2d_bytes_per_step']/1e6:.1f} MB/step"
              + (f" at {busy/1e9:.1f} GB/s busy" if busy else "")
              + f", syncs {p['syncs_per_step']}, overlap {p['copy_overlap']}")
for f in sorted(out.glob("peer-*.json")):
    for r in json.loads(f.read_text())["rows"]:
        print(" ", f.name, r.get("cache"), "b", r["batch"], "ctx", r["context"], r.get("ms_per_step"), "ms",
              r.get("tokens_per_s"), "tok/s", r["status"])
EOF
