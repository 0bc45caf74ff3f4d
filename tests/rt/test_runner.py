"""Continuous batching (runner.py): a request's tokens do not depend on who shares its steps, for every policy;
chunked prefill keeps running streams going; the KV budget makes requests wait, never fail; finished and
aborted requests give their KV back at once."""

from __future__ import annotations

import math
import random

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.cli.console import parse_bytes
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.generate import generate
from infinigen_rt.kv.cache import KVReport, merge_reports
from infinigen_rt.kv.store import RequestPass
from infinigen_rt.policies import KVOptions, Policy, configure
from infinigen_rt.runner import BLOCK_TOKENS, Request, Runner, pool_tokens
from infinigen_rt.sampling import SamplingParams

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


def engine_for(bundle, policy, kv) -> tuple[Engine, Policy]:
    """An engine and the runners' policy."""
    e = Engine(read_bundle(bundle), device="cpu", dtype="float32")
    return e, configure(e, policy, kv)


def alone(setup, n: int = 10, prefill_chunk: int = 8, policy: Policy | None = None):
    """The target request on its own, prefilled in the same chunks (h2o evicts after every pass, chunks too)."""
    run = Runner(*setup, prefill_chunk=prefill_chunk)
    rid = run.add(Request(TARGET, n, policy=policy))
    while run.has_work:
        for out in run.step():
            if out.id == rid and out.finished:
                end = out
    return end


def reserved(policy: Policy, prompt, n: int, chunk: int) -> int:
    """The blocks a request reserves under `policy`."""
    return math.ceil(policy.pool_slots(len(prompt), n, chunk) / BLOCK_TOKENS)


def joined(setup, join_at: int, n: int = 10, prefill_chunk: int = 8, policy: Policy | None = None):
    """The target request joins a runner where others start, finish and are cancelled around it; its Output at
    the end. The paged pool has one block more than the others take (without eviction: long 2, short 1,
    cancelled 3), so the target (at least 2) waits for the short and the cancelled ones to give theirs back, and
    its block table is not one run (the last free block first, then freed ones). The pool's invariants are
    checked after every step."""
    others = sum(reserved(setup[1], p, m, prefill_chunk) for p, m in OTHERS.values())
    assert reserved(policy or setup[1], TARGET, n, prefill_chunk) >= 2
    run = Runner(*setup, max_batch=4, prefill_chunk=prefill_chunk, kv_tokens=(others + 1) * BLOCK_TOKENS)
    ids = {name: run.add(Request(p, m)) for name, (p, m) in OTHERS.items()}
    target, step, end, table = None, 0, None, None
    while run.has_work:
        if step == join_at:
            target = run.add(Request(TARGET, n, policy=policy))
        if step == 4:
            run.abort(ids["cancelled"])
        for out in run.step():
            if out.id == target and out.finished:
                end = out
        run.store.alloc.check()
        table = run.store.alloc.tables.get(target, table)
        step += 1
        if step == join_at + 1000:
            raise AssertionError("the runner never finished")
    assert run.store.alloc.used == 0  # every block back
    assert table is not None and sorted(table) != list(range(min(table), min(table) + len(table))), table
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
    (ref,), _ = generate(e[0], [TARGET], max_new_tokens=10)
    everything = KVOptions(alpha=math.inf, budget=1.0)
    got = joined(e, 3, policy=configure(e[0], "infinigen", everything))  # its own policy among `full` ones
    assert got.generation.token_ids == ref.token_ids
    assert got.report.kv_fetched_share == 1.0
    for policy in ("offload", "int4", "infinigen"):
        own = configure(e[0], policy, everything if policy == "infinigen" else KVOptions())
        solo = alone(e, policy=own).report
        with_others = joined(e, 3, policy=own).report
        assert with_others.bytes_h2d == solo.bytes_h2d > 0, policy
        assert with_others.bytes_d2h == solo.bytes_d2h > 0, policy


def test_a_long_prompt_is_prefilled_in_chunks_while_running_streams_go_on(bundles):
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    run = Runner(*e, max_batch=4, prefill_chunk=8)
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
    run = Runner(*e, max_batch=4, kv_tokens=3 * BLOCK_TOKENS)  # room for one request of 23 + 10 tokens
    with pytest.raises(InfinigenError, match="raise --kv-tokens"):
        run.add(Request(list(range(5, 45)), 20))  # 60 tokens can never fit: refused at once
    first, second = run.add(Request(TARGET, 10)), run.add(Request(TARGET[:20], 5))
    run.step()
    assert [s.id for s in run.running] == [first] and [s.id for s in run.waiting] == [second]
    assert run.block_usage() == (3, 0)
    for _ in range(3):  # the second keeps waiting while the first runs
        run.step()
        assert [s.id for s in run.waiting] == [second]
    gen = run.abort(first)
    assert gen.finish_reason == "cancelled" and len(gen.token_ids) == 5
    assert run.block_usage() == (0, 3) and not run.running  # given back at once, before any step
    outs = run.step()
    assert [s.id for s in run.running] == [second] and run.block_usage() == (2, 1)
    while run.has_work:
        outs = run.step()
    assert outs[0].finished and run.block_usage() == (0, 3)


