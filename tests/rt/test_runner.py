"""Continuous batching (runner.py): a request's tokens do not depend on who shares its steps, for every policy;
chunked prefill keeps running streams going; the KV budget makes requests wait, never fail; finished and
aborted requests give their KV back at once."""

from __future__ import annotations

import math

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import KVOptions
from infinigen_rt.runner import BLOCK_TOKENS, Request

TARGET = list(range(40, 63))  # 23 tokens: three chunks of 8
OTHERS = {  # name: (prompt, max new tokens)
    "long": (list(range(5, 17)), 14),
    "short": (list(range(20, 25)), 3),  # finishes while the target runs
    "cancelled": (list(range(70, 99)), 12),  # aborted at step 4
}
POLICIES = {
    "full": ("full", KVOptions()),
    "offload": ("offload", KVOptions()),
    "infinigen": ("infinigen", KVOptions(budget=0.3)),
    "infinigen-evicting": ("infinigen", KVOptions(budget=0.5, capacity=24, window=4)),
    "h2o": ("h2o", KVOptions(budget=0.5, window=4)),
    "int4": ("int4", KVOptions()),
}


def engine_for(bundle, policy, kv) -> Engine:
    return Engine(read_bundle(bundle), device="cpu", dtype="float32", policy=policy, kv=kv)


def alone(engine: Engine, n: int = 10, prefill_chunk: int = 8, policy=None, kv=None):
    """The target request on its own, prefilled in the same chunks (h2o evicts after every pass, chunks too)."""
    run = engine.runner(prefill_chunk=prefill_chunk)
    rid = run.add(Request(TARGET, n, policy=policy, kv=kv))
    while run.has_work:
        for out in run.step():
            if out.id == rid and out.finished:
                end = out
    return end


def joined(engine: Engine, join_at: int, n: int = 10, prefill_chunk: int = 8, policy=None, kv=None):
    """The target request joins a runner where others start, finish and are cancelled around it; its Output at
    the end, and the steps it took."""
    run = engine.runner(max_batch=4, prefill_chunk=prefill_chunk)
    ids = {name: run.add(Request(p, m)) for name, (p, m) in OTHERS.items()}
    target, step, end = None, 0, None
    while run.has_work:
        if step == join_at:
            target = run.add(Request(TARGET, n, policy=policy, kv=kv))
        if step == 4:
            run.abort(ids["cancelled"])
        for out in run.step():
            if out.id == target and out.finished:
                end = out
        step += 1
        if step == join_at + 1000:
            raise AssertionError("the runner never finished")
    return end


