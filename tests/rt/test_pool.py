"""Eviction in the host pool: each eviction policy's ranking (pool.victims) frees what its definition says and never
the recent window; through the store (store.Evicting) capacity holds, a request's new tokens reuse the slots it
freed (each KV head its own) so its pool stops growing, and an evicted token never comes back."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.kv.evict import victims
from infinigen_rt.policies import KVOptions, configure
from tests.rt.stored import Stored

# six tokens (positions 0..5) in one (sequence, KV head); step 1 selected 0, 1, 3; step 2 selected 1, 2:
# times selected 0:1 1:2 2:1 3:1, last step selected 0:1 1:2 2:2 3:1; a window of 2 protects positions 4 and 5
POS = torch.arange(6)[None]
HITS = torch.tensor([[1, 2, 1, 1, 0, 0]])
LAST = torch.tensor([[1, 2, 2, 1, 0, 0]])
RECENT = POS >= 4


@pytest.mark.parametrize(
    "primary, survivors",
    [
        (HITS, [1, 3, 4, 5]),  # counter: fewest selections (1: positions 0, 2, 3), oldest first: 0 and 2 go
        (LAST, [1, 2, 4, 5]),  # lru: least recently selected (step 1: positions 0, 3): 0 and 3 go
        (None, [2, 3, 4, 5]),  # fifo: oldest, 0 and 1 go
    ],
)
def test_each_eviction_frees_by_its_definition(primary, survivors):
    gone = victims(POS, primary, RECENT, torch.tensor([2]))
    assert POS[~gone].tolist() == survivors


def test_the_window_and_freed_slots_are_never_victims():
    pos = torch.tensor([[0, -1, 2, 3, -1, 5]])  # slots 1 and 4 freed before
    gone = victims(pos, None, pos >= 3, torch.tensor([5]))  # asks for more than the candidates
    assert gone.tolist() == [[True, False, True, False, False, False]]  # only 0 and 2: the window (3, 5) stays
    per_head = victims(torch.arange(4).expand(2, 4), torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1]]),
                       torch.zeros(4, dtype=torch.bool), torch.tensor([1, 1]))  # fmt: skip
    assert per_head.tolist() == [[True, False, False, False], [False, True, False, False]]  # each head its own


@pytest.mark.parametrize(("policy", "eviction"), [("offload", "fifo"), ("infinigen", "counter"), ("infinigen", "lru")])
def test_a_request_reuses_the_slots_it_evicted_and_never_sees_an_evicted_token_again(policy, eviction, bundles):
    """40 prompt tokens and 24 new ones under a capacity of 16 tokens and a window of 4: after every pass the request
    holds at most 16 a (pooled layer, KV head), the window among them; its new tokens go into the slots it freed, so
    its pool stops at what Offload.pool_slots reserved; a position once evicted is never held again."""
    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    kv = KVOptions(capacity=16, window=4, eviction=eviction, **({"budget": 0.3} if policy == "infinigen" else {}))
    pol = configure(e, policy, kv)
    run = Stored(e, pol, [list(range(4, 44))], 25)
    ev = run.store.selector.evicting
    logits = run.prefill()
    gone: set[tuple[int, int, int]] = set()
    before = None
    for _ in range(24):
        held = ev.pos[:, :, run.slots(0)]  # [pooled layers, Hkv, slots taken]: the position each holds, -1 if freed
        newest = int(run.pos) - 1
        assert ev.held[0] <= 16 and bool(((held >= 0).sum(-1) == ev.held[0]).all())
        for w in range(newest - 3, newest + 1):  # the recent window survives in every (layer, head)
            assert bool((held == w).any(-1).all()), w
        now = {(i, h, int(held[i, h, s])) for i, h, s in torch.nonzero(held >= 0).tolist()}  # (layer, head, position)
        assert not now & gone, "an evicted position came back"
        if before is not None:
            gone |= before - now
        before = now
        logits = run.step(logits.argmax(-1))
    assert run.report().evictions > 0 and gone
    assert run.store.length[0] == pol.pool_slots(40, 25, 40) < 40 + 25  # the pool stopped growing
