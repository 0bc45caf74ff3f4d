"""`infinigen`: KV in the host pool; each decode step, layer i speculates which tokens layer i+1 needs
from layer i's normalised input, a partial query (skewed columns) and the partial key cache of layer
i+1 kept on the device; only those rows are fetched (the selection: speculation.py). The dense layers (the
first `dense_layers`) keep their KV on the device.

The selection and the copy of layer i+1's rows overlap layer i's compute (prefetch.py: a CUDA side stream, or
on a CPU with two threads or more this cache's worker thread).
"""

from __future__ import annotations

import math

import torch

from infinigen_rt.policies.offload import OffloadCache
from infinigen_rt.prefetch import prefetcher
from infinigen_rt.speculation import Speculator, select


class InfinigenCache(OffloadCache):
    def __init__(self, cfg, batch, max_len, device, dtype, opts, model, tensors: dict, defaults: dict):
        dense = defaults["dense_layers"] if opts.dense_layers is None else opts.dense_layers
        super().__init__(cfg, batch, max_len, device, dtype, opts, resident=dense)  # dense layers stay on the device
        self.alpha = defaults["alpha"] if opts.alpha is None else opts.alpha
        self.dense_layers = dense
        self.spec = Speculator(cfg, model.speculation_taps(), tensors, self.device, dtype)
        hkv, d_prime = cfg.num_key_value_heads, self.spec.d_prime
        spec = range(dense, cfg.num_hidden_layers)  # the speculated layers' partial keys (transposed), held map
        self.pk = {j: torch.zeros(batch, hkv, d_prime, max_len, device=self.device, dtype=dtype) for j in spec}
        self.held_dev = {j: torch.zeros(batch, hkv, max_len, dtype=torch.bool, device=self.device) for j in spec}
        self.pos_dev = {j: torch.full((batch, hkv, max_len), -1, dtype=torch.long, device=self.device) for j in spec}
        self.prefetch = prefetcher(self.device)  # a side stream, a worker thread, or inline
        self.every: bool | None = None  # set by a speculated fetch, read by after_fetch

    def begin(self, valid, positions) -> None:
        super().begin(valid, positions)
        # one new token over a held context (a one-token prompt's first pass holds nothing to choose from)
        self.decoding = valid.shape[1] == 1 and int(self.lengths.max()) > 1
        self.cos_sin = self.spec.rope(positions, self.pk[self.dense_layers].dtype)

    def observe(self, layer: int, x: torch.Tensor) -> None:
        j = layer + 1
        if not self.decoding or j < self.dense_layers or j >= self.cfg.num_hidden_layers:
            return
        self.prefetch.start(j, self.speculate, j, x)  # while layer j-1 computes

    @torch.inference_mode()
    def speculate(self, j: int, x: torch.Tensor) -> tuple:
        """Choose layer j's rows from layer j-1's normalised input x and copy them.
        Returns (slots, ok, keys, values, every chosen slot counts, per-row counts, bytes fetched)."""
        q = self.spec.query(j, x, self.cos_sin, self.opts.renorm)  # [B, Hkv, G, d'], scaled
        pool = self.pools[j]
        # the common case: no eviction yet and no padding, so the held slots are exactly 0..t-1 in position order
        if not pool.holes and not self.padded:
            sel = select(q, self.pk[j], self.alpha, self.opts, t=pool.fill)
        else:
            sel = select(q, self.pk[j], self.alpha, self.opts, held=self.held_dev[j], pos=self.pos_dev[j])
        k, v = pool.gather(sel.slots, self.device, extra=1)
        n_bytes = (sel.slots.numel() + sel.slots.shape[0] * sel.slots.shape[1]) * pool.row_bytes  # + the new row
        return sel.slots, sel.ok, k, v, sel.every, sel.per_row, n_bytes

    def fetch(self, layer: int, extra: int = 0):
        if layer not in self.prefetch:
            return super().fetch(layer, extra)
        slots, ok, k, v, every, per_row, n_bytes = self.prefetch.take(layer)
        self.count_h2d(layer, n_bytes)  # the counters change on this thread only
        self.stats.tokens_per_head += per_row
        self.every = every  # every chosen slot counts (no per-row limits, no free slots)
        return slots, ok, k, v

    def after_fetch(self, layer, q, slots, ok) -> None:
        every, self.every = self.every, None
        if every is None:  # not a speculated fetch
            return
        pool = self.pools[layer]
        pool.mark_selected(slots, None if every else ok, self.step)
        fetched, held = ok.numel() if every else int(ok.sum()), int(pool.held().sum())
        self.stats.fetched += fetched
        self.stats.held += held
        per = self.stats.layer_fetched.setdefault(layer, [0, 0])
        per[0] += fetched
        per[1] += held
        if self.opts.trace_recall:
            self.stats.recall.append(self.recall(layer, q, slots, ok))

    def recall(self, layer, q, slots, ok) -> float:
        """Diagnosis only: the true attention mass (dense scores over every held token) inside the fetched set."""
        pool = self.pools[layer]
        all_slots, all_ok = pool.held_slots()
        k_all, _ = pool.gather(all_slots, self.device)
        k_all = k_all.to(q.dtype).repeat_interleave(self.group, dim=1)  # [B, H, n_all, D]
        p = (q @ k_all.transpose(-1, -2) / math.sqrt(q.shape[-1])).float()  # [B, H, 1, n_all]
        p = p.masked_fill(~all_ok.to(q.device).repeat_interleave(self.group, 1)[:, :, None], float("-inf")).softmax(-1)
        chosen = torch.zeros_like(pool.pos, dtype=torch.bool)
        chosen.scatter_(2, slots, ok)  # [B, Hkv, S]
        in_set = torch.gather(chosen, 2, all_slots).to(q.device).repeat_interleave(self.group, 1)
        return float((p[:, :, 0] * in_set).sum(-1).mean())

    def after_insert(self, layer, k, slots) -> None:
        pk = self.spec.partial_key(layer, k).transpose(-1, -2)  # [B, Hkv, d', s]
        valid = self.valid[:, None, :].expand(-1, slots.shape[1], -1)
        pos = torch.where(valid, self.positions[:, None, :].expand_as(valid), -1)
        pool = self.pools[layer]
        if not pool.holes:  # written in order: the last s slots before `fill`, the same for every (b, h)
            a, b = pool.fill - k.shape[2], pool.fill
            self.pk[layer][..., a:b] = pk
            self.held_dev[layer][..., a:b] = valid
            self.pos_dev[layer][..., a:b] = pos
            return
        dev_slots = slots.to(self.device)
        self.pk[layer].scatter_(3, dev_slots[:, :, None, :].expand(-1, -1, pk.shape[2], -1), pk)
        self.held_dev[layer].scatter_(2, dev_slots, valid)
        self.pos_dev[layer].scatter_(2, dev_slots, pos)

    def close(self) -> None:
        self.prefetch.close()

    def end(self) -> None:
        before = {j: self.pools[j].evicted for j in self.pk}
        super().end()
        for j in self.pk:
            pool = self.pools[j]
            if pool.evicted != before[j]:  # the device's view of which slots hold a token
                self.held_dev[j].copy_((pool.pos >= 0).to(self.device))
                self.pos_dev[j].copy_(pool.pos.to(self.device))
