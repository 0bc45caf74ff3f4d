"""The one KV store for the batch (kv/store.py): requests of different lengths written through their block tables,
then one decode step for the whole batch: each row's attention equals SDPA over its own rows; state checked after
every operation, as the paged pool's tests do. Through the runner: every policy the store runs makes each request's
tokens as it makes them alone, with its own cache."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infinigen_rt.kv import cpu
from infinigen_rt.kv.ledger import LEDGER_HELD, Ledger
from infinigen_rt.kv.paged import PagedStore, PoolFull
from infinigen_rt.kv.prefetch import WorkerThread
from infinigen_rt.kv.store import BLOCK, KVStore
from infinigen_rt.policies import base as policy_base
from infinigen_rt.policies.base import Selector
from infinigen_rt.policies.int4 import group_size

HKV, H, D = 2, 6, 32


def make(n_blocks, layers, pooled=(), n_kv=HKV, head_dim=D, device="cpu", dtype=torch.float32) -> KVStore:
    cfg = SimpleNamespace(num_key_value_heads=n_kv, head_dim=head_dim, sliding_layers=[])
    return KVStore(PagedStore(n_blocks, BLOCK, device), Selector(layers, pooled), cfg, device, dtype)


def admit(store: KVStore, rid: int, tokens: int) -> None:
    store.alloc.grow(rid, tokens)
    store.admit(rid)


def test_a_decode_step_attends_for_the_whole_batch_as_each_request_alone():
    gen = torch.Generator().manual_seed(0)
    store = make(40, [0, 3])
    prompts = {7: 37, 8: 5, 9: 130}  # request id -> prompt tokens (inside a block, under one, several blocks)
    own = {}
    for rid, n in prompts.items():
        admit(store, rid, n + 4)
        store.check()
        k, v = (torch.randn(1, HKV, n, D, generator=gen) for _ in "kv")
        slots = store.append([rid], n)
        for layer in (0, 3):
            store.write(layer, slots, k, v)
        own[rid] = [k, v]
        store.check()
    rids = [9, 7, 8]  # a step's rows, in any order
    k, v = (torch.randn(3, HKV, 1, D, generator=gen) for _ in "kv")
    slots = store.append(rids, 1)
    store.write(3, slots, k, v)
    for i, rid in enumerate(rids):
        own[rid] = [torch.cat([own[rid][0], k[i : i + 1]], 2), torch.cat([own[rid][1], v[i : i + 1]], 2)]
    batch = store.batch(rids)
    assert batch.longest == 131 and batch.lengths.tolist() == [131, 38, 6]
    q = torch.randn(3, H, 1, D, generator=gen)
    got = store.attend(3, q, batch, k, v)
    with cpu.disabled():  # (the torch path: row by row, over views of each request's blocks)
        plain = store.attend(3, q, store.batch(rids, 0), k, v)
    for i, rid in enumerate(rids):
        want = F.scaled_dot_product_attention(q[i : i + 1], *own[rid], enable_gqa=True)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain[i : i + 1], want, rtol=1e-5, atol=1e-5)
    store.check()


def test_release_forgets_a_request_and_a_full_pool_refuses_without_changing():
    store = make(4, [0])
    admit(store, 1, 3 * BLOCK)
    with pytest.raises(PoolFull):
        admit(store, 2, 2 * BLOCK)
    store.check()
    assert 2 not in store.length and len(store.alloc.free) == 1
    store.release(1)
    store.alloc.release(1)
    store.check()
    assert len(store.alloc.free) == 4 and not store.length


def test_a_ledger_sums_its_host_counts_when_read_as_they_were_added():
    led = Ledger()
    rids = [1, 2]
    led.add("a", rids, [3, 4])
    led.add("a", rids, 5, scale=2.0)
    led.add("a", rids, np.array([1]))
    led.add("b", [2], torch.tensor([7]))
    rids.append(3)  # a list the caller changes later: the counts go to the requests it held
    assert (led.get("a", 1), led.get("a", 2), led.get("a", 3), led.get("b", 2)) == (14, 15, 0, 7)
    assert (led.max("a", 1), led.max("a", 2), led.max("b", 1)) == (10, 10, None)
    with pytest.raises(ValueError, match="3 counts for 2 requests"):
        led.add("a", [1, 2], [1, 2, 3])
    for _ in range(LEDGER_HELD + 1):  # held no further than LEDGER_HELD
        led.add("c", [1], 1)
    assert len(led.later) < LEDGER_HELD and led.get("c", 1) == LEDGER_HELD + 1
    led.forget(1)
    assert led.get("a", 1) == 0 and led.get("a", 2) == 15


def test_writing_past_the_reservation_is_refused():
    store = make(4, [0])
    admit(store, 1, 5)
    store.append([1], 5)
    with pytest.raises(IndexError):
        store.append([1], 1)


def test_a_layers_launches_do_not_grow_with_the_batch_on_the_gpu_path():
    """Under fake CUDA (shapes only, Llama-3.1-8B's heads): one layer's decode work for 1 and for 8 requests of 32k
    issues the same launches: two copies in, the attention kernel and its merge."""
    from infinigen_rt.kv.attention import splits
    from infinigen_rt.measure.fakecuda import FakeCuda, available

    if available():
        pytest.skip(available())
    counts = {}
    with FakeCuda(values=False) as gpu, torch.inference_mode():
        store = make(8 * 2049, [0], n_kv=8, head_dim=128, device="cuda", dtype=torch.bfloat16)
        for rid in range(8):
            admit(store, rid, 32768 + 1)
            store.length[rid] = 32768  # (a prompt written: the shapes are what matters here)
        for b in (1, 8):
            rids = list(range(b))
            k = torch.empty(b, 8, 1, 128, dtype=torch.bfloat16, device="cuda")
            q = torch.empty(b, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
            with gpu.recording() as ops:
                slots = store.append(rids, 1)
                store.write(0, slots, k, k)
                store.attend(0, q, store.batch(rids), k, k)
            counts[b] = [o.name for o in ops if o.launch]
            for r in rids:
                store.length[r] -= 1
        store.host._unpin()  # (its pages are fake CUDA's: released inside it)
    assert counts[1] == counts[8] and "paged_decode_kernel" in counts[8], counts
    assert splits(1, 8, 32769)[1] > splits(8, 8, 32769)[1]  # batch 1 splits its context further


@pytest.mark.parametrize("gpu", [False, True])
def test_a_pooled_layers_chosen_rows_come_in_one_gather_for_the_batch(gpu):
    """Each row's chosen token slots of a pooled layer (host memory), for three requests of different lengths, in
    one gather through the tables (on the GPU path under fake CUDA: the row kernel from pinned memory)."""
    from contextlib import nullcontext

    from infinigen_rt.measure.fakecuda import FakeCuda, available

    if gpu and available():
        pytest.skip(available())
    gen = torch.Generator().manual_seed(1)
    lengths = {4: 40, 5: 9, 6: 70}
    own = {}
    with FakeCuda() if gpu else nullcontext() as fake:
        dev = "cuda" if gpu else "cpu"
        store = make(40, [], [2], device=dev)
        for rid, n in lengths.items():
            admit(store, rid, n + 1)
            k, v = (torch.randn(1, HKV, n, D, generator=gen) for _ in "kv")
            store.write(2, store.append([rid], n), k.to(dev), v.to(dev))
            own[rid] = (k, v)
        rids = list(lengths)
        batch = store.batch(rids)
        chosen = torch.stack([torch.randint(0, lengths[r], (HKV, 5), generator=gen) for r in rids])  # [B, Hkv, 5]
        with fake.recording() if gpu else nullcontext() as ops:
            (k_got,), (v_got,) = store.gather(2, batch, chosen.to(dev), None)  # plain rows: one part each
        k_got, v_got = k_got.cpu(), v_got.cpu()
        if gpu:
            store.host._unpin()
    assert k_got.shape == (3, HKV, 6, D)
    for i, r in enumerate(rids):
        for h in range(HKV):
            torch.testing.assert_close(k_got[i, h, :5], own[r][0][0, h, chosen[i, h]])
            torch.testing.assert_close(v_got[i, h, :5], own[r][1][0, h, chosen[i, h]])
    if gpu:
        assert [o.name for o in ops if o.kind == "triton"] == ["gather_rows_kernel"]


@pytest.mark.parametrize("model", ["llama31_gqa", "opt"])
def test_full_runs_its_batch_through_the_store_with_the_tokens_of_each_request_alone(model, bundles):
    """`full` over a paged pool keeps every request's KV in the runner's store: prompts in chunks through their
    tables, every decode step one pass for the whole batch; each request's tokens are those it makes alone (its own
    buffers, no store), and every block comes back."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles[model]), device="cpu", dtype="float32")
    policy = configure(e, "full")
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    alone = []
    for p in prompts:
        run = Runner(e, policy, prefill_chunk=8)
        run.add(Request(p, 6))
        alone.append([o.generation.token_ids for o in _drain(run)])
    run = Runner(e, policy, max_batch=3, prefill_chunk=8, kv_tokens=512)
    ids = [run.add(Request(p, 6)) for p in prompts]
    outs = {}
    while run.has_work:
        for o in run.step():
            if o.finished:
                outs[o.id] = o.generation.token_ids
        run.kv.check()
    assert [outs[i] for i in ids] == [a[-1] for a in alone]
    assert run.kv.alloc.used == 0 and not run.kv.length


