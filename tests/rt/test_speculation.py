"""Speculation's choices on real (tiny) models: the keys it scores (the skewed partial columns, or every column at 4
or 2 bits), the correction step with the layer's true query, and the oracle at equal bytes; each exact at a full
budget, each moving what it says, on the CPU path and on the GPU's (the kernel through Triton's interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from infinigen_rt.kv.prefetch import Inline
from infinigen_rt.kv.quant import code_bytes, dequantize, quantize
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.policies.speculation import correction_rows, select
from infinigen_rt.runner import Request, Runner
from tests.conftest import run_cli
from tests.rt.stored import Stored, greedy_logits
from tests.rt.test_policies import PROMPTS, engines, needs_triton, selected
from tests.test_cli import one_line_error

VARIANTS = [("partial", 0.0), ("int4", 0.0), ("int2", 0.0), ("partial", 0.3), ("int4", 0.5), ("int4c", 0.25)]


@pytest.mark.parametrize("bits", [4, 2])
def test_low_bit_codes_round_trip_within_half_a_step(bits):
    x = torch.randn(3, 2, 5, 64) * torch.linspace(0.1, 4, 64)  # columns of very different size, as keys have
    group = 64 if bits == 4 else 32
    packed, scale, lo = quantize(x, group, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert packed[0, 0, 0].numel() + 2 * 2 * scale[0, 0, 0].numel() == code_bytes(64, group, bits)
    back = dequantize(packed, scale, lo, group, torch.float32, bits)
    step = scale.float().repeat_interleave(group, -1)
    assert ((back - x).abs() <= step / 2 + 1e-2 * x.abs().amax()).all()  # fp16 scale and min add a little
    assert not torch.equal(back, x)


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
@pytest.mark.parametrize("keys, correct", VARIANTS)
def test_every_key_choice_and_the_correction_are_exact_at_a_full_budget(name, keys, correct, bundles):
    kv = KVOptions(alpha=math.inf, budget=1.0, spec_keys=keys, correct=correct)
    es = engines(bundles[name], x=("infinigen", kv))
    ref, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 6)
    got, toks, run = greedy_logits(*es["x"], PROMPTS, 6)
    assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
    r = run.report()
    assert r.kv_fetched_share == 1.0
    assert (r.kv_corrected_share or 0) > 0 if correct else r.kv_corrected_share is None


def fetched_rows(run: Stored) -> list[list[int]]:
    """Record, per corrected layer, step and (sequence, KV head), the rows its fetch took that count: speculation's
    and the correction's (pool rows where attention reads them in the pool, else slots)."""
    seen, sel = [], run.store.selector
    correct = sel.correct

    def recording(step, layer, q, spec, k, v):
        out = correct(step, layer, q, spec, k, v)
        if sel.in_place:  # (selection, speculation's pool rows, the correction's or None): -1 where one does not count
            rows = out[1] if out[2] is None else torch.cat(out[1:], -1)
            seen.extend(r[r >= 0].tolist() for r in rows.flatten(0, 1))
        else:
            slots = out[0].all_slots()  # speculation's and the correction's
            ok = out[0].ok.expand(slots.shape)
            seen.extend(r[o].tolist() for r, o in zip(slots.flatten(0, 1), ok.flatten(0, 1), strict=True))
        return out

    sel.correct = recording
    return seen


@pytest.mark.parametrize("keys", ["partial", "int4"])
def test_the_correction_fetches_only_what_speculation_missed_within_the_same_budget(keys, bundles):
    """Speculation keeps 1 - correct of the budget and the correction the rest: the rows fetched per step are the
    budget's count either way (equal bytes), no row is fetched twice, and the correction's share is what it took."""
    shares = {}
    for correct in (0.0, 0.5):
        kv = KVOptions(alpha=math.inf, budget=0.4, spec_keys=keys, correct=correct)
        e, pol = engines(bundles["llama31_gqa"], x=("infinigen", kv))["x"]
        run = Stored(e, pol, PROMPTS[:1], 9)
        seen = fetched_rows(run)
        run.greedy(8)
        assert bool(seen) == bool(correct)
        assert all(len(rows) == len(set(rows)) for rows in seen)
        r = run.report()
        shares[correct] = r.kv_fetched_share, r.kv_corrected_share
    assert shares[0.5][0] == shares[0.0][0]  # the same rows per step
    assert shares[0.0][1] is None and 0.1 < shares[0.5][1] < 0.3  # about half of the 40 %


