"""`offload`: all KV in the host pool, every layer fetches every held token (the FlexGen-style baseline).

On a GPU a layer's held KV moves as one contiguous block per tensor (the pool is slot-major), on a side stream
one layer ahead, as FlexGen and transformers' offloaded cache do; on a CPU the rows are copied with
index_select. Also the base of the pool policies: subclasses change what a layer fetches and add per-token
state. The byte counters count the copies actually made; nothing here reads the device during a decode step.
"""

from __future__ import annotations

import numpy as np
import torch

from infinigen_rt.config import ModelConfig
from infinigen_rt.kv.cache import KVCache, KVReport, causal_mask, kv_layers
from infinigen_rt.kv.pool import KVPool
from infinigen_rt.kv.prefetch import prefetcher
from infinigen_rt.kv.store import Evicting, Selector
from infinigen_rt.policies.full import DenseCache
from infinigen_rt.policies.options import KVOptions

POOL_KNOBS = frozenset({"capacity", "eviction", "window", "prefill_chunk"})


class KVStats:
    """Counters of one cache. What the host knows is kept in ints; what only the device knows (rows a selection
    fetched, its per-row counts) stays in device tensors until `settle` reads all of them at once (`report`)."""

    def __init__(self, n_layers: int):
        self.h2d = [0] * n_layers  # bytes known on the host, per layer
        self.h2d_rows: list[list] = [[] for _ in range(n_layers)]  # device row counts (or settled ints), per layer
        self.row_bytes = [0] * n_layers
        self.d2h = 0
        self.fetched: dict[int, list] = {}  # speculated layer -> rows fetched (ints or device counts)
        self.held: dict[int, int] = {}  # speculated layer -> rows it could have fetched
        self.per_row: list[torch.Tensor] = []  # each speculation's mean fetch count per KV head, per sequence
        self.per_row_sum, self.per_row_n, self.per_row_max = 0.0, 0, None  # what settled of them
        self.recall: list[float] = []
        self.corrected: list = []  # rows a correction step fetched (ints or device counts)

    def settle(self) -> None:
        """Every device count to the host in one read (a sync: not inside a decode step), summed into ints."""
        groups = self.h2d_rows + [self.fetched[j] for j in sorted(self.fetched)] + [self.corrected]
        pending = [(g, [c for c in g if not isinstance(c, int)]) for g in groups]
        pending = [(g, t) for g, t in pending if t]
        parts = [torch.stack(t).sum().double()[None] for _, t in pending]
        rows = torch.cat(self.per_row).double() if self.per_row else None
        if rows is not None:
            parts += [rows.sum()[None], rows.amax()[None]]
        if not parts:
            return
        got = torch.cat(parts).tolist()
        for (g, _), value in zip(pending, got, strict=False):
            g[:] = [sum(c for c in g if isinstance(c, int)) + round(value)]
        if rows is not None:
            self.per_row_sum += got[-2]
            self.per_row_n += rows.numel()
            self.per_row_max = got[-1] if self.per_row_max is None else max(self.per_row_max, got[-1])
            self.per_row = []

    def layer_h2d(self) -> list[int]:
        self.settle()
        return [h + sum(rows) * rb for h, rows, rb in zip(self.h2d, self.h2d_rows, self.row_bytes, strict=True)]

    def fetched_rows(self, layer: int) -> int:
        self.settle()
        return sum(self.fetched.get(layer, []))


