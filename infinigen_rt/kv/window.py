"""Sliding-window layers (Gemma 3's local layers, Mistral): a ring of the last `window` tokens on the device.

A sliding layer attends to its last W tokens (itself included), so it never needs more than W of them: whatever
the policy, its KV stays on the compute device in a ring buffer of W slots per (sequence, KV head); it is neither
offloaded nor speculated, and no memory grows with the context. `Hybrid` puts a policy's cache (the global layers)
and a `WindowCache` (the sliding layers) behind one KVCache: the model calls it as any other and never knows.

Ring slot of token slot a (counted per pass, the same in every row: left padding aligns the ends) is a % W; the
ring's slot metadata (which token slot each ring slot holds, whether it is real) is shared by the sliding layers
and updated once per pass. A decode step writes its row and attends over the ring (no mask once the ring is full
of real tokens); a prompt attends in blocks of W queries over the ordered ring plus its own tokens, so it costs
O(S * W), never an S x S mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infinigen_rt.kv.cache import KVCache, KVReport
from infinigen_rt.system import to_device


class WindowCache(KVCache):
    """The sliding layers' KV: for each layer of `cfg.sliding_layers`, a ring [B, Hkv, min(W, max_len), D]."""

    name = "window"

    def __init__(self, cfg, batch: int, max_len: int, device, dtype):
        self.window = cfg.sliding_window
        self.size = w = min(cfg.sliding_window, max_len)
        shape = (batch, cfg.num_key_value_heads, w, cfg.head_dim)
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in cfg.sliding_layers}
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in cfg.sliding_layers}
        self.valid = torch.zeros(batch, w, dtype=torch.bool, device=device)  # the ring slot holds a real token
        self.device, self.max_len = torch.device(device), max_len
        self.length = 0  # token slots passed through, the same for every row
        self.padded = False  # a slot in the ring holds padding (host-known: then a decode step needs a mask)
        self.pad_until = 0  # token slots below this may be padding

    @staticmethod
    def bytes(cfg, batch_kv_heads: int, context: int, dtype_bytes: int) -> int:
        """Device bytes of the rings for `batch_kv_heads` (sequence, KV head) pairs of up to `context` tokens."""
        w = min(cfg.sliding_window or 0, context)
        return batch_kv_heads * w * 2 * cfg.head_dim * dtype_bytes * len(cfg.sliding_layers)

    def begin(self, valid, positions) -> None:
        s = positions.shape[1]
        if self.length + s > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens, asked for {self.length + s}")
        self.start, self.s = self.length, s
        self.length += s
        w, start = self.size, self.start
        n_old = min(start, w)
        if s > 1:  # a prompt: the ring's tokens in slot order and which of them (and of the new ones) are real
            old = torch.arange(start - n_old, start, device=self.device) % w
            self.order = old if n_old else None
            new_valid = torch.ones(valid.shape[0] if valid is not None else self.valid.shape[0], s, dtype=torch.bool,
                                   device=self.device) if valid is None else valid  # fmt: skip
            self.seq_valid = torch.cat([self.valid[:, old], new_valid], 1)  # [B, n_old + s]
            if valid is not None and not bool(valid.all()):
                self.pad_until = self.length
        n = min(s, w)
        slots = torch.arange(self.length - n, self.length, device=self.device) % w
        self.slots = slots
        self.valid[:, slots] = True if valid is None else valid[:, s - n :]
        self.padded = self.pad_until > self.length - w  # padding still inside the ring

    def store(self, layer, q, k, v) -> None:
        """Write the pass's last min(s, W) rows into layer `layer`'s ring."""
        n = self.slots.shape[0]
        self.k[layer].index_copy_(2, self.slots, k[:, :, -n:])
        self.v[layer].index_copy_(2, self.slots, v[:, :, -n:])

    def attend(self, layer, q, k, v) -> torch.Tensor:
        group = q.shape[1] != k.shape[1]
        if self.s == 1:  # decode: write, then attend over the ring (every slot in it is inside the window)
            self.store(layer, q, k, v)
            t = min(self.length, self.size)  # before the ring fills, its slots 0..t-1 hold the tokens in order
            keys, values = self.k[layer][:, :, :t], self.v[layer][:, :, :t]
            mask = self.valid[:, None, None, :t] if self.padded else None
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=group)
        if self.order is not None:  # the ring's tokens before the new ones, in slot order
            keys = torch.cat([self.k[layer][:, :, self.order], k], 2)
            values = torch.cat([self.v[layer][:, :, self.order], v], 2)
        else:
            keys, values = k, v
        self.store(layer, q, k, v)
        return self.blocked(q, keys, values, group)

    def blocked(self, q, keys, values, group: bool) -> torch.Tensor:
        return blocked(q, keys, values, self.window, group, self.seq_valid)


