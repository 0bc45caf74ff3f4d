"""`infinigen`: KV in the host pool; each decode step, layer i speculates which tokens layer i+1 needs
from layer i's normalised input and layer i+1's speculation keys kept on the device (its skewed partial
columns, or every column at a few bits: `spec_keys`); only those rows are fetched (the selection:
speculation.py). The dense layers (the first `dense_layers`) keep their KV on the device.

With a correction step (`correct` C > 0) speculation fetches 1 - C of the budget ahead; when layer i+1 runs, its
true query is scored against the same keys and the best C of the budget that speculation missed are gathered on
the compute stream (the critical path: the copy cannot start before the layer's input exists).

The selection and the copy of layer i+1's rows overlap layer i's compute (prefetch.py: a CUDA side stream, or
on a CPU with two threads or more this cache's worker thread).

On a GPU nothing in a decode step reads the device: the fetch size comes from host-known counts (see
speculation.fetch_width), the selection stays on the device, a kernel gathers the chosen rows straight from
the pinned pool, the new token's rows go down with one asynchronous copy, and the counters are read by
`report`. On a CPU each speculation reads its counts (cheap there) so every row fetches exactly its count.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from infinigen_rt.bundle import InfinigenDefaults
from infinigen_rt.errors import InfinigenError
from infinigen_rt.kv import cpu
from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.evict import Evicting
from infinigen_rt.kv.kernels import gather_reused
from infinigen_rt.kv.rows import PoolRows
from infinigen_rt.kv.store import BLOCK, STEP_BUCKET, Plain, StoreStep
from infinigen_rt.policies.base import Selector, kv_layers
from infinigen_rt.policies.offload import POOL_KNOBS, Offload
from infinigen_rt.policies.options import KVOptions
from infinigen_rt.policies.speculation import (
    BUCKET,
    ChannelKeys,
    Selection,
    correction_counts,
    correction_gathered,
    correction_room,
    correction_rows,
    device_counts,
    fetch_width,
    select,
    selected,
    shortlist_size,
    spec_key_bytes,
    spec_keys,
    speculated_share,
)


def layer_options(
    opts: KVOptions, defaults: InfinigenDefaults, dense: int, n_layers: int, layers: list[int] | None = None,
) -> dict[int, KVOptions]:  # fmt: skip
    """Each speculated layer's options: one budget, or with layer_budget e (the option, else the bundle's default)
    budgets min(1, c * s_j^e) from the calibration's per-layer key shares s_j, c chosen so that their mean is the
    budget (the same bytes: spread layers fetch more, focused ones less; a full budget stays every token).
    `layers`: the speculated layers (default: every layer from `dense` on; a hybrid model's global ones)."""
    layers = range(dense, n_layers) if layers is None else layers
    e = defaults.layer_budget if opts.layer_budget is None else opts.layer_budget
    if not e:
        return dict.fromkeys(layers, opts)
    shares = defaults.layer_key_share
    if not shares or len(shares) != n_layers:
        raise InfinigenError("layer_budget needs the bundle's per-layer attention statistics (layer_key_share); "
                             "convert it again with this version of infinigen-prep")  # fmt: skip
    if opts.budget >= 1:
        return dict.fromkeys(layers, opts)
    w = [max(shares[j], 1e-6) ** e for j in layers]

    def mean_budget(c: float) -> float:
        return sum(min(1.0, c * x) for x in w) / len(w)

    lo, hi = 0.0, 1.0 / min(w)  # at hi every layer is capped at 1
    for _ in range(60):  # the mean is monotone in c: bisect to the budget
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_budget(mid) < opts.budget else (lo, mid)
    return {j: replace(opts, budget=min(1.0, hi * x)) for j, x in zip(layers, w, strict=True)}


def layer_alphas(
    opts: KVOptions, defaults: InfinigenDefaults, dense: int, n_layers: int, layers: list[int] | None = None,
) -> dict[int, float]:  # fmt: skip
    """Each speculated layer's margin: the option's alpha; else with layer_alpha the bundle's calibrated one per
    layer; else none (inf: the budget alone sets the count, the default chosen on the tuning texts)."""
    layers = range(dense, n_layers) if layers is None else layers
    if opts.alpha is not None or not opts.layer_alpha:
        return dict.fromkeys(layers, math.inf if opts.alpha is None else opts.alpha)
    per = defaults.layer_alpha
    if not per or len(per) != n_layers:
        raise InfinigenError("layer_alpha needs the bundle's calibrated margins (layer_alpha); convert it again "
                             "with this version of infinigen-prep")  # fmt: skip
    return {j: float(per[j]) for j in layers}


def speculated(cfg, dense: int) -> list[int]:
    """The layers InfiniGen speculates: the layers it holds (kv_layers) past the dense ones."""
    return [j for j in kv_layers(cfg) if j >= dense]


class Infinigen(Offload):
    name = "infinigen"
    speculative = True
    layer_copy = False  # a decode step fetches the speculated rows
    sweep = ("budget", "alpha")
    knobs = POOL_KNOBS | {
        "alpha", "budget", "max_kv", "dense_layers", "trace_recall", "sinks", "recent", "renorm", "per_head",
        "group_agg", "layer_budget", "layer_alpha", "spec_keys", "correct", "shortlist", "reuse", "runs",
    }  # fmt: skip

    @classmethod
    def configure(cls, opts, engine):
        """Needs the bundle's InfiniGen tensors (a one-line error for a bundle converted without them); the dense
        layers and the speculation keys resolved (the option, else the bundle's default), a layer left to speculate."""
        engine.require_speculation()
        policy = super().configure(replace(opts, spec_keys=opts.spec_keys or engine.speculation.defaults.spec_keys),
                                   engine)  # fmt: skip
        if policy.opts.dense_layers >= engine.cfg.num_hidden_layers:
            raise InfinigenError(f"--dense-layers {policy.opts.dense_layers} leaves no layer to speculate (the model "
                                 f"has {engine.cfg.num_hidden_layers})")  # fmt: skip
        return policy

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """InfiniGen in the store, under the capacity if any."""
        return InfinigenSelector(engine, opts, prefetch)

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        dense = opts.dense_layers
        cfg = engine.cfg
        d_prime = engine.speculator.d_prime
        device, host, read = cls.pool_bytes(engine, tokens, 2 * cfg.head_dim * dtype_bytes, dense)
        row = spec_key_bytes(opts.spec_keys, cfg.head_dim, d_prime, dtype_bytes)
        keys = tokens * row * len(speculated(cfg, dense))  # (`tokens`: token-heads) read every step
        return device + keys, host, read + keys


class LastRows:
    """Rows reused across steps (`reuse`, a GPU): each speculated layer's rows of the last step stay in its own pair
    of device buffers (used in turn, step by step), and a map from a pool row (flat slot x KV heads + head) to where
    it sits there (-1: not held); a step's gather reads a selected row from there when held and from the pool across
    PCIe otherwise (kernels.gather_reused), then the map is moved to this step's rows. Everything stays on the
    device: no host in the loop. A step whose batch differs from the last one's (a request joined or left: rows
    would mean other requests' tokens) starts from nothing held. Not with a capacity: an evicted slot takes a new
    token."""

    def __init__(self, store):
        self.store = store
        self.where: dict[int, torch.Tensor] = {}  # layer -> [S x Hkv] int64: the row's place in the last output
        self.last: dict[int, tuple] = {}  # layer -> (rows [B, Hkv, n], the output's flat (keys, values))
        self.turn: dict[int, int] = {}
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.rids: list[int] | None = None
        self.places: dict[tuple, torch.Tensor] = {}  # (b, h, n, room) -> place

    def begin(self, step) -> None:
        if step.batch.rids != self.rids:
            self.rids = list(step.batch.rids)
            for j, (rows, _) in self.last.items():
                self.where[j].index_fill_(0, rows.reshape(-1), -1)
            self.last.clear()

    def gather(self, step, j: int, sel: Selection, room: int = 0) -> tuple:
        """Layer j's selected rows [B, Hkv, n + room + 1, X] (keys' and values' one part each; `room` rows left for
        the correction to fill, InfinigenSelector.room; the last row for the new token), the held ones from the last
        step's output. Counts what crossed PCIe per request in the ledger."""
        store, (b, h, n) = self.store, sel.slots.shape
        (k_src,), (v_src,) = store.k[j], store.v[j]
        x, width = k_src.shape[-1], n + room + 1
        if (b, h, n, room) not in self.places:  # where each row lands in the output (fetch widths are a few:
            dev = sel.slots.device  # multiples of a bucket)
            across = torch.arange(b * h, device=dev).view(b, h, 1) * width
            self.places[b, h, n, room] = torch.arange(n, device=dev) + across
        place = self.places[b, h, n, room]
        rows = step.pool_rows(sel.slots)  # [B, Hkv, n]: pool rows (slot x heads + head)
        if j not in self.where:
            self.where[j] = torch.full((k_src.numel() // x,), -1, dtype=torch.int64, device=store.device)
        turn = self.turn[j] = 1 - self.turn.get(j, 1)
        need = b * h * width * x
        if (j, turn) not in self.buffers or self.buffers[j, turn][0].numel() < need:
            self.buffers[j, turn] = tuple(torch.empty(need + need // 8, dtype=k_src.dtype, device=store.device)
                                          for _ in "kv")  # fmt: skip
        out_k, out_v = (o[:need].view(b * h, width, x) for o in self.buffers[j, turn])
        ok = sel.ok.expand(b, h, n) if sel.every else sel.ok
        last = self.last.get(j)
        pos = self.where[j].index_select(0, rows.reshape(-1)).view(b, h, n)
        prev = (k_src.view(-1, x), v_src.view(-1, x)) if last is None else last[1]  # (nothing held: pos all -1)
        gather_reused(k_src.view(-1, x), v_src.view(-1, x), *prev, rows.reshape(b * h, n), ok.reshape(b * h, n),
                      pos.reshape(b * h, n), out_k, out_v)  # fmt: skip
        store.ledger.add(f"h2d{j}", step.batch.rids, (ok & (pos < 0)).sum((1, 2)), store.row_bytes)  # what crossed
        if last is not None:  # the map follows this step's rows
            self.where[j].index_fill_(0, last[0].reshape(-1), -1)
        self.where[j].index_copy_(0, rows.reshape(-1), torch.where(ok, place, -1).reshape(-1))
        self.last[j] = (rows, (out_k.view(-1, x), out_v.view(-1, x)))
        return (out_k.view(b, h, width, x),), (out_v.view(b, h, width, x),)


class InfinigenSelector(Selector):
    """InfiniGen in the batch's KV store: the dense layers on the device, the speculated ones pooled in host memory
    with their speculation keys on the device (in the store's slots); each decode step, layer j-1's input chooses
    layer j's rows for every request at once (one speculative query, one scoring over every row's slots through the
    tables, one selection, one gather), on the compute stream while layer j-1 computes, the copy on the side stream
    (or the runner's worker thread on a CPU). Under a capacity (store.Evicting) a speculated layer scores the slots
    each request took and selects among those still holding a token, and its selections count for the eviction
    (counter, lru); the dense layers keep every token. On a CPU (`in_place`) nothing is gathered: attention reads the
    chosen rows where the pool holds them (store.PoolRows), and the worker's copy stage only turns the slots into
    pool rows."""

    def __init__(self, engine, opts: KVOptions, prefetch):
        cfg, dense = engine.cfg, opts.dense_layers
        self.layers = speculated(cfg, dense)
        super().__init__([i for i in kv_layers(cfg) if i < dense], self.layers, prefetch, Evicting.of(opts, True))
        self.cfg, self.opts, self.dtype, self.spec, self.tp = cfg, opts, engine.dtype, engine.speculator, engine.tp
        defaults = engine.speculation.defaults
        self.alphas = layer_alphas(opts, defaults, dense, cfg.num_hidden_layers, self.layers)
        self.layer_opts = layer_options(opts, defaults, dense, cfg.num_hidden_layers, self.layers)
        self.spec_opts = speculated_share(self.layer_opts, opts.correct)

    def attach(self, store) -> None:
        super().attach(store)
        self.keys = spec_keys(self.opts.spec_keys, self.spec, self.layers, 1, store.alloc.n_blocks * BLOCK,
                              store.device, self.dtype)  # fmt: skip
        self.sync_free = store.device.type == "cuda"  # no device read for the fetch size
        # rows reused across steps: the kernel's (a CPU's host memory is its device memory: nothing to save)
        self.last_rows = LastRows(self.store) if self.opts.reuse and store.kernel else None
        # on a CPU, attention reads the chosen rows where the pool holds them (PoolRows), copying none: the rows as
        # they are (Plain, float32), and no correction or its one call (which then returns the picks' pool rows)
        one_call = isinstance(self.keys, ChannelKeys) and not self.opts.shortlist and self.opts.group_agg == "sum"
        self.in_place = (not store.kernel and store.device.type == "cpu" and type(store.layout) is Plain
                         and store.layout.dtype == torch.float32 and cpu.library() is not None
                         and (not self.opts.correct or one_call) and not self.opts.trace_recall)  # fmt: skip

    @property
    def bucketed(self) -> bool:
        """A GPU step sized for its bucket (store.bucket_end, StoreStep.prepare): its scores, selections,
        fetch widths and the correction's room the same for every step of the bucket, each row's counts on the
        device. Not under a capacity (the slots each request freed are its own) or with `trace_recall`."""
        return self.evicting is None and not self.opts.trace_recall

    def graphs(self) -> bool:
        """A step replayed from a CUDA graph (graphs.py): a bucketed step, on one rank, its rows gathered afresh."""
        return self.bucketed and self.last_rows is None and not self.in_place and self.tp is None

    def written(self, batch, layer, k, phys, reusing=None) -> None:
        b, h, s, d = k.shape  # the batch's new keys as one sequence of the store's, at their flat slots
        at = phys.view(1, 1, -1).expand(1, h, -1) if phys.dim() == 1 else phys.transpose(0, 1).reshape(1, h, -1)
        self.keys.write(layer, k.transpose(0, 1).reshape(1, h, b * s, d), at, distinct=s == 1,
                        appends=True if reusing is None else ~reusing.view(1, 1, -1))  # (a page: one sequence's)

    def kept(self, step) -> np.ndarray:
        """The tokens each row held per head before the step ([B], host): its rows, but under a capacity."""
        return step.batch.old if self.evicting is None else step.kept

    def held(self, step, j: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(held, pos) [B, Hkv, T] of layer j's rows for `select` (None, None: every row holds a token, in position
        order): where a request of the step freed slots, its layer's own."""
        if self.evicting is None or not step.holes:
            return step.held3, step.pos
        pos = self.evicting.positions(step, j)
        return pos >= 0, pos

    def begin(self, step) -> None:
        super().begin(step)
        t, held = step.held
        b, h = len(step.batch.rids), self.store.n_kv
        at = torch.arange(t, device=self.store.device)
        step.held3 = None if held is None else held[:, None].expand(b, h, t)
        step.pos = None if held is None else torch.where(held, at, -1)[:, None].expand(b, h, t)
        step.cos_sin = self.spec.rope(step.positions, self.dtype)
        step.counts = {}  # layer -> the correction's counts (see counts)
        step.memo = {}  # what select and correction_rows make once a step (see select)
        if self.last_rows is not None:
            self.last_rows.begin(step)

    def observe(self, step, layer, x) -> None:
        j = layer + 1
        if j in self.store.pooled:  # while layer j-1 computes (the pooled layers are the speculated ones)
            # with a correction at layer j-1, j's copy waits for it (prefetch.py: the link's order); in place, j's
            # speculation waits for the worker's shares of j-1's correction and attention (PoolRows)
            later = (bool(self.opts.correct) or self.in_place) and layer in self.prefetch
            self.prefetch.start(j, self.speculate, step, j, x, copy=self.copy, defer=later)

    @torch.inference_mode()
    def speculate(self, step, j: int, x: torch.Tensor):
        """Choose layer j's rows of every request from layer j-1's normalised input x [B, 1, hidden]."""
        q = self.spec.query(j, x, step.cos_sin, self.opts.renorm, self.keys.full)  # [B, Hkv, G, d' or D], scaled
        t = step.held[0]
        opts = self.spec_opts[j]
        most = t if step.bucketed else int(self.kept(step).max())  # (a bucketed step: the bucket's, t)
        width = fetch_width(most, t, opts, BUCKET) if self.sync_free else None
        at = step.span or step.idx
        k = 0  # the correction's candidates: every held slot, or a shortlist
        if self.opts.correct and self.opts.shortlist:
            k = shortlist_size(most, t, opts, [self.room(step, j)], self.opts.shortlist)
        held, pos = self.held(step, j)
        sel = selected(self.keys, j, q, at, t, self.alphas[j], opts, held, width, self.tp, k)  # (one kernel call)
        if sel is None:
            sel = select(self.keys.scores_at(j, q, at), self.alphas[j], opts, held, pos, width, self.tp, k,
                         self.memo(step))  # fmt: skip
        return step, j, sel

    @torch.inference_mode()
    def copy(self, chosen) -> tuple:
        """The chosen rows of layer j for every request: (selection, keys, values), as stored: plain rows, one part
        [B, Hkv, n + 1, D] each (store.Plain)."""
        step, j, sel = chosen
        if not sel.every and sel.counted is None:  # rows per request (its fetch, its bytes)
            sel.counted = sel.ok.sum((1, 2))
        if self.in_place:  # their pool rows, for attention to read there (PoolRows)
            return sel, self.pool_rows(step, j, sel.slots, None if sel.every else sel.ok, sel.counted, 1), None
        if self.last_rows is not None:
            return sel, *self.last_rows.gather(step, j, sel, self.room(step, j))
        return sel, *self.gather(step, j, sel.slots, None if sel.every else sel.ok, 1, j % 2, sel.counted,
                                 table=step.row_table, room=self.room(step, j))  # fmt: skip

    def pool_rows(self, step, j: int, slots: torch.Tensor, ok: torch.Tensor | None, counted,
                  extra: int = 0) -> torch.Tensor:  # fmt: skip
        """The pool rows [B, Hkv, n] (flat slot x Hkv + KV head) of layer j's token slots [B, Hkv, n], -1 where ok
        is False. The rows that count (`counted` per request, or every one) and `extra` new tokens' a KV head go in
        the ledger as a CPU's gather counts them (the rows read from the host pool, and the new token's)."""
        h, n = self.store.n_kv, slots.shape[-1]
        rows = step.pool_rows(slots)
        if ok is not None:
            rows = rows.masked_fill(~ok, -1)
        read = h * n if counted is None else counted  # a number, or one per request (a tensor)
        read = read + extra * h if extra else read
        self.store.ledger.add(f"h2d{j}", step.batch.rids, read, self.store.row_bytes)
        return rows

    def memo(self, step) -> dict | None:
        """What select and correction_rows may make once for every layer of the step (see select): where every layer
        holds the same rows (no capacity: under one, each layer's freed slots are its own)."""
        return step.memo if self.evicting is None else None

    def counts(self, step, j: int) -> list[int] | torch.Tensor:
        """What layer j's correction fetches per request this step (correction_counts): worked out once a step and
        layer, for the room its gather leaves and the correction itself; a bucketed step's [B] on the device (from
        each row's held count there)."""
        if j not in step.counts:
            o, so = self.layer_opts[j], self.spec_opts[j]
            key = ("counts", o.budget, o.max_kv, so.budget, so.max_kv)  # (layers of one budget share them)
            if not step.bucketed:
                step.counts[j] = correction_counts(self.kept(step).tolist(), o, so)
            elif key in step.memo:
                step.counts[j] = step.memo[key]
            else:
                step.counts[j] = step.memo[key] = device_counts(step.old, o) - device_counts(step.old, so)
        return step.counts[j]

    def room(self, step, j: int) -> int:
        """The rows layer j's correction adds at most (its largest count, at most the slots held): speculation's
        gather leaves them between its rows and the new token's, and the correction writes its rows there, in
        place of joining the two (a copy of every row a layer reads). A bucketed step's: the most any held count of
        its bucket gives (the same for the whole bucket)."""
        if not self.opts.correct:
            return 0
        t = step.held[0]
        if step.bucketed:
            return correction_room(t - STEP_BUCKET + 1, t, self.layer_opts[j], self.spec_opts[j])  # (the widest)
        return max(0, min(max(self.counts(step, j)), t))

    def rows(self, step, layer, q):
        if layer not in self.prefetch:
            return super().rows(step, layer, q)  # not speculated (the first pooled layer without a dense one)
        # on a side stream with a correction, the rows are still crossing: the correction scores and picks on the
        # compute stream meanwhile, and gathers its rows into k and v behind them on the side stream
        ahead = self.opts.correct and self.prefetch.side_stream
        spec, k, v = sel, k, v = self.prefetch.peek(layer) if ahead else self.prefetch.result(layer)
        if self.opts.correct:
            sel, k, v = self.correct(step, layer, q, sel, k, v)
            if not self.in_place:  # (in place: after attention's share, PoolRows)
                self.prefetch.flush()  # the next layer's selection, and its copy after this correction's
                if ("correction", layer) in self.prefetch:  # the correction's rows, and before them speculation's
                    self.prefetch.result(("correction", layer))
            if ahead:
                self.prefetch.result(layer)  # (the copy's event: passed already, where the correction gathered)
        led, rids = self.store.ledger, step.batch.rids
        led.add(f"fetched{layer}", rids, spec.slots.shape[-1] * self.store.n_kv if spec.every else spec.counted)
        if self.evicting is not None:
            self.evicting.mark(step, layer, sel.all_slots(), None if sel.every else sel.ok)
        if self.opts.trace_recall:
            led.add("recall", rids, self.recall(step, layer, q, sel))
            led.add("recalls", rids, 1)
        led.add("per_row", rids, sel.per_row)
        led.add("per_row_n", rids, 1)
        if self.in_place:  # k: the speculated rows' pool rows, v: the correction's (or None)
            (src_k,), (src_v,) = self.store.k[layer], self.store.v[layer]
            return PoolRows(src_k, src_v, [k] if v is None else [k, v], self.prefetch), None, None
        return k, v, None if sel.every else sel.ok

    def end(self, step) -> None:
        """The tokens each request held, per speculated layer that selected (every one a layer before it feeds), in
        the ledger: host numbers, counted here rather than where the layer runs, which a replayed graph skips."""
        super().end(step)
        if not isinstance(step, StoreStep):  # (a prompt chunk's pass)
            return
        held = self.kept(step) * self.store.n_kv
        for j in self.layers:
            if j > 0:
                self.store.ledger.add(f"held{j}", step.rids, held)

    def recall(self, step, layer: int, q: torch.Tensor, sel: Selection) -> torch.Tensor:
        """Diagnosis only (`trace_recall`: it reads every held row of the layer, moving the whole context on a GPU):
        the true attention mass over each row's held tokens that its selection `sel` holds, q [B, H, 1, D] the
        layer's true query; [B], the mean over the query heads."""
        store, slots = self.store, sel.all_slots()
        (b, h, _), t, held = slots.shape, step.held[0], self.held(step, layer)[0]
        every = torch.arange(t, device=store.device).expand(b, h, t)
        keys, _ = store.gather(layer, step.batch, every, held, extra=0)  # (not counted: nothing a step moves)
        keys = store.layout.decode(keys).to(q.dtype).repeat_interleave(q.shape[1] // h, 1)  # [B, H, T, D]
        p = (q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).float()  # [B, H, 1, T]
        if held is not None:
            p = p.masked_fill(~held.repeat_interleave(q.shape[1] // h, 1)[:, :, None], float("-inf"))
        chosen = torch.zeros(b, h, t, dtype=torch.int32, device=store.device)
        ok = sel.ok.expand(slots.shape)
        chosen.scatter_add_(2, slots.clamp(max=max(t - 1, 0)), (ok & (slots < t)).int())  # (slots past T: none)
        inside = (chosen > 0).repeat_interleave(q.shape[1] // h, 1)  # [B, H, T]
        return (p.softmax(-1)[:, :, 0] * inside).sum(-1).mean(1)

    def correct(self, step, layer: int, q: torch.Tensor, sel: Selection, k, v) -> tuple:
        """The correction step for every request: layer j's true query q [B, H, 1, D] scored against the same keys;
        each request's best rows speculation did not fetch, up to the rest of its budget, added to the speculated
        ones (in the room before the new token's row that speculation's gather left, or as a second list of pool rows
        where attention reads them in place)."""
        per_row = self.counts(step, layer)
        if self.room(step, layer) <= 0:
            return sel, k, v
        b, hkv = sel.slots.shape[:2]
        at = step.span or step.idx if sel.cand is None else step.physical(sel.cand)  # every held slot, or a shortlist
        qk = self.spec.keys_side(layer, q.reshape(b, hkv, -1, q.shape[-1]), self.keys.full)
        held = self.held(step, layer)[0]
        if self.in_place:
            return self.correct_in_place(step, layer, qk, at, held, sel, per_row, k)
        (k,), (v,) = k, v  # plain rows: one part each
        return self.correct_steps(step, layer, qk, at, held, sel, per_row, k, v)

    def correct_in_place(self, step, layer: int, qk, at, held, sel: Selection, per_row: list[int], rows) -> tuple:
        """`correct` where attention reads the rows in the pool (in_place): the kernel's one call scores, picks and
        returns the picks' pool rows, copying none, its (sequence, KV head) pairs shared with the worker thread (else
        the scores and the pick, then their rows); (the selection with the picks, or speculation's alone where no
        capacity marks them; the speculated rows' pool rows, the picks')."""
        (src_k,), (src_v,) = self.store.k[layer], self.store.v[layer]
        got = correction_gathered(self.keys, layer, qk, at, step.held[0], sel, held, per_row, None, None, src_k, src_v,
                                  lambda fn: self.prefetch.beside(fn, then=False))  # (then attention's share)
        if got is None:
            slots, ok = correction_rows(self.keys.scores_at(layer, qk, at), sel, held, per_row, self.opts.group_agg)
            counted = ok.sum((1, 2)).tolist()
            more = self.pool_rows(step, layer, slots, ok, counted)
        else:
            slots, ok, pairs, more = got
            counted = pairs.sum(1).tolist()
            self.store.ledger.add(f"h2d{layer}", step.batch.rids, counted, self.store.row_bytes)
        self.count_corrected(step, layer, counted)
        if self.evicting is None:  # attention reads the rows (PoolRows): only a capacity's marks read the slots
            return sel, rows, more
        return self.padded(sel, slots, ok, slots.shape[-1], counted), rows, more

    def correct_steps(self, step, layer: int, qk, at, held, sel: Selection, per_row: list[int], k, v) -> tuple:
        """`correct` one step after another: the scores, the pick (correction_rows), the gather into the room
        speculation's gather left."""
        if not self.prefetch.side_stream:  # nothing here for a worker thread: the next layer's speculation goes now
            self.prefetch.flush()
        n = sel.slots.shape[-1]
        room = k.shape[2] - n - 1
        s = self.keys.scores_at(layer, qk, at)
        slots, ok = correction_rows(s, sel, held, per_row, self.opts.group_agg, room if step.bucketed else None,
                                    self.memo(step))  # fmt: skip
        counted = ok.sum((1, 2))
        c = slots.shape[-1]
        assert room >= c, "the correction's rows exceed the room left for them"
        # straight into the room: a CPU's copy into its window, a GPU's kernel into the rows from n on
        into = [(k, v)] if self.store.kernel else [(k[:, :, n : n + c], v[:, :, n : n + c])]
        every = ok
        if not self.store.kernel:  # a CPU reads the counts for free: once, for the ledger and whether all count
            counted = counted.tolist()
            every = None if sum(counted) == ok.numel() else ok

        def fetch(slots, every, counted, table, k, v) -> None:
            self.gather(step, layer, slots, every, 0, counted=counted, table=table, into=into,
                        first=n if self.store.kernel else 0)  # fmt: skip
            if room > c:  # never attended (and never NaN bits); (an empty fill is still a launch on a GPU)
                k[:, :, n + c : n + room], v[:, :, n + c : n + room] = 0, 0

        args = slots, every, counted, step.row_table, k, v  # (a side stream keeps them alive until it is done)
        if self.prefetch.side_stream:  # on the link before the next layer's rows, while its selection computes (rows)
            self.prefetch.side(("correction", layer), fetch, *args)
        else:
            fetch(*args)
        self.count_corrected(step, layer, counted)
        return self.padded(sel, slots, ok, room, counted), (k,), (v,)

    def count_corrected(self, step, layer: int, counted) -> None:
        """The correction's rows per request (a list, or [B] on the device) in the ledger: fetched and corrected."""
        self.store.ledger.add("corrected", step.batch.rids, counted)
        self.store.ledger.add(f"fetched{layer}", step.batch.rids, counted)

    @staticmethod
    def padded(sel: Selection, slots: torch.Tensor, ok: torch.Tensor, room: int, counted) -> Selection:
        """Speculation's selection with the correction's slots (`more`, joined only where read: Selection.all_slots)
        and ok [B, Hkv, c] after it, and the rest of the room (rows no sequence took) as rows that do not count.
        Every row counts (attention takes no mask) where every speculated one did and `counted` (a CPU's list per
        request; on a GPU a tensor, unread) fills the room."""
        b, hkv, n = sel.slots.shape
        every = sel.every and isinstance(counted, list) and sum(counted) == b * hkv * room
        pad = [ok.new_zeros(b, hkv, room - slots.shape[-1])] if room > slots.shape[-1] else []
        return Selection(sel.slots, torch.cat([sel.ok.expand(b, hkv, n), ok, *pad], -1), every, sel.per_row,
                         more=slots)  # fmt: skip

    def report(self, rid: int, r: KVReport) -> None:
        led = self.store.ledger
        held = {j: led.get(f"held{j}", rid) for j in self.layers}
        fetched = {j: led.get(f"fetched{j}", rid) for j in self.layers}
        total = sum(held.values())
        if not total:
            return
        share = sum(fetched.values()) / total
        dense = 1 - len(self.layers) / self.cfg.num_hidden_layers
        r.kv_fetched_share, r.share_rows = round(share, 6), round(total)
        r.kv_attended_share = round(dense + (1 - dense) * share, 6)
        if self.opts.correct:
            r.kv_corrected_share = round(led.get("corrected", rid) / total, 6)
        n = led.get("per_row_n", rid)
        r.tokens_per_head_mean = round(led.get("per_row", rid) / n, 3) if n else None
        r.tokens_per_head_max = led.max("per_row", rid) if n else None
        r.per_layer["kv_fetched_share"] = [round(fetched[i] / held[i], 6) if held.get(i) else None
                                           for i in range(self.cfg.num_hidden_layers)]  # fmt: skip
        if n := led.get("recalls", rid):
            r.attention_recall = round(led.get("recall", rid) / n, 6)
