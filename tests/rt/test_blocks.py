"""The paged pool's bookkeeping: random grow/release sequences keep every invariant after every operation, slots
map tokens to distinct places, a full pool refuses without changing anything, and all blocks come back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from infinigen_rt.kv.paged import BlockAllocator, PoolFull


def test_random_traffic_keeps_the_invariants():
    rng = random.Random(0)
    pool = BlockAllocator(n_blocks=64, block_size=16)
    lengths: dict[int, int] = {}
    for _ in range(2000):
        rid = rng.randrange(12)
        if rid in lengths and rng.random() < 0.2:
            assert pool.release(rid) == pool.blocks_for(lengths.pop(rid))
        else:
            want = lengths.get(rid, 0) + rng.randrange(1, 40)
            if pool.room(rid, want):
                pool.grow(rid, want)
                lengths[rid] = want
            else:
                with pytest.raises(PoolFull):
                    pool.grow(rid, want)
        pool.check()
        # every reserved token has its own slot, inside its own blocks
        all_slots = np.concatenate([pool.slots(r, 0, n) for r, n in lengths.items()] or [np.zeros(0, int)])
        assert len(np.unique(all_slots)) == len(all_slots)
        assert (pool.owner[all_slots // 16] >= 0).all()
    for rid in list(lengths):
        pool.release(rid)
    pool.check()
    assert pool.used == 0


def test_a_full_pool_refuses_and_changes_nothing():
    pool = BlockAllocator(n_blocks=4, block_size=8)
    pool.grow(1, 20)  # 3 blocks
    assert not pool.room(2, 9) and pool.room(2, 8) and pool.room(1, 32) and not pool.room(1, 33)
    free, tables = list(pool.free), {k: list(v) for k, v in pool.tables.items()}
    with pytest.raises(PoolFull, match="1 free blocks, request 2 needs 2"):
        pool.grow(2, 9)
    assert list(pool.free) == free and pool.tables == tables and 2 not in pool.reserved
    pool.check()


def test_slots_follow_the_table_and_refuse_unreserved_tokens():
    pool = BlockAllocator(n_blocks=8, block_size=4)
    pool.grow(7, 3)
    pool.grow(9, 4)
    pool.grow(7, 6)  # request 7 now holds blocks 0 and 2
    assert pool.tables == {7: [0, 2], 9: [1]}
    assert pool.slots(7, 0, 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert pool.slots(9, 1, 3).tolist() == [5, 6, 7]
    with pytest.raises(IndexError):
        pool.slots(7, 4, 3)