def test_the_oracle_keeps_infinigens_count_and_the_per_head_oracle_more(bundles):
    """`oracle` keeps one top-k per KV head at infinigen's count (the same share of the rows), `oracle-per-head` the
    union of its group's per-query-head sets (more rows under GQA); both attend to everything at a full budget."""
    b = bundles["llama31_gqa"]
    share = {}
    for name in ("infinigen", "oracle", "oracle-per-head"):
        kv = KVOptions(alpha=math.inf, budget=0.25)
        _, _, run = greedy_logits(*engines(b, x=(name, kv))["x"], PROMPTS, 8)
        share[name] = run.report().kv_fetched_share
    assert share["oracle"] == share["infinigen"]
    assert share["oracle-per-head"] > 1.2 * share["oracle"]
    es = engines(b, o=("oracle", KVOptions(budget=1.0)), p=("oracle-per-head", KVOptions(budget=1.0)))
    ref, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 6)
    for name in ("o", "p"):
        got, toks, run = greedy_logits(*es[name], PROMPTS, 6)
        assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
        assert run.report().kv_fetched_share == 1.0


def test_the_correction_with_a_shortlist_takes_the_true_querys_best_among_speculations_next():
    """select(extra=m) keeps speculation's own rows (the same set as without) and the m it ranked next, in order;
    the correction then takes the true query's best of those m by the group's softmax over the candidates."""
    g = torch.Generator().manual_seed(3)
    b, hkv, gq, t = 2, 3, 3, 200
    spec, true = torch.randn(2, b, hkv, gq, t, generator=g)
    opts = KVOptions(alpha=math.inf, budget=0.1)
    plain = select(spec, math.inf, opts)
    sel = select(spec, math.inf, opts, shortlist=plain.slots.shape[-1] + 30)
    n = plain.slots.shape[-1]
    assert sel.cand.shape == (b, hkv, n + 30) and torch.equal(sel.slots, sel.cand[..., :n])
    assert torch.equal(sel.slots.sort(-1).values, plain.slots.sort(-1).values)
    ranked = spec.softmax(-1).sum(2)
    rest = ranked.gather(2, sel.cand[..., n:])
    assert (rest[..., :-1] >= rest[..., 1:]).all()  # the next-ranked, in order
    others = torch.ones(b, hkv, t, dtype=torch.bool).scatter_(2, sel.cand, False)
    assert (ranked[others].view(b, hkv, -1).amax(-1) <= rest.amin(-1)).all()  # none better left out
    s = true.gather(3, sel.cand[:, :, None].expand(-1, -1, gq, -1))
    slots, ok = correction_rows(s, sel, None, [7, 7], "sum")
    agg = s.softmax(-1).sum(2)
    agg[..., :n] = -math.inf
    want = sel.cand.gather(2, agg.topk(7).indices)
    assert ok.all() and torch.equal(slots.sort(-1).values, want.sort(-1).values)