def test_random_traffic_keeps_the_paged_pool_whole(bundles):
    """Requests of random sizes arrive, finish and are cancelled at random over a small paged pool; after every
    operation: no block owned twice or lost, a running request holds exactly the blocks of its prompt and new
    tokens, a waiting one none; once all are done every block is back."""
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    rng = random.Random(0)
    run = Runner(*e, max_batch=3, prefill_chunk=16, kv_tokens=10 * BLOCK_TOKENS)
    live: set[int] = set()

    def check():
        alloc = run.store.alloc
        alloc.check()
        assert set(alloc.tables) == {s.id for s in run.running}
        for s in run.running:
            assert len(alloc.tables[s.id]) == math.ceil(s.need / BLOCK_TOKENS)

    waited = cancelled = 0
    for _ in range(60):
        if rng.random() < 0.5:
            prompt = [rng.randrange(4, 200) for _ in range(rng.randrange(1, 60))]
            live.add(run.add(Request(prompt, rng.randrange(1, 12))))
        if live and rng.random() < 0.15:
            rid = rng.choice(sorted(live))
            run.abort(rid)
            live.discard(rid)
            cancelled += 1
            check()
        live -= {o.id for o in run.step() if o.finished}
        waited += bool(run.waiting) and len(run.running) < run.max_batch  # waiting for blocks, not a row
        check()
    while run.has_work:
        run.step()
        check()
    assert run.store.alloc.used == 0 and waited > 0 and cancelled > 0


@pytest.mark.parametrize("capacity, window, chunk", [(24, 4, 8), (0.5, 4, 8), (0.3, 8, 16), (40, 16, 64)])
def test_a_capacity_reserves_exactly_what_its_pool_reaches(capacity, window, chunk, bundles):
    """Eviction frees slots the sequence reuses, so a request with a capacity reserves fewer than prompt + new:
    the reservation equals the peak its pools reach at its own chunk size, and bounds it when a step's prefill
    budget (shared with another request) cuts its chunks smaller; the tokens stay what private buffers give."""
    e = engine_for(bundles["llama31_gqa"], "infinigen", KVOptions(budget=0.5, capacity=capacity, window=window))
    prompt, n = list(range(5, 65)), 30

    def peaks(run, rids):  # the slots a request took: in the batch's store, or in its own (its length there)
        peak = dict.fromkeys(rids, 0)
        outs = {}
        while run.has_work:
            for s in run.running:
                taken = run.kv.length[s.id] if isinstance(s.cache, RequestPass) else s.cache.store.length[0]
                peak[s.id] = max(peak[s.id], taken)
            outs.update({o.id: o.generation.token_ids for o in run.step() if o.finished})
        return peak, outs

    need = e[1].pool_slots(len(prompt), n, chunk)
    assert need < len(prompt) + n
    private = Runner(*e, prefill_chunk=chunk)
    rid = private.add(Request(prompt, n))
    peak, outs = peaks(private, [rid])
    solo = outs[rid]
    assert peak[rid] == need and len(solo) == n
    exact = Runner(*e, prefill_chunk=chunk, kv_tokens=math.ceil(need / BLOCK_TOKENS) * BLOCK_TOKENS)  # just enough
    rid = exact.add(Request(prompt, n))
    peak, outs = peaks(exact, [rid])
    assert outs[rid] == solo and peak[rid] == need
    paged = Runner(*e, max_batch=2, prefill_chunk=chunk, kv_tokens=64 * BLOCK_TOKENS)
    first = paged.add(Request(prompt[:-3], n))  # its last chunk leaves the second a smaller one
    second = paged.add(Request(prompt, n))
    assert [s.need for s in paged.waiting] == [e[1].pool_slots(57, n, chunk), need]
    peak, outs = peaks(paged, [first, second])
    assert peak[second] <= need and len(outs[second]) == n


