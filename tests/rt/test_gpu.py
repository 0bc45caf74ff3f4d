"""On a CUDA machine: the same greedy tokens and close logits on the GPU as on the CPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
def test_cuda_matches_cpu(name, bundles):
    b = read_bundle(bundles[name])
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    cpu, _ = Engine(b, device="cpu", dtype="float32").generate(prompts, max_new_tokens=16)
    gpu_engine = Engine(b, device="cuda", dtype="float32")
    gpu, stats = gpu_engine.generate(prompts, max_new_tokens=16)
    assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu]
    assert stats.extra["device"].startswith("cuda")
    assert next(gpu_engine.model.parameters()).is_cuda


@pytest.mark.parametrize("policy", ["offload", "infinigen", "int4", "h2o"])
def test_cuda_policies_match_cpu(policy, bundles):
    import math

    from infinigen_rt.policies import KVOptions

    kv = KVOptions(alpha=math.inf, budget=1.0) if policy == "infinigen" else KVOptions(alpha=2.0, budget=0.5)
    b = read_bundle(bundles["llama31_gqa"])
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
    cpu, _ = Engine(b, device="cpu", dtype="float32", policy=policy, kv=kv).generate(prompts, max_new_tokens=12)
    gpu, stats = Engine(b, device="cuda", dtype="float32", policy=policy, kv=kv).generate(prompts, max_new_tokens=12)
    assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu]
    if policy != "h2o":
        assert stats.to_dict()["bytes_h2d"] > 0


@pytest.mark.parametrize("policy", ["infinigen", "offload", "full", "int4"])
def test_one_host_sync_per_decode_step(policy):
    """The decode step's only sync is the sampled tokens' copy to the host (torch's sync debug mode, counted)."""
    from infinigen_rt.bench import measure_bandwidths, run_point, synthetic_engine

    dev = torch.device("cuda")
    e = synthetic_engine("smollm2-135m", dev, torch.float16)
    bw = measure_bandwidths(dev, 1 << 26)
    p = run_point(e, "t", policy, 2, 512, 4, bw, warmup=2)
    assert p.status == "ok" and p.peak_device_bytes > 0
    assert p.syncs_per_step == 1, p
    if policy != "full":
        assert p.h2d_bytes_per_step > 0 and p.h2d_busy_bytes_per_s > 0
        assert p.copy_overlap is not None and 0 <= p.copy_overlap <= 1
    assert bw["gather_bytes_per_s"] > 0


def test_a_paged_pools_buffers_are_pinned_at_their_exact_size_and_released():
    from infinigen_rt.blocks import HostBlocks

    store = HostBlocks(10, 16, "cuda")
    k = store.buffer("k", 0, (3, 64), torch.float16)
    assert k.is_pinned() and k.untyped_storage().nbytes() == 10 * 16 * 3 * 64 * 2 == store.nbytes
    store._unpin()
    assert not k.is_pinned()


def test_pool_pages_are_pinned_at_their_exact_size_and_released(bundles):
    from infinigen_rt.pool import KVPool

    pool = KVPool(2, 3, 64, 1000, torch.float16, "cuda")
    assert pool.k.is_pinned() and pool.k.untyped_storage().nbytes() == 1000 * 2 * 3 * 64 * 2
    pool.close()
    assert not pool.k.is_pinned()


def test_the_gpus_numa_node_is_read_or_unknown():
    from infinigen_rt.tp import gpu_node

    node = gpu_node(0)
    assert node is None or node >= 0
