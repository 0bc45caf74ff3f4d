"""The paged KV pool: fixed-size blocks of token slots taken from one preallocated pool that every request shares,
and per request a block table (its blocks, in order).

BlockAllocator is the bookkeeping (host-side and small); PagedStore is the memory: per layer, host buffers of
every block's slots, which the runner's requests share through the batch's KV store (store.py), which reads and
writes them through the requests' tables.

Invariants (`check`): a block is free or owned by exactly one request; a request's table covers the tokens it
reserved and no more than one block beyond; all blocks are free once every request is released.
"""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import torch

from infinigen_rt.errors import InfinigenError
from infinigen_rt.system import host_buffer, retire, unpin


class PoolFull(InfinigenError):
    """Not enough free blocks for what was asked (admission waits instead of asking)."""


class BlockAllocator:
    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise InfinigenError(f"a KV pool needs blocks (got {n_blocks}) of at least one token (got {block_size})")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free: deque[int] = deque(range(n_blocks))  # FIFO: a freed block is reused last (easier to debug)
        self.owner = np.full(n_blocks, -1, dtype=np.int64)
        self.tables: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}  # tokens each request's table must hold

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def room(self, rid: int, tokens: int) -> bool:
        """Whether request `rid` (new or not) can grow to hold `tokens` tokens now."""
        return self.blocks_for(tokens) - len(self.tables.get(rid, ())) <= len(self.free)

    def grow(self, rid: int, tokens: int) -> list[int]:
        """Make `rid`'s table hold `tokens` tokens (never shrinks); returns the blocks it took. A refusal (PoolFull)
        changes nothing."""
        table = self.tables.get(rid, [])
        tokens = max(self.reserved.get(rid, 0), tokens)
        need = self.blocks_for(tokens) - len(table)
        if need > len(self.free):
            raise PoolFull(f"the KV pool has {len(self.free)} free blocks, request {rid} needs {need}")
        new = [self.free.popleft() for _ in range(need)]
        self.owner[new] = rid
        self.tables[rid], self.reserved[rid] = table + new, tokens
        return new

    def release(self, rid: int) -> int:
        """Give every block of `rid` back; returns how many (0 for an unknown request)."""
        table = self.tables.pop(rid, [])
        self.reserved.pop(rid, None)
        self.owner[table] = -1
        self.free.extend(table)
        return len(table)

    def slots(self, rid: int, start: int, n: int) -> np.ndarray:
        """Flat slot numbers (block * block_size + offset) of `rid`'s tokens start..start+n-1."""
        if start < 0 or start + n > self.reserved.get(rid, 0):
            raise IndexError(f"tokens {start}..{start + n - 1} of request {rid} are not reserved")
        p = np.arange(start, start + n)
        table = np.asarray(self.tables[rid], dtype=np.int64)
        return table[p // self.block_size] * self.block_size + p % self.block_size

    @property
    def used(self) -> int:
        return self.n_blocks - len(self.free)

    def check(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        free = list(self.free)
        assert len(set(free)) == len(free), "a block is free twice"
        assert all(self.owner[b] == -1 for b in free), "a free block has an owner"
        owned = [b for t in self.tables.values() for b in t]
        assert len(set(owned)) == len(owned), "a block is owned twice"
        assert len(owned) + len(free) == self.n_blocks, "a block is lost"
        for rid, table in self.tables.items():
            assert all(self.owner[b] == rid for b in table), f"request {rid}'s table holds another's block"
            assert len(table) == self.blocks_for(self.reserved[rid]), f"request {rid}'s table is not its size"


class PagedStore:
    """The shared host memory of a paged pool: for each layer and tensor a [blocks * block_size, 1, Hkv, X] buffer,
    allocated the first time a store asks for it (so a server running one policy holds one layout), page-locked at
    its exact size when a GPU computes. Every request's blocks are slices of the same buffers."""

    def __init__(self, n_blocks: int, block_size: int, device):
        self.alloc = BlockAllocator(n_blocks, block_size)
        self.device = torch.device(device)
        self.registered: list[int] | None = [] if self.device.type == "cuda" else None
        if self.registered is not None:
            self._unpin = weakref.finalize(self, unpin, self.registered, self.device)
        self.buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, name: str, layer: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer of tensor `name` of `layer` with rows [Hkv, X] = `tail` (made on first use; not zeroed: a slot
        is always written by its request before it is read)."""
        key = (name, layer, tail, dtype)
        if key not in self.buffers:
            shape = (self.alloc.n_blocks * self.alloc.block_size, 1, *tail)
            self.buffers[key] = host_buffer(shape, dtype, self.registered, zero=False)
        return self.buffers[key]

    def reserve(self, rid: int, tokens: int) -> None:
        """Blocks for `tokens` tokens of request `rid` (PoolFull when there is no room: nothing changes then)."""
        self.alloc.grow(rid, tokens)

    def release(self, rid: int) -> int:
        return self.alloc.release(rid)

    def close(self) -> None:
        """Done with its memory (a request's own store, store.Solo): page-locked pages go once the device has passed
        this point (system.retire), without waiting for it inside a step."""
        if self.registered is not None:
            self._unpin.detach()
            retire(self.registered, list(self.buffers.values()), self.device)
        self.buffers = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())
