"""The floor of a decode step: what memory alone allows. The device reads its weights and whatever KV lives on it
(all of it for `full` and `h2o`, the partial keys for `infinigen`) at the measured device bandwidth, and the fetched
KV crosses at the measured host-to-device bandwidth. On a GPU the two overlap (floor = max); on a CPU they share one
memory system (floor = sum). Also the predicted peak memory of a point (its out-of-memory rows)."""

from __future__ import annotations

import statistics
import time

import torch

from infinigen_rt.engine import Engine
from infinigen_rt.kv.window import Rings
from infinigen_rt.policies import Policy
from infinigen_rt.system import sync

GATHER_ROW_BYTES = 256  # the zero-copy gather rate is measured on Llama's K or V rows: 128 fp16 values


def _median_seconds(fn, device, reps: int = 5) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidths(device: torch.device, n_bytes: int | None = None) -> dict:
    """The three rates a step's floor is made of: device memory (a large device copy: bytes read + written per
    second), host to device by DMA (a large pinned copy; on a CPU a host memory copy), and the zero-copy gather
    of GATHER_ROW_BYTES rows (Llama's K or V row in fp16) from pinned host memory by the row kernel, at random rows (on
    a CPU: index_select, as the CPU path gathers)."""
    n = n_bytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.fill_(1)
    t_dev = _median_seconds(lambda: b.copy_(a), device)
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
        t_h2d = _median_seconds(lambda: b.copy_(host, non_blocking=True), device)
    else:
        host, t_h2d = a, t_dev
    gather = gather_rate(host.view(torch.float16).view(-1, GATHER_ROW_BYTES // 2), device)
    return {"device_bytes_per_s": 2 * n / t_dev, "h2d_bytes_per_s": n / t_h2d, "gather_bytes_per_s": gather,
            "probe_bytes": n}  # fmt: skip


def gather_rate(src: torch.Tensor, device: torch.device) -> float:
    """Bytes per second of gathering a quarter of `src`'s rows, at random, into device memory (K and V each)."""
    from infinigen_rt.kv.rows import copy_rows

    rows = src.shape[0] // 2  # K in the first half, V in the second
    k, v = src[:rows], src[rows:]
    n = rows // 4
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:n].to(device).view(1, 1, n)
    out_k = torch.empty(1, 1, n, src.shape[1], dtype=src.dtype, device=device)
    out_v = torch.empty_like(out_k)
    t = _median_seconds(lambda: copy_rows(k, v, idx, None, out_k, out_v, device.type == "cuda"), device)
    return 2 * n * src.shape[1] * src.element_size() / t


def weight_bytes(engine: Engine) -> int:
    """Bytes a decode step reads from the weights: every matrix once (the embedding table only as the head)."""
    m, total = engine.model, 0
    for name, p in m.named_parameters():
        if name.startswith(("embed_tokens", "embed_positions")) and not engine.cfg.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def memory_needs(engine: Engine, policy: Policy, batch: int, context: int, gen: int, chunk: int) -> dict:
    """Predicted peak bytes on the device and in host memory for one point (to report what cannot fit
    as an out-of-memory row before allocating it). The policy states its own KV needs (KVCache.kv_bytes)."""
    cls = policy.cls
    cfg, esz = engine.cfg, torch.empty(0, dtype=engine.dtype).element_size()
    seq, step = context + gen + 1, min(chunk, context)
    tokens = batch * cfg.num_key_value_heads * seq  # (sequence, KV head, slot) triples per layer
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    # a prefill chunk's activations (the runner prefills one request at a time); the [1, H, chunk, T] score matrix
    # only where the policy builds it itself (SDPA's fused kernels never do: counting it predicted 117 GiB for full
    # at Llama-2-7B, batch 8 x 8k): fp32 probabilities and two boolean masks of that shape live at its peak (the
    # fake-CUDA rehearsal's count)
    scores = cfg.num_attention_heads * step * seq * (4 + 2) if cls.scores else 0
    act = step * (cfg.intermediate_size * 3 + cfg.hidden_size * 8) * esz + scores
    kv_device, kv_host, _ = policy.kv_bytes(engine, tokens, esz)
    rings = Rings.bytes(cfg, batch, esz, seq)  # sliding layers, on the device
    return {"device": weights + act + kv_device + rings, "host": kv_host}


def floor_seconds(engine: Engine, policy: Policy, batch: int, context: int, h2d_bytes: float, bw: dict) -> float:
    """The memory-bound floor of one decode step (see the module docstring)."""
    esz = torch.empty(0, dtype=engine.dtype).element_size()
    tokens = batch * engine.cfg.num_key_value_heads * context
    rings = Rings.bytes(engine.cfg, batch, esz, context)  # read every step
    dev = weight_bytes(engine) + policy.kv_bytes(engine, tokens, esz)[2] + rings
    t_dev = dev / bw["device_bytes_per_s"]
    t_h2d = h2d_bytes / bw["h2d_bytes_per_s"]
    return max(t_dev, t_h2d) if engine.device.type == "cuda" else t_dev + t_h2d
