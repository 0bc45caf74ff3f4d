"""The Triton row gather and the selection's group softmax and top-k against their pure-torch definitions: under
TRITON_INTERPRET=1 on CPU tensors here (set by conftest), compiled on a GPU where one is present (then the source is
pinned host memory, as in the pool); the selection's kernels compiled ahead of time for sm_80 and sm_90."""

from __future__ import annotations

import json

import pytest
import torch

from infinigen_rt.kv.kernels import (
    available,
    gather_reused,
    gather_rows,
    gather_rows_reference,
    scatter_rows,
    scatter_rows_reference,
)

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pool_tensor(shape, dtype, gen):
    t = torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point else torch.randint(
        0, 255, shape, generator=gen, dtype=torch.int64
    ).to(dtype)
    return t.pin_memory() if DEVICE.type == "cuda" else t


@pytest.mark.parametrize(
    "dtype, groups, n, extra, width",
    [
        (torch.float16, 6, 13, 1, 64),  # SmolLM2's head_dim, an odd count, room for the new token
        (torch.bfloat16, 3, 1, 1, 128),  # Llama's head_dim, one row
        (torch.float32, 5, 37, 0, 24),  # more rows than a program moves, no extra room
        (torch.uint8, 4, 9, 2, 32),  # int4's packed rows
        (torch.float16, 2, 7, 1, 1),  # int4's per-group scales: one value a row
    ],
)
def test_gather_equals_its_definition(dtype, groups, n, extra, width):
    gen = torch.Generator().manual_seed(groups * 100 + n)
    n_rows = 50
    src_a, src_b = pool_tensor((n_rows, width), dtype, gen), pool_tensor((n_rows, width), dtype, gen)
    rows = torch.randint(0, n_rows, (groups, n), generator=gen).to(DEVICE)
    ok = (torch.rand(groups, n, generator=gen) > 0.3).to(DEVICE)  # padding and evicted slots do not count
    ok[0] = True
    for mask in (ok, None):
        outs = []
        for fn in (gather_rows, gather_rows_reference):
            out_a = torch.full((groups, n + extra, width), 7, dtype=dtype, device=DEVICE)
            out_b = torch.full_like(out_a, 7)
            fn(src_a, src_b, rows, mask, out_a, out_b)
            outs.append((out_a, out_b))
        (ka, kb), (ra, rb) = outs
        assert torch.equal(ka, ra) and torch.equal(kb, rb)
        assert bool((ka[:, n:] == 7).all())  # the extra rows are left for the new tokens
        if mask is not None:
            assert bool((ka[:, :n][~mask] == 0).all())  # a row that does not count is zeros, not pool bytes
        assert torch.equal(ka[0, :n], src_a[rows[0].cpu()].to(DEVICE))
    # after rows already there (the correction's, into the room speculation's gather left): those are kept
    outs = []
    for fn in (gather_rows, gather_rows_reference):
        out_a = torch.full((groups, 3 + n + extra, width), 7, dtype=dtype, device=DEVICE)
        out_b = torch.full_like(out_a, 7)
        fn(src_a, src_b, rows, ok, out_a, out_b, 3)
        outs.append((out_a, out_b))
    (ka, kb), (ra, rb) = outs
    assert torch.equal(ka, ra) and torch.equal(kb, rb)
    assert bool((ka[:, :3] == 7).all()) and bool((ka[:, 3 + n :] == 7).all())
    assert torch.equal(ka[0, 3 : 3 + n], src_a[rows[0].cpu()].to(DEVICE))
    with pytest.raises(RuntimeError, match="n_out >= first"):
        gather_rows(src_a, src_b, rows, ok, out_a, out_b, 4 + extra)
    # a selection's slots [B, Hkv, n] looked up in the step's table of pool rows, its count mask expanded over the
    # KV heads (one row a sequence, read in place)
    heads = 2 if groups % 2 == 0 else 1
    b = groups // heads
    table = torch.randint(0, n_rows, (b, heads, 40), generator=gen).to(DEVICE)
    slots = torch.randint(0, 40, (b, heads, n), generator=gen).to(DEVICE)
    counted = (torch.arange(n) < torch.randint(1, n + 1, (b, 1, 1), generator=gen)).to(DEVICE).expand(b, heads, n)
    outs = []
    for fn in (gather_rows, gather_rows_reference):
        out_a = torch.full((groups, n + extra, width), 7, dtype=dtype, device=DEVICE)
        out_b = torch.full_like(out_a, 7)
        fn(src_a, src_b, slots, counted, out_a, out_b, 0, table)
        outs.append((out_a, out_b))
    (ka, kb), (ra, rb) = outs
    assert torch.equal(ka, ra) and torch.equal(kb, rb)
    first = torch.gather(table, 2, slots)[0, 0, 0].item()
    assert torch.equal(ka[0, 0], src_a[first].to(DEVICE))


