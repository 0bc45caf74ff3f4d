"""`quest`, the Quest-style page selector (policies/quest.py): its page bounds are each page's key minimum and maximum,
they bound every q.k of the page, the pages it fetches are those with the highest bounds and their rows really cross
from the pool, within the budget; at a budget of 1 it answers as `full` does; eval runs it beside the others."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate
from infinigen_rt.kv.store import BLOCK
from infinigen_rt.measure import needle
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.policies.quest import QuestSelector
from tests.rt.stored import Stored

PROMPTS = [list(range(5, 75)), list(range(30, 83))]  # 70 and 53 tokens: full pages and a partial one, two lengths


@pytest.fixture(scope="module")
def tiny(bundles):
    return Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")


def test_page_bounds_hold_each_pages_keys_and_the_chosen_pages_rank_first(tiny, monkeypatch):
    run = Stored(tiny, configure(tiny, "quest", KVOptions(budget=0.3)), PROMPTS, 4)
    sel = run.store.selector
    assert isinstance(sel, QuestSelector) and sel.pooled_layers
    seen, chosen = {}, []
    rows, gather = QuestSelector.rows, QuestSelector.gather

    def spying(self, step, layer, q):  # the query, and each page's bound as the layer ranks them
        table = step.batch.table.long()
        lo, hi = self.lo[layer][table].clone(), self.hi[layer][table].clone()  # [B, P, Hkv, D]
        qg = q.float().reshape(q.shape[0], 1, self.store.n_kv, -1, q.shape[-1])
        bound = torch.maximum(qg * hi[:, :, :, None], qg * lo[:, :, :, None]).sum(-1).amax(-1)  # [B, P, Hkv]
        seen[layer] = (q.clone(), step.batch.table.clone(), step.held, bound, step.batch.old.copy())
        return rows(self, step, layer, q)

    def taking(self, step, j, slots, ok, *a, **k):
        chosen.append((j, slots.clone(), ok.clone()))
        return gather(self, step, j, slots, ok, *a, **k)

    monkeypatch.setattr(QuestSelector, "rows", spying)
    monkeypatch.setattr(QuestSelector, "gather", taking)
    run.greedy(3)
    for j, slots, ok in chosen[-len(sel.pooled_layers):]:  # the last step: each layer's pages are its best bounds
        _, _, _, bound, old = seen[j]
        for b in range(slots.shape[0]):
            pages = -(-int(old[b]) // BLOCK)
            for h in range(slots.shape[1]):
                got = {int(s) // BLOCK for s, o in zip(slots[b, h], ok[b, h], strict=True) if o}
                best = bound[b, :pages, h].argsort(descending=True)[: len(got)].tolist()
                assert got == set(best) and len(got) == max(1, int(0.3 * int(old[b])) // BLOCK), (j, b, h)
    store, j = run.store, sel.pooled_layers[-1]
    q, table, _, _, _ = seen[j]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt) + 3  # every token written (its key in the pool, through the request's table)
        slots = torch.arange(n)
        phys = table[i, slots // BLOCK].long() * BLOCK + slots % BLOCK
        k = store.k[j][0][phys].float()  # [n, Hkv, D]
        for p in range(-(-n // BLOCK)):
            page = k[p * BLOCK : (p + 1) * BLOCK]
            block = int(table[i, p])
            assert torch.equal(sel.lo[j][block], page.amin(0)) and torch.equal(sel.hi[j][block], page.amax(0))
            # the bound is at least every key's q.k, each query head of the group
            qh = q[i, :, 0].float().view(store.n_kv, -1, store.head_dim)  # [Hkv, G, D]
            dots = torch.einsum("hgd,nhd->nhg", qh, page)
            bound = torch.maximum(qh * sel.hi[j][block][:, None], qh * sel.lo[j][block][:, None]).sum(-1)
            assert (dots <= bound + 1e-4).all()
    run.close()


def test_at_a_full_budget_it_answers_as_full_does_and_below_it_fetches_its_pages(tiny):
    ids = list(range(5, 200))
    want, _ = generate(tiny, [ids], 8, policy="full")
    got, stats = generate(tiny, [ids], 8, policy="quest", kv=KVOptions(budget=1.0))
    assert got[0].token_ids == want[0].token_ids
    assert stats.extra["kv_fetched_share"] == 1.0
    small, stats = generate(tiny, [ids], 8, policy="quest", kv=KVOptions(budget=0.2))
    share = stats.extra["kv_fetched_share"]
    assert 0 < share <= 0.2  # whole pages within infinigen's count at the budget
    row = 2 * tiny.cfg.head_dim * 4  # a key and a value, float32
    pooled = sum(1 for b in stats.extra["per_layer"]["bytes_h2d"] if b)
    assert stats.extra["bytes_h2d"] > 0 and stats.extra["bytes_h2d"] % row == 0
    assert pooled == len(configure(tiny, "quest").selector(tiny).pooled_layers)


def test_eval_runs_quest_beside_the_others_at_equal_bytes(tiny):
    hay = "\n".join(["The quick brown fox jumps over the lazy dog. It was the best of times."] * 60)
    case = needle.build_cases(tiny.tokenizer, hay, ["single"], [230], [0.5], 1, seed=2)[0]
    todo = [("full", None, None, None, None, None, None), ("quest", 0.2, None, None, None, None, None),
            ("oracle", 0.2, None, None, None, None, None)]
    got = needle.answer_all(tiny, case, todo)
    assert [r.policy for r in got] == ["full", "quest", "oracle"]
    quest = got[1]
    assert 0 < quest.kv_fetched_share <= 0.2 and quest.answer
    assert needle.configs(["full", "quest"], [0.05, 0.1], None) == [
        ("full", None, None, None, None, None, None), ("quest", 0.05, None, None, None, None, None),
        ("quest", 0.1, None, None, None, None, None)]
