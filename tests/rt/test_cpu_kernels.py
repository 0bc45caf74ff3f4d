"""The CPU's native kernels (kv/_cpu_kernels.c, typed torch operators through kv/_cpu_ops.cpp, built on first use
by kv/cpu_build.py): scoring queries against low-bit keys without forming them, quantizing new keys into their slots,
the selection's group softmax and top-k, the row gather, against the torch path and a float64 reference; every
instruction set's variant against the others; an operator's tensors checked before its kernel reads them, its call
releasing the GIL; hostile slots; the build's cache, its fallbacks and what a failed build leaves behind; a cache
others could write, a library planted or cut short there, a compiler that writes junk, a CC that is not found."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infinigen_rt.kv import cpu, cpu_build, quant
from infinigen_rt.policies.speculation import key_group

needs_kernel = pytest.mark.skipif(cpu.library() is None, reason=f"no CPU kernel: {cpu.reason()}")

# (bits, head_dim, query heads a KV head): SmolLM2's 64 and 3, Llama-3.1's 128 and 4, two bits, Gemma 3's 256 and 1,
# a head_dim no 64 divides (one group a row: the generic loop), a group of 5 (padded to fours in the AVX2 loop)
CASES = [(4, 64, 3), (4, 128, 4), (2, 64, 2), (4, 256, 1), (4, 96, 3), (4, 64, 5), (2, 128, 8)]


def codes_of(gen, r, hkv, slots, d, bits):
    group = key_group(d, bits)
    x = torch.randn(r, hkv, slots, d, generator=gen) * torch.linspace(0.1, 4, d)  # columns of very different size
    c, scale, lo = quant.quantize(x, group, bits)
    return c, torch.stack([scale, lo], -2).contiguous(), group


def reference(q, codes, meta, slots, group, bits):
    """float64: q [B, Hkv, G, D] against the dequantized keys of rows slots [B, T] (or each pair's [B, Hkv, T]) of
    codes [R, Hkv, S, bytes]."""
    k = quant.dequantize(codes, meta[..., 0, :], meta[..., 1, :], group, torch.float64, bits)  # [R, Hkv, S, D]
    b, hkv = q.shape[:2]
    if slots.dim() == 3:
        rows = torch.stack([torch.stack([k[i if k.shape[0] > 1 else 0][h][slots[i, h]] for h in range(hkv)])
                            for i in range(b)])  # fmt: skip
        return q.double() @ rows.transpose(-1, -2)
    rows = k[0][:, slots] if k.shape[0] == 1 else torch.stack([k[i][:, slots[i]] for i in range(b)])
    if k.shape[0] == 1:
        rows = rows.permute(1, 0, 2, 3)  # [B, Hkv, T, D]
    return q.double() @ rows.transpose(-1, -2)


@needs_kernel
@pytest.mark.parametrize("bits, d, g", CASES)
def test_the_kernel_scores_as_the_torch_path_and_the_float64_reference(bits, d, g, monkeypatch):
    """Every form a caller has: slots through a table (the batch's store), one run of slots (a request alone), and
    each sequence's own first slots (a request's own cache), and each (sequence, KV head) its own slots (the
    correction's shortlist, through a table or in a request's own rows); split over threads or not."""
    gen = torch.Generator().manual_seed(bits * d + g)
    hkv, n_slots, b, t = 3, 300, 3, 257
    codes, meta, group = codes_of(gen, 1, hkv, n_slots, d, bits)
    own, own_meta, _ = codes_of(gen, b, hkv, n_slots, d, bits)
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.randint(0, n_slots, (b, t), generator=gen)
    run = slice(11, 11 + t)
    pairs = torch.randint(0, n_slots, (b, hkv, t), generator=gen)
    forms = [(q, codes, meta, idx, idx), (q[:1], codes, meta, run, torch.arange(11, 11 + t)[None]),
             (q, own, own_meta, t, torch.arange(t).expand(b, t)), (q, codes, meta, pairs, pairs),
             (q, own, own_meta, pairs, pairs)]  # fmt: skip
    for split in (1 << 30, 1):
        for qq, c, m, at, slots in forms:
            monkeypatch.setattr(cpu, "SPLIT_WORK", split)
            got = cpu.score_codes(qq, c, m, at, t, group, bits)
            with cpu.disabled():
                torch_path = quant.scores(qq, c, m, at, group, bits)
            ref = reference(qq, c, m, slots, group, bits)
            assert got is not None and got.shape == ref.shape and got.dtype == torch.float32
            assert torch.isfinite(got).all()
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
            torch.testing.assert_close(got, torch_path, rtol=1e-4, atol=1e-4 * d)
            if bits == 4:  # what a CPU's quant.scores runs (at 2 bits the torch path: the faster there)
                assert torch.equal(quant.scores(qq, c, m, at, group, bits), got)


def channel_store(gen, r, hkv, slots, d):
    """ChannelKeys' tensors with every slot written (keys with a few huge channels, as Qwen's biases make)."""
    from types import SimpleNamespace

    from infinigen_rt.policies.speculation import ChannelKeys

    store = ChannelKeys(SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv)), [0], r, slots,
                        "cpu", torch.float32)  # fmt: skip
    k = torch.randn(r, hkv, slots, d, generator=gen) * torch.linspace(0.1, 4, d)
    k[..., :3] += 40.0
    with cpu.disabled():
        store.write(0, k, 0)
    return store


@needs_kernel
@pytest.mark.parametrize("d, g", [(64, 7), (128, 6), (64, 1), (96, 3), (256, 2)])
def test_the_per_channel_kernel_scores_as_the_torch_path(d, g, monkeypatch):
    """int4c's keys (a scale and minimum per channel and run of 16 slots) scored by the kernel in every form a caller
    has, split over threads or not: the torch path's scores (which form the keys) within float32 rounding, and a
    float64 reference's. Qwen's 0.5B is (64, 7), its 1.5B (128, 6)."""
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS

    monkeypatch.setattr(cpu, "INTEGER", False)  # (the integer path: the test after this one)
    gen = torch.Generator().manual_seed(d + g)
    hkv, n_slots, b, t = 2, 320, 3, 257
    shared, own = channel_store(gen, 1, hkv, n_slots, d), channel_store(gen, b, hkv, n_slots, d)
    q = torch.randn(b, hkv, g, d, generator=gen)
    idx = torch.randint(0, n_slots, (b, t), generator=gen)
    pairs = torch.randint(0, n_slots, (b, hkv, t), generator=gen)
    forms = [(q, shared, idx), (q[:1], shared, slice(11, 11 + t)), (q, own, t), (q, shared, pairs), (q, own, pairs)]
    for split in (1 << 30, 1):
        for qq, store, at in forms:
            monkeypatch.setattr(cpu, "SPLIT_WORK", split)
            n = at if isinstance(at, int) else at.stop - at.start if isinstance(at, slice) else at.shape[-1]
            got = cpu.score_channel(qq, store.codes[0], store.meta[0], at, n, CHANNEL_TOKENS)
            with cpu.disabled():
                torch_path = store.scores_at(0, qq.double(), at).double()
            assert got is not None and got.shape == torch_path.shape and got.dtype == torch.float32
            assert ((got.double() - torch_path).norm() / torch_path.norm()).item() < 1e-5
            assert torch.equal(store.scores_at(0, qq, at), got)  # what a CPU's store runs


def integer_reference(q, store, t):
    """What the integer path computes for each row's first t slots (t a multiple of 16: whole runs), in torch: per
    run and query head, w = q x scale, u = max |w| / 127 and the integers round(w / u); score = u x (those .
    codes), exact in int64, + q . minimum."""
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS

    codes, meta = store.codes[0][:, :, :t], store.meta[0][:, :, : t // CHANNEL_TOKENS].float()
    c = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()  # [R, Hkv, t, D]: column 2p low, 2p + 1 high
    scale, low = meta[..., 0, :], meta[..., 1, :]  # [R, Hkv, runs, D]
    w = q[:, :, :, None] * scale[:, :, None]  # [B, Hkv, G, runs, D]
    m = w.abs().amax(-1, keepdim=True)
    ints = torch.round(w * (127 / m)).long()
    runs = c.view(*c.shape[:2], -1, CHANNEL_TOKENS, c.shape[-1])  # [R, Hkv, runs, 16, D]
    dots = torch.einsum("bhgrd,bhrkd->bhgrk", ints, runs.expand(q.shape[0], -1, -1, -1, -1))
    bias = torch.einsum("bhgd,bhrd->bhgr", q.double(), low.double().expand(q.shape[0], -1, -1, -1))
    return (dots.double() * (m / 127).double() + bias[..., None]).flatten(-2)


@needs_kernel
@pytest.mark.parametrize("d, g", [(64, 3), (64, 7), (128, 4), (256, 2)])
def test_integer_scores_are_the_query_folded_into_int8_and_within_half_a_step_of_the_float_ones(d, g, monkeypatch):
    """cpu.INTEGER on a machine with AVX-512 VNNI: each key scores by integer dot products against the query folded
    with its run's scales in int8 (a step u per run and query head: its largest |q x scale| / 127). The scores are
    integer_reference's (the integers exact, float32 rounding after), each the float path's within 0.5 u x the sum
    of its codes <= 7.5 u D, and a key's score is the same in every slot form, bit for bit, whatever its
    neighbours in the call."""
    if not cpu.library().integer_scores():
        pytest.skip("this machine has no AVX-512 VNNI: the float path is the only one")
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS

    gen = torch.Generator().manual_seed(d * g)
    hkv, n_slots, b, t = 2, 320, 3, 256
    shared, own = channel_store(gen, 1, hkv, n_slots, d), channel_store(gen, b, hkv, n_slots, d)
    q = torch.randn(b, hkv, g, d, generator=gen)
    q[..., 0] *= 30  # a query channel far above the others
    scattered = torch.arange(0, 2 * t, 2)[None].expand(b, t) % n_slots  # no two slots in a row
    forms = [(q, own, t), (q[:1], shared, slice(0, t)), (q, shared, torch.arange(t)[None].expand(b, t)),
             (q, own, torch.randint(0, n_slots, (b, hkv, t), generator=gen)), (q, shared, scattered)]  # fmt: skip
    every = {}
    for qq, store, at in forms:
        n = at if isinstance(at, int) else at.stop - at.start if isinstance(at, slice) else at.shape[-1]
        monkeypatch.setattr(cpu, "INTEGER", False)
        want = cpu.score_channel(qq, store.codes[0], store.meta[0], at, n, CHANNEL_TOKENS)
        assert not cpu.integer_scores()
        monkeypatch.setattr(cpu, "INTEGER", True)
        assert cpu.integer_scores()
        got = cpu.score_channel(qq, store.codes[0], store.meta[0], at, n, CHANNEL_TOKENS)
        scale = store.meta[0][:, :, :, 0].float().amax(2)[:, :, None]  # every run's: >= the scored runs'
        step = (qq.abs() * scale).amax(-1, keepdim=True) / 127  # [B, Hkv, G, 1]
        assert (got - want).abs().le(0.5 * step * 15 * d + 1e-5 * want.abs() + 1e-4).all()
        assert not torch.equal(got, want)
        if not isinstance(at, torch.Tensor) or at is not scattered and at.dim() == 2:  # each row's first t slots
            ref = integer_reference(qq, store, t)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6
            every[id(store)] = got
    # the same keys named one by one, every other slot: their scores in the first t slots' call, bit for bit
    k = t // 4
    assert torch.equal(got[..., :k], every[id(shared)][..., : 2 * k : 2])


@needs_kernel
@pytest.mark.parametrize("d", [64, 256, 6])
@pytest.mark.parametrize("appends", [None, True, "mask"])
def test_new_keys_into_per_channel_runs_through_the_kernel_write_what_torch_writes_bit_for_bit(d, appends, monkeypatch):
    """int4c's writes on a CPU (a new key per run: the run dequantized, the key put in, each column quantized again
    over the run's held slots) against the torch path, from a store holding keys with outlier channels and a page
    another sequence left: a key per (row, KV head) into freed slots (None), appended (True: the run's later slots
    dropped) or some of each; then a sequence's decode steps, one new key after another, across a run's end.
    Codes, scales, minimums and held flags equal bit for bit; a slot outside is an error."""
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, ChannelKeys

    gen = torch.Generator().manual_seed(d)
    r, hkv, slots = 2, 3, 64
    spec = SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv))
    stores = [ChannelKeys(spec, [0], r, slots, "cpu", torch.float32) for _ in range(2)]
    keys = torch.randn(r, hkv, slots, d, generator=gen) * torch.linspace(0.1, 4, d)
    keys[..., :2] += 25.0
    runs = torch.stack([torch.randperm(slots // CHANNEL_TOKENS, generator=gen)[:1] for _ in range(r * hkv)])
    at = (runs * CHANNEL_TOKENS + torch.randint(0, CHANNEL_TOKENS, (r * hkv, 1), generator=gen)).view(r, hkv, 1)
    x = torch.randn(r, hkv, 1, d, generator=gen) * 3
    flags = torch.rand(r, 1, 1, generator=gen) < 0.5 if appends == "mask" else appends
    taken, kernel = [], cpu.quantize_channel
    monkeypatch.setattr(cpu, "quantize_channel", lambda *a: taken.append(kernel(*a)) or taken[-1])
    for i, store in enumerate(stores):
        with cpu.disabled():  # (the prefill's many keys a write: the torch path either way)
            store.write(0, keys[:, :, :27], 0)
            store.write(0, keys[:, :, 48:50] * 9, 48)  # another sequence's keys in the last page
        with cpu.disabled() if i == 0 else nullcontext():
            store.write(0, x, at, distinct=True, appends=flags)
            for t in range(27, 36):  # decode steps: a key a row at slot t, run 1 ending at 31
                store.write(0, keys[:, :, t : t + 1], t)
    want, got = stores
    assert taken == [False] * 10 + [True] * 10  # the second store's ten writes, each through the kernel
    assert torch.equal(got.held[0], want.held[0]) and torch.equal(got.meta[0], want.meta[0])
    assert torch.equal(got.codes[0], want.codes[0])
    before = [t.clone() for t in (got.codes[0], got.meta[0], got.held[0])]
    bad = at.clone()
    bad[-1, -1, 0] = slots  # the last key's slot outside: nothing written, the first keys' neither
    with pytest.raises(IndexError, match="slot outside"):
        got.write(0, x, bad, distinct=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (got.codes[0], got.meta[0], got.held[0]), strict=True))


def every_op() -> dict[str, torch.Tensor | None]:
    """Every CPU operator through its cpu.py function on the same inputs (seeded), in the variant this process runs
    (None where it does not take them: its caller's torch path runs), and under "<name>/torch" the torch path's
    result (or a float64 reference's) for the same. What test_every_variant_gives_every_ops_results_to_float32_rounding
    compares across the variants, each in a process of its own."""
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS, ChannelKeys

    gen = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor | None] = {}
    for bits, d, g in [(4, 64, 3), (2, 128, 4), (4, 96, 2)]:  # the AVX2 loop (4 bits, G >= 3), the specialised, none
        codes, meta, group = codes_of(gen, 1, 2, 300, d, bits)
        q, idx = torch.randn(2, 2, g, d, generator=gen), torch.randint(0, 300, (2, 257), generator=gen)
        out[f"score_codes {bits} {d}"] = cpu.score_codes(q, codes, meta, idx, 257, group, bits)
        out[f"score_codes {bits} {d}/torch"] = reference(q, codes, meta, idx, group, bits).float()
    store = channel_store(gen, 1, 2, 320, 64)
    before = cpu.INTEGER
    try:
        for integer, g in [(False, 7), (True, 3)]:
            cpu.INTEGER = integer
            q, idx = torch.randn(2, 2, g, 64, generator=gen), torch.randint(0, 320, (2, 256), generator=gen)
            name = f"score_channel {'integer' if integer and cpu.integer_scores() else 'float'} {g}"
            out[name] = cpu.score_channel(q, store.codes[0], store.meta[0], idx, 256, CHANNEL_TOKENS)
            with cpu.disabled():
                out[f"{name}/torch"] = store.scores_at(0, q.double(), idx).float()
        cpu.INTEGER = False  # (below: the float path's scores in every variant)
        q = torch.randn(3, 2, 3, 64, generator=gen)
        at = torch.stack([torch.randperm(320, generator=gen)[:300] for _ in range(3)])
        spec = cpu.speculate_channel(q, store.codes[0], store.meta[0], at, 300, CHANNEL_TOKENS, 4, 8, 40)
        out["speculate_channel"] = None if spec is None else spec.sort(-1).values
        with cpu.disabled():
            s = store.scores_at(0, q, at)
        agg = s.double().softmax(-1).sum(2)
        forced = agg.clone()
        forced[..., :4], forced[..., -8:] = 1e9, 1e9  # the sinks and the newest
        out["speculate_channel/torch"] = forced.topk(40, -1).indices.sort(-1).values
        taken = torch.stack([torch.randperm(300, generator=gen)[:30] for _ in range(6)]).view(3, 2, 30)
        src_k, src_v = (torch.randn(320 * 2, 64, generator=gen) for _ in "kv")
        room_k, room_v = (torch.zeros(3, 2, 50, 64) for _ in "kv")
        got = cpu.correct_channel(q, store.codes[0], store.meta[0], at, 300, CHANNEL_TOKENS, taken, None, None, 40,
                                  False, [40, 40, 40], src_k, src_v, room_k, room_v)  # fmt: skip
        out["correct_channel"] = None if got is None else got[0].sort(-1).values
        if got is not None:  # the rows of the slots it chose copied, then zeros
            rows = at.gather(1, got[0].reshape(3, -1)).view(3, 2, 40) * 2 + torch.arange(2)[:, None]
            copied = torch.equal(room_k, torch.cat([src_k[rows], torch.zeros(3, 2, 10, 64)], 2))
            out["correct_channel copied"] = torch.tensor(copied and bool(got[1].all()))
        out["correct_channel copied/torch"] = torch.tensor(True)
        out["correct_channel/torch"] = agg.scatter(2, taken, -math.inf).topk(40, -1).indices.sort(-1).values
    finally:
        cpu.INTEGER = before
    x = torch.randn(2, 3, 5, 64, generator=gen) * torch.linspace(0.1, 4, 64)
    codes, meta = torch.zeros(2, 3, 24, 32, dtype=torch.uint8), torch.zeros(2, 3, 24, 2, 1, dtype=torch.float16)
    quant.store(x, codes, meta, 7, 64, 4)  # (the kernel where the variant takes it, else torch's: the same bits)
    out["quantize_rows"] = torch.cat([codes.view(-1), meta.view(torch.uint8).view(-1)])
    with cpu.disabled():
        quant.store(x, codes, meta, 7, 64, 4)
    out["quantize_rows/torch"] = torch.cat([codes.view(-1), meta.view(torch.uint8).view(-1)])
    for name, off in [("quantize_channel", nullcontext()), ("quantize_channel/torch", cpu.disabled())]:
        keys = ChannelKeys(SimpleNamespace(cfg=SimpleNamespace(head_dim=64, num_key_value_heads=2)), [0], 2, 64, "cpu",
                           torch.float32)  # fmt: skip
        with off:
            for t in range(20):  # decode steps: a key a row, across a run's end
                keys.write(0, x[:, :2, t % 5 : t % 5 + 1] * (1 + t), t)
        out[name] = torch.cat([keys.codes[0].view(-1), keys.meta[0].view(torch.uint8).view(-1), keys.held[0].view(-1)])
    s = torch.randn(2, 3, 4, 2000, generator=gen) * 4
    s[0, 1, :, :500] = -math.inf
    got = cpu.group_softmax(s, 5.0)
    out["group_softmax"], out["group_softmax within"] = (None, None) if got is None else got
    out["group_softmax/torch"] = s.double().softmax(-1).sum(2).float()
    out["group_softmax within/torch"] = (s > s.amax(-1, keepdim=True) - 5.0).sum(-1)
    x = torch.randn(3, 4, 8192, generator=gen)
    for sorted in (True, False):  # the values torch's; the slots (of equal values, the lower ones) the variants' own
        got = cpu.topk(x, 614, sorted)
        out[f"topk {sorted}"] = None if got is None else got[0].sort(-1, descending=True).values
        out[f"topk {sorted}/torch"] = x.topk(614, -1).values
        out[f"topk slots {sorted}"], out[f"topk slots {sorted}/torch"] = None if got is None else got[1], None
    s = torch.randn(2, 3, 3, 2000, generator=gen) * 3
    taken = torch.stack([torch.randperm(2000, generator=gen)[:100] for _ in range(6)]).view(2, 3, 100)
    got = cpu.correct_pick(s, taken, None, 204, True)
    out["correct_pick"] = None if got is None else got[1].sort(-1).values
    out["correct_pick/torch"] = s.double().softmax(-1).sum(2).scatter(2, taken, -math.inf).topk(204).indices.sort(-1)[0]
    src_k, src_v = (torch.randn(500, 64, generator=gen) for _ in "kv")
    rows = torch.randint(0, 500, (2, 3, 37), generator=gen)
    out_k, out_v = (torch.full((2, 3, 41, 64), 7.0) for _ in "kv")
    out["gather_rows"] = torch.cat([out_k, out_v]) if cpu.gather_rows(src_k, src_v, rows, out_k, out_v) else None
    out["gather_rows/torch"] = torch.cat([torch.cat([x[rows], torch.zeros(2, 3, 4, 64)], 2) for x in (src_k, src_v)])
    q, kn, vn = torch.randn(3, 6, 1, 64, generator=gen), *(torch.randn(3, 2, 1, 64, generator=gen) for _ in "kv")
    rows = [torch.randint(0, 500, (3, 2, n), generator=gen) for n in (40, 9)]
    out["attend_rows"] = cpu.attend_rows(q, src_k, src_v, rows, kn, vn)
    every = torch.cat(rows, -1)
    keys, values = (torch.cat([src[every], new], 2).double() for src, new in ((src_k, kn), (src_v, vn)))
    scores = q.double().view(3, 2, 3, 64) @ keys.transpose(-1, -2) / 8
    out["attend_rows/torch"] = (scores.softmax(-1) @ values).view(3, 6, 1, 64).float()
    x, w = torch.randn(8, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"linear {dtype}"] = cpu.linear(x, w.to(dtype))
        out[f"linear {dtype}/torch"] = torch.nn.functional.linear(x.double(), w.to(dtype).double()).float()
    return out


@needs_kernel
@pytest.mark.slow
def test_every_variant_gives_every_ops_results_to_float32_rounding(tmp_path):
    """Each instruction set this CPU runs (plain, AVX2, AVX-512: INFINIGEN_CPU_ISA, each in a process of its own)
    gives every operator's results on the same inputs (every_op) as the others do and as the torch path does, to
    the tolerance docs/performance.md states: the variants differ only in float32 rounding (the order of a sum's
    terms, a fused multiply-add or not), so a score, a softmax sum, an attention output or a linear output is
    within a relative (norm) difference of 1e-5 of another variant's and of torch's; what is exact in one is exact
    in all (codes and fp16 scales bit for bit, the top-k of the same floats, the rows gathered); a choice that ranks
    computed scores (speculation, the correction) chooses the same slots but for two scores within that rounding,
    99 % the same or more. Where a variant does not take an op (no F16C: quantizing; no AVX-512: the linear layer),
    the torch path runs, which is the reference. AVX-512 VNNI's integer scores are their own path (test above)."""
    ran = {}
    for isa in cpu.library().variants():
        path = tmp_path / f"{isa}.pt"
        code = ("import sys, torch\nfrom infinigen_rt.kv import cpu\nfrom tests.rt.test_cpu_kernels import every_op\n"
                f"assert cpu.isa() == {isa!r}, cpu.reason()\ntorch.save(every_op(), sys.argv[1])\n")  # fmt: skip
        env = {**os.environ, "INFINIGEN_CPU_ISA": isa}
        r = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                           timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        ran[isa] = torch.load(path)
    assert "plain" in ran
    exact = ("quantize_rows", "quantize_channel", "group_softmax within", "topk True", "topk False", "topk slots True",
             "topk slots False", "gather_rows",
             "correct_channel copied")  # fmt: skip
    ranked = ("speculate_channel", "correct_channel", "correct_pick")
    for isa, got in ran.items():
        for name, value in got.items():
            if name.endswith("/torch") or "integer" in name:
                continue
            if value is None:  # the variant does not take it: only where it has no F16C or no AVX-512
                assert isa == "plain" or isa == "avx2" and name.startswith("linear"), (isa, name)
                continue
            for other, want in [("torch", got[f"{name}/torch"])] + [(o, ran[o].get(name)) for o in ran if o != isa]:
                if want is None:
                    continue
                if name in exact:
                    assert torch.equal(value, want), (isa, other, name)
                elif name in ranked:
                    same = (value[..., :, None] == want[..., None, :]).any(-1).float().mean()
                    assert same >= 0.99, (isa, other, name, same)
                else:
                    diff = ((value.double() - want.double()).norm() / want.double().norm()).item()
                    assert diff < 1e-5, (isa, other, name, diff)


@needs_kernel
def test_an_operators_call_releases_the_gil_while_its_kernel_runs():
    """The two threads of a decode step (a call's pairs shared with the worker beside it, speculation's scoring
    beside the layers) need a kernel's call to release the GIL: while one thread's call of a torch.ops.infinigen
    operator runs (a long one: 8 KV heads of 16 query heads against 65536 keys), the other thread's Python goes on,
    all through the call, not only at its ends."""
    import threading
    import time

    ops = cpu.library()
    gen = torch.Generator().manual_seed(4)
    hkv, g, d, n = 8, 16, 128, 1 << 16
    codes = torch.randint(0, 256, (1, hkv, n, d // 2), dtype=torch.uint8, generator=gen)
    meta = torch.rand(1, hkv, n, 2, d // 64, generator=gen).half()
    q, out = torch.randn(1, hkv, g, d, generator=gen), torch.empty(1, hkv, g, n)
    started, done, span = threading.Event(), threading.Event(), []

    def call():
        started.set()
        t0 = time.perf_counter()
        assert ops.score_codes(q, codes, meta, None, out, 64, 4, 0, 0, hkv) == 0
        span.extend((t0, time.perf_counter()))
        done.set()

    worker = threading.Thread(target=call)
    worker.start()
    started.wait()
    marks = []
    while not done.is_set():  # this thread's Python, a mark every thousand steps
        for _ in range(1000):
            pass
        marks.append(time.perf_counter())
    worker.join()
    t0, t1 = span
    assert t1 - t0 > 0.03, "a call too short to tell"
    third = (t1 - t0) / 3
    assert any(t0 + third <= m <= t1 - third for m in marks), "no Python ran in the middle of the call"


@needs_kernel
def test_an_operators_tensors_are_checked_against_each_other_before_its_kernel_reads_them():
    """torch.ops.infinigen's schemas type every argument, and each operator checks its tensors' device, dtype,
    layout and shapes against each other before its kernel reads a byte: a mismatch raises RuntimeError naming
    the operator and the tensor, never a read or write past a buffer; arguments the kernel does not take return -1
    (its caller's torch path then runs)."""
    ops = cpu.library()
    gen = torch.Generator().manual_seed(3)
    codes, meta, group = codes_of(gen, 1, 2, 40, 64, 4)
    q, out, slots = torch.randn(1, 2, 3, 64, generator=gen), torch.empty(1, 2, 3, 10), torch.zeros(1, 10).long()
    strided = torch.randn(1, 2, 64, 3, generator=gen).transpose(2, 3)  # q's shape, not contiguous
    assert ops.score_codes(q, codes, meta, slots, out, group, 4, 0, 0, 2) == 0
    assert ops.score_codes(q, codes, meta, slots, out, group, 3, 0, 0, 2) == -1  # no 3-bit keys
    for args, why in [((q, codes, meta, slots[:, :5], out), r"slots is \[1, 5\] where \[1, 10\]"),
                      ((q, codes[..., :16], meta, slots, out), "codes is"),  # rows narrower than 64 columns at 4 bits
                      ((q, codes, meta.float(), slots, out), "meta is Float, not Half"),
                      ((strided, codes, meta, slots, out), "q is not contiguous"),
                      ((q, codes, meta, slots.int(), out), "slots is Int"),
                      ((q, codes, meta, slots, out[:1, :1]), r"out is \[1, 1, 3, 10\] where \[1, 2, 3, 10\]"),
                      ((q, codes[:, :1].contiguous(), meta, slots, out), r"codes is \[1, 1, 40, 32\] where \[1, 2")]:
        with pytest.raises(RuntimeError, match=f"infinigen::score_codes: {why}"):
            ops.score_codes(*args, group, 4, 0, 0, 2)
    with pytest.raises(RuntimeError, match=r"type 'Optional\[Tensor\]' for argument 'slots'"):  # the schema's
        ops.score_codes(q, codes, meta, 5, out, group, 4, 0, 0, 2)
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="infinigen::linear: out has 8 elements where 16 are expected"):
        ops.linear(x, w, torch.empty(1, 8), None, 0, 8)
    with pytest.raises(RuntimeError, match="infinigen::linear: next is Float"):
        ops.linear(x, w, torch.empty(2, 8), torch.zeros(1), 0, 8)
    assert ops.linear(x, w.double(), torch.empty(2, 8), None, 0, 8) == -1  # not a width it reads
    src = torch.randn(100, 64)
    rows, room = torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3, 6, 64)
    with pytest.raises(RuntimeError, match="infinigen::gather_rows: out_v is not laid out as out_k"):
        ops.gather_rows(src, src, rows, room, room[:, :, :5], 0, 6)
    with pytest.raises(RuntimeError, match="infinigen::gather_rows: rows is"):
        ops.gather_rows(src, src, rows[:1], room, room, 0, 6)
    assert ops.gather_rows(src, src, rows, room[:, :, ::2], room[:, :, ::2], 0, 6) == -1  # not rows in a run
    assert ops.gather_rows(src, src, rows, room, room, 0, 6) == 0


@needs_kernel
def test_the_per_channel_kernel_refuses_a_slot_outside_and_shapes_it_does_not_take():
    from infinigen_rt.policies.speculation import CHANNEL_TOKENS

    store = channel_store(torch.Generator().manual_seed(1), 1, 2, 48, 64)
    q = torch.randn(1, 2, 3, 64)
    for bad in (48, -1, 1 << 40):
        with pytest.raises(IndexError, match="slot outside"):
            cpu.score_channel(q, store.codes[0], store.meta[0], torch.tensor([[0, 5, bad]]), 3, CHANNEL_TOKENS)
    with pytest.raises(IndexError, match="slot outside"):
        cpu.score_channel(q, store.codes[0], store.meta[0], slice(40, 55), 15, CHANNEL_TOKENS)
    assert cpu.score_channel(q, store.codes[0], store.meta[0], slice(0, 3), 3, 7) is None  # runs that split S unevenly
    assert cpu.score_channel(q, store.codes[0], store.meta[0].float(), slice(0, 3), 3, CHANNEL_TOKENS) is None


@needs_kernel
def test_a_slot_outside_the_rows_is_an_error_not_a_read():
    gen = torch.Generator().manual_seed(0)
    codes, meta, group = codes_of(gen, 1, 2, 40, 64, 4)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    for bad in (40, -1, 1 << 40):
        with pytest.raises(IndexError, match="slot outside"):
            cpu.score_codes(q, codes, meta, torch.tensor([[0, 5, bad]]), 3, group, 4)
    with pytest.raises(IndexError, match="slot outside"):
        cpu.score_codes(q, codes, meta, slice(30, 45), 15, group, 4)  # a run past the end
    x = torch.randn(1, 2, 1, 64)
    with pytest.raises(IndexError, match="outside"):
        cpu.quantize_rows(x, codes, meta, torch.tensor([[[0], [40]]]), group, 4)  # at [R, Hkv, s]
    assert cpu.score_codes(q, codes, meta, torch.tensor([[0, 5, 39]]), 3, group, 4) is not None


@needs_kernel
@pytest.mark.parametrize("bits, d", [(4, 64), (4, 128), (2, 64), (4, 256), (4, 96), (2, 16)])
def test_quantizing_into_slots_writes_the_codes_torch_writes_bit_for_bit(bits, d):
    """Each row into its own slot (each sequence and KV head its own) and a run of slots; ties rounded to even as
    torch.round does, a constant row (the scale's floor), the other slots left as they were."""
    gen = torch.Generator().manual_seed(d + bits)
    r, hkv, s, n_slots = 2, 3, 5, 24
    group = key_group(d, bits)
    # not contiguous, as a step's keys come (the kernel's contiguous copy must live through the call)
    x = (torch.randn(r, s, hkv, d, generator=gen) * torch.linspace(0.1, 4, d)).transpose(1, 2)
    top = 2**bits - 1
    ties = torch.arange(d) % (top + 1) + 0.5  # a group spanning 0.5..top+0.5: scale 1, every value a tie
    ties[::group], ties[group - 1 :: group] = 0.0, float(top)
    x[0, 0, 0], x[1, 2, 4] = ties, 2.5
    at = torch.stack([torch.randperm(n_slots, generator=gen)[:s] for _ in range(r * hkv)]).view(r, hkv, s)
    shape = (r, hkv, n_slots)
    start_c = torch.randint(0, 255, (*shape, d * bits // 8), dtype=torch.uint8, generator=gen)
    start_m = torch.randn(*shape, 2, d // group, generator=gen).half()
    for where in (at, 7):
        want_c, want_m, got_c, got_m = start_c.clone(), start_m.clone(), start_c.clone(), start_m.clone()
        with cpu.disabled():
            quant.store(x, want_c, want_m, where, group, bits)  # the torch path
        assert cpu.quantize_rows(x, got_c, got_m, where, group, bits)
        assert torch.equal(got_c, want_c)
        assert torch.equal(got_m.view(torch.int16), want_m.view(torch.int16))


def cached(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def cached_names(lib: Path) -> list[str]:
    """What a cache holding the library `lib` holds: it, its record and the lock."""
    return sorted([lib.name, cpu_build.record_of(lib).name, cpu_build.LOCK_NAME])


def test_a_failed_build_falls_back_to_the_torch_path_and_leaves_nothing(tmp_path, monkeypatch):
    """A compiler that fails (or none, or INFINIGEN_CPU_KERNELS=0): the scores still come, from the torch path, and
    the cache holds no half-written library; a failed build and a missing compiler are one warning each, with the
    fix (INFINIGEN_CPU_KERNELS=0: none); a working build leaves exactly the library."""
    import warnings

    from infinigen_rt.errors import InfinigenWarning

    gen = torch.Generator().manual_seed(1)
    codes, meta, group = codes_of(gen, 1, 2, 50, 64, 4)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    with cpu.disabled():
        want = quant.scores(q, codes, meta, 50, group, 4)
    bad_cc = tmp_path / "bad-cc"
    bad_cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo bad-cc 1.0 && exit 0\n"
                      "echo 'no such flag' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    cache = tmp_path / "cache"
    off = "INFINIGEN_CPU_KERNELS"
    cases = [({"CC": str(bad_cc)}, "build failed", "the CPU kernels' build failed"), ({off: "0"}, f"{off}=0", None),
             ({"NO_CC": "1"}, "no C compiler", "no C compiler")]  # NO_CC: no compiler found (cpu.compiler None)
    for env, why, said in cases:
        monkeypatch.setattr(cpu, "_lib", None)
        monkeypatch.setattr(cpu, "_failed", None)
        monkeypatch.setattr(cpu, "_warned", set())
        monkeypatch.setenv("INFINIGEN_KERNEL_CACHE", str(cache))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with monkeypatch.context() as m, warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            if "NO_CC" in env:
                m.setattr(cpu, "compiler", lambda: None)
            assert cpu.library() is None and why in cpu.reason()
        lines = [str(w.message) for w in got if issubclass(w.category, InfinigenWarning)]
        if said is None:
            assert not lines
        else:
            (line,) = lines
            assert line.startswith(said) and "torch's ops run" in line and f"set {off}=0" in line, line
        monkeypatch.delenv("NO_CC", raising=False)
        assert cpu.score_codes(q, codes, meta, 50, 50, group, 4) is None
        torch.testing.assert_close(quant.scores(q, codes, meta, 50, group, 4), want)
        assert not cache.exists() or not any(cache.rglob("*.so"))
        monkeypatch.delenv("INFINIGEN_CPU_KERNELS", raising=False)
        monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)
    if cpu_build.compiler() is None:
        pytest.skip("no C compiler here")
    assert cpu.library() is not None, cpu.reason()
    (lib,) = cache.glob("infinigen-cpu-kernels-*.so")
    assert cached(cache) == cached_names(lib)
    torch.testing.assert_close(quant.scores(q, codes, meta, 50, group, 4), want, rtol=1e-4, atol=1e-2)


def fresh(monkeypatch, **env):
    """cpu as a new process finds it (nothing loaded, tried or warned about), with env set (None: unset)."""
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)
    monkeypatch.setattr(cpu, "_warned", set())
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)


# a process that loads the kernels as the CLI does (its notices one `warning:` line each): what it finds, and why
LOADER = ("from infinigen_rt.cli.console import show_notices\nshow_notices()\nfrom infinigen_rt.kv import cpu\n"
          "print(cpu.library() is not None, cpu.reason())\nimport os\n"
          "if os.environ.get('ISA_LINE'):\n    print(cpu.isa(), cpu.integer_scores())\n")  # fmt: skip


def load_elsewhere(tmp_path, **env) -> subprocess.CompletedProcess:
    """LOADER in a child process (what a planted library's constructor does cannot touch this one), with env set,
    CC unset and its temporary folders under tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    child = {k: v for k, v in os.environ.items() if k != "CC"} | {"TMPDIR": str(tmp_path / "tmp"), **env}
    return subprocess.run([sys.executable, "-c", LOADER], env=child, capture_output=True, text=True, timeout=300)


def warning_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if "warning:" in line]


def whole(lib) -> bool:
    """The library's size and sha256 are those recorded beside it."""
    return cpu_build.file_problem(lib) is None and cpu_build.damage(lib) is None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the compiler's command, a library cpu_build.build built with it in a cache of its own), once a module."""
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    folder = tmp_path_factory.mktemp("built")
    folder.chmod(0o700)
    return cc, cpu_build.build(cc, folder)


PLANTED = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *at = getenv("PLANTED_MARKER");
    FILE *f = at ? fopen(at, "w") : NULL;
    if (f) { fputs("the planted library ran\\n", f); fclose(f); }
}
int infinigen_integer_scores(void) { return 0; }
"""


@pytest.mark.parametrize("where", ["a folder others can write", "a folder another user owns", "a link to it"])
def test_a_library_planted_in_the_cache_is_not_loaded(where, tmp_path, built):
    """A library under the very name the loader looks for, with a record that matches it, its constructor a marker:
    in a cache folder others may write (0o777) or another user owns, the folder is not read (nor written) and the
    kernels are built for the run alone, one warning naming the folder and the fix; in a folder of this user's own
    but a link to the planted file, the link is not followed: built again over it, one warning. Never the marker."""
    cc, _ = built
    if where == "a folder another user owns" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    src, planted, marker = tmp_path / "planted.c", tmp_path / "planted.so", tmp_path / "marker"
    src.write_text(PLANTED)
    subprocess.run([*cc, "-shared", "-fPIC", str(src), "-o", str(planted)], check=True, capture_output=True)
    control = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(planted)!r})"],
                             env={**os.environ, "PLANTED_MARKER": str(tmp_path / "control")})  # fmt: skip
    assert control.returncode == 0 and (tmp_path / "control").exists()  # what loading it would do
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    lib = cache / cpu_build.kernel_name(cc)
    if where == "a link to it":
        lib.symlink_to(planted)
    else:
        shutil.copy(planted, lib)
    data = planted.read_bytes()
    cpu_build.record_of(lib).write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")  # forged as the loader's
    if where == "a folder others can write":
        cache.chmod(0o777)
    elif where == "a folder another user owns":
        for p in (cache, lib, cpu_build.record_of(lib)):
            os.chown(p, 65534, 65534)
    before = sorted((p.name, p.lstat().st_mtime_ns) for p in cache.iterdir())
    r = load_elsewhere(tmp_path, INFINIGEN_KERNEL_CACHE=str(cache), PLANTED_MARKER=str(marker))
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    assert r.stdout.split()[0] == "True", r.stdout + r.stderr  # the kernels, built here
    (line,) = warning_lines(r)
    if where == "a link to it":
        assert f"{lib} is a symbolic link" in line and "built again" in line
        assert not lib.is_symlink() and whole(lib)
    else:
        why = "writable by group or others" if where == "a folder others can write" else "owned by uid 65534"
        assert f"the kernel cache {cache} is {why}" in line
        assert "set INFINIGEN_KERNEL_CACHE to a folder only you can write" in line
        assert sorted((p.name, p.lstat().st_mtime_ns) for p in cache.iterdir()) == before  # not written
        assert not any((tmp_path / "tmp").iterdir())  # the private folder gone once the kernels were loaded


def test_a_cut_short_cached_library_is_rebuilt_not_loaded(tmp_path, built):
    """A cached library cut short (its first 4000 bytes: loading it is SIGBUS): the size is not the record's, so
    it is not loaded: rebuilt over, one warning, and the run goes on with the kernels; the cache whole again. A
    byte changed in place (the size the record's): its sha256 is not."""
    _, good = built
    cache = tmp_path / "cache"
    shutil.copytree(good.parent, cache)
    lib = cache / good.name
    assert whole(lib)
    data = lib.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    lib.write_bytes(flipped)
    assert "sha256 is not the one recorded" in cpu_build.damage(lib)
    lib.write_bytes(data[:4000])
    assert "4000 bytes where" in cpu_build.damage(lib)
    r = load_elsewhere(tmp_path, INFINIGEN_KERNEL_CACHE=str(cache))
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.split()[0] == "True", r.stdout + r.stderr
    (line,) = warning_lines(r)
    assert f"the cached kernel library {lib} was damaged" in line and "rebuilt" in line
    assert lib.stat().st_size > 4000 and whole(lib)
    assert cached(cache) == cached_names(lib)


def test_a_process_checks_builds_and_opens_the_cache_under_its_lock(tmp_path):
    """Another process's first build renames its library in before its record: one that checked the cache between
    the two would call the library damaged and rebuild it, with a warning (a one-line error test's second line).
    So the check, the build and the open hold the cache's lock: while this test holds it, a loader waits and writes
    nothing; once it is free the loader builds, silently."""
    import fcntl

    if cpu_build.compiler() is None:
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"} | {"TMPDIR": str(tmp_path / "tmp"),
                                                                 "INFINIGEN_KERNEL_CACHE": str(cache)}  # fmt: skip
    with open(cache / cpu_build.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", LOADER], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            proc.wait(8)
        except subprocess.TimeoutExpired:
            pass
        assert proc.poll() is None, proc.communicate()
        assert cached(cache) == [cpu_build.LOCK_NAME]  # nothing built or read while the lock was held
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.split()[0] == "True", out + err
    assert "warning:" not in err, err
    (lib,) = cache.glob("*.so")
    assert whole(lib) and cached(cache) == cached_names(lib)


def test_a_compiler_that_says_it_succeeded_but_wrote_junk_fails_the_build_and_leaves_nothing(tmp_path, monkeypatch,
                                                                                            built):  # fmt: skip
    """A compiler that exits 0 having written junk, or a library cut short (which kills the process loading it):
    the child process that proves a build loads refuses it, so the build failed (the torch path runs, reason()
    says why) and the cache holds nothing; a good compiler after it builds and loads."""
    _, good = built
    cache = tmp_path / "cache"
    junk_cc = tmp_path / "junk-cc"
    for writes, why in [("echo junk", "does not load"), (f"head -c 4000 {good}", "kills the process")]:
        out = f'while [ $# -gt 0 ]; do [ "$1" = -o ] && {writes} > "$2"; shift; done'  # (what follows -o)
        junk_cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo junk-cc 1.0 && exit 0\n{out}\nexit 0\n')
        junk_cc.chmod(0o755)
        fresh(monkeypatch, CC=str(junk_cc), INFINIGEN_KERNEL_CACHE=str(cache))
        assert cpu.library() is None
        assert "the build failed" in cpu.reason() and why in cpu.reason(), cpu.reason()
        assert cache.is_dir() and [p.name for p in cache.iterdir()] == [cpu_build.LOCK_NAME]  # the lock alone
    fresh(monkeypatch, CC=None)
    assert cpu.library() is not None, cpu.reason()
    (lib,) = cache.glob("*.so")
    assert whole(lib) and cached(cache) == cached_names(lib)


def test_a_cc_that_is_not_found_is_said_and_no_other_compiler_is_taken(tmp_path, monkeypatch):
    """CC naming no program (or not a command at all): no kernels, reason() names CC, one warning with the fix, the
    torch path's scores; not another compiler in its place. CC with arguments runs them, in the cache key too."""
    import warnings

    from infinigen_rt.errors import InfinigenWarning

    gen = torch.Generator().manual_seed(2)
    codes, meta, group = codes_of(gen, 1, 2, 20, 64, 4)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    cache = tmp_path / "cache"
    for bad in ("/nonexistent/cc", 'cc "-O0'):
        fresh(monkeypatch, CC=bad, INFINIGEN_KERNEL_CACHE=str(cache))
        with pytest.warns(InfinigenWarning) as got:
            assert cpu.library() is None
        assert cpu.reason().startswith(f"CC={bad}: not found"), cpu.reason()
        (w,) = got
        assert f"CC={bad}: not found" in str(w.message) and "unset CC or point it at a C compiler" in str(w.message)
        assert cpu_build.compiler() is None
        assert cpu.score_codes(q, codes, meta, 20, 20, group, 4) is None  # the torch path's scores, then
        assert quant.scores(q, codes, meta, 20, group, 4).shape == (1, 2, 3, 20)
        monkeypatch.setattr(cpu, "_failed", None)
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            assert cpu.library() is None
        assert not again  # once a process
    assert not cache.exists()
    fresh(monkeypatch, CC=None)
    plain = cpu_build.compiler()
    if plain is None:
        pytest.skip("no C compiler here")
    fresh(monkeypatch, CC=f"{plain[0]} -O0")
    assert cpu_build.compiler() == [plain[0], "-O0"]
    # another build than this process may hold (one a process): loaded in a child
    r = load_elsewhere(tmp_path, CC=f"{plain[0]} -O0", INFINIGEN_KERNEL_CACHE=str(cache))
    assert r.returncode == 0 and r.stdout.split()[0] == "True", r.stdout + r.stderr
    name = cpu_build.kernel_name([plain[0], "-O0"])
    assert name != cpu_build.kernel_name(plain)
    assert cached(cache) == cached_names(cache / name)


@needs_kernel
def test_infinigen_cpu_isa_names_the_variant_and_one_this_cpu_does_not_run_is_said(tmp_path):
    """INFINIGEN_CPU_ISA picks the variant a process runs (isa() says which, integer_scores() only where it has
    them); unset, the best this CPU runs. A name this CPU does not run (or no variant's): one warning with the fix,
    reason() says why, and the torch path runs."""
    best = cpu.library().variants()[0]
    for isa, want in [(None, f"True None {best} {best == 'avx512'}"), ("plain", "True None plain False"),
                      ("AVX2", "True None avx2 False")]:  # fmt: skip
        r = load_elsewhere(tmp_path, INFINIGEN_CPU_ISA=isa or "", ISA_LINE="1")
        assert r.returncode == 0 and r.stdout.split() == want.split(), r.stdout + r.stderr
        assert not warning_lines(r)
    r = load_elsewhere(tmp_path, INFINIGEN_CPU_ISA="sse9", ISA_LINE="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False INFINIGEN_CPU_ISA=sse9: not a variant this CPU runs"), r.stdout
    (line,) = warning_lines(r)
    assert "INFINIGEN_CPU_ISA=sse9" in line and "unset INFINIGEN_CPU_ISA or name one of those" in line


@needs_kernel
@pytest.mark.parametrize("g, t", [(3, 8192), (4, 300), (1, 1), (8, 2049)])
def test_the_group_softmax_is_torchs_and_its_counts_exact(g, t):
    """The selection's sum over a KV head's query heads of their softmax, and each head's slots within alpha of
    its largest: masked slots (-inf) count for nothing, a head masked whole adds nothing (torch: NaN)."""
    gen = torch.Generator().manual_seed(g * t)
    s = torch.randn(2, 3, g, t, generator=gen) * 4
    s[0, 1, :, : t // 3] = float("-inf")
    agg, within = cpu.group_softmax(s, 5.0)
    torch.testing.assert_close(agg, s.softmax(-1).sum(2), rtol=2e-6, atol=1e-7)
    assert torch.equal(within, (s > s.amax(-1, keepdim=True) - 5.0).sum(-1))
    agg, within = cpu.group_softmax(s, float("inf"))
    assert within is None and torch.allclose(agg.sum(-1), torch.full((2, 3), float(g)))
    s[1, 2, 0] = float("-inf")  # a head with no slot
    agg, within = cpu.group_softmax(s, 5.0)
    torch.testing.assert_close(agg[1, 2], s[1, 2, 1:].softmax(-1).sum(0), rtol=2e-6, atol=1e-7)
    assert within[1, 2, 0] == 0


def _bar_too_high(t: int) -> torch.Tensor:
    """A row whose sample (every t // 256th slot) holds its only large values: the sample's bar passes fewer than
    k slots, and the kernel must fall back to every slot."""
    x = torch.linspace(-1, 0, t)
    x[:: t // 256] = 10 + torch.arange(len(x[:: t // 256]), dtype=torch.float32)
    return x


@needs_kernel
@pytest.mark.parametrize("t, k", [(8192, 614), (8192, 204), (8192, 4500), (8192, 8192), (8192, 1), (300, 30),
                                  (5000, 1200), (2048, 100)])  # fmt: skip
def test_the_top_k_kernel_chooses_torchs_rows(t, k):
    """torch's top-k values, from the slots holding them (distinct within the row, and of equal values the lower
    ones: randn holds a few ties), unsorted in slot order, sorted largest first; values masked to -inf taken last;
    a row whose sample misleads the bar."""
    gen = torch.Generator().manual_seed(t + k)
    x = torch.randn(3, 4, t, generator=gen)
    x[1, 2, : t // 2] = float("-inf")  # more masked slots than most k leave
    x[2, 3] = _bar_too_high(t)[torch.randperm(t, generator=gen)] if t >= 2048 else x[2, 3]
    x[2, 2] = _bar_too_high(t) if t >= 2048 else x[2, 2]
    want_v, want_i = x.topk(k, -1, sorted=True)
    v, i = cpu.topk(x, k, True)
    assert torch.equal(v, want_v) and torch.equal(x.gather(-1, i), v)
    assert ((v[..., :-1] > v[..., 1:]) | ((v[..., :-1] == v[..., 1:]) & (i[..., :-1] < i[..., 1:]))).all()
    finite = torch.isfinite(want_v)
    assert (i[finite] == want_i[finite]).float().mean() > 0.99  # the same slots but where values tie
    v, i = cpu.topk(x, k, False)
    assert (i[..., 1:] > i[..., :-1]).all(), "unsorted: in slot order, each slot once"
    assert torch.equal(v, x.gather(-1, i))
    assert torch.equal(v.sort(-1, descending=True).values, want_v)  # the k largest values


@needs_kernel
def test_the_top_k_kernel_breaks_ties_towards_the_lower_slots():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    assert cpu.topk(x, 3, False)[1].tolist() == [[1, 2, 3]]
    assert cpu.topk(x, 4, True)[1].tolist() == [[1, 3, 2, 4]]
    assert cpu.topk(x, 9, True) is None and cpu.topk(x, 0, False) is None  # torch's then says what is wrong
    assert cpu.topk(x.double(), 2, True) is None


@needs_kernel
@pytest.mark.parametrize("t, k, sorted", [(8192, 204, False), (8192, 204, True), (300, 30, True), (40, 40, False)])
def test_the_corrections_pick_is_its_softmax_mask_and_top_k_in_one_call(t, k, sorted):
    """correct_pick: the group softmax summed, speculation's taken slots (where they count) at -inf, the top k: the
    same slots and values as the three kernels one after another; a taken slot that does not count (a shorter
    fetch's padding, here on a slot another entry takes) masks nothing; slots a row does not hold are never chosen;
    a taken slot outside the row is an error."""
    gen = torch.Generator().manual_seed(t + k)
    s = torch.randn(2, 3, 3, t, generator=gen) * 3
    n = min(t // 4, 820)
    taken = torch.stack([torch.randperm(t, generator=gen)[:n] for _ in range(6)]).view(2, 3, n)
    ok = torch.rand(2, 3, n, generator=gen) > 0.2
    taken[1, 0, -1], ok[1, 0, -1], ok[1, 0, 0] = taken[1, 0, 0], False, True  # padding over a taken slot
    agg, _ = cpu.group_softmax(s, float("inf"))
    masked = agg.clone()
    for (b, h, i) in ok.nonzero().tolist():
        masked[b, h, taken[b, h, i]] = float("-inf")
    kk = min(k, t - n)
    want = cpu.topk(masked, kk, sorted)
    got = cpu.correct_pick(s, taken, ok, kk, sorted)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isfinite(got[0]).all() and not torch.isin(got[1][1, 0], taken[1, 0][ok[1, 0]]).any()
    every = cpu.correct_pick(s, taken, None, kk, sorted)  # every taken slot counts
    masked = agg.scatter(2, taken, float("-inf"))
    assert torch.equal(every[1], cpu.topk(masked, kk, sorted)[1])
    held = torch.ones(2, 3, t, dtype=torch.bool)
    held[0, 1, : t // 3] = False  # a shorter sequence's row (slots it does not hold)
    cut = s.masked_fill(~held[:, :, None], float("-inf"))
    masked = cpu.group_softmax(cut, float("inf"))[0].masked_fill(~held, float("-inf"))
    for (b, h, i) in ok.nonzero().tolist():
        masked[b, h, taken[b, h, i]] = float("-inf")
    got, want = cpu.correct_pick(cut, taken, ok, kk, sorted, held), cpu.topk(masked, kk, sorted)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    taken[0, 2, 3] = t
    with pytest.raises(IndexError, match="outside"):
        cpu.correct_pick(s, taken, ok, kk, sorted)
    assert cpu.correct_pick(s.double(), taken, ok, kk, sorted) is None


@needs_kernel
@pytest.mark.parametrize("d, g, span, uneven", [(64, 3, False, True), (64, 3, True, False), (128, 4, False, False),
                                                (96, 2, False, True)])  # fmt: skip
def test_the_corrections_one_call_scores_picks_and_copies_what_its_steps_do(d, g, span, uneven, monkeypatch):
    """correction_gathered (per-channel keys, a CPU): the same slots, the same rows that count and the same rows
    copied into the room (zeros after them and where a pick does not count) as the steps one after another
    (score_channel, correction_rows, the row gather), through each row's flat slots or one span, with sequences of
    other lengths (held, and each its own count) or not, with its pairs shared over torch's threads, or taken from
    one counter by a worker thread beside it (at any pace: all of them first, or none); a row past the pool is an
    error, not a read."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from infinigen_rt.policies.speculation import Selection, correction_gathered, correction_rows

    gen = torch.Generator().manual_seed(d + g)
    b, hkv, t, slots_n = (1 if span else 3), 2, 1000, 1024
    keys = channel_store(gen, 1, hkv, slots_n, d)
    q = torch.randn(b, hkv, g, d, generator=gen)
    at = slice(16, 16 + t) if span else torch.stack([torch.randperm(slots_n, generator=gen)[:t] for _ in range(b)])
    phys = (torch.arange(16, 16 + t)[None] if span else at)  # [B, t] flat slots
    n = 100
    taken = torch.stack([torch.randperm(t, generator=gen)[:n] for _ in range(b * hkv)]).view(b, hkv, n)
    sel = Selection(taken, torch.rand(b, hkv, n, generator=gen) > 0.1, False, 0.1)
    held = None
    per_row = [40] * b
    if uneven:
        held = torch.ones(b, t, dtype=torch.bool)
        held[1, 700:] = False
        held = held[:, None].expand(b, hkv, t)
        per_row = [40, 28, 40]
    src_k, src_v = (torch.randn(slots_n * hkv, d, generator=gen) for _ in "kv")
    room = 45
    out = {}
    worker = ThreadPoolExecutor(1)
    took = []

    def first(fn):  # the thread beside takes every pair before the caller starts
        f = Future()
        took.append(fn())
        f.set_result(took[-1])
        return f

    besides = {"worker": worker.submit, "first": first, "never": lambda fn: Future()}  # never: never starts
    for fused in ("shared", *besides, True, False):
        big_k, big_v = (torch.full((b, hkv, n + room + 1, d), 7.0) for _ in "kv")
        win_k, win_v = big_k[:, :, n : n + room], big_v[:, :, n : n + room]
        with monkeypatch.context() as m:
            if fused == "shared":  # every call over torch's threads (a pair each, at most)
                m.setattr(cpu, "SPLIT_WORK", 0)
                m.setattr(torch, "get_num_threads", lambda: 2)
                slots, ok, pairs, _ = correction_gathered(keys, 0, q, at, t, sel, held, per_row, win_k, win_v, src_k,
                                                       src_v)  # fmt: skip
                out[fused] = slots, ok, pairs, big_k, big_v
                continue
        if fused in besides:
            slots, ok, pairs, _ = correction_gathered(keys, 0, q, at, t, sel, held, per_row, win_k, win_v, src_k, src_v,
                                                   besides[fused])  # fmt: skip
        elif fused:
            slots, ok, pairs, _ = correction_gathered(keys, 0, q, at, t, sel, held, per_row, win_k, win_v, src_k, src_v)
        else:
            slots, ok = correction_rows(keys.scores_at(0, q, at), sel, held, per_row, "sum")
            rows = torch.gather(phys, 1, slots.reshape(b, -1)).view(slots.shape) * hkv + torch.arange(hkv)[:, None]
            win_k[:, :, : slots.shape[-1]] = torch.where(ok[..., None], src_k[rows], 0)
            win_v[:, :, : slots.shape[-1]] = torch.where(ok[..., None], src_v[rows], 0)
            win_k[:, :, slots.shape[-1] :], win_v[:, :, slots.shape[-1] :] = 0, 0
            pairs = ok.sum(-1)
        out[fused] = slots, ok, pairs, big_k, big_v
    worker.shutdown()
    assert took == ([0] if b * hkv > 1 else [])  # (one pair: nothing to share)
    for x, *ys, z in zip(out[True], *(out[k] for k in ("shared", *besides)), out[False], strict=True):
        assert torch.equal(x, z) and all(torch.equal(y, z) for y in ys)
    slots, ok, pairs, big_k, _ = out[True]
    assert 0 < int(pairs.sum()) < ok.numel() if uneven else int(pairs.sum()) == ok.numel()
    assert (big_k[:, :, :n] == 7).all() and (big_k[:, :, -1] == 7).all()  # only the room written
    # nothing copied: the picks' pool rows instead (-1 where a pick does not count), for attention to read there
    slots_r, ok_r, pairs_r, rows = correction_gathered(keys, 0, q, at, t, sel, held, per_row, None, None, src_k, src_v)
    assert torch.equal(slots_r, slots) and torch.equal(ok_r, ok) and torch.equal(pairs_r, pairs)
    want = torch.gather(phys, 1, slots.reshape(b, -1)).view(slots.shape) * hkv + torch.arange(hkv)[:, None]
    assert torch.equal(rows, torch.where(ok, want, -1))
    if not span:
        at[0, 5] = slots_n  # a slot past the keys' rows
        with pytest.raises(IndexError):
            correction_gathered(keys, 0, q, at, t, sel, held, per_row, win_k, win_v, src_k, src_v)
    assert correction_gathered(keys, 0, q.double(), at, 0, sel, held, per_row, win_k, win_v, src_k, src_v) is None


@needs_kernel
@pytest.mark.parametrize("d, g, span, t, budget, sinks, recent", [
    (64, 3, False, 1000, 0.1, 4, 8), (64, 3, True, 4000, 0.075, 4, 8), (64, 3, False, 4000, 0.4, 0, 0),
    (128, 4, False, 1000, 0.5, 4, 8), (96, 2, True, 300, 0.02, 20, 30), (64, 7, False, 2500, 1.0, 4, 8)])  # fmt: skip
def test_speculations_one_call_chooses_what_select_chooses(d, g, span, t, budget, sinks, recent):
    """selected (per-channel keys, a CPU, every slot held in order, no margin): the Selection that select makes from
    the scores one step after another (the scores, the group softmax, the sinks and the newest forced, the top-k),
    bit for bit, through each row's flat slots or one span, at budgets whose top-k samples a bar and whose does
    not, sinks and the newest past the budget's count; where it does not apply (a margin, slots not held, counts
    not read, a shortlist, another store, keys it does not take), None."""
    import math

    from infinigen_rt.policies.options import KVOptions
    from infinigen_rt.policies.speculation import QuantKeys, select, selected

    gen = torch.Generator().manual_seed(d + g + t)
    b, hkv, slots_n = (1 if span else 3), 2, 4096
    keys = channel_store(gen, 1, hkv, slots_n, d)
    q = torch.randn(b, hkv, g, d, generator=gen)
    at = slice(16, 16 + t) if span else torch.stack([torch.randperm(slots_n, generator=gen)[:t] for _ in range(b)])
    opts = KVOptions(budget=budget, sinks=sinks, recent=recent)
    got = selected(keys, 0, q, at, t, math.inf, opts, None, None, None, 0)
    want = select(keys.scores_at(0, q, at), math.inf, opts)
    assert got is not None and torch.equal(got.slots, want.slots) and torch.equal(got.ok, want.ok)
    assert got.every and want.every and torch.equal(got.per_row, want.per_row) and got.cand is None
    forced = list(range(min(sinks, t))) + list(range(t - min(recent, t), t))
    if len(set(forced)) <= got.slots.shape[-1]:  # the sinks and the newest are chosen first, inside the budget
        assert all(set(forced) <= set(row) for row in got.slots.reshape(-1, got.slots.shape[-1]).tolist())
    held = torch.ones(b, hkv, t, dtype=torch.bool)
    for args in ((2.0, opts, None, None, None, 0), (math.inf, opts, held, None, None, 0),
                 (math.inf, opts, None, 64, None, 0), (math.inf, opts, None, None, object(), 0),
                 (math.inf, opts, None, None, None, 5), (math.inf, KVOptions(group_agg="max"), None, None, None, 0)):
        assert selected(keys, 0, q, at, t, *args) is None
    assert selected(keys, 0, q.double(), at, 0, math.inf, opts, None, None, None, 0) is None
    int4 = QuantKeys(keys.spec, [0], 1, slots_n, "cpu", torch.float32, 4)
    assert selected(int4, 0, q, at, t, math.inf, opts, None, None, None, 0) is None


@needs_kernel
def test_a_kernel_call_the_worker_offers_is_taken_by_the_thread_waiting_for_its_result():
    """cpu._offered on the worker thread (speculation's one call) and cpu.take_offered on the thread that waits for
    its result: both take the call's pairs from its counter, each pair once; the worker's call returns once the
    pairs the other thread took are done, and a failure on either thread is its error. A waiting thread that comes
    after the call, or a worker that offers nothing, just waits."""
    import threading
    import time

    from infinigen_rt.kv.prefetch import WorkerThread

    lock, seen, started = threading.Lock(), [], threading.Event()

    def kernel(fail_at, nxt, lo, hi):  # a kernel's way with the counter: take the next pair until none is left
        while True:
            with lock:
                i = lo + int(nxt[0])
                nxt[0] += 1
            if i >= hi:
                return 0
            started.set()
            time.sleep(0.002)
            seen.append((i, threading.current_thread().name))
            if i == fail_at:
                return -2

    worker = WorkerThread()
    try:
        worker.pool.submit(lambda: None).result()  # (started: its ident known)
        done = worker.pool.submit(cpu._offered, kernel, (-1,), 40, "test")
        started.wait()
        cpu.take_offered(worker.thread["ident"], done)
        assert done.result() is True
        assert sorted(i for i, _ in seen) == list(range(40))
        assert {name for _, name in seen} == {threading.current_thread().name, "infinigen-prefetch_0"}
        seen.clear()
        started.clear()
        done = worker.pool.submit(cpu._offered, kernel, (39,), 40, "test")  # the last pair fails, on either thread
        started.wait()
        cpu.take_offered(worker.thread["ident"], done)
        with pytest.raises(IndexError, match="test"):
            done.result()
        nothing = worker.pool.submit(time.sleep, 0.05)
        cpu.take_offered(worker.thread["ident"], nothing)  # (waits for it: no call offered)
        assert nothing.done() and not cpu._offers
        cpu.take_offered(worker.thread["ident"], nothing)  # done already
        cpu.take_offered(None, nothing)
    finally:
        worker.close()


@needs_kernel
@pytest.mark.parametrize("dtype, x", [(torch.float32, 64), (torch.bfloat16, 128), (torch.uint8, 40)])
def test_the_row_gather_kernel_copies_index_selects_rows_and_zeros_the_rest(dtype, x):
    """rows.copy_rows on a CPU: the chosen rows of K and V as index_select copies them, the rows left for the new
    token and the correction zeros (never the memory's old bits); a row outside the pool is an error, not a read."""
    from infinigen_rt.kv import rows as pool

    gen = torch.Generator().manual_seed(x)
    src_k, src_v = (torch.randint(0, 200, (500, x), generator=gen).to(dtype) for _ in "kv")
    rows = torch.randint(0, 500, (2, 3, 37), generator=gen)
    out_k, out_v = (torch.full((2, 3, 41, x), 7, dtype=dtype) for _ in "kv")
    pool.copy_rows(src_k, src_v, rows, None, out_k, out_v, False)
    assert torch.equal(out_k[:, :, :37], src_k[rows]) and torch.equal(out_v[:, :, :37], src_v[rows])
    assert (out_k[:, :, 37:] == 0).all() and (out_v[:, :, 37:] == 0).all()
    big_k, big_v = (torch.full((2, 3, 60, x), 7, dtype=dtype) for _ in "kv")  # a window: rows 10 .. 51 of each
    assert cpu.gather_rows(src_k, src_v, rows, big_k[:, :, 10:51], big_v[:, :, 10:51])
    assert torch.equal(big_k[:, :, 10:47], src_k[rows]) and torch.equal(big_v[:, :, 10:47], src_v[rows])
    assert (big_k[:, :, 47:51] == 0).all() and (big_k[:, :, :10] == 7).all() and (big_v[:, :, 51:] == 7).all()
    with cpu.disabled():  # the torch path writes the window alike
        big_k.fill_(7), big_v.fill_(7)
        pool.copy_rows(src_k, src_v, rows, None, big_k[:, :, 10:51], big_v[:, :, 10:51], False)
        assert torch.equal(big_k[:, :, 10:47], src_k[rows]) and (big_k[:, :, 47:51] == 0).all()
        assert (big_v[:, :, 51:] == 7).all() and (big_v[:, :, :10] == 7).all()
    assert not cpu.gather_rows(src_k, src_v, rows, big_k[:, :, 10:51:2], big_v[:, :, 10:51:2])  # not rows in a run
    rows[1, 2, 5] = 500
    with pytest.raises(IndexError, match="outside"):
        cpu.gather_rows(src_k, src_v, rows, out_k, out_v)
    assert not cpu.gather_rows(src_k, src_v.double(), rows, out_k, out_v)  # not its tensors: index_select's turn


@needs_kernel
@pytest.mark.parametrize("keys", ["int4", "int2", "int4c"])
def test_a_cpu_decode_step_scores_and_quantizes_through_the_kernel(keys, bundles, monkeypatch):
    """The defaults' layouts (every key column at low bits, a correction) decoding a batch on a CPU: speculation's
    and the correction's scores (at 4 bits, per token or per channel) and every new per-token key's codes go through
    the kernels, and the logits are the torch path's up to float32 rounding (the tiny model's margins are wide: the
    tokens are the same)."""
    import math

    from infinigen_rt.policies import KVOptions
    from tests.rt.test_policies import PROMPTS, engines, greedy_logits

    kv = KVOptions(alpha=math.inf, budget=0.2, spec_keys=keys, correct=0.25)
    e, pol = engines(bundles["llama31_gqa"], x=("infinigen", kv))["x"]
    with cpu.disabled():
        ref, ref_toks, _ = greedy_logits(e, pol, PROMPTS, 6)
    calls = {"score": 0, "quantize": 0, "topk": 0, "group_softmax": 0, "correct_pick": 0}
    score, quantize, topk, softmax = cpu.score_codes, cpu.quantize_rows, cpu.topk, cpu.group_softmax
    channel = cpu.score_channel
    pick, channel_pick = cpu.correct_pick, cpu.correct_channel

    def counted(name, fn):
        def run(*a, **k):
            out = fn(*a, **k)
            calls[name] += out is not None and out is not False
            return out

        return run

    monkeypatch.setattr(cpu, "score_codes", counted("score", score))
    monkeypatch.setattr(cpu, "score_channel", counted("score", channel))
    monkeypatch.setattr(cpu, "quantize_rows", counted("quantize", quantize))
    monkeypatch.setattr(cpu, "topk", counted("topk", topk))
    monkeypatch.setattr(cpu, "group_softmax", counted("group_softmax", softmax))
    monkeypatch.setattr(cpu, "correct_pick", counted("correct_pick", pick))
    # (per-channel keys read in place: the scores, pick and pool rows in one call)
    monkeypatch.setattr(cpu, "correct_channel", counted("correct_pick", channel_pick))
    got, toks, _ = greedy_logits(e, pol, PROMPTS, 6)
    speculated = e.cfg.num_hidden_layers - pol.opts.dense_layers - 1  # layer j's rows chosen at layer j - 1
    scored = 5 * 2 * speculated if keys != "int2" else 0  # 2 bits: the torch path scores (the faster there)
    # (int4c's runs are quantized again as they fill, by torch)
    assert speculated > 0 and (calls["quantize"] > 0) == (keys != "int4c"), calls
    assert calls["score"] >= scored if scored else calls["score"] == 0, calls
    # speculation's selection and the correction's pick (its softmax, mask and top-k in one call) each step
    assert calls["topk"] >= 5 * speculated and calls["group_softmax"] >= 5 * speculated, calls
    assert calls["correct_pick"] >= 5 * speculated, calls
    assert torch.equal(toks, ref_toks)
    assert (got - ref).abs().max().item() <= 1e-3


@needs_kernel
@pytest.mark.parametrize("d, g, two", [(64, 3, True), (64, 1, False), (64, 7, True), (96, 2, False), (32, 4, True)])
def test_attention_over_the_rows_in_the_pool_is_sdpa_over_those_rows_gathered(d, g, two):
    """cpu.attend_rows (a CPU's decode step reading the chosen rows where the pool holds them): SDPA's output over
    the same rows gathered and then the new token's, up to float32 rounding, with rows that do not count (-1)
    skipped, one list of rows or two (speculation's and the correction's), the pairs in order, over torch's threads,
    or taken with a worker thread beside (at any pace); PoolRows gives the same with the kernels off (the rows
    gathered, SDPA masked); a row past the pool is an error, not a read."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from infinigen_rt.kv.attention import decode_sdpa
    from infinigen_rt.kv.rows import PoolRows

    gen = torch.Generator().manual_seed(d * g)
    b, hkv, slots = 3, 2, 300
    src_k, src_v = (torch.randn(slots * hkv, d, generator=gen) for _ in "kv")
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    kn, vn = (torch.randn(b, hkv, 1, d, generator=gen) for _ in "kv")
    rows = [torch.randint(0, slots * hkv, (b, hkv, n), generator=gen) for n in ((40, 9) if two else (45,))]
    for r in rows:
        r[torch.rand(r.shape, generator=gen) < 0.2] = -1
    rows[0][1, 0] = -1  # a pair none of whose first rows count (its others and the new token do)
    every = torch.cat(rows, -1)
    ok = every >= 0
    keys = torch.cat([src_k[every.clamp(min=0)], kn], 2)
    values = torch.cat([src_v[every.clamp(min=0)], vn], 2)
    mask = torch.cat([ok, torch.ones_like(ok[..., :1])], -1)[:, :, None]
    ref = decode_sdpa(q, keys, values, mask)
    worker = ThreadPoolExecutor(1)

    def first(fn):
        f = Future()
        f.set_result(fn())
        return f

    try:
        for beside in (None, worker.submit, first, lambda fn: Future()):
            got = cpu.attend_rows(q, src_k, src_v, rows, kn, vn, beside)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        with pytest.MonkeyPatch.context() as m:  # over torch's threads, a pair each at most
            m.setattr(cpu, "SPLIT_WORK", 0)
            m.setattr(torch, "get_num_threads", lambda: 2)
            torch.testing.assert_close(cpu.attend_rows(q, src_k, src_v, rows, kn, vn), ref, rtol=1e-5, atol=1e-6)
    finally:
        worker.shutdown()
    with cpu.disabled():
        assert cpu.attend_rows(q, src_k, src_v, rows, kn, vn) is None
        torch.testing.assert_close(PoolRows(src_k, src_v, rows).attend(q, kn, vn), ref, rtol=1e-5, atol=1e-6)
    assert cpu.attend_rows(q.double(), src_k, src_v, rows, kn, vn) is None  # not its dtype: the caller's SDPA
    rows[-1][2, 1, 3] = slots * hkv
    with pytest.raises(IndexError):
        cpu.attend_rows(q, src_k, src_v, rows, kn, vn)


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (8, 576, 577), (3, 100, 33), (5, 7, 4), (8, 16, 1)])
def test_a_decode_steps_linear_layer_is_f_linear_and_the_same_in_any_batch(m, k, n):
    """The linear kernel gives F.linear's outputs to float32 rounding (head dims with a tail past 16 columns, a
    bias, any leading shape), and each row's exactly as alone or in the batch."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    got = cpu.linear(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    assert got is not None and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert all(torch.equal(cpu.linear(x[i : i + 1], w, b)[0], got[i]) for i in range(m))
    lead = cpu.linear(x[None], w)
    assert lead is not None and lead.shape == (1, m, n) and torch.equal(lead[0] + b, got)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (8, 576, 577), (3, 100, 33), (5, 7, 4)])
def test_the_linear_kernel_reads_half_width_weights_as_their_float32_values(dtype, m, k, n, monkeypatch):
    """A float16 or bfloat16 weight gives, bit for bit, what the kernel gives for the same weight widened to float32
    (a tail past 16 columns, a bias), on one thread and with its rows lent to a second one."""
    from concurrent.futures import ThreadPoolExecutor

    assert cpu.narrow_weights()
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).to(dtype), torch.randn(n)
    want = cpu.linear(x, w.float(), b)
    got = cpu.linear(x, w, b)
    assert got is not None and torch.equal(got, want)
    torch.testing.assert_close(got, torch.nn.functional.linear(x.double(), w.double(), b.double()).float(),
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    monkeypatch.setattr(cpu, "LEND_WORK", 0)
    with ThreadPoolExecutor(1) as pool, cpu.lending(pool.submit):
        assert torch.equal(cpu.linear(x, w, b), want)


@needs_kernel
def test_the_linear_kernel_declines_what_it_does_not_take():
    """More rows than a decode step's, another dtype, a weight not contiguous, or autograd recording: torch's
    matmul runs (None)."""
    w = torch.randn(8, 16)
    assert cpu.linear(torch.randn(cpu.LINEAR_ROWS + 1, 16), w) is None
    assert cpu.linear(torch.randn(2, 16).double(), w.double()) is None
    assert cpu.linear(torch.randn(2, 16).half(), w.half()) is None  # (the rows float32, whatever the weight)
    assert cpu.linear(torch.randn(2, 16), torch.randn(16, 8).t()) is None
    assert cpu.linear(torch.randn(2, 16, requires_grad=True), w) is None
    with torch.no_grad():
        assert cpu.linear(torch.randn(2, 16, requires_grad=True), w) is not None
    with cpu.disabled():
        assert cpu.linear(torch.randn(2, 16), w) is None


@needs_kernel
@pytest.mark.parametrize("name", ["llama31_gqa", "opt", "gemma3"])
def test_a_cpu_decode_steps_linear_layers_and_head_go_through_the_kernel(name, bundles, monkeypatch):
    """Every projection, MLP layer and the head of a decode step (a batch of three) runs the linear kernel (Llama's
    and Gemma's q, k and v in one call, gate and up in one: Attention.fuse, MLP.fuse), the prefill's many rows
    torch's matmul; the logits are the torch path's up to float32 rounding."""
    from tests.rt.test_policies import PROMPTS, engines, greedy_logits

    e, pol = engines(bundles[name])["full"]
    with cpu.disabled():
        ref, ref_toks, _ = greedy_logits(e, pol, PROMPTS, 3)
    ran = []
    linear = cpu.linear

    def counted(x, *a):
        out = linear(x, *a)
        ran.append((x.numel() // x.shape[-1], out is not None))
        return out

    monkeypatch.setattr(cpu, "linear", counted)
    got, toks, _ = greedy_logits(e, pol, PROMPTS, 3)
    per_layer = 6 if name == "opt" else 4  # q, k, v, out; fc1, fc2 / q, k and v in one, o; gate and up in one, down
    decode = [took for rows, took in ran if rows == len(PROMPTS)]
    assert len(decode) >= 3 * (per_layer * e.cfg.num_hidden_layers + 1) and all(decode), ran
    assert not any(took for rows, took in ran if rows > cpu.LINEAR_ROWS)
    assert torch.equal(toks, ref_toks)


@needs_kernel
@pytest.mark.parametrize(
    "name, dtype", [("llama32", "float16"), ("gemma3", "bfloat16"), ("qwen25", "float16"), ("opt", "float16")]
)
def test_a_half_width_bundle_keeps_its_matrices_narrow_on_a_cpu_with_the_same_logits(
    name, dtype, checkpoints, calib_file, tmp_path, monkeypatch
):  # fmt: skip
    """A float32 engine on a CPU keeps a float16 or bfloat16 bundle's linear weights (and a tied head's embeddings)
    as they are stored, every other tensor widened, and calls q, k and v's projections as one, gate and up as one
    (Attention.fuse, MLP.fuse: a bias, a query and key norm, RoPE on both at once); its logits, prefill and decode,
    with `full` and with InfiniGen, are those of the same bundle with every tensor widened at load and each
    projection its own call, bit for bit."""
    from infinigen_rt import models
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.models.llama import MLP, Attention, Linear
    from infinigen_rt.policies import KVOptions, configure
    from tests.conftest import tiny_convert
    from tests.rt.test_policies import PROMPTS, greedy_logits

    bundle = read_bundle(tiny_convert(checkpoints[name], tmp_path / name, calib_file, dtype=dtype))
    e = Engine(bundle, device="cpu", dtype="float32")
    with monkeypatch.context() as m:
        m.setattr(models, "keeps_narrow", lambda device, dtype: False)
        m.setattr(Attention, "fuse", lambda self: None)
        m.setattr(MLP, "fuse", lambda self: None)
        wide = Engine(bundle, device="cpu", dtype="float32")
    fused = [hasattr(m, "qkv") or hasattr(m, "gate_up") for m in e.model.modules() if isinstance(m, Attention | MLP)]
    assert fused and all(fused) or name == "opt"
    narrow = getattr(torch, dtype)
    kept = {f"{n}.weight" for n, mod in e.model.named_modules() if isinstance(mod, Linear)}
    if e.cfg.tie_word_embeddings:
        kept.add("embed_tokens.weight")
    params = dict(e.model.named_parameters())
    assert len(kept) > 4 * e.cfg.num_hidden_layers
    assert {n for n, p in params.items() if p.dtype == narrow} == kept
    assert all(p.dtype == torch.float32 for n, p in params.items() if n not in kept)
    assert all(p.dtype == torch.float32 for p in wide.model.parameters())
    for args in [(), ("infinigen", KVOptions(budget=0.5))]:
        got, toks, _ = greedy_logits(e, configure(e, *args), PROMPTS, 4)
        ref, ref_toks, _ = greedy_logits(wide, configure(wide, *args), PROMPTS, 4)
        assert got.dtype == torch.float32 and torch.equal(got, ref) and torch.equal(toks, ref_toks), args
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_head_sized_linear_layer_lends_half_its_rows_to_the_thread_beside(monkeypatch):
    """Within `lending`, a linear layer of LEND_WORK multiply-adds or more shares its rows with the worker beside (a
    smaller one, or the same weights at fewer rows, none), and its outputs are those computed alone, bit for bit;
    a share that never starts is cancelled, its rows computed by the calling thread."""
    from concurrent.futures import Future

    from infinigen_rt.kv.prefetch import WorkerThread

    monkeypatch.setattr(cpu, "LEND_WORK", 3 * 64 * 16)
    gen = torch.Generator().manual_seed(3)
    x, w, small = (torch.randn(*s, generator=gen) for s in ((3, 16), (4096, 16), (8, 16)))
    alone, alone_small, alone_row = cpu.linear(x, w), cpu.linear(x, small), cpu.linear(x[:2], w[:64])
    worker, lent = WorkerThread(), []

    def beside(fn):
        lent.append(fn)
        return worker.beside(fn, then=False)

    try:
        with cpu.lending(beside):
            got, got_small, got_row = cpu.linear(x, w), cpu.linear(x, small), cpu.linear(x[:2], w[:64])
        assert len(lent) == 1 and torch.equal(got, alone) and torch.equal(got_small, alone_small)
        assert torch.equal(got_row, alone_row)
        with cpu.lending(lambda fn: Future()):  # never started: cancelled, the rows computed here
            assert torch.equal(cpu.linear(x, w), alone)
        assert getattr(cpu._lent, "beside", None) is None
    finally:
        worker.close()


def test_each_item_runs_once_on_the_calling_thread_and_the_worker_beside():
    """cpu.each (a dense layer's attention, a sequence at a time): within `lending` the calling thread and the
    worker take the items from one counter, each item once, both threads working; an item's error reaches the
    caller; outside `lending`, every item on the calling thread, in order."""
    import threading
    import time

    from infinigen_rt.kv.prefetch import WorkerThread

    seen = []

    def item(i):
        seen.append((i, threading.current_thread().name))
        time.sleep(0.002)

    cpu.each(5, item)
    assert seen == [(i, threading.current_thread().name) for i in range(5)]
    worker = WorkerThread()
    try:
        with cpu.lending(lambda fn: worker.beside(fn, then=False)):
            seen.clear()
            cpu.each(40, item)
            assert sorted(i for i, _ in seen) == list(range(40))
            assert len({name for _, name in seen}) == 2
            with pytest.raises(ZeroDivisionError):
                cpu.each(40, lambda i: 1 / (i != 30))
    finally:
        worker.close()
