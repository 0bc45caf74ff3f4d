"""The host KV pool on small deterministic scenarios: each eviction policy evicts what its definition says,
capacity holds, the recent window survives, an evicted token is never fetched again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infinigen_rt.kv.pool import KVPool


def scenario(eviction: str) -> KVPool:
    """Six tokens (positions 0..5) in one (sequence, KV head); step 1 selects 0, 1, 3; step 2 selects 1, 2.
    hits: 0:1 1:2 2:1 3:1; last selected: 0:1 1:2 2:2 3:1; window 2 protects positions 4 and 5."""
    pool = KVPool(1, 1, 2, 8, torch.float32, "cpu", eviction=eviction, window=2)
    k = torch.arange(6, dtype=torch.float32)[None, None, :, None].expand(1, 1, 6, 2)
    start = pool.insert(k, -k, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
    slots = torch.arange(start, start + 6)[None, None]
    for step, chosen in ((1, [0, 1, 3]), (2, [1, 2])):
        sel = slots[:, :, chosen]
        pool.mark_selected(sel, torch.ones_like(sel, dtype=torch.bool), step)
    return pool


def held_positions(pool: KVPool) -> list[int]:
    return sorted(int(p) for p in pool.pos[0, 0] if p >= 0)


@pytest.mark.parametrize(
    "eviction, survivors",
    [
        ("counter", [1, 3, 4, 5]),  # fewest selections (1: positions 0, 2, 3), oldest first: 0 and 2 go
        ("lru", [1, 2, 4, 5]),  # least recently selected (step 1: positions 0, 3): 0 and 3 go
        ("fifo", [2, 3, 4, 5]),  # oldest: 0 and 1 go
    ],
)
def test_each_policy_evicts_by_its_definition(eviction, survivors):
    pool = scenario(eviction)
    assert pool.evict(np.array([4])) == 2
    assert held_positions(pool) == survivors
    assert pool.evicted == 2


def test_evicted_tokens_are_never_fetched_and_a_prompts_tokens_take_fresh_slots():
    pool = scenario("fifo")
    pool.evict(np.array([4]))
    slots, ok = pool.held_slots()
    k, v = pool.gather(slots)
    held = k[0, 0, :, 0][ok[0, 0]]
    assert sorted(held.tolist()) == [2.0, 3.0, 4.0, 5.0] and ok.sum() == 4
    assert torch.equal(v[0, 0][ok[0, 0]], -k[0, 0][ok[0, 0]])
    new = pool.insert(
        torch.full((1, 1, 1, 2), 9.0), torch.zeros(1, 1, 1, 2), torch.tensor([[6]]), torch.ones(1, 1, dtype=torch.bool)
    )
    assert new == 6 and pool.fill == 7  # arrival order: the freed slots stay free
    assert held_positions(pool) == [2, 3, 4, 5, 6] and pool.hits[0, 0, 6] == 0
    assert pool.n_held.tolist() == [[5]]
    pool.evict(np.array([4]))
    assert held_positions(pool) == [3, 4, 5, 6] and pool.evicted == 3


def test_window_is_never_evicted_and_padding_takes_no_slot():
    pool = KVPool(2, 2, 4, 10, torch.float32, "cpu", eviction="counter", window=3)
    valid = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    pool.insert(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), positions, valid)
    assert pool.n_held.tolist() == [[4, 4], [6, 6]]
    assert pool.evict(np.array([1, 1])) == 8  # asks for less than the window: the window stays
    assert pool.n_held.tolist() == [[3, 3], [3, 3]]
    assert sorted(int(p) for p in pool.pos[1, 0] if p >= 0) == [3, 4, 5]


def decode(pool: KVPool, value: float, position: int):
    """One decode step's token (K = value, V = -value) for every (sequence, KV head)."""
    b, h, d = pool.batch, pool.n_kv, pool.k.shape[-1]
    k = torch.full((b, h, 1, d), value)
    return pool.insert(k, -k, torch.full((b, 1), position), torch.ones(b, 1, dtype=torch.bool), np.ones(b, int))


@pytest.mark.parametrize("kernel", [False, True])
def test_a_sequence_reuses_the_slots_it_evicted_each_head_its_own(kernel):
    """Two KV heads that evicted different tokens: a decode step's token goes into each head's lowest freed slot
    (the scatter kernel through Triton's interpreter, or index_copy), the pool stops growing, the new token is
    fetched from there with fresh counters, and what was evicted is gone for good."""
    if kernel:
        pytest.importorskip("triton")
    pool = KVPool(1, 2, 2, 8, torch.float32, "cpu", eviction="counter", window=2)
    pool.kernel = kernel
    k = torch.arange(6, dtype=torch.float32)[None, None, :, None].expand(1, 2, 6, 2).contiguous()
    pool.insert(k, -k, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
    sel = torch.tensor([[[0, 1, 3], [0, 1, 4]]])  # head 0 never selects 2, head 1 never 2 and 3
    pool.mark_selected(sel, torch.ones_like(sel, dtype=torch.bool), 1)
    pool.mark_selected(sel[:, :, :1], torch.ones_like(sel[:, :, :1], dtype=torch.bool), 2)  # 0 twice
    assert pool.evict(np.array([4])) == 4  # each head drops its two least selected outside the window (4, 5)
    assert [sorted(int(p) for p in pool.pos[0, h] if p >= 0) for h in (0, 1)] == [[0, 3, 4, 5], [0, 1, 4, 5]]
    slots = decode(pool, 9.0, 6)
    assert slots.tolist() == [[[1], [2]]] and pool.fill == 6  # head 0's lowest hole is 1, head 1's is 2
    assert pool.pos[0, 0, 1] == 6 and pool.pos[0, 1, 2] == 6 and pool.hits[0, 0, 1] == 0 and pool.hits[0, 1, 2] == 0
    got, _ = pool.gather(*pool.held_slots())
    assert got[0, 0, 1, 0] == 9.0 and got[0, 1, 2, 0] == 9.0 and got[0, 1, 1, 0] == 1.0  # head 1 kept its slot 1
    assert pool.n_held.tolist() == [[5, 5]]
    assert decode(pool, 10.0, 7).tolist() == [[[2], [3]]]  # the last holes
    assert pool.fill == 6 and pool.n_held.tolist() == [[6, 6]]
    assert decode(pool, 11.0, 8) == 6 and pool.fill == 7  # no hole left: the pool grows again
    held = [sorted(int(p) for p in pool.pos[0, h] if p >= 0) for h in (0, 1)]
    assert held == [[0, 3, 4, 5, 6, 7, 8], [0, 1, 4, 5, 6, 7, 8]]  # every evicted position stays gone
