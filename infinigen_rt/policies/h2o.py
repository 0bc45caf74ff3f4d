"""`h2o`: heavy hitters plus a recent window under the same budget, KV resident on the device (the H2O
baseline). Every layer accumulates, per (sequence, KV head), the attention each token received (summed
over the group's query heads and every query so far); after each forward pass the tokens outside the
`window` most recent with the least accumulated attention are evicted for good until at most
ceil(budget * length) remain.

The buffers stay allocated (tokens are masked out, not compacted): this policy measures H2O's accuracy
and the share of KV it attends, not its memory savings.

The attention with its scores and the eviction are functions of the tensors they read (`scored`, `kept`,
`survivors`), whatever holds them.
"""

from __future__ import annotations

import math

import torch

from infinigen_rt.kv.cache import KVReport, kv_layers
from infinigen_rt.policies.full import DenseCache
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


class H2OCache(DenseCache):
    name = "h2o"
    knobs = frozenset({"budget", "window", "prefill_chunk"})
    sweep = ("budget",)
    scores = True  # its attention builds the scores over the context

    @classmethod
    def build(cls, engine, opts, batch, max_len, pages=None, prefetch=None):
        return cls(engine.cfg, batch, max_len, engine.device, engine.dtype, opts)

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        kv, _, read = super().kv_bytes(engine, opts, tokens, dtype_bytes)
        state = tokens * 5 * len(kv_layers(engine.cfg))  # alive flags and accumulated scores (fp32)
        return kv + state, 0, read

    def __init__(self, cfg, batch, max_len, device, dtype, opts: KVOptions):
        super().__init__(cfg, batch, max_len, device, dtype)
        shape = (batch, cfg.num_key_value_heads, max_len)
        layers = kv_layers(cfg)
        self.alive = {i: torch.zeros(shape, dtype=torch.bool, device=device) for i in layers}
        self.score = {i: torch.zeros(shape, dtype=torch.float32, device=device) for i in layers}
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.opts = opts
        # counted on the device, read by `report` (a decode step reads nothing)
        self.attended = self.possible = self.evictions = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, layer, q, k, v):
        keys, values, _ = super().update(layer, q, k, v)
        t, s = self.length, q.shape[2]
        self.alive[layer][:, :, self.start : t] = self.valid[:, None, self.start : t]  # new tokens join
        alive = self.alive[layer][:, :, :t]  # [B, Hkv, T]
        allowed = self.mask & alive[:, :, None, :]  # [B, Hkv, s, T]
        dev = q.device  # index tensors on the host would be copied over with a wait, every layer
        allowed[:, :, torch.arange(s, device=dev), torch.arange(self.start, t, device=dev)] = True  # sees itself
        _, received = scored(q.unflatten(1, (-1, self.group)), keys, allowed)
        self.score[layer][:, :, :t] += received
        if s == 1:
            self.attended = self.attended + alive.sum()
            self.possible = self.possible + self.valid[:, None, :t].sum() * alive.shape[1]
        return keys, values, allowed.repeat_interleave(self.group, 1)

    def end(self) -> None:
        t = self.length
        keep = kept(self.opts.budget, self.valid[:, :t].sum(-1))[:, None]  # [B, 1]
        recent = torch.arange(t, device=keep.device) >= t - self.opts.window  # [T]
        for layer in self.alive:
            alive = self.alive[layer][:, :, :t]
            survive = survivors(alive, self.score[layer][:, :, :t], recent, keep)
            self.evictions = self.evictions + (alive & ~survive).sum()
            self.alive[layer][:, :, :t] = survive

    def report(self) -> KVReport:
        attended, possible, evictions = torch.stack([self.attended, self.possible, self.evictions]).tolist()
        share = round(attended / possible, 6) if possible else None
        return KVReport(
            kv_fetched_share=share, kv_attended_share=share, evictions=evictions, share_rows=possible or None
        )  # fmt: skip