@pytest.mark.parametrize("model", ["llama31_gqa", "opt"])
def test_int4_runs_its_batch_through_the_store_as_codes_with_the_tokens_and_bytes_of_each_request_alone(model, bundles):
    """`int4` over a paged pool keeps every request's KV in the runner's store, as 4-bit codes with their scales and
    minimums in the pool's host buffers: each request's tokens, and the report of what moved (the packed bytes), are
    those of its own cache alone. Each prompt goes in chunks of 8 tokens of its own (the policy's, not a budget the
    batch shares), so that it reads the same earlier rows in both runs."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles[model]), device="cpu", dtype="float32")
    policy = configure(e, "int4", KVOptions(prefill_chunk=8))
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    alone = []
    for p in prompts:
        run = Runner(e, policy, prefill_chunk=None)
        run.add(Request(p, 6))
        alone.append(_drain(run)[-1])
    run = Runner(e, policy, max_batch=3, prefill_chunk=None, kv_tokens=512)
    ids = [run.add(Request(p, 6)) for p in prompts]
    outs = {}
    while run.has_work:
        outs.update({o.id: o for o in run.step() if o.finished})
        assert run.kv is not None and run.kv_policy.name == "int4", "int4's requests kept caches of their own"
        run.kv.check()
    d, hkv = e.cfg.head_dim, e.cfg.num_key_value_heads
    codes, groups = ((hkv, d // 2), torch.uint8), ((hkv, d // group_size(d)), torch.float16)
    held = {name: (tail, t.dtype) for (name, _, tail, _), t in run.store.buffers.items()}
    assert held == {"k": codes, "v": codes, "k_scale": groups, "k_min": groups, "v_scale": groups, "v_min": groups}
    assert run.kv.row_bytes == 2 * (d // 2 + 4 * (d // group_size(d)))
    for rid, solo in zip(ids, alone, strict=True):
        assert outs[rid].generation.token_ids == solo.generation.token_ids
        assert outs[rid].report.to_dict() == solo.report.to_dict()
        assert outs[rid].report.bytes_h2d > 0 and outs[rid].report.kv_fetched_share < 0.5
    assert run.kv.alloc.used == 0 and not run.kv.length


def _drain(run):
    """Run `run` to the end: the Output of every request, as it finished."""
    done = []
    while run.has_work:
        done += [o for o in run.step() if o.finished]
    return done


def test_a_pool_larger_than_the_device_leaves_full_on_buffers_of_its_own(bundles, monkeypatch):
    """The runner's pool is sized for admission (by default max_batch x the context): where its KV would not fit the
    device, `full` keeps each request's buffers, exactly its size, and generates the same."""
    import infinigen_rt.runner as runner_mod
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    policy = configure(e, "full")
    out = []
    for available in (1 << 40, 1 << 10):  # room, then none
        monkeypatch.setattr(runner_mod, "host_available", lambda a=available: a)
        run = Runner(e, policy, max_batch=2, prefill_chunk=8, kv_tokens=512)
        ids = [run.add(Request(list(range(5, 30)), 4)), run.add(Request(list(range(40, 49)), 4))]
        done = {}
        while run.has_work:
            done.update({o.id: o.generation.token_ids for o in run.step() if o.finished})
        out.append(([done[i] for i in ids], run.kv is not None))
    assert out[0][1] and not out[1][1] and out[0][0] == out[1][0]