def test_the_pool_is_sized_in_tokens_or_in_bytes_and_holds_that_much_memory(bundles):
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    cfg = e[0].cfg
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * cfg.head_dim * 4  # fp32 K and V
    assert pool_tokens(*e, 8, kv_memory=5 * BLOCK_TOKENS * per_token + 7) == 5 * BLOCK_TOKENS
    assert pool_tokens(*e, 8, kv_tokens=100) == 100
    assert pool_tokens(*e, 2) == 2 * cfg.max_position_embeddings  # the tiny model's fits the free memory
    with pytest.raises(InfinigenError, match="give one of them"):
        pool_tokens(*e, 8, kv_tokens=100, kv_memory=10**6)
    with pytest.raises(InfinigenError, match="one block"):
        pool_tokens(*e, 8, kv_memory=3 * per_token)
    int4 = engine_for(bundles["llama31_gqa"], "int4", KVOptions())
    assert pool_tokens(*int4, 8, kv_memory=10**6) > 3 * pool_tokens(*e, 8, kv_memory=10**6)  # 4-bit rows
    # the memory is the pool's: one shared buffer per layer and tensor, made when the first request needs it
    run = Runner(*e, kv_tokens=pool_tokens(*e, 8, kv_memory=5 * BLOCK_TOKENS * per_token))
    assert run.store.nbytes == 0
    run.add(Request(TARGET, 3))
    run.add(Request(TARGET, 3))
    run.step()
    assert run.store.nbytes == 5 * BLOCK_TOKENS * per_token and len(run.store.buffers) == 2 * cfg.num_hidden_layers
    assert run.block_usage() == (4, 1)


def test_a_batchs_shares_weigh_each_request_by_the_rows_it_held(bundles):
    """generate over two prompts of different lengths reports the fetched share over all their held rows, not the
    mean of the two requests' shares."""
    e = engine_for(bundles["llama31_gqa"], "infinigen", KVOptions(budget=0.3))
    short, long = list(range(5, 20)), list(range(30, 90))
    alone = [generate(e[0], [p], 6, policy=e[1])[1].extra for p in (short, long)]
    both = generate(e[0], [short, long], 6, policy=e[1])[1].extra
    rows = [a["share_rows"] for a in alone]
    assert rows[1] > 2 * rows[0] and both["share_rows"] == sum(rows)
    want = sum(a["kv_fetched_share"] * r for a, r in zip(alone, rows, strict=True)) / sum(rows)
    assert both["kv_fetched_share"] == pytest.approx(want, abs=2e-6)
    assert abs(both["kv_fetched_share"] - want) < abs(sum(a["kv_fetched_share"] for a in alone) / 2 - want)
    plain = merge_reports([KVReport(kv_fetched_share=0.1), KVReport(kv_fetched_share=0.5, share_rows=300)])
    assert plain.kv_fetched_share == 0.3  # a report without rows: one each


def test_sizes_read_in_si_and_binary_units():
    assert parse_bytes("8GiB", "--kv-memory") == 8 * 2**30 and parse_bytes("500MB", "--kv-memory") == 5 * 10**8
    assert parse_bytes(" 1.5 gb", "--kv-memory") == 1_500_000_000 and parse_bytes("4096", "--kv-memory") == 4096
    for bad in ("lots", "8 GiBs", "-1GB", ""):
        with pytest.raises(InfinigenError, match="--kv-memory: cannot read"):
            parse_bytes(bad, "--kv-memory")


def test_a_finished_request_closes_its_cache_in_the_step_it_ends(bundles):
    e = engine_for(bundles["llama31_gqa"], "offload", KVOptions())
    run = Runner(*e)
    short, long = run.add(Request([5, 6, 7], 2)), run.add(Request([8, 9], 6))
    run.step()  # both prefilled and decoded once: the short one has its 2 tokens
    assert [s.id for s in run.running] == [long]
    assert run.abort(short) is None  # already over: the runner does not know it any more
    assert run.block_usage()[0] == 1


