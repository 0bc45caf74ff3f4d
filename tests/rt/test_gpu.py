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


def test_bench_point_on_cuda_counts_syncs_and_overlap():
    from infinigen_rt.bench import measure_bandwidths, run_point, synthetic_engine

    dev = torch.device("cuda")
    e = synthetic_engine("smollm2-135m", dev, torch.float16)
    bw = measure_bandwidths(dev, 1 << 26)
    p = run_point(e, "t", "infinigen", 2, 512, 4, bw, warmup=2)
    assert p.status == "ok" and p.peak_device_bytes > 0 and p.h2d_bytes_per_step > 0
    assert p.syncs_per_step >= 1  # at least the sampled tokens' copy to the host is seen
    assert p.copy_overlap is not None and 0 <= p.copy_overlap <= 1