@pytest.mark.parametrize("model", ["llama31_gqa", "opt"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_request_generates_the_same_alone_or_joining_a_running_batch(name, model, bundles):
    e = engine_for(bundles[model], *POLICIES[name])
    solo = alone(e).generation
    assert len(solo.token_ids) == 10
    for join_at in (0, 2, 5):
        out = joined(e, join_at)
        assert out.generation.token_ids == solo.token_ids, (name, join_at)
        assert out.generation.finish_reason == "length"


def test_a_full_budget_under_joins_equals_full_and_moves_what_it_moves_alone(bundles):
    e = engine_for(bundles["llama31_gqa"], "full", KVOptions())
    (ref,), _ = e.generate([TARGET], max_new_tokens=10)
    everything = KVOptions(alpha=math.inf, budget=1.0)
    got = joined(e, 3, policy="infinigen", kv=everything)  # one request with its own policy among `full` ones
    assert got.generation.token_ids == ref.token_ids
    assert got.report.kv_fetched_share == 1.0
    for policy in ("offload", "int4", "infinigen"):
        kv = everything if policy == "infinigen" else KVOptions()
        solo = alone(e, policy=policy, kv=kv).report
        with_others = joined(e, 3, policy=policy, kv=kv).report
        assert with_others.bytes_h2d == solo.bytes_h2d > 0, policy
        assert with_others.bytes_d2h == solo.bytes_d2h > 0, policy


def test_a_long_prompt_is_prefilled_in_chunks_while_running_streams_go_on(bundles):
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    run = e.runner(max_batch=4, prefill_chunk=8)
    a = run.add(Request([5, 6, 7], 20))
    run.step()
    b = run.add(Request(TARGET, 5))  # 23 tokens: prefilled over three steps
    for k in range(3):
        got = {o.id: o for o in run.step()}
        assert len(got[a].new_token_ids) == 1  # the running stream gets its token every step
        assert (b in got) == (k == 2)  # the new one's first token comes with its last chunk
    assert run.stats.prefill_tokens == 3 + len(TARGET)


def test_the_kv_budget_makes_requests_wait_and_frees_at_once(bundles):
    e = engine_for(bundles["llama31_gqa"], "infinigen", KVOptions(budget=0.3))
    run = e.runner(max_batch=4, kv_tokens=3 * BLOCK_TOKENS)  # room for one request of 23 + 10 tokens
    with pytest.raises(InfinigenError, match="raise --kv-tokens"):
        run.add(Request(list(range(5, 45)), 20))  # 60 tokens can never fit: refused at once
    first, second = run.add(Request(TARGET, 10)), run.add(Request(TARGET[:20], 5))
    run.step()
    assert [s.id for s in run.running] == [first] and [s.id for s in run.waiting] == [second]
    assert run.blocks() == (3, 0)
    for _ in range(3):  # the second keeps waiting while the first runs
        run.step()
        assert [s.id for s in run.waiting] == [second]
    gen = run.abort(first)
    assert gen.finish_reason == "cancelled" and len(gen.token_ids) == 5
    assert run.blocks() == (0, 3) and not run.running  # given back at once, before any step
    outs = run.step()
    assert [s.id for s in run.running] == [second] and run.blocks() == (2, 1)
    while run.has_work:
        outs = run.step()
    assert outs[0].finished and run.blocks() == (0, 3)


def test_a_finished_request_closes_its_cache_in_the_step_it_ends(bundles):
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    run = e.runner()
    short, long = run.add(Request([5, 6, 7], 2)), run.add(Request([8, 9], 6))
    run.step()  # both prefilled and decoded once: the short one has its 2 tokens
    assert [s.id for s in run.running] == [long]
    assert run.abort(short) is None  # already over: the runner does not know it any more
    assert run.blocks()[0] == 1


def test_bad_requests_fail_when_added(bundles):
    e = engine_for(bundles["llama31_gqa"], "full", KVOptions())
    run = e.runner()
    with pytest.raises(InfinigenError, match="at least one token"):
        run.add(Request([], 4))
    with pytest.raises(InfinigenError, match="max-new-tokens"):
        run.add(Request([5], 0))
    with pytest.raises(InfinigenError, match="unknown policy"):
        run.add(Request([5], 4, policy="nope"))
    with pytest.raises(InfinigenError, match="--budget"):
        run.add(Request([5], 4, policy="infinigen", kv=KVOptions(budget=2.0)))
    with pytest.raises(InfinigenError, match="--max-batch"):
        e.runner(max_batch=0)
    assert not run.has_work


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_smollm2_joining_requests_generate_what_they_do_alone(policy, smollm2_bundle):
    e = Engine(read_bundle(smollm2_bundle), device="cpu", dtype="float32", policy=policy,
               kv=KVOptions(budget=0.2) if policy == "infinigen" else None)  # fmt: skip
    tok = e.tokenizer
    prompts = [tok.encode(t) for t in (
        "The old king stood upon the wall and looked across the valley where his army",
        "Once upon a time",
        "Water boils at a temperature of",
    )]  # fmt: skip
    alone = [e.generate([p], max_new_tokens=12)[0][0].token_ids for p in prompts]
    run = e.runner(max_batch=3, prefill_chunk=6)
    got, rids, step = {}, {}, 0
    while run.has_work or len(rids) < len(prompts):
        if step in (0, 3, 7):
            rids[run.add(Request(prompts[len(rids)], 12))] = len(rids)
        for out in run.step():
            if out.finished:
                got[rids[out.id]] = out.generation.token_ids
        step += 1
    assert [got[i] for i in range(len(prompts))] == alone
