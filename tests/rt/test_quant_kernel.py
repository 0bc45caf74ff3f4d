"""The low-bit key kernels (kv/_quant_kernel.py): scoring queries straight from packed codes, and quantizing new keys
into their slots, under Triton's interpreter (TRITON_INTERPRET=1 on CPU tensors, set by conftest; compiled on a GPU
where one is present) against the torch path a CPU runs; compiled ahead of time for sm_80 and sm_90 without spills;
priced by what they read under fake CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from infinigen_rt.kv import cpu as cpu_kernels
from infinigen_rt.kv import quant
from infinigen_rt.kv.kernels import available
from infinigen_rt.policies.speculation import key_group
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled where a GPU is present


def on(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x

# (bits, head_dim, group of query heads): SmolLM2's 64 and group of 3, Llama-3.1's 128 and 4, two bits, a tiny
# config's 16 (one group a row), Gemma 3's 256 with one query head a KV head
CASES = [(4, 64, 3), (4, 128, 4), (2, 64, 2), (4, 16, 1), (4, 256, 1)]


def codes_of(gen, r, hkv, slots, d, bits):
    group = key_group(d, bits)
    x = torch.randn(r, hkv, slots, d, generator=gen) * torch.linspace(0.1, 4, d)  # columns of very different size
    c, scale, lo = quant.quantize(x, group, bits)
    return c, torch.stack([scale, lo], -2), group


@pytest.mark.parametrize("bits, d, g", CASES)
def test_scoring_from_the_codes_equals_the_dequantized_keys_scores(bits, d, g):
    """Each form a caller has: slots through a table (the batch's store, rows of other lengths), one run of slots (a
    request alone), each sequence's own first slots (a request's own cache), and each (sequence, KV head) its own
    slots (the correction's shortlist) through a table or in a request's own rows."""
    gen = torch.Generator().manual_seed(bits * d + g)
    hkv, slots, b, t = 2, 90, 3, 70
    codes, meta, group = codes_of(gen, 1, hkv, slots, d, bits)
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.randint(0, slots, (b, t), generator=gen)
    pairs = torch.randint(0, slots, (b, hkv, t), generator=gen)
    own, own_meta, _ = codes_of(gen, b, hkv, slots, d, bits)
    for at, qq, c, m, n in [(idx, q, codes, meta, t), (slice(11, 11 + t), q[:1], codes, meta, t),
                            (pairs, q, codes, meta, t), (pairs, q, own, own_meta, t)]:  # fmt: skip
        want = quant.scores(qq, c, m, at, group, bits)  # the torch path (CPU tensors)
        got = quant._scores_kernel(on(qq), on(c), on(m), on(at), n, group, bits).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * d)
        if isinstance(at, torch.Tensor) and at.dim() == 3:  # against each pair's rows of the dequantized keys
            k = quant.dequantize(c, m[..., 0, :], m[..., 1, :], group, torch.float32, bits)
            rows = k.expand(b, -1, -1, -1).gather(2, at[..., None].expand(-1, -1, -1, d))
            torch.testing.assert_close(got, qq @ rows.transpose(-1, -2), rtol=1e-4, atol=1e-3 * d)
    want = quant.scores(q, own, own_meta, t, group, bits)
    got = quant._scores_kernel(on(q), on(own), on(own_meta), t, t, group, bits).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * d)
    for dtype in (torch.float16, torch.bfloat16):  # a query in the model's dtype (no cast op): one product in it,
        half = q.to(dtype)  # exact (a code times a 16-bit value is exact in float32), as the three of a float32 query
        got = quant._scores_kernel(on(half), on(own), on(own_meta), t, t, group, bits).cpu()
        wide = quant._scores_kernel(on(half.float()), on(own), on(own_meta), t, t, group, bits).cpu()
        if DEVICE.type == "cpu":  # the interpreter sums both in float32 alike
            assert torch.equal(got, wide)
        torch.testing.assert_close(got, wide, rtol=1e-5, atol=1e-5 * d)  # (on a GPU: the sums' order may differ)
        torch.testing.assert_close(got, quant.scores(half, own, own_meta, t, group, bits), rtol=1e-4, atol=1e-4 * d)


@pytest.mark.parametrize("d, g", [(64, 7), (128, 6), (16, 1)])
def test_scoring_per_channel_codes_equals_the_torch_paths_scores(d, g, monkeypatch):
    """The kernel with a scale per channel over each 16 slots (ChannelKeys, `int4c`: Qwen2.5-Coder's 7 and 6 query
    heads a KV head at head_dim 64 and 128) against the store's float32 scores on the CPU (cpu.INTEGER off: the
    GPU's kernel scores in float32), in every form a caller has: each sequence's own first slots, one run of slots,
    slots through a table, each (sequence, KV head) its own."""
    monkeypatch.setattr(cpu_kernels, "INTEGER", False)
    from types import SimpleNamespace

    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, ChannelKeys

    gen = torch.Generator().manual_seed(d + g)
    hkv, b, t = 2, 3, 70
    spec = SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv))
    k = torch.randn(b, hkv, 90, d, generator=gen) * torch.linspace(0.1, 4, d)
    k[..., :2] += 30.0  # two outlier channels, as Qwen's keys carry
    own, one = ChannelKeys(spec, [0], b, 90, "cpu", torch.float32), ChannelKeys(spec, [0], 1, 96, "cpu", torch.float32)
    own.write(0, k, 0)
    one.write(0, k[:1], 0)
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.randint(0, 90, (b, t), generator=gen)
    pairs = torch.randint(0, 90, (b, hkv, t), generator=gen)
    for store, at, qq in [(own, t, q), (one, slice(11, 11 + t), q[:1]), (one, idx, q), (one, pairs, q),
                          (own, pairs, q)]:  # fmt: skip
        want = store.scores_at(0, qq, at)  # the torch path (CPU tensors)
        got = quant._scores_kernel(on(qq), on(store.codes[0]), on(store.meta[0]), on(at), t, d, 4,
                                   CHANNEL_TOKENS).cpu()  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * d)


@pytest.mark.parametrize("d", [64, 128, 16])
@pytest.mark.parametrize("appends", [None, True, "mask"])
def test_a_new_key_into_its_run_of_per_channel_codes_writes_what_torch_writes_bit_for_bit(d, appends):
    """ChannelKeys' write kernel (a program a new row: its run dequantized, the key put in, the run quantized again
    over its held slots) against the store's torch path, on a store already holding keys with outlier channels and
    a page another sequence left: codes, scales and held flags equal, each row in a run of its own; the new keys
    into freed slots (None), appended (True: the run's later slots dropped) or some of each."""
    from types import SimpleNamespace

    from infinigen_rt.kv._quant_kernel import quantize_channel_kernel
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, ChannelKeys

    gen = torch.Generator().manual_seed(d)
    r, hkv, slots = 2, 3, 64
    spec = SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv))
    want = ChannelKeys(spec, [0], r, slots, "cpu", torch.float32)
    keys = torch.randn(r, hkv, slots, d, generator=gen) * torch.linspace(0.1, 4, d)
    keys[..., :2] += 25.0
    want.write(0, keys[:, :, :40], 0)
    want.write(0, keys[:, :, 48:50] * 9, 48)  # another sequence's keys in the last page
    got_c, got_m, got_h = want.codes[0].clone(), want.meta[0].clone(), want.held[0].clone()
    runs = torch.stack([torch.randperm(slots // CHANNEL_TOKENS, generator=gen)[:1] for _ in range(r * hkv)])
    at = (runs * CHANNEL_TOKENS + torch.randint(0, CHANNEL_TOKENS, (r * hkv, 1), generator=gen)).view(r, hkv, 1)
    x = torch.randn(r, hkv, 1, d, generator=gen) * 3
    flags = torch.rand(r, 1, 1, generator=gen) < 0.5 if appends == "mask" else appends
    want.write(0, x, at, distinct=True, appends=flags)
    mode = 2 if appends == "mask" else int(bool(appends))
    held = got_h.view(torch.uint8)
    quantize_channel_kernel[(r * hkv,)](
        x, at, flags.expand(r, hkv, 1).contiguous().view(torch.uint8) if mode == 2 else held, got_c, got_m, held, 1,
        slots, D=d, RUN=CHANNEL_TOKENS, APPENDS=mode, TINY=quant.FP16_TINY)  # fmt: skip
    assert torch.equal(got_h, want.held[0]) and torch.equal(got_m, want.meta[0]) and torch.equal(got_c, want.codes[0])


@pytest.mark.parametrize("bits, d", [(4, 64), (4, 128), (2, 64), (4, 16), (4, 256)])
def test_quantizing_into_slots_writes_the_codes_torch_writes_bit_for_bit(bits, d):
    """Every row into its own slot (each sequence and KV head its own), ties rounded to even as torch.round does (a
    group spanning 0..15 at 4 bits puts x.5 values exactly half-way), the other slots left as they were."""
    import triton

    from infinigen_rt.kv._quant_kernel import quantize_rows_kernel

    gen = torch.Generator().manual_seed(d + bits)
    r, hkv, s, slots = 2, 3, 5, 24
    group = key_group(d, bits)
    x = torch.randn(r, hkv, s, d, generator=gen) * torch.linspace(0.1, 4, d)
    top = 2**bits - 1
    ties = torch.arange(d) % (top + 1) + 0.5  # a group spanning 0.5..top+0.5: scale 1, every value a tie
    ties[::group], ties[group - 1 :: group] = 0.0, float(top)
    x[0, 0, 0] = ties
    at = torch.stack([torch.randperm(slots, generator=gen)[:s] for _ in range(r * hkv)]).view(r, hkv, s)
    shape = (r, hkv, slots)
    want_c = torch.randint(0, 255, (*shape, d * bits // 8), dtype=torch.uint8, generator=gen)
    want_m = torch.randn(*shape, 2, d // group, generator=gen).half()
    got_c, got_m = on(want_c.clone()), on(want_m.clone())
    quant.store(x, want_c, want_m, at, group, bits)  # the torch path
    total = r * hkv * s
    quantize_rows_kernel[(triton.cdiv(total, quant.QUANT_ROWS),)](
        on(x), on(at), got_c, got_m, total, s, slots, hkv * s, s, D=d, GROUP=group, BITS=bits, ROWS=quant.QUANT_ROWS,
        HKV=hkv)  # fmt: skip
    assert torch.equal(got_c.cpu(), want_c) and torch.equal(got_m.cpu(), want_m)
    # every KV head's row into the same slots (a store's new tokens: an expanded view, read in place by the op)
    same = at[:, :1].expand(r, hkv, s)
    quant.store(x, want_c, want_m, same.contiguous(), group, bits)
    quant.quantize_rows(on(x), on(same), got_c, got_m, group, bits)
    assert torch.equal(got_c.cpu(), want_c) and torch.equal(got_m.cpu(), want_m)


COMPILE = """
import json, sys, torch, triton
from pathlib import Path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from infinigen_rt.kv import quant
from infinigen_rt.kv._quant_kernel import quantize_channel_kernel, quantize_rows_kernel, score_codes_kernel
from infinigen_rt.policies.speculation import key_group
from tests.rt.test_kernels_aot import resource_usage, signature_of

(cc, g, d, bits), tmp = (int(x) for x in sys.argv[1:5]), sys.argv[5]
group, hkv, slots, b, t = key_group(d, bits), 8, 4096, 2, 700
q = torch.empty(b, hkv, g, d)
codes = torch.empty(1, hkv, slots, d * bits // 8, dtype=torch.uint8)
meta = torch.empty(1, hkv, slots, 2, d // group, dtype=torch.float16)
idx, out = torch.empty(b, t, dtype=torch.int64), torch.empty(b, hkv, g, t)
target = GPUTarget("cuda", cc, 32)
usage, ptx, sigs = [], "", []
for kernel, args, meta_ in [
    (score_codes_kernel, (q, codes, meta, idx, out, t, slots, 0),
     dict(BATCH_ROWS=False, HKV=hkv, HAS_SLOTS=True, **quant.score_meta(g, d, group, bits))),
    (quantize_rows_kernel, (torch.empty(1, hkv, b, d, dtype=torch.bfloat16), idx, codes, meta, hkv * b, b, slots, b,
                            0), dict(D=d, GROUP=group, BITS=bits, ROWS=quant.QUANT_ROWS, HKV=hkv)),
    # each (sequence, KV head) its own slots [B, Hkv, t]: the correction's shortlist, a capacity's evicted slots
    (score_codes_kernel, (q, codes, meta, torch.empty(b, hkv, t, dtype=torch.int64), out, t, slots, 0),
     dict(BATCH_ROWS=False, HKV=hkv, HAS_SLOTS=True, PAIR_SLOTS=True, **quant.score_meta(g, d, group, bits))),
    # ChannelKeys' write: a new key into its run, the run quantized again
    (quantize_channel_kernel, (torch.empty(1, hkv, b, d, dtype=torch.bfloat16), idx, codes, codes, meta, codes, b,
                               slots), dict(D=d, RUN=16, APPENDS=2, TINY=quant.FP16_TINY)),
    # a scale per channel over each 16 slots (ChannelKeys), through a table
    (score_codes_kernel, (q, codes, torch.empty(1, hkv, slots // 16, 2, d, dtype=torch.float16), idx, out, t, slots, 0),
     dict(BATCH_ROWS=False, HKV=hkv, HAS_SLOTS=True, **quant.score_meta(g, d, d, 4, run=16))),
    # a query in the model's 16-bit dtype: one product in it (HALF)
    (score_codes_kernel, (q.half(), codes, meta, idx, out, t, slots, 0),
     dict(BATCH_ROWS=False, HKV=hkv, HAS_SLOTS=True, **quant.score_meta(g, d, group, bits, half=True))),
]:
    jit, signature, constexprs, attrs, options = signature_of(kernel, args, meta_, target)
    k = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
    usage.append({**resource_usage(k.asm["cubin"], Path(tmp)), "dynamic_shared": k.metadata.shared})
    ptx += k.asm["ptx"]
    sigs.append(signature)
print(json.dumps({"signatures": sigs, "local": ".local" in ptx, "usage": usage}))
"""


SHARED_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}  # the most shared memory a block may hold: A100, H100
# the launches (by their place in COMPILE's list) that spill at head_dim 256: on sm_80 every tf32 scoring (the plain,
# the pairs' and the per-channel one), on sm_90 the per-channel one
SPILLS_AT_256 = {80: {0, 2, 4}, 90: {4}}


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("g, d, bits", [(4, 128, 4), (3, 64, 4), (1, 256, 4), (4, 128, 2)])
def test_the_kernels_compile_for_sm80_and_sm90_without_spills(cc, g, d, bits, tmp_path):
    """Llama-3.1-8B's group of 4 at head_dim 128, SmolLM2's 3 at 64, Gemma 3's 256, and two bits: both kernels as
    quant.py launches them (the scoring also with each pair's own slots, PAIR_SLOTS, and with a scale per channel
    over each 16 slots, CHANNEL, whose write kernel too), compiled to cubin here (no
    GPU; in a process of its own, as the interpreter this suite runs kernels under replaces the compiler's loop),
    with no stack or local memory, the counts unspecialised, within the shared memory a block may hold. The one
    exception: head_dim 256, where on sm_80 the scoring kernel's [TOKENS, 256] tile and its tf32 parts spill a few
    hundred bytes at every launch configuration tried, per channel about 2 KB, and on sm_90 per channel a few hundred
    (its tile of 64 keys formed in float32 took 233 KiB of shared memory: a launch refused); a 16-bit query's one
    product (HALF) spills nowhere."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", COMPILE, str(cc), str(g), str(d), str(bits), str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    score, quantize, pairs, channel_write, channel, half = out["signatures"]
    assert channel_write["n_new"] in ("i32", "i64") and channel_write["n_slots"] in ("i32", "i64")
    for sig in (score, pairs, channel, half):
        assert sig["n_tok"] in ("i32", "i64") and sig["n_slots"] in ("i32", "i64") and sig["start"] in ("i32", "i64")
    assert quantize["total"] in ("i32", "i64") and quantize["n_new"] in ("i32", "i64")
    assert not out["local"]
    for i, usage in enumerate(out["usage"]):
        if usage and not (d == 256 and i in SPILLS_AT_256[cc]):
            assert usage.get("STACK", 0) == 0 and usage.get("LOCAL", 0) == 0, usage
        assert usage["dynamic_shared"] <= SHARED_PER_BLOCK[cc], (i, usage)  # else the launch fails on the GPU
    # a 16-bit query's one product: its operand's bytes a quarter of the three's (on sm_90 they pass through shared
    # memory to the matrix units), and fewer registers
    assert out["usage"][5]["dynamic_shared"] <= out["usage"][0]["dynamic_shared"] / (3 if cc == 90 else 1.5)
    assert out["usage"][5].get("REG", 0) <= out["usage"][0].get("REG", 0)


def test_on_the_gpu_path_under_fake_cuda_one_launch_scores_and_reads_only_the_rows_it_scores():
    """quant.scores and quant.store on cuda tensors (fake CUDA: the kernels through the interpreter) give the CPU's
    results in one launch each; the scoring is priced by the codes of the rows it scores, not by the store's size."""
    from infinigen_rt.measure.fakecuda import FakeCuda
    from infinigen_rt.measure.fakecuda import available as fake_available

    if fake_available():
        pytest.skip(fake_available())
    gen = torch.Generator().manual_seed(3)
    bits, d, g, hkv, slots, b, t = 4, 64, 3, 2, 4096, 2, 100
    codes, meta, group = codes_of(gen, 1, hkv, slots, d, bits)
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.randint(0, slots, (b, t), generator=gen)
    x = torch.randn(1, hkv, b, d, generator=gen)
    at = torch.randint(0, slots, (1, hkv, b), generator=gen)
    want = quant.scores(q, codes, meta, idx, group, bits)
    want_c, want_m = codes.clone(), meta.clone()
    quant.store(x, want_c, want_m, at, group, bits)
    with FakeCuda() as gpu:
        dev = [y.to("cuda") for y in (q, codes, meta, idx, x, at)]
        with gpu.recording() as ops:
            got = quant.scores(*dev[:4], group, bits)
            quant.store(dev[4], dev[1], dev[2], dev[5], group, bits)
        got, got_c, got_m = got.cpu(), dev[1].cpu(), dev[2].cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)
    assert torch.equal(got_c, want_c) and torch.equal(got_m, want_m)
    launches = [o for o in ops if o.kind == "triton"]
    assert [o.name for o in launches] == ["score_codes_kernel", "quantize_rows_kernel"]
    row = d * bits // 8 + 4 * (d // group)
    assert b * hkv * t * row <= launches[0].hbm_bytes < codes.numel() + meta.numel() * 2  # not the whole store


def test_per_channel_keys_on_the_gpu_path_write_in_one_launch_and_score_in_one(monkeypatch):
    """ChannelKeys on cuda tensors (fake CUDA: the kernels through the interpreter): a prompt chunk whose keys share
    runs goes in without a device read (its runs sorted), a decode step's new keys (one a sequence,
    through the batch's store's flat slots) with one launch, scored with one; the codes and scores those of the
    CPU's float32 path (unique's runs; cpu.INTEGER off); each launch priced by the runs it touches, not the store's
    size."""
    monkeypatch.setattr(cpu_kernels, "INTEGER", False)
    from types import SimpleNamespace

    from infinigen_rt.measure.fakecuda import FakeCuda
    from infinigen_rt.measure.fakecuda import available as fake_available
    from infinigen_rt.policies.speculation import ChannelKeys

    if fake_available():
        pytest.skip(fake_available())
    gen = torch.Generator().manual_seed(5)
    hkv, d, g, slots, b = 2, 64, 7, 4096, 3
    spec = SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv))
    cpu = ChannelKeys(spec, [0], 1, slots, "cpu", torch.float32)
    cpu.write(0, torch.randn(1, hkv, 100, d, generator=gen) + 20 * (torch.arange(d) < 2), 0)
    x = torch.randn(1, hkv, b, d, generator=gen)
    at = torch.tensor([100, 1000, 2000]).view(1, 1, b).expand(1, hkv, b).contiguous()
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.stack([torch.arange(101), torch.arange(101) + 1000, torch.arange(101) + 2000]) % slots
    prompt = torch.randn(1, hkv, 250, d, generator=gen)  # a prompt chunk from slot 3000 (mid-run): runs shared
    prompt_at = torch.arange(3000, 3250).view(1, 1, -1).expand(1, hkv, -1).contiguous()
    with FakeCuda() as gpu:
        dev = ChannelKeys(spec, [0], 1, slots, "cuda", torch.float32)
        for name in ("codes", "meta", "held"):
            getattr(dev, name)[0].copy_(getattr(cpu, name)[0].to("cuda"))
        dev.write(0, prompt.to("cuda"), prompt_at.to("cuda"), appends=True)  # no device read: sorted, not unique
        with gpu.recording() as ops:
            dev.write(0, x.to("cuda"), at.to("cuda"), distinct=True, appends=True)
            got = dev.scores_at(0, q.to("cuda"), idx.to("cuda")).cpu()
        got_c = dev.codes[0].cpu()
    cpu.write(0, prompt, prompt_at, appends=True)
    cpu.write(0, x, at, distinct=True, appends=True)
    assert torch.equal(got_c, cpu.codes[0])
    torch.testing.assert_close(got, cpu.scores_at(0, q, idx), rtol=1e-4, atol=1e-3)
    launches = [o for o in ops if o.kind == "triton"]
    assert [o.name for o in launches] == ["quantize_channel_kernel", "score_codes_kernel"]
    assert launches[0].hbm_bytes < 2 * b * hkv * (16 * d + 4 * d)  # three runs a head, not the 4096 slots


def test_a_gpu_prefill_writes_int4c_keys_in_whole_runs_within_the_bound():
    """ChannelKeys.write on a GPU puts a prompt's keys in a span at a time: whole runs of CHANNEL_TOKENS (else the
    run at a span's end would be quantized twice), at least WRITE_SPAN, the runs it forms within WRITE_BYTES."""
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, WRITE_BYTES, WRITE_SPAN, write_span

    # SmolLM2 (3 KV heads, 64), Qwen 0.5B (2, 64), Gemma 3 270M (1, 256), Llama-3.1-8B (8, 128), Llama-2-7B (32, 128)
    for pairs, d, want in ((3, 64, 5456), (2, 64, 8192), (1, 256, 4096), (8, 128, 1024), (32, 128, 256)):
        span = write_span(pairs, d)
        assert span == want and span % CHANNEL_TOKENS == 0 and span >= WRITE_SPAN
        assert span == WRITE_SPAN or span * pairs * CHANNEL_TOKENS * d * 4 <= WRITE_BYTES