@pytest.mark.parametrize("cap", ["1", "3", ""])
def test_a_capped_gather_grid_loops_over_every_chunk(cap, monkeypatch):
    """INFINIGEN_GATHER_PROGRAMS (unset: GATHER_PROGRAMS from host memory): fewer programs than chunks, each looping
    over its share, move the same rows (fresh and reused); a cap that is not a count is a one-line error."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.kv import kernels

    gen = torch.Generator().manual_seed(len(cap))
    groups, n, width, n_rows = 5, 37, 24, 60  # 185 rows of 96 bytes: 12 chunks of 16 (12 of 16 uncapped too)
    monkeypatch.setattr(kernels, "CAPPED_CHUNK_BYTES", 16 * 96)
    monkeypatch.setattr(kernels, "GATHER_PROGRAMS", 5)
    src_a, src_b = pool_tensor((n_rows, width), torch.float32, gen), pool_tensor((n_rows, width), torch.float32, gen)
    rows = torch.randint(0, n_rows, (groups, n), generator=gen).to(DEVICE)
    ok = (torch.rand(groups, n, generator=gen) > 0.3).to(DEVICE)
    monkeypatch.setenv(kernels.GATHER_PROGRAMS_ENV, cap)
    assert kernels.gather_grid(groups * n, 96) == (int(cap or 5), 16, kernels.CAPPED_WARPS)
    uncapped = (int(cap), 16, kernels.CAPPED_WARPS) if cap else (12, 16, 4)  # (from device memory: no cap unless set)
    assert kernels.gather_grid(groups * n, 96, from_host=False) == uncapped
    outs = []
    for fn in (gather_rows, gather_rows_reference):
        out_a, out_b = (torch.full((groups, n + 1, width), 7.0, device=DEVICE) for _ in "ab")
        fn(src_a, src_b, rows, ok, out_a, out_b)
        outs.append((out_a, out_b))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    prev_a, prev_b = outs[1][0].reshape(-1, width), outs[1][1].reshape(-1, width)
    pos = torch.where(torch.rand(groups, n, generator=gen).to(DEVICE) > 0.5, torch.arange(groups * n, device=DEVICE)
                      .view(groups, n), -1)  # fmt: skip
    reused = [torch.full((groups, n + 1, width), 7.0, device=DEVICE) for _ in "ab"]
    gather_reused(src_a, src_b, prev_a, prev_b, rows, ok, pos, *reused)
    want = [torch.full((groups, n + 1, width), 7.0, device=DEVICE) for _ in "ab"]
    monkeypatch.setenv(kernels.GATHER_PROGRAMS_ENV, "0")  # a program a chunk
    gather_reused(src_a, src_b, prev_a, prev_b, rows, ok, pos, *want)
    assert torch.equal(reused[0], want[0]) and torch.equal(reused[1], want[1])
    monkeypatch.setenv(kernels.GATHER_PROGRAMS_ENV, "many")
    with pytest.raises(InfinigenError, match="whole number"):
        kernels.gather_grid(10, 96)
    monkeypatch.setenv(kernels.GATHER_PROGRAMS_ENV, "0")
    assert kernels.gather_grid(185, 96) == (12, 16, 4)
    monkeypatch.delenv(kernels.GATHER_PROGRAMS_ENV)
    monkeypatch.setattr(kernels, "CAPPED_CHUNK_BYTES", 32768)  # a chunk of 256 rows of 96 bytes, 128 of 256, 16 of 4k
    assert [kernels.gather_grid(10_000, b, True)[1] for b in (96, 256, 4096, 1 << 16)] == [256, 128, 16, 16]


@pytest.mark.parametrize(
    "dtype, n, width",
    [(torch.float16, 13, 64), (torch.bfloat16, 1, 128), (torch.float32, 37, 24), (torch.uint8, 9, 32),
     (torch.float16, 7, 1)],
)  # fmt: skip
def test_scatter_equals_its_definition(dtype, n, width):
    """New tokens into freed slots: distinct rows of the pool, the others untouched."""
    gen = torch.Generator().manual_seed(n * 10 + width)
    n_rows = 50
    base = pool_tensor((n_rows, width), dtype, gen)
    src = pool_tensor((n, width), dtype, gen).to(DEVICE)
    rows = torch.randperm(n_rows, generator=gen)[:n].to(DEVICE)
    got, want = base.clone(), base.clone()
    if DEVICE.type == "cuda":
        got = got.pin_memory()
    scatter_rows(got, rows, src)
    scatter_rows_reference(want, rows, src)
    assert torch.equal(got.cpu(), want.cpu())
    untouched = torch.ones(n_rows, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(got.cpu()[untouched], base.cpu()[untouched]) and torch.equal(got.cpu()[rows.cpu()], src.cpu())
    # a pair in one launch (a layer's new keys and values): each into its own pool at the same rows
    other, src_b = base.clone() + 1, pool_tensor((n, width), dtype, gen).to(DEVICE)
    got_a, got_b = base.clone(), other.clone()
    if DEVICE.type == "cuda":
        got_a, got_b = got_a.pin_memory(), got_b.pin_memory()
    scatter_rows(got_a, rows, src, got_b, src_b)
    assert torch.equal(got_a.cpu(), want.cpu())
    scatter_rows_reference(other, rows, src_b)
    assert torch.equal(got_b.cpu(), other.cpu())
    with pytest.raises(RuntimeError, match="dst_b and src_b together"):
        scatter_rows(got_a, rows, src, got_b, None)
    # and each new row after the rows gathered for attention (the last of each group's m rows), the rest untouched
    last_a = torch.full((n, 3, width), 5, dtype=dtype, device=DEVICE)
    last_b = last_a.clone()
    scatter_rows(got_a, rows, src, got_b, src_b, last_a, last_b)
    assert torch.equal(got_a.cpu(), want.cpu()) and torch.equal(got_b.cpu(), other.cpu())
    assert torch.equal(last_a[:, 2], src) and torch.equal(last_b[:, 2], src_b) and bool((last_a[:, :2] == 5).all())
    with pytest.raises(RuntimeError, match="last_a and last_b together"):
        scatter_rows(got_a, rows, src, None, None, last_a, last_b)


@pytest.mark.parametrize("dtype, width", [(torch.float16, 64), (torch.bfloat16, 128), (torch.float32, 24)])
def test_gather_reusing_the_last_rows_equals_its_definition(dtype, width):
    """gather_reused: a selected row held from the step before (pos >= 0) comes from the previous output, the others
    from the pool, zeros where a row does not count; the rows past n of each group are left as they were."""
    from infinigen_rt.kv.kernels import gather_reused, gather_reused_reference

    gen = torch.Generator().manual_seed(width)
    groups, n, extra, n_rows, n_prev = 4, 21, 1, 60, 50
    src_a, src_b = pool_tensor((n_rows, width), dtype, gen), pool_tensor((n_rows, width), dtype, gen)
    prev_a, prev_b = (torch.randn(n_prev, width, generator=gen).to(dtype).to(DEVICE) for _ in "ab")
    rows = torch.randint(0, n_rows, (groups, n), generator=gen).to(DEVICE)
    ok = (torch.rand(groups, n, generator=gen) > 0.2).to(DEVICE)
    pos = torch.where(torch.rand(groups, n, generator=gen) > 0.5, torch.randint(0, n_prev, (groups, n), generator=gen),
                      -1).to(DEVICE)  # fmt: skip
    outs = []
    for fn in (gather_reused, gather_reused_reference):
        out_a = torch.full((groups, n + extra, width), 7, dtype=dtype, device=DEVICE)
        out_b = out_a.clone()
        fn(src_a, src_b, prev_a, prev_b, rows, ok, pos, out_a, out_b)
        outs.append((out_a, out_b))
    (ka, kb), (ra, rb) = outs
    assert torch.equal(ka, ra) and torch.equal(kb, rb)
    held = ok & (pos >= 0)
    assert held.any() and (ok & (pos < 0)).any() and (~ok).any()
    assert torch.equal(ka[:, :n][held], prev_a[pos[held]]) and bool((ka[:, n:] == 7).all())


def test_the_gpu_kernels_are_typed_operators_that_check_their_tensors():
    """Every GPU kernel is a torch operator (torch.ops.infinigen_gpu: what a CUDA graph captures), its schema
    declaring the tensors it writes; an argument of the wrong kind is refused by the schema, and tensors of the wrong
    shape or dtype by the op's checks, before any kernel reads a pointer."""
    from infinigen_rt.kv import attention, kernels, quant
    from infinigen_rt.models import fused

    ops = torch.ops.infinigen_gpu
    assert {op.default for op in (ops.gather_rows, ops.gather_reused, ops.scatter_rows, ops.paged_decode,
                                  ops.score_codes, ops.quantize_rows, ops.quantize_channel, ops.rms_norm,
                                  ops.add_rms_norm, ops.rope, ops.silu_mul, ops.group_agg,
                                  ops.top_rows)
            } == set(kernels.BODIES)  # fmt: skip
    assert fused.rope is ops.rope and fused.silu_mul is ops.silu_mul
    assert gather_rows is ops.gather_rows and attention.paged_decode is ops.paged_decode
    assert quant.score_codes is ops.score_codes
    schema = str(ops.gather_rows.default._schema)
    assert "Tensor(a!) out_a" in schema and "Tensor(b!) out_b" in schema and "Tensor? ok" in schema
    src = torch.zeros(10, 8)
    out = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="rows \\[G, n\\] int64"):
        gather_rows(src, src, torch.zeros(2, 3), None, out, out.clone())  # float rows
    with pytest.raises(RuntimeError, match="in the sources' dtype"):
        gather_rows(src, src, torch.zeros(2, 3, dtype=torch.long), None, out.half(), out.half())
    with pytest.raises(RuntimeError):  # not a tensor where the schema wants one
        gather_rows(src, src, [0, 1], None, out, out.clone())
    with pytest.raises(RuntimeError, match="group_agg: s"):  # scores in half precision
        ops.group_agg(torch.zeros(1, 2, 3, 4, dtype=torch.half), None, None, None, None, None, False)
    with pytest.raises(RuntimeError, match="top_rows: k 5 within"):  # more than a row holds
        ops.top_rows(torch.zeros(1, 2, 4), 5)
    with pytest.raises(RuntimeError, match="top_rows: count"):  # counts as floats
        ops.top_rows(torch.zeros(1, 2, 4), 2, torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="group_agg: held"):  # a mask of another length
        ops.group_agg(torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 5, dtype=torch.bool), None, None, None, None, False)
    with pytest.raises(RuntimeError, match="scatter_rows"):
        scatter_rows(src, torch.zeros(3, dtype=torch.long), torch.zeros(2, 8))
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])
    gather_rows(src + torch.arange(10.0)[:, None], src, rows, None, out, out.clone())
    assert torch.equal(out[:, :3, 0], rows.float())