def device_pairs(shape, dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two (keys, values) device buffers of `shape`, used in turn by consecutive layers: layer i reads one while
    layer i+1's rows arrive in the other, so what a step moves lands in memory fixed before the first step."""
    return [tuple(torch.empty(shape, dtype=dtype, device=device) for _ in "kv") for _ in range(2)]


class OffloadCache(KVCache):
    name = "offload"
    knobs = POOL_KNOBS
    pool_class = KVPool  # how the host stores rows (Int4Pool for the int4 policy)
    layer_copy = True  # a decode step fetches whole layers (on a GPU: one block per tensor, one layer ahead)

    @classmethod
    def build(cls, engine, opts, batch, max_len, pages=None, prefetch=None):
        return cls(engine.cfg, batch, max_len, engine.device, engine.dtype, opts, pages=pages, prefetch=prefetch)

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer pooled, every row read (the store's default selector), under the capacity if any."""
        if cls is not OffloadCache:
            return None
        return Selector([], kv_layers(engine.cfg), prefetch, Evicting.of(opts))

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        return cls.pool_bytes(engine, tokens, 2 * engine.cfg.head_dim * dtype_bytes, resident=0)

    @classmethod
    def pool_slots(cls, opts, prompt, new, chunk):
        """With a capacity, what KVPool.insert and evict do to one sequence, replayed on counts: a pass of s tokens
        takes min(free, s) freed slots and grows the pool by the rest, then eviction keeps at most the capacity.
        The largest chunk gives the largest peak (a smaller pass fits inside a larger one's span, and the kept
        count grows at most one per token), so chunks split by a step's prefill budget never need more."""
        if opts.capacity is None:
            return prompt + new
        fill = held = length = peak = 0
        passes = [min(chunk, prompt - i) for i in range(0, prompt, chunk)] + [1] * (new - 1)
        for s in passes:
            fill += s - min(fill - held, s)
            held, length = held + s, length + s
            peak = max(peak, fill)
            held = min(held, max(int(opts.capacity_tokens(np.array([length]))[0]), opts.window))
        return max(peak, 1)

    @staticmethod
    def pool_bytes(engine, tokens: int, row: int, resident: int) -> tuple[int, int, int]:
        """Pooled layers: rows in host memory, 12 bytes of slot state each on the device, and on the device one
        layer's fetched rows twice over (the layer computing and the next one arriving); resident layers' KV on
        the device, read every step."""
        cfg = engine.cfg
        pooled = len([i for i in kv_layers(cfg) if i >= resident])
        kv_row = 2 * cfg.head_dim * engine.dtype.itemsize
        dense = tokens * kv_row * len([i for i in kv_layers(cfg) if i < resident])
        return 2 * tokens * kv_row + tokens * 12 * pooled + dense, tokens * row * pooled, dense

    def __init__(
        self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, opts: KVOptions, resident: int = 0, pages=None,
        prefetch=None,
    ):  # fmt: skip
        """`resident`: the first layers keep their KV on the device (a DenseCache), outside the pool. `pages`: the
        pools' rows live in a paged pool's shared buffers; `prefetch`: the runner's (see KVCache.build)."""
        self.cfg, self.device, self.opts, self.dtype = cfg, torch.device(device), opts, dtype
        held = kv_layers(cfg)
        self.resident = DenseCache(cfg, batch, max_len, self.device, dtype, [i for i in held if i < resident]) \
            if resident else None  # fmt: skip
        self.n_resident = resident
        slots = max_len if pages is None else min(max_len, len(pages.slots))  # pages: the reservation (pool_slots)
        self.pools = [
            None if i < resident or i not in held else self.pool_class(
                batch, cfg.num_key_value_heads, cfg.head_dim, slots, dtype, self.device, opts.eviction, opts.window,
                pages, i,
            )
            for i in range(cfg.num_hidden_layers)
        ]  # fmt: skip
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.lengths = np.zeros(batch, dtype=np.int64)  # real tokens seen per sequence (host)
        self.stats = KVStats(cfg.num_hidden_layers)
        for i, pool in enumerate(self.pools):
            self.stats.row_bytes[i] = pool.row_bytes if pool is not None else 0
        self.step = 0
        self.padded = False  # some slot holds padding (decode steps bring none: see KVCache.begin)
        self.prefetch = prefetch or prefetcher(self.device, overlap=False)
        # on a GPU a decode step moves layer i+1 on the side stream while layer i computes: a pool of its own as one
        # block per tensor; a paged pool's layer is a block per 16 tokens, so there the gather kernel reads its rows
        # (one launch per layer)
        self.ahead = self.layer_copy and self.prefetch.side_stream and type(self).pool_class is KVPool
        self.paged = pages is not None
        self.block_copy = self.ahead and not self.paged
        # the layers land in two device buffers used in turn (layer i reads one while layer i+1's copy fills the
        # other): device memory is fixed before the first step. A fresh block per layer, freed on the compute stream
        # while the host runs ahead of the copy engine, could not be reused before the copies caught up: up to a
        # step's worth of blocks (Llama-2-7B at 4 x 32k: 32 of 2 GiB)
        self.blocks = self.layer_blocks() if self.ahead and any(p is not None for p in self.pools) else None

    def begin(self, valid, positions) -> None:
        if self.resident is not None:
            self.resident.begin(valid, positions)
        s = positions.shape[1]
        known = valid is None or s == 1  # no padding (a decode step brings none: see KVCache.begin)
        if valid is None:
            valid = torch.ones_like(positions, dtype=torch.bool)
        self.valid, self.positions = valid, positions
        self._new_mask = None  # [B, 1, s, s] among the new tokens, made when a pass needs it (never a first one)
        if known:  # every new token is real, known on the host
            self.n_new = np.full(len(self.lengths), s, dtype=np.int64)
        else:  # a prompt: one read of its padding
            self.n_new = valid.sum(-1).cpu().numpy()
            self.padded = self.padded or bool((self.n_new < s).any())
        self.plain = s > 1 and int(self.lengths.max()) == 0 and not self.padded  # a first prefill, no padding
        self.lengths += self.n_new
        self.step += 1

    @property
    def new_mask(self) -> torch.Tensor:
        if self._new_mask is None:
            self._new_mask = causal_mask(self.valid, 0)
        return self._new_mask

    def every_slot_held(self, layer: int) -> bool:
        """Host-known: slots 0..fill-1 of the layer's pool all hold a token (no padding, no eviction)."""
        return not self.padded and not self.pools[layer].holes

    def observe(self, layer: int, x: torch.Tensor) -> None:
        j = layer + 1  # the next pooled layer, one layer ahead on the side stream
        if self.ahead and self.valid.shape[1] == 1 and j < len(self.pools) and self.pools[j] is not None:
            self.prefetch.start(j, self.copy_layer, j)

    def layer_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The two (keys, values) device buffers of whole-layer copies: [slots + 1, B, Hkv, D] each (block copies
        fill them slot-major; the gather kernel's rows, sequence-major, use their bytes as [B, Hkv, slots + 1, D])."""
        pool = next(p for p in self.pools if p is not None)
        return device_pairs((pool.slots + 1, pool.batch, pool.n_kv, pool.k.shape[-1]), pool.k.dtype, self.device)

    def copy_layer(self, j: int):
        """Layer j's held KV with a row for the new token, [B, Hkv, fill + 1, D] in buffer j % 2: one block per
        tensor (a pool of its own), or the gather kernel's rows (a paged pool)."""
        if self.block_copy:
            return self.copy_block(j)
        pool = self.pools[j]
        slots, _ = pool.held_slots()
        out = tuple(buf.view(pool.batch, pool.n_kv, -1, buf.shape[-1]) for buf in self.blocks[j % 2])
        return pool.gather(slots, None, 1, out=out)

    def copy_block(self, j: int):
        """Layer j's held KV as one contiguous block per tensor, with a row for the new token: [B, Hkv, fill + 1, D]
        views of the first fill + 1 slots of buffer j % 2 ([slots + 1, B, Hkv, D] each)."""
        pool = self.pools[j]
        n = pool.fill
        k, v = (buf[: n + 1] for buf in self.blocks[j % 2])
        pool.block(k[:n], v[:n])
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def fetch(self, layer: int, extra: int = 0, q: torch.Tensor | None = None):
        """(slots, ok, keys, values) for `layer`: every slot taken and whether it holds a token, the rows copied to
        the device, with `extra` rows per (sequence, KV head) at the end for the new tokens. `q`: the layer's query
        (a subclass may use it to choose)."""
        pool = self.pools[layer]
        slots, ok = pool.held_slots()
        b, h, n = slots.shape
        if self.ahead and extra == 1:  # the layer: the held rows only
            k, v = self.prefetch.result(layer) if layer in self.prefetch else self.copy_layer(layer)
            self.stats.h2d[layer] += b * h * n * pool.row_bytes
        else:  # rows by row; index_select (not the kernel) copies one for each new token too (overwritten)
            k, v = pool.gather(slots, None, extra)
            self.stats.h2d[layer] += b * h * (n + (0 if pool.kernel else extra)) * pool.row_bytes
        return slots, ok, k, v

    def update(self, layer, q, k, v):
        if layer < self.n_resident:
            return self.resident.update(layer, q, k, v)
        pool, s = self.pools[layer], k.shape[2]
        decode = s == 1  # one new token: the fetch leaves a row for it (no concatenation)
        all_held = self.every_slot_held(layer)
        slots, ok, keys, values = self.fetch(layer, extra=1 if decode else 0, q=q)
        self.after_fetch(layer, q, slots, ok)
        start = pool.insert(k, v, self.positions, self.valid, self.n_new)
        self.stats.d2h += k.shape[0] * k.shape[1] * s * pool.row_bytes
        self.after_insert(layer, k, start)
        if decode:
            keys[:, :, -1:], values[:, :, -1:] = k, v
        else:
            keys, values = torch.cat([keys.to(k.dtype), k], 2), torch.cat([values.to(v.dtype), v], 2)
        if self.plain:  # nothing held yet: plain causal attention among the new tokens
            return keys, values, None
        if all_held and self.every_fetched_row_counts():  # host-known: every held row counts
            if decode:  # no mask
                return keys, values, None
            held = torch.ones(k.shape[0], 1, s, keys.shape[2] - s, dtype=torch.bool, device=k.device)
            return keys, values, torch.cat([held, self.new_mask], -1)  # one mask for every head: [B, 1, s, n + s]
        old = ok.repeat_interleave(self.group, dim=1)[:, :, None, :]  # [B, H, 1, n]
        if decode:
            new = torch.ones_like(old[..., :1])
            return keys, values, torch.cat([old, new], -1)
        mask = torch.cat([old.expand(-1, -1, s, -1), self.new_mask.expand(-1, old.shape[1], -1, -1)], -1)
        return keys, values, mask

    def every_fetched_row_counts(self) -> bool:
        """Host-known: every row the last fetch returned counts (offload: given every slot is held)."""
        return True

    def after_fetch(self, layer, q, slots, ok) -> None:
        """Hook for subclasses: the rows of `slots` were just fetched for `layer`."""

    def after_insert(self, layer, k, start) -> None:
        """Hook for subclasses: the new tokens' keys went into slots start..start+s-1 (an int), or into each
        (sequence, KV head)'s slots start [B, Hkv, s] (see KVPool.insert)."""

    def end(self) -> None:
        if self.opts.capacity is None:  # the pool holds everything: nothing to evict
            return
        cap = self.opts.capacity_tokens(self.lengths)
        for pool in self.pools:
            if pool is not None:
                pool.evict(cap)

    def evictions(self) -> int:
        return sum(p.evicted for p in self.pools if p is not None)

    def report(self) -> KVReport:
        h2d = self.stats.layer_h2d()
        return KVReport(
            bytes_h2d=sum(h2d), bytes_d2h=self.stats.d2h, kv_fetched_share=1.0, kv_attended_share=1.0,
            evictions=self.evictions(), per_layer={"bytes_h2d": h2d},
        )  # fmt: skip

    def close(self) -> None:
        self.prefetch.close()
        for pool in self.pools:
            if pool is not None:
                pool.close()