@pytest.mark.parametrize(("model", "policy"), [("gemma3", "full"), ("gemma3", "offload"), ("gemma3", "infinigen"),
                                               ("gemma3", "h2o"), ("gemma3", "int4"), ("mistral", "full")])  # fmt: skip
def test_sliding_layers_keep_their_rings_in_the_store_with_the_tokens_of_each_request_alone(model, policy, bundles):
    """A model with sliding-window layers (window 8 here) runs in the store: each request's ring is one row of the
    store's rings, written and attended for the whole batch in a decode step, through its prompt chunks before;
    prompts longer than the window, in chunks that end inside it, and requests that come and go reuse the rows.
    Each request's tokens are those it makes alone (in a store of its own), and every ring row comes back."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles[model]), device="cpu", dtype="float32")
    pol = configure(e, policy, KVOptions(budget=0.5) if policy == "infinigen" else KVOptions())
    prompts = [list(range(5, 42)), list(range(50, 53)), list(range(60, 83)), list(range(90, 101))]
    alone = []
    for p in prompts:
        run = Runner(e, pol, prefill_chunk=5)
        run.add(Request(p, 12))
        alone.append(_drain(run)[0].token_ids)
    run = Runner(e, pol, max_batch=3, prefill_chunk=5, kv_tokens=1024)  # chunks across the window's turns
    ids = [run.add(Request(p, 12)) for p in prompts]  # the fourth waits for a row
    outs = {}
    while run.has_work:
        for o in run.step():
            if o.finished:
                outs[o.id] = o.generation.token_ids
        assert run.kv is not None and run.kv.rings is not None
        run.kv.check()
    assert [outs[i] for i in ids] == alone
    assert not run.kv.rings.row and len(run.kv.rings.free) == 3


@pytest.mark.parametrize("model", ["llama31_gqa", "opt"])
def test_h2o_runs_its_batch_through_the_store_with_the_tokens_and_report_of_each_request_alone(model, bundles):
    """`h2o` over a paged pool keeps every request's KV in the runner's store (its scores and alive flags per flat
    slot beside it): each request's tokens and report (the share it attended, its evictions) are those it makes
    alone with its own cache, prefilled in the same chunks of 8 (h2o evicts after every one; the last prompt ends
    in a one-token chunk), the rows of a step of different lengths."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure

    e = Engine(read_bundle(bundles[model]), device="cpu", dtype="float32")
    policy = configure(e, "h2o", KVOptions(budget=0.4, window=4, prefill_chunk=8))
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 77))]
    solo, joined, run = _alone_then_joined(e, policy, prompts, 9)
    alone = [(o.generation.token_ids, o.report) for o in solo]
    assert [(o.generation.token_ids, o.report) for o in joined] == alone
    assert all(r.evictions > 0 and 0 < r.kv_fetched_share < 1 for _, r in alone)
    assert run.kv.alloc.used == 0 and not run.kv.length


