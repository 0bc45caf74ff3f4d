"""`h2o`: heavy hitters plus a recent window under the same budget, KV resident on the device (the H2O
baseline). Every layer accumulates, per (sequence, KV head), the attention each token received (summed
over the group's query heads and every query so far); after each forward pass the tokens outside the
`window` most recent with the least accumulated attention are evicted for good until at most
ceil(budget * length) remain.

The buffers stay allocated (tokens are masked out, not compacted): this policy measures H2O's accuracy
and the share of KV it attends, not its memory savings.
"""

from __future__ import annotations

import math

import torch

from infinigen_rt.kv.cache import KVReport, kv_layers
from infinigen_rt.policies.full import DenseCache
from infinigen_rt.policies.options import KVOptions


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
        mask = self.mask  # [B, 1, s, T]
        t, s = self.length, q.shape[2]
        self.alive[layer][:, :, self.start : t] = self.valid[:, None, self.start : t]  # new tokens join
        alive = self.alive[layer][:, :, :t]  # [B, Hkv, T]
        head_mask = mask & alive.repeat_interleave(self.group, dim=1)[:, :, None, :]  # [B, H, s, T]
        dev = q.device  # index tensors on the host would be copied over with a wait, every layer
        head_mask[:, :, torch.arange(s, device=dev), torch.arange(self.start, t, device=dev)] = True  # sees itself
        # the [B, H, s, T] probabilities in fp32, in place: one score matrix at a time (a prompt's is the largest
        # tensor this policy makes: bench's memory model counts it once, with the mask)
        k_all = keys.repeat_interleave(self.group, 1).float().transpose(-1, -2)
        p = torch.matmul(q.float() / math.sqrt(q.shape[-1]), k_all).masked_fill_(~head_mask, float("-inf"))
        p = p.sub_(p.amax(-1, keepdim=True)).exp_()
        p = p.div_(p.sum(-1, keepdim=True))  # [B, H, s, T]
        self.score[layer][:, :, :t] += p.sum(2).unflatten(1, (-1, self.group)).sum(2)
        if q.shape[2] == 1:
            self.attended = self.attended + alive.sum()
            self.possible = self.possible + self.valid[:, None, :t].sum() * alive.shape[1]
        return keys, values, head_mask

    def end(self) -> None:
        t = self.length
        lengths = self.valid[:, :t].sum(-1)  # [B]
        keep = torch.ceil(self.opts.budget * lengths.double()).long().clamp(min=1)  # [B]
        recent = torch.arange(t, device=lengths.device) >= t - self.opts.window  # [T]
        for layer in self.alive:
            alive, score = self.alive[layer][:, :, :t], self.score[layer][:, :, :t]
            n_heavy = (keep[:, None] - (alive & recent).sum(-1)).clamp(min=0)  # [B, Hkv]
            rank = score.masked_fill(~alive | recent, float("-inf"))
            order = rank.argsort(-1, descending=True)
            nth = torch.empty_like(order).scatter_(2, order, torch.arange(t, device=order.device).expand_as(order))
            survive = (alive & recent) | (alive & ~recent & (nth < n_heavy[..., None]))
            self.evictions = self.evictions + (alive & ~survive).sum()
            self.alive[layer][:, :, :t] = survive

    def report(self) -> KVReport:
        attended, possible, evictions = torch.stack([self.attended, self.possible, self.evictions]).tolist()
        share = round(attended / possible, 6) if possible else None
        return KVReport(
            kv_fetched_share=share, kv_attended_share=share, evictions=evictions, share_rows=possible or None
        )  # fmt: skip
