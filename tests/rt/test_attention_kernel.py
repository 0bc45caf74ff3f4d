"""Paged decode attention (kv/attention.py): the Triton kernel (TRITON_INTERPRET=1 on CPU tensors, set by conftest)
and its torch definition against plain SDPA over each sequence's own contiguous rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infinigen_rt.kv.attention import decode_sdpa, paged_decode_reference, run_kernel_on_cpu, splits
from infinigen_rt.kv.kernels import available
from tests.conftest import ROOT

BLOCK = 16


def paged_batch(lengths, hkv, d, dtype, gen, n_blocks=64):
    """Each sequence's rows [Hkv, len, D] and the same rows in a shared paged pool through a scattered table."""
    order = torch.randperm(n_blocks, generator=gen)
    k_pool = torch.randn(hkv, n_blocks * BLOCK, d, generator=gen).to(dtype)  # garbage where no sequence writes
    v_pool = torch.randn(hkv, n_blocks * BLOCK, d, generator=gen).to(dtype)
    max_blocks = max(-(-n // BLOCK) for n in lengths)
    table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    own, used = [], 0
    for i, n in enumerate(lengths):
        nb = -(-n // BLOCK)
        table[i, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        t = torch.arange(n)
        slots = table[i, t // BLOCK].long() * BLOCK + t % BLOCK
        k_pool[:, slots], v_pool[:, slots] = k.transpose(0, 1), v.transpose(0, 1)
        own.append((k.transpose(0, 1)[None], v.transpose(0, 1)[None]))
    return k_pool, v_pool, table, torch.tensor(lengths, dtype=torch.int32), own


def expected(q, own):
    return torch.cat([
        F.scaled_dot_product_attention(q[i : i + 1], k, v, enable_gqa=k.shape[1] != q.shape[1])
        for i, (k, v) in enumerate(own)
    ])  # fmt: skip


CASES = [
    ([37, 5, 300], 8, 2, 64, torch.float32),  # lengths that end inside a block; GQA of 4; more than one split
    ([1], 4, 4, 32, torch.float32),  # one token; one query head per KV head
    ([600, 17], 3, 1, 64, torch.float16),  # SmolLM2's group of 3 (padded to 16); fp16
    ([130, 700], 8, 2, 128, torch.bfloat16),  # bf16 tiles (the interpreter's products widened: kv/_triton.py)
    ([90], 2, 1, 256, torch.float16),  # Gemma 3's head_dim (tiles of WIDE_TOKENS)
]


@pytest.mark.parametrize("lengths, h, hkv, d, dtype", CASES)
def test_the_reference_equals_attention_over_each_sequences_own_rows(lengths, h, hkv, d, dtype):
    gen = torch.Generator().manual_seed(sum(lengths))
    k, v, table, lens, own = paged_batch(lengths, hkv, d, dtype, gen)
    q = torch.randn(len(lengths), h, 1, d, generator=gen).to(dtype)
    got = paged_decode_reference(q, k, v, table, lens, BLOCK, max(lengths), 1 / math.sqrt(d))
    torch.testing.assert_close(got.float(), expected(q, own).float(), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")
@pytest.mark.parametrize("lengths, h, hkv, d, dtype", CASES)
def test_the_kernel_equals_attention_over_each_sequences_own_rows(lengths, h, hkv, d, dtype):
    gen = torch.Generator().manual_seed(sum(lengths) + 1)
    k, v, table, lens, own = paged_batch(lengths, hkv, d, dtype, gen)
    q = torch.randn(len(lengths), h, 1, d, generator=gen).to(dtype)
    got = run_kernel_on_cpu(q, k, v, table, lens, BLOCK, max(lengths))
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # (bfloat16: a unit in the last place of 0.5 is 0.004)
    torch.testing.assert_close(got.float(), expected(q, own).float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (benchmarks/gpu.sh tests)")
@pytest.mark.parametrize("lengths, h, hkv, d, dtype", CASES)
def test_on_a_gpu_the_kernel_equals_attention_over_each_sequences_own_rows(lengths, h, hkv, d, dtype):
    """paged_decode compiled and run on a GPU (tensor-core products of 16-bit tiles; float32 rows without TF32)."""
    from infinigen_rt.kv.attention import paged_decode

    gen = torch.Generator().manual_seed(sum(lengths) + 2)
    k, v, table, lens, own = paged_batch(lengths, hkv, d, dtype, gen)
    q = torch.randn(len(lengths), h, 1, d, generator=gen).to(dtype)
    got = paged_decode(*(x.cuda() for x in (q, k, v, table, lens)), BLOCK, max(lengths))
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.cpu().float(), expected(q, own).float(), rtol=tol, atol=tol)


def test_the_context_is_split_to_fill_the_device_at_batch_1():
    split, n = splits(1, 8, 32768)  # Llama-3.1-8B at 1 x 32k: 8 KV heads
    assert 1 * 8 * n >= 132 and split * n >= 32768 and split & (split - 1) == 0
    assert splits(64, 8, 300) == (512, 1)  # a full batch of short contexts: no split


COMPILE = """
import json, sys, torch, triton
from pathlib import Path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from infinigen_rt.kv._attention_kernel import merge_splits_kernel, paged_decode_kernel
from infinigen_rt.kv.attention import kernel_meta
from tests.rt.test_kernels_aot import resource_usage, signature_of

cc, g, d, dtype, tmp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]), sys.argv[5]
b, hkv, block = 2, 8, 16
q = torch.empty(b, hkv, g, d, dtype=dtype)
k = v = torch.empty(hkv, 64 * block, d, dtype=dtype)
table, lengths = torch.zeros(b, 64, dtype=torch.int32), torch.full((b,), 700, dtype=torch.int32)
out_m = out_l = torch.empty(b, hkv, 3, g)
out_acc = torch.empty(b, hkv, 3, g, d)
args = (q, k, v, table, lengths, out_m, out_l, out_acc, 0.088, 3, 64, 64 * block)
meta = dict(HKV=hkv, **kernel_meta(g, d, dtype, block, 256))
target = GPUTarget("cuda", cc, 32)
jit, signature, constexprs, attrs, options = signature_of(paged_decode_kernel, args, meta, target)
kernel = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
out = torch.empty(b, hkv, g, d, dtype=dtype)
mjit, msig, mconst, mattrs, mopts = signature_of(merge_splits_kernel, (out_m, out_l, out_acc, out, 3),
                                                 dict(G=g, D=d, D_PAD=d, S_PAD=4), target)
merged = triton.compile(ASTSource(mjit, msig, mconst, mattrs), target=target, options=mopts.__dict__)
print(json.dumps({"signature": signature, "local": ".local" in kernel.asm["ptx"] + merged.asm["ptx"],
                  "usage": resource_usage(kernel.asm["cubin"], Path(tmp)), "merge_signature": msig}))
"""


@pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")
@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("g, d, dtype", [(4, 128, "bfloat16"), (1, 128, "float16"), (2, 256, "bfloat16")])
def test_the_kernel_compiles_for_sm80_and_sm90_without_spills(cc, g, d, dtype, tmp_path):
    """Llama-3.1-8B's group of 4 at head_dim 128 (bf16), Llama-2's group of 1 (fp16), Gemma 3's 256: the launches
    `paged_decode` makes (the kernel and its merge), compiled to cubin here (no GPU; in a process of its own, as the
    interpreter this suite runs kernels under replaces the compiler's loop), with no stack or local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", COMPILE, str(cc), str(g), str(d), dtype, str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["signature"]["n_splits"] in ("i32", "i64") and out["signature"]["max_blocks"] in ("i32", "i64")
    assert out["merge_signature"]["n_splits"] in ("i32", "i64")  # the merge kernel compiles too, unspecialised
    assert not out["local"]
    if out["usage"]:
        assert out["usage"].get("STACK", 0) == 0 and out["usage"].get("LOCAL", 0) == 0, out["usage"]
        assert out["usage"]["REG"] <= 192, out["usage"]  # (168 at a group of 4; 32 keys at a time took all 255)


@pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")
def test_on_the_gpu_path_under_fake_cuda_it_equals_the_reference_and_is_recorded():
    """paged_decode on cuda tensors (fake CUDA: the kernel through the interpreter) gives the reference's output, and
    the recorder prices the launch by the keys and values of its splits."""
    from infinigen_rt.kv.attention import paged_decode
    from infinigen_rt.measure.fakecuda import FakeCuda
    from infinigen_rt.measure.fakecuda import available as fake_available

    if fake_available():
        pytest.skip(fake_available())
    gen = torch.Generator().manual_seed(7)
    lengths, h, hkv, d = [37, 300], 8, 2, 64
    k, v, table, lens, own = paged_batch(lengths, hkv, d, torch.float32, gen)
    q = torch.randn(2, h, 1, d, generator=gen)
    want = expected(q, own)
    with FakeCuda() as gpu:
        dev = [x.to("cuda") for x in (q, k, v, table, lens)]
        with gpu.recording() as ops:
            got = paged_decode(*dev, BLOCK, max(lengths)).cpu()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    launches = [o for o in ops if o.kind == "triton"]
    assert [o.name for o in launches] == ["paged_decode_kernel", "merge_splits_kernel"]
    assert launches[0].hbm_bytes >= 2 * 2 * hkv * max(lengths) * d * 4  # every row's keys and values, once


@pytest.mark.parametrize("b, h, hkv, n", [(1, 9, 3, 1025), (4, 14, 2, 37), (2, 4, 4, 10), (3, 8, 1, 5)])
def test_decode_sdpa_on_a_cpu_is_sdpa_over_repeated_heads(b, h, hkv, n):
    """A KV head's query heads taken as query positions over its keys: SDPA with enable_gqa's outputs (float32
    rounding), with no mask, a mask per KV head, or one per sequence; a mask over the query heads is refused."""
    gen = torch.Generator().manual_seed(b * h + n)
    q, k, v = torch.randn(b, h, 1, 64, generator=gen), *torch.randn(2, b, hkv, n, 64, generator=gen)
    ok = torch.rand(b, hkv, 1, n, generator=gen) > 0.3
    ok[..., -1] = True  # the new token's row counts
    gqa = h != hkv
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    torch.testing.assert_close(decode_sdpa(q, k, v), want, rtol=1e-5, atol=2e-6)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=ok.repeat_interleave(h // hkv, 1), enable_gqa=gqa)
    torch.testing.assert_close(decode_sdpa(q, k, v, ok), want, rtol=1e-5, atol=2e-6)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=ok[:, :1], enable_gqa=gqa)
    torch.testing.assert_close(decode_sdpa(q, k, v, ok[:, :1]), want, rtol=1e-5, atol=2e-6)
    if gqa and hkv > 1:
        with pytest.raises(ValueError, match="KV heads"):
            decode_sdpa(q, k, v, ok.repeat_interleave(h // hkv, 1))

