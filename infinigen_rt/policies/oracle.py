"""`oracle` and `oracle-per-head` (eval only): KV on the device, and each layer at or past the dense layers attends
to the true top tokens by the real scores. A mask over dense attention: it measures accuracy, never speed.

- `oracle`, the bound at equal bytes: one selection per KV head, k = the budget's count of the held tokens (the
  count `infinigen` fetches: floor(budget * held), at least 1), ranked by the group's true probabilities summed
  over its query heads. What a KV-head selector that fetched k rows could at best attend to.
- `oracle-per-head`: the true top-k of each query head, k = ceil(budget * held). Under GQA a KV head then keeps
  the union of its group's sets, more rows than the budget (SmolLM2, 3 query heads per KV head: about 17-18 % at
  10 %); its report gives the share of KV rows it really keeps.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from infinigen_rt.kv.cache import KVReport, kv_layers
from infinigen_rt.policies.full import DenseCache
from infinigen_rt.policies.options import KVOptions


class OracleCache(DenseCache):
    name = "oracle"
    knobs = frozenset({"budget", "max_kv", "dense_layers", "prefill_chunk"})
    runtime = False
    sweep = ("budget",)
    scores = True
    per_query_head = False

    @classmethod
    def configure(cls, opts, engine):
        """The dense layers resolved: the option, else the bundle's default."""
        return super().configure(replace(opts, dense_layers=opts.dense_layers or engine.dense_layers), engine)

    @classmethod
    def build(cls, engine, opts, batch, max_len, pages=None, prefetch=None):
        return cls(engine.cfg, batch, max_len, engine.device, engine.dtype, opts, opts.dense_layers)

    def __init__(self, cfg, batch, max_len, device, dtype, opts: KVOptions, dense_layers: int):
        super().__init__(cfg, batch, max_len, device, dtype)
        self.cfg, self.opts, self.dense_layers = cfg, opts, dense_layers
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kept = self.possible = 0  # KV rows (per KV head) kept, and held, over the decode steps
        self.recall: list[float] = []

    def ranks_kept(self, held: torch.Tensor) -> torch.Tensor:
        """How many of the first ranks each (sequence, head) keeps, of `held` tokens (the current one included)."""
        if self.per_query_head:  # as published: ceil(budget * held) by score (then the current token, if not in)
            n = torch.ceil(self.opts.budget * held.double()).long().clamp(min=1)
        else:  # infinigen's count of the tokens before the current one, which is ranked first
            n = torch.floor(self.opts.budget * (held - 1).double()).long().clamp(min=1)
        if self.opts.max_kv is not None:
            n = n.clamp(max=self.opts.max_kv)
        return n if self.per_query_head else n + 1

    def update(self, layer, q, k, v):
        keys, values, mask = super().update(layer, q, k, v)
        mask = self.mask if mask is None else mask  # [B, 1, s, T]
        if q.shape[2] != 1 or layer < self.dense_layers:
            return keys, values, mask
        b, hkv = q.shape[0], keys.shape[1]
        scores = q @ keys.repeat_interleave(self.group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1)  # [B, H, 1, T]
        held = mask.sum(-1, keepdim=True)  # [B, 1, 1, 1]
        if self.per_query_head:  # each query head its own top-k
            rank_by = probs
        else:  # one top-k per KV head: the group's probabilities summed, the current token first (above any sum)
            rank_by = probs.view(b, hkv, self.group, -1).sum(2, keepdim=True)
            rank_by[..., -1] = 2.0 * self.group
        order = rank_by.argsort(-1, descending=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order))
        keep = (rank < self.ranks_kept(held)) & mask  # [B, H or Hkv, 1, T]
        keep[..., -1] = True  # the current token
        attend = keep if self.per_query_head else keep.repeat_interleave(self.group, 1)  # [B, H, 1, T]
        rows = keep.view(b, hkv, self.group, -1).any(2) if self.per_query_head else keep[:, :, 0]  # [B, Hkv, T]
        self.recall.append(float((probs * attend).sum(-1).mean()))
        self.kept += int(rows[..., :-1].sum())  # the KV rows a fetch would move (the current token's is new)
        self.possible += int(mask[..., :-1].expand(b, hkv, 1, -1).sum())
        return keys, values, attend

    def report(self) -> KVReport:
        share = round(self.kept / self.possible, 6) if self.possible else None
        # the other layers (dense, or not the policy's) attend all they hold
        dense = 1 - sum(1 for j in kv_layers(self.cfg) if j >= self.dense_layers) / self.cfg.num_hidden_layers
        return KVReport(
            kv_fetched_share=share,
            kv_attended_share=None if share is None else round(dense + (1 - dense) * share, 6),
            attention_recall=round(sum(self.recall) / len(self.recall), 6) if self.recall else None,
            share_rows=self.possible or None,
        )


class PerHeadOracleCache(OracleCache):
    name = "oracle-per-head"
    per_query_head = True