@pytest.mark.parametrize("g, t, held_kind", [(4, 70, "expanded"), (7, 300, "own"), (1, 5, None), (3, 700, "own")])
def test_the_group_softmax_op_equals_select_and_the_corrections_torch_chain(g, t, held_kind, monkeypatch):
    """kernels.group_agg (two passes over the scores, a cut after) against its definition in torch ops, in each form
    select and correction_rows call it: held slots shared by every KV head (an expanded mask) or each its own, the
    sinks' and recent tokens' values forced, a cut list of slots with a mask that counts fewer of them per sequence
    (expanded over the heads), or a slice of one; t over many splits, combined a few at a time."""
    from infinigen_rt.kv import kernels

    monkeypatch.setattr(kernels, "AGG_SPLIT", 64)  # many splits at a test's sizes,
    monkeypatch.setattr(kernels, "AGG_SPLITS", 4)  # combined over several rounds
    gen = torch.Generator().manual_seed(g * t)
    b, hkv = 2, 3
    s = torch.randn(b, hkv, g, t, generator=gen) * 4
    if held_kind == "expanded":
        held = (torch.rand(b, 1, t, generator=gen) > 0.2).expand(b, hkv, t)
    else:
        held = torch.rand(b, hkv, t, generator=gen) > 0.3 if held_kind else None
    forced = (torch.rand(b, hkv, t, generator=gen) > 0.9) & (held if held is not None else True)
    value = 10 + torch.rand(b, hkv, t, generator=gen)
    n = min(t, 40)
    cut = torch.stack([torch.randperm(t, generator=gen)[:n] for _ in range(b * hkv)]).view(b, hkv, n)
    ok = (torch.arange(n) < torch.tensor([[[n // 3]], [[n]]])).expand(b, hkv, n)
    forms = [(held, None, None, None, None, False), (held, forced, value, None, None, False),
             (held, None, None, cut, ok, True), (held, None, None, cut, None, True),
             (held, None, None, cut[..., : n // 2], ok[..., : n // 2], True)]  # fmt: skip

    def on(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x

    for form in forms:
        want = kernels.group_agg_reference(s, *form)
        got = torch.ops.infinigen_gpu.group_agg(on(s), *(on(x) for x in form)).cpu()
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="group_agg: forced and value together"):
        torch.ops.infinigen_gpu.group_agg(on(s), None, on(forced), None, None, None, False)


AGG_COMPILE = """
import json, sys, torch, triton
from infinigen_rt.kv._agg_kernel import cut_kernel, group_agg_kernel, group_stats_kernel
from tests.rt.test_kernels_aot import compiled

cc, g = int(sys.argv[1]), int(sys.argv[2])
gp = triton.next_power_of_2(g)
t, rows, split = 32768, 32, max(64, 1024 // gp)
s = torch.empty(rows, g, t)
held = torch.empty(rows, t, dtype=torch.bool)
value = torch.empty(rows, t)
stats = torch.empty(rows, t // split, 2, gp)
slots = torch.empty(rows, 2458, dtype=torch.int64)
shape = dict(HKV=8, G=g, GP=gp, SPLIT=split, HAS_HELD=True)
launches = [
    (group_stats_kernel, (s, held, stats, t, t // split, t, 0), shape),
    (group_agg_kernel, (s, held, held, value, stats, value, t, t // split, t, 0, t, 0, t, 0),
     dict(shape, NS=64, HAS_FORCED=True, FREE_INF=False)),
    (group_agg_kernel, (s, held, held, value, stats, value, t, t // split, t, 0, t, 0, t, 0),
     dict(shape, NS=64, HAS_FORCED=False, FREE_INF=True)),
    (cut_kernel, (value, slots, held, t, 2458, 2458 * 8, 2458, t, 0), dict(HKV=8, BLOCK=256, HAS_OK=True)),
]
print(json.dumps(compiled(launches, cc)))
"""


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("g", [4, 7])
def test_the_group_softmax_kernels_compile_for_sm80_and_sm90(cc, g):
    """group_agg's kernels at Llama-3.1-8B's shapes (4 query heads a KV head, 32k slots, 8 KV heads) and Qwen2.5's 7,
    compiled to cubin in a process of its own (no interpreter), with no local memory (spills)."""
    assert compile_in_a_process(AGG_COMPILE, cc, g) == {"local": False, "kernels": 4}


def compile_in_a_process(code: str, *argv) -> dict:
    """Run a compile script (its last line of output JSON) in a Python of its own, without the interpreter."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("t, k", [(70, 9), (5000, 700), (64, 64), (9000, 1), (4200, 4200)])
def test_the_top_k_op_takes_each_rows_best_first_in_slot_order_as_the_cpus_kernel(t, k):
    """kernels.top_rows (radix select, one program a row) against its definition in torch ops, exactly, in every form
    select and correction_rows call it (one count for every row, a count a sequence, read from the device, a count a
    (sequence, KV head), none: k), over rows with ties at the edge, infinities, both zeros and more than one pass's
    slots; with a row's every slot taken it is the CPU's unsorted top-k (slot order, of equal values the lower slots),
    and each row's first c are the same set as torch.topk's where the values are distinct; `ok` the first c of
    those above -inf."""
    from infinigen_rt.kv import cpu, kernels

    gen = torch.Generator().manual_seed(t + k)
    b, hkv = 2, 3
    x = torch.randn(b, hkv, t, generator=gen)
    x[0, 0, :5] = float("inf")
    x[..., 7:30] = 0.5  # ties, perhaps at the edge
    x[..., 40:45] = float("-inf")
    x[..., 50], x[..., 51] = -0.0, 0.0
    per_seq = torch.randint(0, k + 1, (b, 1), generator=gen)
    forms = [(None, -1), (None, k // 2), (per_seq, -1), (per_seq.view(b), -1),
             (torch.randint(0, k + 1, (b, hkv), generator=gen), -1), (per_seq.expand(b, hkv), -1)]  # fmt: skip

    def on(c):
        return c.to(DEVICE) if c is not None else None

    for count, n in forms:
        want = kernels.top_rows_reference(x, k, count, n)
        got = torch.ops.infinigen_gpu.top_rows(x.to(DEVICE), k, on(count), n)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
        c = (torch.full((b, hkv), k if n < 0 else n) if count is None else count.reshape(b, -1).expand(b, hkv))
        for r in range(b * hkv):  # distinct slots a row, the first c its c largest
            slots = want[1].view(-1, k)[r]
            assert len(set(slots.tolist())) == k
            first, rest = x.view(-1, t)[r][slots[: c.reshape(-1)[r]]], x.view(-1, t)[r][slots[c.reshape(-1)[r] :]]
            assert torch.equal(want[2].view(-1, k)[r], torch.cat([first > float("-inf"), rest < float("-inf")]))
            if len(first) and len(rest):
                assert first.min() >= rest.max()
    every = cpu.topk(x, k, False)
    if every is not None:  # the CPU's kernels are built here
        assert torch.equal(torch.ops.infinigen_gpu.top_rows(x.to(DEVICE), k)[1].cpu(), every[1])
    y = torch.randn(b, hkv, t, generator=gen)  # distinct values: the same set as torch.topk's
    got = torch.ops.infinigen_gpu.top_rows(y.to(DEVICE), k)[1].cpu()
    assert torch.equal(got.sort(-1).values, y.topk(k, -1).indices.sort(-1).values)


TOPK_COMPILE = """
import json, sys, torch
from infinigen_rt.kv._topk_kernel import top_rows_kernel
from tests.rt.test_kernels_aot import compiled

cc, t, k = int(sys.argv[1]), 32768, 3277
x, count = torch.empty(32, t), torch.empty(4, 1, dtype=torch.int64)
val, slot, ok = torch.empty(32, k), torch.empty(32, k, dtype=torch.int64), torch.empty(32, k, dtype=torch.int8)
meta = dict(HKV=8, BLOCK=4096, num_warps=16)
launches = [(top_rows_kernel, (x, count, val, slot, ok, t, k, k, 1, 0), dict(meta, HAS_COUNT=True)),
            (top_rows_kernel, (x, count, val, slot, ok, t, k, k, 0, 0), dict(meta, HAS_COUNT=False))]
print(json.dumps(compiled(launches, cc)))
"""


@pytest.mark.parametrize("cc", [80, 90])
def test_the_top_k_kernel_compiles_for_sm80_and_sm90(cc):
    """top_rows' kernel at Llama-3.1-8B's batch-4 shapes (32 rows of 32k slots, a tenth taken), with a count a
    sequence and with none, compiled to cubin in a process of its own, with no local memory (spills)."""
    assert compile_in_a_process(TOPK_COMPILE, cc) == {"local": False, "kernels": 2}
