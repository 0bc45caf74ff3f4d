"""On a CUDA machine: the same greedy tokens and close logits on the GPU as on the CPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
def test_cuda_matches_cpu(name, bundles):
    b = read_bundle(bundles[name])
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    cpu, _ = generate(Engine(b, device="cpu", dtype="float32"), prompts, max_new_tokens=16)
    gpu_engine = Engine(b, device="cuda", dtype="float32")
    gpu, stats = generate(gpu_engine, prompts, max_new_tokens=16)
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
    cpu, _ = generate(Engine(b, device="cpu", dtype="float32"), prompts, 12, policy=policy, kv=kv)
    gpu, stats = generate(Engine(b, device="cuda", dtype="float32"), prompts, 12, policy=policy, kv=kv)
    assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu]
    if policy != "h2o":
        assert stats.to_dict()["bytes_h2d"] > 0


@pytest.mark.parametrize("policy", ["infinigen", "offload", "full", "int4"])
def test_one_host_sync_per_decode_step(policy):
    """The decode step's only sync is the sampled tokens' copy to the host (torch's sync debug mode, counted)."""
    from infinigen_rt.measure.bench import run_points
    from infinigen_rt.measure.floor import measure_bandwidths
    from infinigen_rt.measure.synthetic import synthetic_engine

    dev = torch.device("cuda")
    e = synthetic_engine("smollm2-135m", dev, torch.float16)
    bw = measure_bandwidths(dev, 1 << 26)
    (p,) = run_points(e, "t", [policy], 2, 512, 4, bw, warmup=2)
    assert p.status == "ok" and p.peak_device_bytes > 0
    assert p.syncs_per_step == 1, p.sync_sites
    if policy != "full":
        assert p.h2d_bytes_per_step > 0 and p.h2d_busy_bytes_per_s > 0
        assert p.copy_overlap is not None and 0 <= p.copy_overlap <= 1
    assert bw["gather_bytes_per_s"] > 0


def test_a_paged_pools_buffers_are_pinned_at_their_exact_size_and_released():
    from infinigen_rt.kv.paged import PagedStore

    store = PagedStore(10, 16, "cuda")
    k = store.buffer("k", 0, (3, 64), torch.float16)
    assert k.is_pinned() and k.untyped_storage().nbytes() == 10 * 16 * 3 * 64 * 2 == store.nbytes
    store._unpin()
    assert not k.is_pinned()


def test_the_gpus_numa_node_is_read_or_unknown():
    from infinigen_rt.tp import gpu_node

    node = gpu_node(0)
    assert node is None or node >= 0


@pytest.mark.parametrize("policy", ["infinigen", "offload", "int4"])
def test_one_host_sync_per_decode_step_through_the_runner(policy, bundles):
    """generate and serve's path (the runner, a paged pool): a decode step waits on the device once, for the sampled
    tokens (torch's sync debug mode counts what the fake-CUDA rehearsal counts on a CPU)."""
    from infinigen_rt.measure.bench import count_syncs
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    engine = Engine(read_bundle(bundles["llama31_gqa"]), device="cuda", dtype="float32")
    run = Runner(engine, configure(engine, policy, KVOptions(alpha=2.0, budget=0.5)), max_batch=2, prefill_chunk=None,
                 kv_tokens=1024)  # fmt: skip
    for p in ([5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]):
        run.add(Request(p, 12))
    run.step()  # the prefills
    counts = [count_syncs(run.step) for _ in range(6)]
    assert counts == [1] * 6, counts


def test_a_decode_step_holds_no_more_device_memory_than_it_starts_with():
    """The device memory of offload's whole-layer copies and infinigen's speculated rows is preallocated: a step's
    peak is its start (what the rehearsal's allocator model says, checked against the real caching allocator)."""
    from infinigen_rt.measure.bench import start_runner
    from infinigen_rt.measure.synthetic import synthetic_engine
    from infinigen_rt.policies import KVOptions, configure

    dev = torch.device("cuda")
    e = synthetic_engine("smollm2-135m", dev, torch.float16)
    for policy in ("offload", "infinigen"):
        with torch.inference_mode():
            prompts = torch.randint(3, 1000, (4, 4096)).tolist()
            run, _ = start_runner(e, configure(e, policy, KVOptions(budget=0.1)), prompts, 8, warmup=1)
            step = run.step
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            assert torch.cuda.max_memory_allocated(dev) - start < 64 << 20, policy
            run.close()


def test_a_failed_registration_is_cleared_from_cudas_last_error():
    """cudaHostRegister's failure stays in the runtime's last error unless it is read: the next kernel launch would
    raise it. system.clear_cuda_error reads it from the runtime torch loaded."""
    from infinigen_rt.system import clear_cuda_error, loaded_cudart

    assert loaded_cudart() is not None  # torch's wheels load libcudart dynamically: its path is in the maps
    err = int(torch.cuda.cudart().cudaHostRegister(0, 1 << 20, 0))  # a null pointer: refused
    assert err != 0
    assert clear_cuda_error() == err
    assert float((torch.ones(4, device="cuda") * 2).sum()) == 8.0  # the next launch is fine


def test_the_defaults_with_rows_reused_give_the_cpus_tokens_and_cross_pcie_less(bundles):
    """--reuse on a real GPU: the defaults' int4 keys scored by the fused kernel, the correction, and the rows a layer
    fetched the step before read from the device; through the runner with a request joining when one ends. The CPU's
    tokens, with and without reuse, and fewer bytes across PCIe with it."""
    from dataclasses import replace

    from infinigen_rt.policies import KVOptions, configure
    from tests.rt.test_rehearsal import steps

    b = read_bundle(bundles["llama31_gqa"])
    kv = KVOptions(alpha=2.0, budget=0.5, window=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [13, 14, 15] * 5, list(range(30, 52))]

    def run(device, reuse):
        engine = Engine(b, device=device, dtype="float32")
        report = []
        got, _ = steps(engine, configure(engine, "infinigen", replace(kv, reuse=reuse)), None, prompts, 10,
                       max_batch=2, report=report)  # fmt: skip
        return got, report[0].bytes_h2d

    want = run("cpu", False)[0]
    plain, moved_plain = run("cuda", False)
    reused, moved_reused = run("cuda", True)
    assert plain == want and reused == want
    assert 0 < moved_reused < moved_plain, (moved_reused, moved_plain)


def test_graphed_decode_steps_give_the_eager_tokens(bundles, monkeypatch):
    """`full`'s decode steps replayed from CUDA graphs (graphs.py): the eager tokens across buckets (of 16 tokens
    here) and a batch that shrinks; every shape captured once, the rest replayed; one host sync a replayed step."""
    import infinigen_rt.kv.store as store
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    monkeypatch.setattr(store, "STEP_BUCKET", 16)
    engine = Engine(read_bundle(bundles["llama31_gqa"]), device="cuda", dtype="float32")
    policy = configure(engine, "full", KVOptions())

    def run(graphs: bool):
        runner = Runner(engine, policy, max_batch=3, prefill_chunk=8, kv_tokens=4096, graphs=graphs)
        asks = (([*range(5, 30)], 40), ([13, 14, 15], 20), ([*range(40, 49)], 30))
        ids = [runner.add(Request(p, n)) for p, n in asks]
        out = {}
        while runner.has_work:
            for o in runner.step():
                out[o.id] = list(o.token_ids)
        stats = runner.step_graphs.stats if runner.step_graphs is not None else None
        runner.close()
        return [out[i] for i in ids], stats

    want, _ = run(False)
    got, stats = run(True)
    assert got == want
    assert stats.captured >= 3 and stats.replayed > 2 * stats.captured and not stats.moved


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fused_kernels_on_the_gpu_give_the_torch_chains_values(dtype):
    """models/fused.py's kernels compiled for this GPU against the torch chains they replace at Llama-3.1-8B's widths:
    RoPE and the residual add bit for bit (each product and sum rounded where torch rounds), the norm and SwiGLU
    within two ulps of the dtype (a sum in another order, rounded twice; exp's own last bits)."""
    import torch.nn.functional as F

    from infinigen_rt.models import fused
    from infinigen_rt.models.llama import apply_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(4, 1, 4096, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = torch.randn(4096, generator=g, device="cuda").to(dtype)
    ulp = 2 * torch.finfo(dtype).eps

    def norm(z):
        return w * F.rms_norm(z.float(), w.shape, eps=1e-5).to(dtype)

    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), norm(x), rtol=ulp, atol=0)
    out, added = fused.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(added, x + y)
    torch.testing.assert_close(out, norm(x + y), rtol=ulp, atol=0)
    heads = torch.randn(4, 48, 1, 128, generator=g, device="cuda").to(dtype)
    cos, sin = (torch.randn(4, 1, 1, 128, generator=g, device="cuda").to(dtype) for _ in range(2))
    assert torch.equal(fused.rope(heads, cos, sin, 40), apply_rope(heads[:, :40], cos, sin))
    gate_up = torch.randn(4, 1, 2 * 14336, generator=g, device="cuda").to(dtype)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, rtol=ulp, atol=0)