def test_a_shortlist_of_every_slot_is_the_plain_correction_and_a_short_one_changes_only_the_corrected_rows(bundles):
    """In the batch's store and in a store of its own: a shortlist covering every slot gives the correction's own
    tokens and logits; a short one fetches as many rows (the same budget), the correction's among them."""
    e = engines(bundles["llama31_gqa"])["full"][0]
    prompts = [list(range(5, 62)), list(range(70, 101)), list(range(110, 153))]
    outs, shares = {}, {}
    for shortlist in (0.0, 1e6, 1.0):
        kv = KVOptions(alpha=math.inf, budget=0.3, correct=0.5, shortlist=shortlist)
        pol = configure(e, "infinigen", kv)
        run = Runner(e, pol, max_batch=3, prefill_chunk=16, kv_tokens=1024)
        ids = [run.add(Request(p, 8)) for p in prompts]
        done = {}
        while run.has_work:
            done.update({o.id: o for o in run.step() if o.finished})
        outs[shortlist] = [done[i].generation.token_ids for i in ids]
        reps = [done[i].report for i in ids]
        shares[shortlist] = [(r.kv_fetched_share, r.kv_corrected_share) for r in reps]
        logits = greedy_logits(e, pol, prompts[:2], 6)
        if shortlist == 0.0:
            ref = logits
        elif shortlist == 1e6:
            assert torch.equal(logits[1], ref[1]) and (logits[0] - ref[0]).abs().max().item() <= 1e-4
    assert outs[1e6] == outs[0.0] and shares[1e6] == shares[0.0]
    assert [f for f, _ in shares[1.0]] == [f for f, _ in shares[0.0]]  # as many rows
    assert all(c > 0 for _, c in shares[1.0])


def _gpu_step_chooses_what_the_cpu_step_does(kv, bundles):
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", kv))["ig"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, e.cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 37)]
    ref, ref_toks, cpu = greedy_logits(e, pol, prompts, 8, prefetch=Inline())
    got, toks, gpu = greedy_logits(e, pol, prompts, 8, prefetch=Inline(), gpu=True)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for j in cpu.store.pooled:
        for i in range(2):
            assert torch.equal(selected(cpu, j, i), selected(gpu, j, i))
    assert sum(selected(cpu, j, 0).sum() for j in cpu.store.pooled) > 0
    r, rc = gpu.report(), cpu.report()
    fetched = sum(gpu.store.ledger.get(f"fetched{j}", rid) for j in gpu.store.pooled for rid in gpu.rids)
    assert r.bytes_h2d == fetched * 2 * e.cfg.head_dim * 4  # the speculated and the corrected rows that count
    assert r.kv_fetched_share == rc.kv_fetched_share and r.kv_corrected_share == rc.kv_corrected_share
    assert r.evictions > 0


@needs_triton
@pytest.mark.parametrize("keys, correct", VARIANTS[1:])
def test_the_gpu_step_chooses_what_the_cpu_step_does_with_every_key_choice(keys, correct, bundles):
    """The GPU path (fetch sizes from host counts, the kernel's rows, the correction's gather on the critical path)
    gives the CPU path's tokens, selections and shares, with rows of two lengths and an evicting capacity (the masked
    path); only rows that count cross."""
    _gpu_step_chooses_what_the_cpu_step_does(
        KVOptions(alpha=1.0, budget=0.3, capacity=0.6, spec_keys=keys, correct=correct), bundles)


@needs_triton
@pytest.mark.parametrize("keys", ["partial", "int4"])
def test_the_gpu_step_chooses_what_the_cpu_step_does_with_a_shortlist(keys, bundles):
    """The same with the correction scoring a shortlist (each row's candidates through the kernel's slots)."""
    _gpu_step_chooses_what_the_cpu_step_does(
        KVOptions(alpha=1.0, budget=0.3, capacity=0.6, spec_keys=keys, correct=0.5, shortlist=1.5), bundles)


def test_bad_speculation_options(bundles):
    b = bundles["tied_hd64"]
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--spec-keys", "int3"), "spec-keys")
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--correct", "1"), "correct")
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--shortlist", "-1"), "shortlist")
    one_line_error(run_cli("rt", "eval", b, "--text", "x.txt", "--spec-keys", "fp8"), "spec-keys")
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--dense-layers", "99"), "no layer")