@pytest.mark.parametrize(("model", "policy", "capacity", "eviction"), [
    ("llama31_gqa", "offload", 12, "counter"), ("llama31_gqa", "int4", 0.4, "lru"), ("opt", "offload", 0.4, "fifo"),
    ("opt", "int4", 12, "counter"), ("llama31_gqa", "infinigen", 12, "counter"),
    ("llama31_gqa", "infinigen", 0.4, "lru"), ("opt", "infinigen", 0.4, "fifo"), ("gemma3", "offload", 12, "counter"),
    ("gemma3", "infinigen", 12, "lru"),
])  # fmt: skip
def test_a_capacity_runs_in_the_store_with_the_tokens_and_report_of_each_request_alone(model, policy, capacity,
                                                                                        eviction, bundles):  # fmt: skip
    """With a capacity (a count, or a share of the length) `offload`, `int4` and `infinigen` keep their requests' KV
    in the runner's store: each request evicts after every pass (its prompt chunks of 8 too) down to the capacity per
    (layer, KV head), by what infinigen selected (counter, lru) or the oldest, and its new tokens reuse the slots it
    freed, each head its own; infinigen's dense layers keep every token in tables of their own, and a sliding
    layer's ring (Gemma 3) every token of its window. Each request's tokens and report (the bytes moved, its
    evictions, the share fetched) are those of its own cache alone. Prompts longer than the capacity, the rows of a
    step of different lengths, some with freed slots and some not yet."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure

    e = Engine(read_bundle(bundles[model]), device="cpu", dtype="float32")
    pol = configure(e, policy, KVOptions(capacity=capacity, eviction=eviction, window=4, prefill_chunk=8, budget=0.5))
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    solo, joined, run = _alone_then_joined(e, pol, prompts, 9)
    alone = [(o.generation.token_ids, o.report.to_dict()) for o in solo]
    assert [(o.generation.token_ids, o.report.to_dict()) for o in joined] == alone
    assert all(r["evictions"] > 0 and r["bytes_h2d"] > 0 for _, r in alone)
    assert run.kv.alloc.used == 0 and not run.kv.length and not run.kv.selector.evicting.held


def _alone_then_joined(e, policy, prompts, new: int):
    """Each prompt alone (its own cache: no pool), then all of them joined in one runner over a paged pool, whose
    store holds them (checked after every step): (the Outputs alone, the Outputs joined, in the prompts' order, the
    joined runner)."""
    from infinigen_rt.runner import Request, Runner

    solo = []
    for p in prompts:
        run = Runner(e, policy, prefill_chunk=None)
        run.add(Request(p, new))
        (o,) = _drain(run)
        assert run.kv is None
        solo.append(o)
    run = Runner(e, policy, max_batch=len(prompts), prefill_chunk=None, kv_tokens=512)
    ids = [run.add(Request(p, new)) for p in prompts]
    outs = {}
    while run.has_work:
        outs.update({o.id: o for o in run.step() if o.finished})
        assert run.kv is not None and run.kv_policy.name == policy.name
        run.kv.check()
    return solo, [outs[i] for i in ids], run



@pytest.mark.parametrize("capacity,one_call,write_after", [(None, True, 5), (12, True, 5), (None, False, 5),
                                                           (None, True, 1)])  # fmt: skip
def test_per_channel_keys_run_in_the_store_with_the_tokens_and_report_of_each_request_alone(
    capacity, one_call, write_after, bundles, monkeypatch,
):  # fmt: skip
    """infinigen's per-channel speculation keys (int4c: a scale per channel over each page's 16 slots, quantized
    again as a page fills) in the runner's store, one row of codes for the batch's pages: each request's tokens
    and report are those of its own cache alone, with and without a capacity (new tokens in freed slots); then,
    with the pages the first batch used free again, a second batch gets the same. The correction on this CPU: the
    kernel's one call (cpu.correct_channel), where it is built, its pairs shared with the runner's worker thread
    (on two threads or more); without it (`one_call` False: the call declines), its steps one after another, with
    attention still reading the rows in the pool. `write_after` 1: the new rows written after attention at every
    batch (store.WRITE_AFTER; by default from batch 5)."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request

    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    pol = configure(e, "infinigen", KVOptions(budget=0.4, capacity=capacity, window=4, prefill_chunk=8,
                                              spec_keys="int4c", correct=0.25))  # fmt: skip
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    calls, besides, fused = [], set(), cpu.correct_channel

    def counted(*a, beside=None):
        besides.add(beside is not None)
        calls.append(out := fused(*a, beside=beside) if one_call else None)
        return out

    monkeypatch.setattr(cpu, "correct_channel", counted)
    monkeypatch.setattr(policy_base, "WRITE_AFTER", write_after)
    solo, joined, run = _alone_then_joined(e, pol, prompts, 9)
    assert run.kv.selector.in_place == (cpu.library() is not None)
    assert calls and (None not in calls) == one_call or cpu.library() is None
    assert besides == {isinstance(run.prefetch, WorkerThread)} or cpu.library() is None
    alone = [(o.generation.token_ids, o.report.to_dict()) for o in solo]
    assert [(o.generation.token_ids, o.report.to_dict()) for o in joined] == alone
    assert all(0 < r["kv_fetched_share"] < 1 for _, r in alone)
    ids = [run.add(Request(p, 9)) for p in prompts[::-1]]  # other sequences on the pages the first ones left
    outs = {}
    while run.has_work:
        outs.update({o.id: o for o in run.step() if o.finished})
        run.kv.check()
    assert [(outs[i].generation.token_ids, outs[i].report.to_dict()) for i in ids] == alone[::-1]


