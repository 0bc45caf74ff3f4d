"""The host KV pool: one layer's keys and values per (sequence, KV head) in CPU memory, in slots.

Mechanism only: which slots a layer fetches is the policy's business. Each (sequence, KV head) owns
its slots; a slot holds one token (its position in `pos`, -1 when free). Eviction, per (sequence, KV
head), keeps at most `capacity` tokens and never touches the most recent `window` positions:
  counter  fewest times selected first (the paper's choice), then oldest
  lru      least recently selected first, then oldest
  fifo     oldest first
An evicted slot is freed (pos = -1), so its token can never be selected again.
"""

from __future__ import annotations

import torch

EVICTIONS = ("counter", "lru", "fifo")
_BIG = 1 << 32  # ranks: primary key * _BIG + position (positions < 2**32)


class KVPool:
    """k, v: [B, Hkv, S, D] on the host (pinned when a GPU computes); pos, hits, last: [B, Hkv, S]."""

    def __init__(self, batch, n_kv, head_dim, slots, dtype, pin: bool, eviction="counter", window=0):
        assert eviction in EVICTIONS
        shape = (batch, n_kv, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.pos = torch.full(shape[:3], -1, dtype=torch.long)
        self.hits = torch.zeros(shape[:3], dtype=torch.long)
        self.last = torch.zeros(shape[:3], dtype=torch.long)
        self.eviction, self.window = eviction, window
        self.evicted = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return 2 * self.k.shape[-1] * self.k.element_size()

    def held(self) -> torch.Tensor:
        """Tokens held per (sequence, KV head): [B, Hkv]."""
        return (self.pos >= 0).sum(-1)

    def insert(self, k, v, positions, valid) -> torch.Tensor:
        """Write s new tokens into free slots. k, v: [B, Hkv, s, D] (any device); positions, valid: [B, s].

        Padding tokens are written but their slots stay free. Returns the slots used: [B, Hkv, s] (host)."""
        b, h, s, d = k.shape
        free = self.pos < 0
        assert int(free.sum(-1).min()) >= s, "pool full: evict before inserting"
        slots = torch.argsort((~free).to(torch.int8), dim=-1, stable=True)[..., :s]  # first free slots
        rows = slots[..., None].expand(b, h, s, d)
        self.k.scatter_(2, rows, k.to("cpu", self.k.dtype))
        self.v.scatter_(2, rows, v.to("cpu", self.v.dtype))
        new_pos = torch.where(valid.cpu(), positions.cpu(), -1)[:, None, :].expand(b, h, s)
        self.pos.scatter_(2, slots, new_pos)
        self.hits.scatter_(2, slots, torch.zeros_like(slots))
        self.last.scatter_(2, slots, torch.zeros_like(slots))
        return slots

    def held_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held slot: (slots [B, Hkv, n], ok [B, Hkv, n]) with n = the most held by any (b, h)."""
        n = max(int(self.held().max()), 0)
        slots = torch.argsort((self.pos < 0).to(torch.int8), dim=-1, stable=True)[..., :n]
        return slots, torch.gather(self.pos, 2, slots) >= 0

    def gather(self, slots: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the K and V rows of `slots` ([B, Hkv, n], host) to `device`: [B, Hkv, n, D] each."""
        b, h, n = slots.shape
        rows = slots[..., None].expand(b, h, n, self.k.shape[-1])
        k, v = torch.gather(self.k, 2, rows), torch.gather(self.v, 2, rows)
        if torch.device(device).type == "cuda":
            k, v = k.pin_memory(), v.pin_memory()
        return k.to(device, non_blocking=True), v.to(device, non_blocking=True)

    def mark_selected(self, slots: torch.Tensor, ok: torch.Tensor, step: int) -> None:
        """Count a selection of `slots` (where `ok`) for the counter and LRU policies."""
        self.hits.scatter_add_(2, slots, ok.long())
        self.last.scatter_(2, slots, torch.where(ok, step, torch.gather(self.last, 2, slots)))

    def evict(self, capacity: torch.Tensor) -> int:
        """Free slots until every (sequence, KV head) holds at most capacity[b] tokens. Returns how many."""
        held = self.held()
        over = (held - capacity[:, None]).clamp(min=0)  # [B, Hkv]
        if int(over.max()) == 0:
            return 0
        newest = self.pos.amax(dim=(1, 2))  # [B]: the latest position of each sequence
        recent = self.pos > (newest[:, None, None] - self.window)
        primary = {"counter": self.hits, "lru": self.last, "fifo": torch.zeros_like(self.pos)}[self.eviction]
        rank = primary * _BIG + self.pos
        rank = rank.masked_fill((self.pos < 0) | recent, torch.iinfo(torch.long).max)
        order = rank.argsort(dim=-1, stable=True)
        nth = torch.empty_like(order).scatter_(2, order, torch.arange(order.shape[-1]).expand_as(order))
        victims = (nth < over[..., None]) & (self.pos >= 0) & ~recent
        n = int(victims.sum())
        self.pos.masked_fill_(victims, -1)
        self.evicted += n
        return n