@pytest.mark.parametrize("bits, d", [(4, 64), (4, 128), (2, 64), (4, 80), (2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_scores_low_bit_keys_without_forming_them_as_the_dequantized_keys_score(bits, d, dtype):
    """quant.score_span (scale * (q . codes) + minimum * sum(q) per group, on codes unpacked four bytes a word, or a
    byte at a time where a group's bytes are not a multiple of four) against q @ the dequantized keys, both in float64
    from the same bf16 or fp32 query: one group a row or two, 4 and 2 bits, head_dim 80's one group of 80."""
    from infinigen_rt.kv import quant
    from infinigen_rt.policies.speculation import key_group

    gen = torch.Generator().manual_seed(bits * d)
    group = key_group(d, bits)
    x = torch.randn(2, 3, 40, d, generator=gen) * torch.linspace(0.1, 4, d)
    codes, scale, lo = quantize(x, group, bits)
    q = torch.randn(2, 3, 4, d, generator=gen).to(dtype)
    want = q.double() @ dequantize(codes, scale, lo, group, torch.float64, bits).transpose(-1, -2)
    got = quant.score_span(q, codes, torch.stack([scale, lo], -2), group, bits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_low_bit_keys_score_the_same_a_span_at_a_time(bundles, monkeypatch):
    """The keys are dequantized a span of slots at a time (a step's memory stays small at long context): spans of 64
    give the scores, tokens and logits of one span over everything."""
    from infinigen_rt.kv import cpu, quant

    kv = KVOptions(alpha=math.inf, budget=0.2, spec_keys="int4", correct=0.25)
    e, pol = engines(bundles["llama31_gqa"], x=("infinigen", kv))["x"]
    prompt = [list(range(4, 180))]
    with cpu.disabled():  # the torch path (a CPU with its kernel scores without spans)
        ref, ref_toks, _ = greedy_logits(e, pol, prompt, 4)
        monkeypatch.setattr(quant, "CHUNK_BYTES", 0)
        got, toks, _ = greedy_logits(e, pol, prompt, 4)
    assert torch.equal(toks, ref_toks) and torch.equal(got, ref)


@pytest.mark.parametrize("keys", ["partial", "int4", "int2", "int4c"])
def test_the_memory_model_counts_the_speculation_keys_allocated(keys, bundles):
    """What bench's floor and the pool reservation are told (KVPolicy.kv_bytes) holds the key store's own tensors:
    the speculation keys' device bytes are the policy's device bytes less offload's at the same shape."""
    from infinigen_rt.policies.offload import Offload

    e, pol = engines(bundles["llama31_gqa"], x=("infinigen", KVOptions(spec_keys=keys)))["x"]
    batch, slots = 2, 48  # (the store's slots: whole blocks of 16)
    keys_held = Stored(e, pol, [list(range(4, 3 + slots))] * batch, 1).store.selector.keys
    token_heads, esz = batch * e.cfg.num_key_value_heads * slots, 4
    device = pol.kv_bytes(e, token_heads, esz)[0]
    dense = pol.opts.dense_layers
    base = Offload.pool_bytes(e, token_heads, 2 * e.cfg.head_dim * esz, dense)[0]
    assert device - base == keys_held.device_bytes > 0
    if keys == "int4":  # every column at 4 bits: half a byte per value, 4 bytes of scale and minimum per 64 (or row)
        assert keys_held.device_bytes == token_heads * (e.cfg.head_dim // 2 + 4 * max(1, e.cfg.head_dim // 64)) * (
            e.cfg.num_hidden_layers - dense)  # fmt: skip


def _channel_store(batch: int, slots: int, hkv: int = 2, d: int = 64):
    from types import SimpleNamespace

    from infinigen_rt.policies.speculation import ChannelKeys

    spec = SimpleNamespace(cfg=SimpleNamespace(head_dim=d, num_key_value_heads=hkv))
    return ChannelKeys(spec, [0], batch, slots, "cpu", torch.float32)


def test_per_channel_keys_keep_small_channels_beside_huge_offsets_where_per_token_groups_lose_them():
    """int4c's keys (a scale per channel over 16 slots) against the true keys, with four channels offset by 40 (as
    Qwen's key biases make): each score within half a step per channel of the true one, written at once or a token
    at a time (each write quantizes its run again), and several times closer than int4's per-token groups of 64,
    whose one scale the huge channels set."""
    from infinigen_rt.kv import quant
    from infinigen_rt.policies.speculation import key_group

    gen = torch.Generator().manual_seed(3)
    b, hkv, n, d = 2, 2, 70, 64
    k = torch.randn(b, hkv, n, d, generator=gen)
    k[..., :4] += 40.0
    q = torch.randn(b, hkv, 3, d, generator=gen)
    true = q @ k.transpose(-1, -2)
    at_once, by_token = _channel_store(b, n), _channel_store(b, n)
    at_once.write(0, k, 0)
    by_token.write(0, k[:, :, :5], 0)
    for i in range(5, n):
        by_token.write(0, k[:, :, i : i + 1], i)
    runs = k.unflatten(2, (-1, 1))[:, :, :64].reshape(b, hkv, 4, 16, d)
    step = (runs.amax(3) - runs.amin(3)) / 15  # [B, Hkv, runs, D]: each channel's step over its run
    bound = (q.abs()[:, :, :, None] * step[:, :, None]).sum(-1) / 2 * 1.05 + 1e-2  # [B, Hkv, G, runs]
    err = (at_once.scores(0, q, n) - true).abs()
    assert (err[..., :64].unflatten(-1, (4, 16)) <= bound[..., None]).all()
    err_tok = (by_token.scores(0, q, n) - true).abs()
    assert err_tok.max() <= 2 * err.max()  # quantized again as its run filled: a little more, no drift
    codes, scale, lo = quant.quantize(k, key_group(d, 4), 4)
    per_token = q @ quant.dequantize(codes, scale, lo, key_group(d, 4), torch.float32, 4).transpose(-1, -2)
    assert (per_token - true).abs().mean() > 4 * err.mean()


def test_per_channel_keys_score_the_same_through_every_way_of_naming_slots():
    """scores (a row's first t slots), scores_at a slice, each (sequence, KV head)'s own slots, and one row's slots
    per sequence (the batch's store): the same numbers for the same slots, a span at a time or all at once."""
    from infinigen_rt.kv import quant

    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 2, 75, 64, generator=gen) * torch.linspace(0.2, 5, 64)
    q = torch.randn(2, 2, 3, 64, generator=gen)
    rows = _channel_store(2, 80)
    rows.write(0, k, 0)
    every = rows.scores(0, q, 75)
    pair = torch.randint(0, 75, (2, 2, 9), generator=gen)
    want = torch.gather(every, 3, pair[:, :, None].expand(-1, -1, 3, -1))
    torch.testing.assert_close(rows.scores_at(0, q, pair), want)
    one = _channel_store(1, 160)  # one row: sequence 0 in slots 0..74, sequence 1 in 80..154
    one.write(0, k[:1], 0)
    one.write(0, k[1:], 80)
    torch.testing.assert_close(one.scores_at(0, q[:1], slice(0, 75)), every[:1])
    torch.testing.assert_close(one.scores_at(0, q[1:], slice(80, 155)), every[1:])
    seq = torch.stack([torch.arange(75), torch.arange(80, 155)])
    torch.testing.assert_close(one.scores_at(0, q, seq), every)
    old = quant.CHUNK_BYTES
    try:
        quant.CHUNK_BYTES = 0  # spans of one run
        torch.testing.assert_close(rows.scores(0, q, 75), every)
        torch.testing.assert_close(one.scores_at(0, q, seq), every)
    finally:
        quant.CHUNK_BYTES = old


def test_per_channel_keys_forget_a_page_another_sequence_left_and_keep_freed_slots_neighbours():
    """A run's range spans its own sequence's keys only: a key appended at the start of a page whose slots held
    another sequence's huge keys is kept as if alone (within fp16), while a key written into a freed slot (not an
    append) keeps the run's other keys in the range, as they are still held."""
    store = _channel_store(1, 32, hkv=1)
    store.write(0, torch.full((1, 1, 16, 64), 500.0) + torch.arange(16.0)[:, None], 0)  # another sequence's page
    new = torch.randn(1, 1, 1, 64)
    store.write(0, new, torch.zeros(1, 1, 1, dtype=torch.long), appends=torch.ones(1, 1, 1, dtype=torch.bool))
    q = torch.eye(64)[None, None]  # each channel's value
    torch.testing.assert_close(store.scores(0, q, 1)[0, 0, :, 0], new[0, 0, 0], rtol=1e-3, atol=1e-3)
    held = _channel_store(1, 32, hkv=1)
    held.write(0, torch.arange(16.0)[None, None, :, None].expand(1, 1, 16, 64) * 10, 0)
    held.write(0, torch.zeros(1, 1, 1, 64), torch.full((1, 1, 1), 5))  # freed slot 5, the run's others held
    got = held.scores(0, q, 16)  # [1, 1, 64, 16]: channel c's value at each slot
    want = torch.arange(16.0) * 10
    want[5] = 0
    assert (got - want).abs().max() <= 150 / 15 / 2 + 0.1


@pytest.mark.parametrize("t", [200, 203])
def test_a_selection_in_runs_takes_whole_aligned_runs_ranked_by_the_attention_they_hold(t):
    """KVOptions.runs: speculation's rows are whole runs of consecutive slots (the last one short where t is not a
    multiple), the runs whose tokens hold the most of the group's attention, at the budget's count; sinks' and
    recent tokens' runs first; the sync-free (GPU) selection's first n are the same slots."""
    g = torch.Generator().manual_seed(5)
    b, hkv, gq, runs = 2, 3, 3, 8
    spec = torch.randn(b, hkv, gq, t, generator=g)
    opts = KVOptions(alpha=math.inf, budget=0.2, sinks=0, recent=0, runs=runs)
    sel = select(spec, math.inf, opts)
    n = sel.slots.shape[-1]
    assert n == select(spec, math.inf, KVOptions(alpha=math.inf, budget=0.2, sinks=0, recent=0)).slots.shape[-1]
    mass = torch.nn.functional.pad(spec.softmax(-1).sum(2), (0, -t % runs)).unflatten(-1, (-1, runs)).sum(-1)
    best = mass.argsort(-1, descending=True)
    for row, want in zip(sel.slots.flatten(0, 1), best.flatten(0, 1), strict=True):
        taken = [int(r) for r in want[: -(-n // runs)]]
        slots = [s for r in taken for s in range(r * runs, min(r * runs + runs, t))][:n]
        assert row.tolist() == slots  # in rank order, each run's slots in order
    wide = select(spec, math.inf, opts, width=n + 5)
    assert torch.equal(wide.slots[..., :n], sel.slots)
    held = torch.ones(b, hkv, t, dtype=torch.bool)
    held[0, :, t - 21 :] = False  # a shorter sequence: its last run part held, part free
    pos = torch.arange(t).expand(b, hkv, t).masked_fill(~held, -1)
    short = select(spec, math.inf, opts, held, pos)
    assert torch.gather(held, 2, short.slots).all()  # its runs' free slots never among the first n
    assert (short.ok.sum(-1) == short.per_row[:, None]).all() and short.per_row[0] < short.per_row[1]
    forced = select(spec, math.inf, KVOptions(alpha=math.inf, budget=0.2, sinks=4, recent=8, runs=runs))
    held = {0} | {p // runs for p in range(t - 8, t)}  # the runs of the sinks and of the 8 newest tokens
    want = {s for r in held for s in range(r * runs, min(r * runs + runs, t))}
    for row in forced.slots.flatten(0, 1):
        assert set(row[: len(want)].tolist()) == want


def test_a_selection_in_runs_fetches_as_many_rows_and_at_a_full_budget_is_exact(bundles):
    """In the store (the CPU's step, which otherwise selects in one kernel call): runs of 8 fetch the rows single
    tokens do (equal bytes), and at a budget of 1 give `full`'s tokens."""
    b = bundles["llama31_gqa"]
    share = {}
    for runs in (1, 8):
        kv = KVOptions(alpha=math.inf, budget=0.3, runs=runs)
        _, toks, run = greedy_logits(*engines(b, x=("infinigen", kv))["x"], PROMPTS, 8)
        share[runs] = run.report().kv_fetched_share
    assert share[8] == share[1]
    es = engines(b, x=("infinigen", KVOptions(alpha=math.inf, budget=1.0, runs=8)))
    _, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 6)
    _, toks, run = greedy_logits(*es["x"], PROMPTS, 6)
    assert torch.equal(toks, ref_toks) and run.report().kv_fetched_share == 1.0