def blocked(q, keys, values, window: int, group: bool, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt's s queries over the n_old + s rows in token order, in blocks of W queries: each sees its last W
    token slots (itself included) that hold real tokens (`valid` [B, n_old + s]; None: all of them), and always
    itself (a padding row is never empty)."""
    s, w = q.shape[2], window
    n_old = keys.shape[2] - s
    out = []
    for q0 in range(0, s, w):
        q1 = min(s, q0 + w)
        k0 = max(0, n_old + q0 - w + 1)  # the oldest row the block's first query sees
        kpos = torch.arange(k0, n_old + q1, device=q.device)  # rows, in token-slot order
        qpos = torch.arange(n_old + q0, n_old + q1, device=q.device)[:, None]
        mask = (kpos <= qpos) & (kpos > qpos - w)  # [s', t']
        mask = mask[None] if valid is None else (mask[None] & valid[:, None, k0 : n_old + q1]) | (kpos == qpos)[None]
        out.append(F.scaled_dot_product_attention(
            q[:, :, q0:q1], keys[:, :, k0 : n_old + q1], values[:, :, k0 : n_old + q1], attn_mask=mask[:, None],
            enable_gqa=group,
        ))  # fmt: skip
    return out[0] if len(out) == 1 else torch.cat(out, 2)


class Rings:
    """The sliding layers' KV in the batch's store (store.py): a ring of W slots per row of the running batch and
    sliding layer, [rows, Hkv, W, D] on the device; a request takes a row when it is admitted. Token t of a request
    sits in ring slot t % W, so before its ring fills a request's tokens are slots 0..n-1 in order. A decode step
    writes every request's new rows and attends over the rings of the whole batch in a few launches (a mask only
    while some ring is not full); a prompt chunk attends as WindowCache's prompt does (`blocked`), over its ring's
    tokens in order and its own."""

    def __init__(self, cfg, rows: int, device, dtype):
        self.window = w = cfg.sliding_window
        shape = (rows, cfg.num_key_value_heads, w, cfg.head_dim)
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in cfg.sliding_layers}
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in cfg.sliding_layers}
        self.device = torch.device(device)
        self.rows = rows
        self.free = list(range(rows))
        self.row: dict[int, int] = {}  # request -> its row of the rings

    @staticmethod
    def bytes(cfg, rows: int, dtype_bytes: int) -> int:
        return WindowCache.bytes(cfg, rows * cfg.num_key_value_heads, cfg.sliding_window or 0, dtype_bytes)

    def admit(self, rid: int) -> None:
        self.row[rid] = self.free.pop(0)

    def release(self, rid: int) -> None:
        if rid in self.row:
            self.free.append(self.row.pop(rid))

    def begin(self, rids: list[int], old: list[int]) -> None:
        """A decode step of requests `rids`, which held `old` tokens each: where each writes its row, and over which
        of its ring's slots it attends (every slot of a full ring, else its tokens so far and the new one)."""
        w = self.window
        n = [min(x + 1, w) for x in old]
        self.t = max(n)
        self.idx = to_device(torch.tensor([self.row[r] for r in rids]), self.device)
        self.at = to_device(torch.tensor([x % w for x in old]), self.device)
        self.mask = None
        if min(n) < self.t:  # [B, 1, 1, t]: a ring not yet full
            self.mask = to_device((torch.arange(self.t)[None] < torch.tensor(n)[:, None])[:, None, None], self.device)

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """A decode step's sliding layer for the whole batch: k, v [B, Hkv, 1, D] into the rings, q [B, H, 1, D] over
        them."""
        ring_k, ring_v = self.k[layer], self.v[layer]
        ring_k[self.idx, :, self.at] = k[:, :, 0]
        ring_v[self.idx, :, self.at] = v[:, :, 0]
        keys = ring_k[:, :, : self.t].index_select(0, self.idx)
        values = ring_v[:, :, : self.t].index_select(0, self.idx)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=k.shape[1] != q.shape[1])

    def attend_pass(self, rid: int, start: int, layer: int, q, k, v) -> torch.Tensor:
        """Request `rid`'s prompt chunk of s tokens after its first `start`: attended over its ring's last
        min(start, W) tokens and its own; then its last min(s, W) rows go into the ring."""
        w, s, r = self.window, k.shape[2], self.row[rid]
        ring_k, ring_v = self.k[layer][r : r + 1], self.v[layer][r : r + 1]
        keys, values = k, v
        if start:
            order = torch.arange(start - min(start, w), start, device=self.device) % w
            keys, values = torch.cat([ring_k[:, :, order], k], 2), torch.cat([ring_v[:, :, order], v], 2)
        n = min(s, w)
        slots = torch.arange(start + s - n, start + s, device=self.device) % w
        ring_k.index_copy_(2, slots, k[:, :, -n:])
        ring_v.index_copy_(2, slots, v[:, :, -n:])
        return blocked(q, keys, values, w, k.shape[1] != q.shape[1])


class Hybrid(KVCache):
    """A model with sliding and global layers: the sliding layers attend through a WindowCache, the others through
    the policy's cache (`inner`, which holds nothing for the sliding layers). Reports are the inner cache's."""

    def __init__(self, inner: KVCache, window: WindowCache):
        self.inner, self.ring = inner, window
        self.sliding = set(window.k)

    def begin(self, valid, positions) -> None:
        self.ring.begin(valid, positions)
        self.inner.begin(valid, positions)

    def observe(self, layer, x) -> None:
        self.inner.observe(layer, x)  # speculation of the next global layer may start from a sliding layer's input

    def attend(self, layer, q, k, v) -> torch.Tensor:
        return (self.ring if layer in self.sliding else self.inner).attend(layer, q, k, v)

    def update(self, layer, q, k, v):
        if layer in self.sliding:
            raise TypeError("a sliding layer attends through attend(), not update()")
        return self.inner.update(layer, q, k, v)

    def store(self, layer, q, k, v) -> None:
        (self.ring if layer in self.sliding else self.inner).store(layer, q, k, v)

    def end(self) -> None:
        self.inner.end()

    def report(self) -> KVReport:
        return self.inner.report()

    def close(self) -> None:
        self.inner.close()


def windowed(cfg, cache: KVCache, batch: int, max_len: int, device, dtype) -> KVCache:
    """`cache` as the model sees it: behind a Hybrid with the sliding layers' rings when the model has any."""
    if not cfg.sliding_layers:
        return cache
    return Hybrid(cache, WindowCache(cfg, batch, max_len, device, dtype))


def inner(cache: KVCache) -> KVCache:
    """The policy's own cache behind a Hybrid (or the cache itself)."""
    return cache.inner if isinstance(cache, Hybrid) else cache
