"""Sliding-window layers (Gemma 3's local layers, Mistral): a ring of each request's last `window` tokens on the device.

A sliding layer attends to its last W tokens (itself included), so it never needs more than W of them: whatever
the policy, its KV stays on the compute device in the store's rings (`Rings`, one row of W slots per running request
and sliding layer); it is neither offloaded nor speculated, no policy's selector ever sees it, and no memory grows
with the context. A decode step writes its rows and attends over the rings of the whole batch; a prompt chunk
attends in blocks of W queries over its ring's tokens in order and its own (`blocked`), so it costs O(S * W), never
an S x S mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infinigen_rt.system import to_device


def blocked(q, keys, values, window: int, group: bool) -> torch.Tensor:
    """A prompt's s queries over the n_old + s rows in token order, in blocks of W queries: each sees its last W
    token slots (itself included)."""
    s, w = q.shape[2], window
    n_old = keys.shape[2] - s
    out = []
    for q0 in range(0, s, w):
        q1 = min(s, q0 + w)
        k0 = max(0, n_old + q0 - w + 1)  # the oldest row the block's first query sees
        kpos = torch.arange(k0, n_old + q1, device=q.device)  # rows, in token-slot order
        qpos = torch.arange(n_old + q0, n_old + q1, device=q.device)[:, None]
        mask = (kpos <= qpos) & (kpos > qpos - w)  # [s', t']
        out.append(F.scaled_dot_product_attention(
            q[:, :, q0:q1], keys[:, :, k0 : n_old + q1], values[:, :, k0 : n_old + q1], attn_mask=mask,
            enable_gqa=group,
        ))  # fmt: skip
    return out[0] if len(out) == 1 else torch.cat(out, 2)


class Rings:
    """The sliding layers' KV in the batch's store (store.py): a ring of W slots per row of the running batch and
    sliding layer, [rows, Hkv, W, D] on the device; a request takes a row when it is admitted. Token t of a request
    sits in ring slot t % W, so before its ring fills a request's tokens are slots 0..n-1 in order. A decode step
    writes every request's new rows and attends over the rings of the whole batch in a few launches (a mask only
    while some ring is not full); a prompt chunk attends in blocks (`blocked`), over its ring's
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
    def bytes(cfg, rows: int, dtype_bytes: int, context: int | None = None) -> int:
        """Device bytes of the rings for `rows` requests of up to `context` tokens (None: a whole window each)."""
        w = min(cfg.sliding_window or 0, context or cfg.sliding_window or 0)
        return rows * cfg.num_key_value_heads * w * 2 * cfg.head_dim * dtype_bytes * len(cfg.sliding_layers)

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