def test_bad_requests_fail_when_added(bundles):
    e = engine_for(bundles["llama31_gqa"], "full", KVOptions())
    run = Runner(*e)
    with pytest.raises(InfinigenError, match="at least one token"):
        run.add(Request([], 4))
    with pytest.raises(InfinigenError, match="max-new-tokens"):
        run.add(Request([5], 0))
    with pytest.raises(InfinigenError, match="unknown policy"):
        run.add(Request([5], 4, policy=configure(e[0], "nope")))
    with pytest.raises(InfinigenError, match="--budget"):
        run.add(Request([5], 4, policy=configure(e[0], "infinigen", KVOptions(budget=2.0))))
    with pytest.raises(InfinigenError, match="--max-batch"):
        Runner(*e, max_batch=0)
    with pytest.raises(InfinigenError, match="64-bit"):  # a torch generator's range (the server's fuzz found it)
        run.add(Request([5], 4, SamplingParams(seed=2**64)))
    assert not run.has_work


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_smollm2_joining_requests_generate_what_they_do_alone(policy, smollm2_bundle):
    e = engine_for(smollm2_bundle, policy, KVOptions(budget=0.2) if policy == "infinigen" else None)
    tok = e[0].tokenizer
    prompts = [tok.encode(t) for t in (
        "The old king stood upon the wall and looked across the valley where his army",
        "Once upon a time",
        "Water boils at a temperature of",
    )]  # fmt: skip
    alone = [generate(e[0], [p], 12, policy=e[1])[0][0].token_ids for p in prompts]
    run = Runner(*e, max_batch=3, prefill_chunk=6)
    got, rids, step = {}, {}, 0
    while run.has_work or len(rids) < len(prompts):
        if step in (0, 3, 7):
            rids[run.add(Request(prompts[len(rids)], 12))] = len(rids)
        for out in run.step():
            if out.finished:
                got[rids[out.id]] = out.generation.token_ids
        step += 1
    assert [got[i] for i in range(len(prompts))] == alone


def run_all(run: Runner, reqs: list[Request]) -> list:
    """Every request's Generation, in the order given (they share the runner's steps)."""
    ids = [run.add(r) for r in reqs]
    ends = {}
    while run.has_work:
        for out in run.step():
            if out.finished:
                ends[out.id] = out.generation
    return [ends[i] for i in ids]


@pytest.mark.parametrize("name", ["full", "infinigen", "h2o"])
def test_prompt_scoring_by_decode_steps_equals_eval_and_joins_batches(name, bundles):
    """A prompt's tail scored through decode steps (teacher forcing) gives eval's token logprobs under the same
    policy, alone or sharing steps with generating requests; the head, scored by the prefill, is the dense
    prefill's under every policy; max_new_tokens 0 scores without generating; logprobs of new tokens are the
    raw distribution's at the sampled token, with the top alternatives best first."""
    import torch

    from infinigen_rt.measure.perplexity import score

    engine, policy = engine_for(bundles["llama31_gqa"], *POLICIES[name])
    prompt = list(range(3, 60))
    tail = 20
    split = len(prompt) - 1 - tail
    want = score(engine, policy, prompt, split).logprobs
    dense = score(engine, configure(engine, "full", KVOptions()), prompt, 1).logprobs
    for max_new, others in [(0, []), (3, [Request(list(range(30, 50)), 25), Request([7, 8, 9], 2)])]:
        chunk = None if name == "h2o" else 16  # h2o evicts after every prefill pass: eval prefills in one
        run = Runner(engine, policy, max_batch=4, prefill_chunk=chunk)
        req = Request(prompt, max_new, prompt_logprobs=2, score_tail=tail, logprobs=3)
        gen = run_all(run, [req, *others])[0]
        lp = gen.prompt_logprobs
        assert len(lp) == len(prompt) and lp[0] is None
        assert [x.token for x in lp[1:]] == prompt[1:]
        got = torch.tensor([x.logprob for x in lp[split:]])
        assert torch.allclose(got, want, atol=1e-4), (name, max_new, (got - want).abs().max())
        head = torch.tensor([x.logprob for x in lp[1 : split + 1]])
        assert torch.allclose(head, dense[: split], atol=1e-4)
        for x in lp[1:]:
            assert len(x.top) == 2 and x.top[0][1] >= x.top[1][1] >= x.logprob - 1e-5 or x.token == x.top[0][0]
        assert len(gen.token_ids) == max_new and len(gen.logprobs) == max_new
        for t, x in zip(gen.token_ids, gen.logprobs, strict=True):
            assert x.token == t and len(x.top) == 3 and x.top[0][0] == t  # greedy: the sampled token is the best
            assert abs(x.top[0][1] - x.logprob) < 1e-6
    if name != "full":  # the policy is measured: its tail differs from the dense one
        assert not torch.allclose(want, dense[split - 1 :], atol=1e-3)
    # without score_tail the whole prompt is scored by the prefill, as dense, and equals the dense scores
    gen = run_all(Runner(engine, policy), [Request(prompt, 0, prompt_logprobs=0)])[0]
    assert torch.allclose(torch.tensor([x.logprob for x in gen.prompt_logprobs[1:]]), dense, atol=1e-4)
    assert all(x.top == [] for x in gen.prompt_logprobs[1:])