@pytest.mark.skipif(cpu.library() is None, reason=f"no CPU kernel: {cpu.reason()}")
def test_speculations_one_call_makes_the_tokens_and_reports_its_steps_make(bundles, monkeypatch):
    """infinigen's per-channel keys over a batch whose requests hold as many tokens (every slot held, in order):
    each speculation is one kernel call (cpu.speculate_channel: the scores, the group softmax, the forced slots and
    the top-k), its pairs taken beside the worker by the compute thread that waits for them (cpu.take_offered), and
    each request's tokens and report are those the steps one after another make."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.policies import infinigen as ig
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    pol = configure(e, "infinigen", KVOptions(budget=0.3, prefill_chunk=16, spec_keys="int4c", correct=0.25))
    prompts = [list(range(5 + 3 * i, 45 + 3 * i)) for i in range(4)]
    calls, taken, one_call, take = [], [], cpu.speculate_channel, cpu.take_offered

    def counted(*a):
        time.sleep(0.02)  # (the compute thread then waits for this call: it joins it, rather than finding it done)
        calls.append(out := one_call(*a))
        return out

    def taking(*a):
        taken.append(a[0])
        return take(*a)

    monkeypatch.setattr(cpu, "speculate_channel", counted)
    monkeypatch.setattr(cpu, "take_offered", taking)
    got = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ig, "selected", lambda *a: None)
        calls.clear()
        run = Runner(e, pol, max_batch=len(prompts), prefill_chunk=None, kv_tokens=512)
        ids = [run.add(Request(p, 8)) for p in prompts]
        outs = {o.id: o for o in _drain(run)}
        got[fused] = [(outs[i].generation.token_ids, outs[i].report.to_dict()) for i in ids]
        assert bool(calls) == fused and None not in calls
    assert got[True] == got[False]
    assert taken or not isinstance(run.prefetch, WorkerThread)  # (the compute thread joined, or found it done)


@pytest.mark.parametrize("name", ["oracle", "oracle-per-head"])
def test_the_oracle_runs_its_batch_through_the_store_with_the_tokens_and_report_of_each_request_alone(name, bundles):
    """The equal-bytes oracle (and the per-query-head one) over a paged pool: every request in the runner's store,
    each decode step's true top rows chosen for the whole batch; each request's tokens, the share of rows it kept and
    the attention mass kept are those it has alone (in a store of its own), at a budget that chooses (0.3)."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    policy = configure(e, name, KVOptions(budget=0.3, dense_layers=1))
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    alone = []
    for p in prompts:
        run = Runner(e, policy, prefill_chunk=8)
        run.add(Request(p, 6))
        alone.append(_drain(run)[-1])
        assert run.kv is None  # a store of its own (no pool)
    run = Runner(e, policy, max_batch=3, prefill_chunk=8, kv_tokens=512)
    ids = [run.add(Request(p, 6)) for p in prompts]
    outs = {}
    while run.has_work:
        outs.update({o.id: o for o in run.step() if o.finished})
        assert run.kv is not None and run.kv_policy.name == name, "the oracle's requests kept caches of their own"
        run.kv.check()
    for rid, solo in zip(ids, alone, strict=True):
        got, want = outs[rid], solo
        assert got.generation.token_ids == want.generation.token_ids
        assert 0 < want.report.kv_fetched_share < 1 and want.report.attention_recall < 1
        for f in ("kv_fetched_share", "kv_attended_share", "share_rows"):
            assert getattr(got.report, f) == getattr(want.report, f), f
        assert got.report.attention_recall == pytest.approx(want.report.attention_recall, abs=1e-6)
    assert run.kv.alloc.used == 0 and not run.kv.length


