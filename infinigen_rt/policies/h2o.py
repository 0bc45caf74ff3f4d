"""`h2o`: heavy hitters plus a recent window under the same budget, KV resident on the device (the H2O
baseline). Every layer accumulates, per (sequence, KV head), the attention each token received (summed
over the group's query heads and every query so far); after each forward pass the tokens outside the
`window` most recent with the least accumulated attention are evicted for good until at most
ceil(budget * length) remain.

The buffers stay allocated (tokens are masked out, not compacted): this policy measures H2O's accuracy
and the share of KV it attends, not its memory savings.

In the batch's KV store (kv/store.py) it runs as `H2OSelector`: attention with its scores written out, and the
eviction (`scored`, `kept`, `survivors`) over the store's flat slots, for every request of a decode step at once.
"""

from __future__ import annotations

import math

import torch

from infinigen_rt.kv.cache import KVReport, causal_mask
from infinigen_rt.kv.store import BLOCK
from infinigen_rt.policies.base import KVPolicy, Selector, kv_layers
from infinigen_rt.policies.full import Full
from infinigen_rt.policies.options import KVOptions


def scored(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its probabilities written out in fp32 (SDPA's fused kernels never form them, and the scores
    are their sums): q [..., G, s, D] (each KV head's group of query heads), keys [..., T, D], allowed [..., s, T]
    bool (True where a query may attend; never an empty row). Returns the probabilities [..., G, s, T] and the
    attention each token received, summed over the group's heads and the queries [..., T]. In place: one score
    matrix at a time (a prompt's is the largest tensor this policy makes: bench's memory model counts it once, with
    the mask)."""
    g, s = q.shape[-3], q.shape[-2]
    p = torch.matmul(q.float().flatten(-3, -2) / math.sqrt(q.shape[-1]), keys.float().transpose(-1, -2))
    p = p.unflatten(-2, (g, s)).masked_fill_(~allowed.unsqueeze(-3), float("-inf"))
    p = p.sub_(p.amax(-1, keepdim=True)).exp_()
    p = p.div_(p.sum(-1, keepdim=True))
    return p, p.sum(-2).sum(-2)


def weighted(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The output of probabilities p [..., G, s, T] over values [..., T, D]: [..., G, s, D], in the values' dtype."""
    return torch.matmul(p.flatten(-3, -2).to(values.dtype), values).unflatten(-2, p.shape[-3:-1])


def kept(budget: float, lengths: torch.Tensor) -> torch.Tensor:
    """The most tokens each sequence of `lengths` keeps per KV head after a pass: ceil(budget * length), at least
    one."""
    return torch.ceil(budget * lengths.double()).long().clamp(min=1)


def survivors(alive: torch.Tensor, score: torch.Tensor, recent: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The tokens that stay after a pass: of the alive ones, every recent one, and of the others the most attended,
    as many as leave at most `keep` (fewer where the recent ones alone reach it). alive, score [..., T] (one sequence
    and KV head a row); recent: bool, broadcast to them; keep: broadcast to alive.shape[:-1]."""
    n_heavy = (keep - (alive & recent).sum(-1)).clamp(min=0)
    rank = score.masked_fill(~alive | recent, float("-inf"))
    order = rank.argsort(-1, descending=True)
    at = torch.arange(alive.shape[-1], device=order.device).expand_as(order)
    nth = torch.empty_like(order).scatter_(-1, order, at)  # each token's place in the ranking
    return alive & (recent | (nth < n_heavy[..., None]))


class H2O(KVPolicy):
    name = "h2o"
    knobs = frozenset({"budget", "window", "prefill_chunk"})
    sweep = ("budget",)
    scores = True  # its attention builds the scores over the context

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """H2O in the store, whatever its options (nothing of it moves: no prefetch)."""
        return H2OSelector(engine, opts)

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        kv, _, read = Full.kv_bytes(engine, opts, tokens, dtype_bytes)
        state = tokens * 5 * len(kv_layers(engine.cfg))  # alive flags and accumulated scores (fp32)
        return kv + state, 0, read


class H2OSelector(Selector):
    """H2O in the batch's KV store: every layer's KV on the device under the requests' block tables, and beside it
    each flat slot's state per layer and KV head (alive, and the attention its token received), [L, Hkv, slots + 1]:
    the last slot is a sink, never alive, whose state a row shorter than the step's longest reads and writes for the
    rows it does not hold (their keys, read wherever its table's padding points, then need no mask of their own).
    A decode step gathers every row's rows through their flat slots (the paged attention kernel never forms the
    probabilities whose sums are the scores), attends with them written out, adds them into the scores in one
    scatter a layer, and after the step evicts for every request and layer at once; a prompt chunk attends over its
    request's alive rows and its own and evicts for it."""

    indexed = True

    def __init__(self, engine, opts: KVOptions):
        layers = kv_layers(engine.cfg)
        super().__init__(layers, [])
        self.at = {layer: i for i, layer in enumerate(layers)}  # a layer's row of the state
        self.opts = opts
        self.group = engine.cfg.num_attention_heads // engine.cfg.num_key_value_heads

    def attach(self, store) -> None:
        super().attach(store)
        self.sink = store.alloc.n_blocks * BLOCK  # the store's slots, then the sink
        shape = (len(self.at), store.n_kv, self.sink + 1)
        self.alive = torch.zeros(shape, dtype=torch.bool, device=store.device)
        self.score = torch.zeros(shape, dtype=torch.float32, device=store.device)

    def join(self, p, state: torch.Tensor) -> None:
        """A pass's new tokens join (their slots' state reset: a slot may have been another request's); `p.state_at`
        [B, Hkv, n]: the rows' places in a layer's flat state, from their flat slots `state` [B, n] (the sink where
        a row holds none)."""
        self.alive.index_fill_(2, p.slots, True)
        self.score.index_fill_(2, p.slots, 0)
        p.head = torch.arange(self.store.n_kv, device=state.device).view(1, -1, 1)
        p.state_at = state[:, None] + p.head * (self.sink + 1)

    def begin(self, step) -> None:
        t, held = step.held
        new = step.slots[:, None]
        rows = torch.cat([step.idx, new], 1)  # [B, T + 1]: each row's tokens held before the step, then its new one
        self.join(step, rows if held is None else torch.cat([torch.where(held, step.idx, self.sink), new], 1))
        step.kv_at = rows[:, None] + step.head * self.sink  # [B, Hkv, T + 1]: the rows in a layer's flat keys
        within = torch.arange(t, device=new.device) >= (step.batch.lengths - self.opts.window)[:, None]
        step.recent = torch.cat([within, within.new_ones(within.shape[0], 1)], 1)[:, None]  # [B, 1, T + 1]

    def begin_pass(self, p) -> None:
        t = p.start + p.slots.shape[0]
        at = torch.arange(t, device=p.slots.device)
        self.join(p, self.store.physical(p.batch, at[None]))
        p.recent = at >= t - self.opts.window  # [T]
        p.causal = causal_mask(torch.ones(1, t, dtype=torch.bool, device=at.device), p.start)  # [1, 1, s, T]

    def attend(self, step, layer, q, k, v) -> torch.Tensor:
        """Every row's query over its alive rows and its new one [B, Hkv, T + 1], gathered through the flat slots."""
        store = self.store
        store.write(layer, step.slots, k, v)
        d = q.shape[-1]
        keys = store.k[layer].view(-1, d)[step.kv_at]  # [B, Hkv, T + 1, D]
        values = store.v[layer].view(-1, d)[step.kv_at]
        allowed = self.alive[self.at[layer]].view(-1)[step.state_at][:, :, None]  # [B, Hkv, 1, T + 1]
        return self.attend_over(step, layer, q, keys, values, allowed)

    def attend_pass(self, p, layer, q, k, v) -> torch.Tensor:
        """The chunk's queries causally over its request's alive earlier rows and its own (a view where the request's
        blocks are one run)."""
        store = self.store
        store.write(layer, p.slots, k, v)
        t = p.state_at.shape[-1]
        keys, values = store.rows_of(store.k[layer], p.rid, t), store.rows_of(store.v[layer], p.rid, t)
        allowed = p.causal & self.alive[self.at[layer]].view(-1)[p.state_at][:, :, None]  # [1, Hkv, s, T]
        return self.attend_over(p, layer, q, keys, values, allowed)

    def attend_over(self, p, layer, q, keys, values, allowed) -> torch.Tensor:
        """q [B, H, s, D] over keys and values [B, Hkv, T, D] where `allowed` [B, Hkv, s, T]: the output, and the
        attention each token received added into its slot's score (one scatter for the batch)."""
        probs, received = scored(q.unflatten(1, (-1, self.group)), keys, allowed)
        self.score[self.at[layer]].view(-1).index_add_(0, p.state_at.view(-1), received.view(-1))
        return weighted(probs, values).flatten(1, 2)

    def end(self, p) -> None:
        """The eviction after a pass, for every row and layer at once; counted per request (the rows attended and
        their share only for a pass of one query a row)."""
        n = len(self.at)
        state = self.alive.view(n, -1)
        alive = state[:, p.state_at]  # [L, B, Hkv, T]
        score = self.score.view(n, -1)[:, p.state_at]
        keep = kept(self.opts.budget, p.batch.lengths)[:, None]  # [B, 1]
        survive = survivors(alive, score, p.recent, keep)
        state[:, p.state_at] = survive
        led, rids = self.store.ledger, p.batch.rids
        held = alive.sum((0, 2, 3))
        led.add("evictions", rids, held - survive.sum((0, 2, 3)))
        if p.slots.shape[0] == len(rids):  # one query a row: a decode step's (or a one-token chunk's)
            led.add("attended", rids, held)
            led.add("possible", rids, (p.batch.old + 1) * self.store.n_kv * n)

    def report(self, rid: int, r: KVReport) -> None:
        led = self.store.ledger
        attended, possible = led.get("attended", rid), led.get("possible", rid)
        r.kv_fetched_share = r.kv_attended_share = round(attended / possible, 6) if possible else None
        r.share_rows = round(possible) or None  # (its evictions: the store's report counts them)
