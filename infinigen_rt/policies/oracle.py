"""`oracle` (eval only): KV on the device, and each layer at or past the dense layers attends to the true
top-k tokens per query head by the real scores, k = ceil(budget * held tokens). The upper bound for any
selector at that budget; a mask over dense attention, so it measures accuracy, never speed."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.policies.full import DenseCache
from infinigen_rt.policies.options import KVOptions


class OracleCache(DenseCache):
    name = "oracle"
    knobs = frozenset({"budget", "max_kv", "dense_layers", "prefill_chunk"})
    runtime = False
    sweep = ("budget",)
    scores = True

    @classmethod
    def configure(cls, opts, engine):
        """The dense layers resolved: the option, else the bundle's default."""
        return super().configure(replace(opts, dense_layers=opts.dense_layers or engine.dense_layers), engine)

    @classmethod
    def build(cls, engine, opts, batch, max_len, pages=None):
        return cls(engine.cfg, batch, max_len, engine.device, engine.dtype, opts, opts.dense_layers)

    def __init__(self, cfg, batch, max_len, device, dtype, opts: KVOptions, dense_layers: int):
        super().__init__(cfg, batch, max_len, device, dtype)
        self.cfg, self.opts, self.dense_layers = cfg, opts, dense_layers
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kept = self.possible = 0
        self.recall: list[float] = []

    def update(self, layer, q, k, v):
        keys, values, mask = super().update(layer, q, k, v)
        mask = self.mask if mask is None else mask  # [B, 1, s, T]
        if q.shape[2] != 1 or layer < self.dense_layers:
            return keys, values, mask
        scores = q @ keys.repeat_interleave(self.group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.float().masked_fill(~mask, float("-inf"))  # [B, H, 1, T]
        held = mask.sum(-1, keepdim=True)  # [B, 1, 1, 1]
        n = torch.clamp(torch.ceil(self.opts.budget * held.double()).long(), min=1)
        if self.opts.max_kv is not None:
            n = n.clamp(max=self.opts.max_kv)
        order = scores.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order)
        )
        keep = (rank < n) & mask
        keep[..., -1] = True  # the current token
        probs = scores.softmax(-1)
        self.recall.append(float((probs * keep).sum(-1).mean()))
        self.kept += int(keep.sum())
        self.possible += int(mask.expand_as(keep).sum())
        return keys, values, keep

    def report(self) -> KVReport:
        share = round(self.kept / self.possible, 6) if self.possible else None
        dense = self.dense_layers / self.cfg.num_hidden_layers
        return KVReport(
            kv_fetched_share=share,
            kv_attended_share=None if share is None else round(dense + (1 - dense) * share, 6),
            attention_recall=round(sum(self.recall) / len(self.recall), 6) if self.recall else None,
            share_rows=self.possible or None,
        )