def test_infinigen_traces_its_recall_in_the_store_as_each_request_alone(bundles):
    """The recall trace (`trace_recall`: the true attention mass each step's selection holds) is a diagnostic of the
    store: a batch's requests stay in the runner's store with it on, with the tokens and the mean recall each request
    has alone (in a store of its own); at a budget that fetches everything the recall is 1."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import KVOptions, configure
    from infinigen_rt.runner import Request, Runner

    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    prompts = [list(range(5, 42)), list(range(50, 57)), list(range(60, 83))]
    for budget in (0.3, 1.0):
        policy = configure(e, "infinigen", KVOptions(budget=budget, alpha=None, trace_recall=True))
        alone = []
        for p in prompts:
            run = Runner(e, policy, prefill_chunk=8)
            run.add(Request(p, 6))
            alone.append(_drain(run)[-1])
        run = Runner(e, policy, max_batch=3, prefill_chunk=8, kv_tokens=512)
        ids = [run.add(Request(p, 6)) for p in prompts]
        outs = {}
        while run.has_work:
            outs.update({o.id: o for o in run.step() if o.finished})
            assert run.kv is not None and run.kv_policy.name == "infinigen", "the traced requests left the store"
        for rid, solo in zip(ids, alone, strict=True):
            got = outs[rid]
            assert got.generation.token_ids == solo.generation.token_ids
            assert got.report.attention_recall == pytest.approx(solo.report.attention_recall, abs=1e-5)
            assert got.report.attention_recall == pytest.approx(1.0, abs=1e-5) if budget == 1.0 else (
                0 < got.report.attention_recall < 1)  # fmt: skip
