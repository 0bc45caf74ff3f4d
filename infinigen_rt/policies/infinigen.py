"""`infinigen`: KV in the host pool; each decode step, layer i speculates which tokens layer i+1 needs
from layer i's normalised input, a partial query (skewed columns) and the partial key cache of layer
i+1 kept on the device; only those rows are fetched.

Per speculated layer j and sequence b: scores s = q~ . K~ / sqrt(D) over every held token; n = the mean
over query heads of the tokens within `alpha` of the head's maximum, capped by the budget; the top-n
tokens per KV head (the group's probabilities summed, or its logits' max) are fetched. Sinks and recent
tokens are always among them. The dense layers (the first `dense_layers`) keep their KV on the device.

The selection and the copy of layer i+1's rows overlap layer i's compute: on a GPU through a copy stream,
on a CPU with two threads or more through a worker thread (torch ops release the GIL).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F

from infinigen_rt.bundle import partial_idx_name, partial_q_name, skew_name
from infinigen_rt.models.llama import Llama, apply_rope, rope_cos_sin
from infinigen_rt.policies.offload import OffloadCache

_SPECULATOR: ThreadPoolExecutor | None = None


def speculator() -> ThreadPoolExecutor:
    """One worker thread per process that speculates on the CPU. Torch ops release the GIL, so layer j+1's
    selection and row gather run on the second core while the main thread computes layer j."""
    global _SPECULATOR
    if _SPECULATOR is None:
        _SPECULATOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-speculate")
    return _SPECULATOR


class InfinigenCache(OffloadCache):
    def __init__(self, cfg, batch, max_len, device, dtype, opts, model, tensors: dict, defaults: dict):
        dense = defaults["dense_layers"] if opts.dense_layers is None else opts.dense_layers
        super().__init__(cfg, batch, max_len, device, dtype, opts, resident=dense)  # dense layers stay on the device
        self.model = model
        self.rope = isinstance(model, Llama)
        self.alpha = defaults["alpha"] if opts.alpha is None else opts.alpha
        self.dense_layers = dense
        n_layers, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.idx = [tensors[partial_idx_name(j)].to(self.device) for j in range(n_layers)]  # [Hkv, d']
        d_prime = self.idx[0].shape[-1]
        scale = 1 / math.sqrt(d)  # folded into the query side once, not applied to scores over the context
        if self.rope:  # the skew's chosen columns: [Hkv, D, d'] (keys) and scaled (queries)
            self.a_part = [
                torch.gather(tensors[skew_name(j)].to(self.device), 2, self.idx[j][:, None, :].expand(hkv, d, -1)).to(
                    dtype
                )
                for j in range(n_layers)
            ]
            self.a_part_q = [(a * scale)[None] for a in self.a_part]
        else:  # OPT: skew folded into the weights; the partial query weight is a real smaller matmul
            self.pq = [
                (tensors[partial_q_name(j, "weight")].to(self.device, dtype) * scale,
                 tensors[partial_q_name(j, "bias")].to(self.device, dtype) * scale
                 if partial_q_name(j, "bias") in tensors else None)
                for j in range(n_layers)
            ]  # fmt: skip
        spec = range(dense, n_layers)  # the speculated layers' partial keys (transposed) and held map, on the device
        self.pk = {j: torch.zeros(batch, hkv, d_prime, max_len, device=self.device, dtype=dtype) for j in spec}
        self.held_dev = {j: torch.zeros(batch, hkv, max_len, dtype=torch.bool, device=self.device) for j in spec}
        self.pos_dev = {j: torch.full((batch, hkv, max_len), -1, dtype=torch.long, device=self.device) for j in spec}
        self.norms = [getattr(blk, "input_layernorm", None) or blk.self_attn_layer_norm for blk in model.layers]
        self.renorm = [None] + [self._renorm_affine(j) for j in range(1, n_layers)]  # (scale, shift or None)
        self.pending: dict[int, tuple | Future] = {}  # layer -> what `speculate` returns (or will)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # a CPU with a core to spare speculates on a worker thread (a GPU overlaps through the copy stream)
        self.overlap = self.device.type == "cpu" and torch.get_num_threads() > 1

    def begin(self, valid, positions) -> None:
        super().begin(valid, positions)
        # one new token over a held context (a one-token prompt's first pass holds nothing to choose from)
        self.decoding = valid.shape[1] == 1 and int(self.lengths.max()) > 1
        if self.rope:
            self.cos_sin = rope_cos_sin(self.model.inv_freq, positions, self.pk[self.dense_layers].dtype)

    def partial_key(self, j: int, k: torch.Tensor) -> torch.Tensor:
        """k: [B, Hkv, s, D] (post-RoPE) -> the skewed partial key [B, Hkv, s, d']."""
        if self.rope:
            return k @ self.a_part[j]
        idx = self.idx[j]
        return torch.gather(k, -1, idx[None, :, None, :].expand(k.shape[0], -1, k.shape[2], -1))

    def _renorm_affine(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        prev, cur = self.norms[j - 1], self.norms[j]
        ratio = cur.weight / torch.where(prev.weight.abs() < 1e-6, 1e-6, prev.weight)
        pb, cb = getattr(prev, "bias", None), getattr(cur, "bias", None)
        if pb is None and cb is None:
            return ratio, None
        shift = (cb if cb is not None else 0) - (pb * ratio if pb is not None else 0)
        return ratio, shift

    def renormed(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j-1's normalised input as layer j's norm would give it: exact for RMSNorm (x * g_j / g_{j-1});
        for LayerNorm (x - b_{j-1}) / g_{j-1} * g_j + b_j (one affine map, computed once per layer)."""
        ratio, shift = self.renorm[j]
        return x * ratio if shift is None else torch.addcmul(shift, x, ratio)

    def partial_query(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j's speculative query from layer j-1's normalised input x: [B, 1, hidden] -> [B, Hkv, G, d'],
        already divided by sqrt(head_dim)."""
        b, hkv, g, d = x.shape[0], self.cfg.num_key_value_heads, self.group, self.cfg.head_dim
        if self.rope:  # RoPE sits between projection and dot product: full query, rotate, then skew
            proj = self.model.layers[j].self_attn.q_proj
            q = F.linear(x, proj.weight, proj.bias).view(b, 1, hkv * g, d).transpose(1, 2)
            q = apply_rope(q, *self.cos_sin).view(b, hkv, g, d)
            return q @ self.a_part_q[j]
        w, bias = self.pq[j]
        return F.linear(x, w, bias).view(b, hkv, g, -1)

    def observe(self, layer: int, x: torch.Tensor) -> None:
        j = layer + 1
        if not self.decoding or j < self.dense_layers or j >= self.cfg.num_hidden_layers:
            return
        if self.overlap:  # on the other core, while layer j-1 computes
            self.pending[j] = speculator().submit(self.speculate, j, x)
        else:
            self.pending[j] = self.speculate(j, x)

    @torch.inference_mode()
    def speculate(self, j: int, x: torch.Tensor) -> tuple:
        """Choose layer j's rows from layer j-1's normalised input x and start copying them.
        Returns (slots, ok, keys, values, copy event, every chosen slot counts, per-row counts, bytes fetched)."""
        if self.opts.renorm and self.cfg.do_layer_norm_before:  # post-LN OPT: the input is not normalised
            x = self.renormed(j, x)
        q = self.partial_query(j, x)  # [B, Hkv, G, d'], scaled
        pool, inf = self.pools[j], float("inf")
        # the common case: no eviction yet and no padding, so the held slots are exactly 0..t-1 in position
        # order; the host knows t, and no mask over the context is needed (sinks: the first slots; recent: the last)
        prefix = not pool.holes and not self.padded
        if prefix:
            t = pool.fill
            s = (q @ self.pk[j][..., :t]).float()  # [B, Hkv, G, t]: a batched matmul over the transposed keys
            cap = max(1, math.floor(self.opts.budget * t))
            cap = min(cap, t, self.opts.max_kv or cap)
        else:
            held = self.held_dev[j]  # [B, Hkv, S]
            s = (q @ self.pk[j]).float().masked_fill(~held[:, :, None, :], -inf)
            held_b = held.sum(-1).amax(-1)  # [B]
            cap = torch.clamp((self.opts.budget * held_b).floor().long(), min=1)
            if self.opts.max_kv is not None:
                cap = cap.clamp(max=self.opts.max_kv)
            cap = torch.minimum(cap, held_b)[:, None]
        if math.isinf(self.alpha):  # no margin: the budget decides
            n = cap
        else:
            within = s > (s.amax(-1, keepdim=True) - self.alpha)  # tokens within alpha of each query head's max
            if self.opts.per_head:  # [B, Hkv]: each KV head its group's mean count
                n = within.sum(-1).float().mean(2).ceil().long()
            else:  # [B, 1]: one count per sequence, the mean over every query head
                n = (within.sum(dim=(1, 2, 3)) / (s.shape[1] * s.shape[2])).ceil().long()[:, None]
            n = n.clamp(1, cap) if prefix else torch.minimum(n, cap).clamp(min=1)
        if self.opts.group_agg == "sum":  # a token's share of the group's attention
            agg = s.softmax(-1).sum(2)
        else:  # a token any head of the group wants
            agg = s.amax(2)  # [B, Hkv, S]
        if prefix:  # always fetched, inside the budget
            agg[..., : self.opts.sinks] = inf
            if self.opts.recent:
                agg[..., max(t - self.opts.recent, 0) :] = inf
        elif self.opts.sinks or self.opts.recent:
            pos = self.pos_dev[j]
            newest = pos.amax(-1, keepdim=True)
            forced = held & ((pos < self.opts.sinks) | (pos > newest - self.opts.recent))
            agg = agg.masked_fill(forced, inf)
        if isinstance(n, int):  # known on the host
            n_min = n_max = n
            per_row = [n] * q.shape[0]
        else:  # the one host sync of a speculation: the fetch size (and each row's mean, for the stats)
            *per_row, n_min, n_max = torch.cat([n.float().mean(-1), n.min()[None], n.max()[None]]).tolist()
            n_min, n_max = int(n_min), int(n_max)
        # every row fetching the same count needs no order among the chosen (an unsorted top-k is several times
        # cheaper on a CPU once k is a sizeable share); rows fetching fewer take the first n of a sorted top-k
        top = agg.topk(n_max, dim=-1, sorted=n_min != n_max).indices  # [B, Hkv, n]
        if prefix:  # every chosen slot holds a token; built on the host (rows fetching fewer drop their tail)
            ok = torch.ones(top.shape, dtype=torch.bool)
            if n_min != n_max:
                ok &= torch.arange(n_max) < n.cpu()[..., None]
        else:
            ok = torch.gather(held, 2, top)
            if n_min != n_max:
                ok &= torch.arange(n_max, device=top.device) < n[..., None]
            ok = ok.cpu()
        slots = top.cpu()
        # prefetch now, while layer j-1 computes: on a copy stream with a GPU; layer j waits on this copy only
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                k, v = pool.gather(slots, self.device, extra=1)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
        else:
            k, v, done = *pool.gather(slots, self.device, extra=1), None
        n_bytes = (slots.numel() + slots.shape[0] * slots.shape[1]) * pool.row_bytes  # + the new token's row
        return slots, ok, k, v, done, prefix and n_min == n_max, per_row, n_bytes

    def fetch(self, layer: int, extra: int = 0):
        if layer not in self.pending:
            return super().fetch(layer, extra)
        if isinstance(self.pending[layer], Future):  # speculated on the other core: wait for it
            self.pending[layer] = self.pending[layer].result()
        slots, ok, k, v, done, _, per_row, n_bytes = self.pending[layer]
        self.count_h2d(layer, n_bytes)  # the counters change on this thread only
        self.stats.tokens_per_head += per_row
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            k.record_stream(compute)  # allocated on the copy stream, used on this one
            v.record_stream(compute)
        return slots, ok, k, v

    def after_fetch(self, layer, q, slots, ok) -> None:
        if layer not in self.pending:
            return
        every = self.pending.pop(layer)[5]  # every chosen slot counts (no per-row limits, no free slots)
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
        pk = self.partial_key(layer, k).transpose(-1, -2)  # [B, Hkv, d', s]
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

    def end(self) -> None:
        before = {j: self.pools[j].evicted for j in self.pk}
        super().end()
        for j in self.pk:
            pool = self.pools[j]
            if pool.evicted != before[j]:  # the device's view of which slots hold a token
                self.held_dev[j].copy_((pool.pos >= 0).to(self.device))
                self.pos_dev[j].copy_(pool.pos.to(self.device))
