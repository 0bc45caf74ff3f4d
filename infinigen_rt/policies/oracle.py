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

import torch
import torch.nn.functional as F

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.store import BLOCK
from infinigen_rt.policies.base import KVPolicy, Selector, kv_layers
from infinigen_rt.policies.full import Full
from infinigen_rt.policies.options import KVOptions


class Oracle(KVPolicy):
    name = "oracle"
    knobs = frozenset({"budget", "max_kv", "dense_layers", "prefill_chunk"})
    runtime = False
    sweep = ("budget",)
    scores = True
    per_query_head = False

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        return OracleSelector(engine, opts, cls.per_query_head)

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        return Full.kv_bytes(engine, opts, tokens, dtype_bytes)


class PerHeadOracle(Oracle):
    name = "oracle-per-head"
    per_query_head = True


def ranks_kept(held: torch.Tensor, opts: KVOptions, per_query_head: bool) -> torch.Tensor:
    """How many of the first ranks each (sequence, head) keeps, of `held` tokens (the current one included)."""
    if per_query_head:  # as published: ceil(budget * held) by score (then the current token, if not in)
        n = torch.ceil(opts.budget * held.double()).long().clamp(min=1)
    else:  # infinigen's count of the tokens before the current one, which is ranked first
        n = torch.floor(opts.budget * (held - 1).double()).long().clamp(min=1)
    if opts.max_kv is not None:
        n = n.clamp(max=opts.max_kv)
    return n if per_query_head else n + 1


def true_top(q, keys, mask, group: int, opts: KVOptions, per_query_head: bool):
    """The oracle's choice for one decode query a row, q [B, H, 1, D], over keys [B, Hkv, T, D] where mask [B, 1, 1, T]
    (the current token last): (attend [B, H, 1, T], the attention mass it keeps [B] (mean over heads), the KV rows a
    fetch would move [B] and the rows held [B], both over the KV heads and the current token's excluded)."""
    b, hkv = q.shape[0], keys.shape[1]
    scores = q @ keys.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1)  # [B, H, 1, T]
    held = mask.sum(-1, keepdim=True)  # [B, 1, 1, 1]
    if per_query_head:  # each query head its own top-k
        rank_by = probs
    else:  # one top-k per KV head: the group's probabilities summed, the current token first (above any sum)
        rank_by = probs.view(b, hkv, group, -1).sum(2, keepdim=True)
        rank_by[..., -1] = 2.0 * group
    order = rank_by.argsort(-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order))
    keep = (rank < ranks_kept(held, opts, per_query_head)) & mask  # [B, H or Hkv, 1, T]
    keep[..., -1] = True  # the current token
    attend = keep if per_query_head else keep.repeat_interleave(group, 1)  # [B, H, 1, T]
    rows = keep.view(b, hkv, group, -1).any(2) if per_query_head else keep[:, :, 0]  # [B, Hkv, T]
    recall = (probs * attend).sum(-1).flatten(1).mean(1)
    return attend, recall, rows[..., :-1].sum((1, 2)), mask[..., :-1].sum((1, 2, 3)) * hkv


class OracleSelector(Selector):
    """The oracle in the batch's KV store: every layer's KV on the device under the requests' block tables, prompts
    attended in full; in a decode step a layer at or past the dense layers gathers every row's rows through their
    flat slots (as h2o's selector does), scores them with the true query and attends to its true top ones only
    (`true_top`). Counted per request in the store's ledger: the rows kept, the rows held, the attention mass kept."""

    indexed = True

    def __init__(self, engine, opts: KVOptions, per_query_head: bool):
        cfg = engine.cfg
        super().__init__(kv_layers(cfg), [])
        self.cfg, self.opts, self.per_query_head = cfg, opts, per_query_head
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads

    def begin(self, step) -> None:
        super().begin(step)
        t, held = step.held
        slots = self.store.alloc.n_blocks * BLOCK
        rows = torch.cat([step.idx, step.slots[:, None]], 1)  # [B, T + 1]: the rows held before the step, the new one
        head = torch.arange(self.store.n_kv, device=rows.device).view(1, -1, 1)
        step.kv_at = rows[:, None] + head * slots  # [B, Hkv, T + 1]: the rows in a layer's flat keys
        ok = rows.new_ones(rows.shape[0], t + 1, dtype=torch.bool)
        if held is not None:
            ok[:, :t] = held
        step.ok = ok[:, None, None]  # [B, 1, 1, T + 1]

    def attend(self, step, layer, q, k, v) -> torch.Tensor:
        if layer < self.opts.dense_layers:
            return super().attend(step, layer, q, k, v)
        store = self.store
        store.write(layer, step.slots, k, v)
        d = q.shape[-1]
        keys = store.k[layer].view(-1, d)[step.kv_at]  # [B, Hkv, T + 1, D]
        values = store.v[layer].view(-1, d)[step.kv_at]
        attend, recall, kept, possible = true_top(q, keys, step.ok, self.group, self.opts, self.per_query_head)
        led = store.ledger
        led.add("recall", step.rids, recall)
        led.add("recalls", step.rids, 1)
        led.add("kept", step.rids, kept)
        led.add("possible", step.rids, possible)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, enable_gqa=keys.shape[1] != q.shape[1])

    def report(self, rid: int, r: KVReport) -> None:
        led = self.store.ledger
        kept, possible, n = led.get("kept", rid), led.get("possible", rid), led.get("recalls", rid)
        share = round(kept / possible, 6) if possible else None
        # the other layers (dense, or not the policy's) attend all they hold
        dense = 1 - sum(1 for j in kv_layers(self.cfg) if j >= self.opts.dense_layers) / self.cfg.num_hidden_layers
        r.kv_fetched_share = share
        r.kv_attended_share = None if share is None else round(dense + (1 - dense) * share, 6)
        r.attention_recall = round(led.get("recall", rid) / n, 6) if n else None
        r.share_rows = round(possible) or None
