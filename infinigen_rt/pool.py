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
        self.fill = 0  # slots written in order from 0, the same for every (b, h), until the first eviction
        self.holes = False  # once an eviction frees a slot below `fill`, free slots are found by search
        self.n_held = torch.zeros(shape[:2], dtype=torch.long)  # tokens held per (b, h), kept up to date

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return 2 * self.k.shape[-1] * self.k.element_size()

    def held(self) -> torch.Tensor:
        """Tokens held per (sequence, KV head): [B, Hkv]."""
        return self.n_held.clone()

    def insert(self, k, v, positions, valid) -> torch.Tensor:
        """Write s new tokens into free slots. k, v: [B, Hkv, s, D] (any device); positions, valid: [B, s].

        Padding tokens are written but their slots stay free. Returns the slots used: [B, Hkv, s] (host)."""
        b, h, s, d = k.shape
        valid = valid.cpu()
        new_pos = torch.where(valid, positions.cpu(), -1)[:, None, :].expand(b, h, s)
        self.n_held += valid.sum(-1)[:, None]
        if not self.holes:  # no eviction yet: the next slots in order, the same for every (b, h)
            f = self.fill
            assert f + s <= self.pos.shape[-1], "pool full: evict before inserting"
            self.fill += s
            self.k[:, :, f : f + s] = k
            self.v[:, :, f : f + s] = v
            self.pos[:, :, f : f + s] = new_pos
            self.hits[:, :, f : f + s] = 0
            self.last[:, :, f : f + s] = 0
            return torch.arange(f, f + s).expand(b, h, s)
        free = self.pos < 0
        assert int(free.sum(-1).min()) >= s, "pool full: evict before inserting"
        slots = torch.argsort((~free).to(torch.int8), dim=-1, stable=True)[..., :s]  # first free slots
        rows = slots[..., None].expand(b, h, s, d)
        self.k.scatter_(2, rows, k.to("cpu", self.k.dtype))
        self.v.scatter_(2, rows, v.to("cpu", self.v.dtype))
        self.pos.scatter_(2, slots, new_pos)
        self.hits.scatter_(2, slots, torch.zeros_like(slots))
        self.last.scatter_(2, slots, torch.zeros_like(slots))
        return slots

    def held_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held slot: (slots [B, Hkv, n], ok [B, Hkv, n]); ok is False on slots padding n out."""
        b, h, size = self.pos.shape
        if not self.holes:  # slots 0..fill-1 (left padding's free slots among them, not ok)
            n = self.fill
            return torch.arange(n).expand(b, h, n), self.pos[..., :n] >= 0
        n = max(int(self.held().max()), 0)
        slots = torch.argsort((self.pos < 0).to(torch.int8), dim=-1, stable=True)[..., :n]
        return slots, torch.gather(self.pos, 2, slots) >= 0

    def flat_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, n] slots -> row numbers into the pool viewed as [B * Hkv * S, D]."""
        b, h, n = slots.shape
        return (slots + torch.arange(b * h).view(b, h, 1) * self.pos.shape[-1]).reshape(-1)

    def gather(self, slots: torch.Tensor, device, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the K and V rows of `slots` ([B, Hkv, n], host) to `device`: [B, Hkv, n + extra, D] each.

        Rows are gathered on the host (one row copy each, into pinned staging when a GPU computes),
        then sent with one asynchronous copy per tensor. The `extra` last rows per (b, h) are room for
        the new tokens (copied from slot 0, to be overwritten), so no concatenation follows."""
        flat = self.flat_rows(pad_slots(slots, extra))
        shape = (*slots.shape[:2], slots.shape[2] + extra)
        return take_rows(self.k, flat, shape, device), take_rows(self.v, flat, shape, device)

    def mark_selected(self, slots: torch.Tensor, ok: torch.Tensor | None, step: int) -> None:
        """Count a selection of `slots` (where `ok`; None: all of them) for the counter and LRU policies."""
        if ok is None:
            self.hits.scatter_add_(2, slots, torch.ones_like(slots))
            self.last.scatter_(2, slots, step)
            return
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
        self.n_held -= victims.sum(-1)
        n = int(victims.sum())
        self.pos.masked_fill_(victims, -1)
        self.evicted += n
        self.holes = self.holes or n > 0
        return n


def pad_slots(slots: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([slots, slots.new_zeros(*slots.shape[:2], extra)], -1) if extra else slots


def take_rows(t: torch.Tensor, flat: torch.Tensor, shape, device) -> torch.Tensor:
    """Rows `flat` of t ([B, Hkv, S, X] on the host, viewed as [B*Hkv*S, X]) on `device`, shaped [*shape, X]."""
    x = t.shape[-1]
    cuda = torch.device(device).type == "cuda"
    out = torch.empty(flat.numel(), x, dtype=t.dtype, pin_memory=cuda)
    torch.index_select(t.view(-1, x), 0, flat, out=out)
    out = out.view(*shape, x)
    return out.to(device, non_blocking=True) if cuda else out
