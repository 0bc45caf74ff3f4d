"""The host KV pool: one layer's keys and values for a batch in CPU memory, in slots, and the single owner of
which slot holds which token.

Mechanism only: which slots a layer fetches is the policy's business. Layout and state:
  k, v   [S, B, Hkv, D] in host memory (exactly sized pinned pages when a GPU computes), slot-major: a slot's
         rows for every (sequence, KV head) are one contiguous block, so a new token is one contiguous copy and
         the held prefix of a layer is one contiguous block (what `offload` copies)
  pos    [B, Hkv, S] on the compute device: the position a slot holds, -1 when free (padding, or evicted)
  hits, last  [B, Hkv, S] on the compute device: times selected, last step selected (eviction's keys)
Tokens take slots in arrival order, the same slot for every (sequence, KV head), until eviction frees some: then
a sequence's new tokens go first into the slots it freed, each (sequence, KV head) into its own (see `insert`),
so under a capacity the pool stops growing (policies' `pool_slots` says how far it gets). A pool of one sequence
may live in a paged pool's shared buffers (blocks.PagedStore): its slots are then looked up in its block table,
on the host for the copies in and on the device for the gather's row numbers. The host keeps what every decision
needs (`fill`, the held counts, whether a slot was ever freed), so nothing here reads the device during a decode
step.

Eviction, per (sequence, KV head), keeps at most `capacity` tokens and never touches the most recent `window`
positions:
  counter  fewest times selected first (the paper's choice), then oldest
  lru      least recently selected first, then oldest
  fifo     oldest first
An evicted slot is freed (pos = -1), so its token can never be selected again; a token written there later is a
new one, with fresh counters.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from infinigen_rt.kv import cpu
from infinigen_rt.kv.kernels import gather_rows, scatter_rows
from infinigen_rt.system import host_buffer, retire, to_device, unpin

EVICTIONS = ("counter", "lru", "fifo")
_BIG = 1 << 32  # ranks: primary key * _BIG + position (positions < 2**32)


class KVPool:
    """See the module docstring. `device`: where the compute (and the slot state) lives."""

    def __init__(self, batch, n_kv, head_dim, slots, dtype, device, eviction="counter", window=0, pages=None, layer=0):
        """`pages` (blocks.Pages, one sequence): the rows live in a paged pool's shared buffers of layer `layer`, slot
        i at the pool's physical slot pages.slots[i]; else in buffers of this pool's own."""
        assert eviction in EVICTIONS
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.kernel = self.pinned  # gather with the kernel (tests turn it on for CPU tensors: the interpreter)
        self.batch, self.n_kv, self.slots = batch, n_kv, slots
        # page-locked addresses, released by close() or, failing that, when the pool is collected (its tensors
        # are still alive then: the pages are unregistered before they are freed)
        self.registered: list[int] | None = [] if self.pinned else None
        self.host_tensors: list[torch.Tensor] = []  # the buffers of its own
        if self.pinned:
            self._unpin = weakref.finalize(self, unpin, self.registered, self.device)
        self.pages, self.layer = pages, layer
        if pages is not None:
            if batch != 1 or len(pages.slots) < slots:
                raise ValueError(f"pages hold one sequence of {len(pages.slots)} slots: not {batch} of {slots}")
            self.phys = pages.slots[:slots]  # host: the copies' runs
            self.phys_dev = pages.on(self.device)[:slots]  # device: the gather's row numbers
        self.k = self.buffer("k", (n_kv, head_dim), dtype)
        self.v = self.buffer("v", (n_kv, head_dim), dtype)
        state = (batch, n_kv, slots)  # int32: 12 bytes of state per (sequence, KV head, slot) on the device
        self.pos = torch.full(state, -1, dtype=torch.int32, device=self.device)
        self.hits = torch.zeros(state, dtype=torch.int32, device=self.device)
        self.last = torch.zeros(state, dtype=torch.int32, device=self.device)
        self.eviction, self.window = eviction, window
        self.evicted = 0
        self.fill = 0  # slots taken, from 0, the same for every (sequence, KV head)
        self.holes = False  # a slot below `fill` was freed by eviction
        self.n_held = np.zeros((batch, n_kv), dtype=np.int64)  # tokens held per (b, h), on the host
        # row r of the flat view [S * B * Hkv, D] is slot r // (B * Hkv), sequence and head r % (B * Hkv)
        self.lane = torch.arange(batch * n_kv, device=self.device).view(batch, n_kv, 1)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return 2 * self.k.shape[-1] * self.k.element_size()

    def insert(self, k, v, positions, valid, n_valid: np.ndarray | None = None) -> int | torch.Tensor:
        """Write s new tokens; k, v: [B, Hkv, s, D] on the compute device; positions, valid: [B, s]. Padding tokens
        are written, but their slots stay free. `n_valid`: the real tokens per sequence when the host knows them (a
        decode step: one each); else they are counted.

        Where: slots fill..fill+s-1 (returns fill), or, once eviction has freed slots, first the slots it freed: a
        sequence reuses what it evicted, so its pool stops growing (returns the slots, [B, Hkv, s] on the device).
        Every (sequence, KV head) with as many free slots (host-known: fill less its held count; so always for one
        sequence, whose heads hold as many tokens) takes its r = min(free, s) lowest ones and fill.. for the rest;
        else each takes s of its own where all have s free, or all append."""
        b, h, s, _ = k.shape
        f = self.fill
        full = n_valid is not None and bool((np.asarray(n_valid) == s).all())  # no padding among the new tokens
        free_n = f - self.n_held  # [B, Hkv]
        same = bool((free_n == free_n.flat[0]).all())
        r = min(int(free_n.min()), s) if same or int(free_n.min()) >= s else 0
        if self.holes and full and r > 0:
            assert f + s - r <= self.slots, "pool full"
            free = (self.pos[..., :f] < 0).to(torch.int8)
            slots = free.sort(dim=-1, descending=True, stable=True).indices[..., :r]  # lowest free first
            if r < s:  # the rest at the end, the same slots for every (sequence, KV head)
                fresh = torch.arange(f, f + s - r, device=slots.device).expand(b, h, -1)
                slots = torch.cat([slots, fresh], -1)
            self.store(slots, k, v)
            self.pos.scatter_(2, slots, positions.to(torch.int32)[:, None, :].expand(b, h, s).contiguous())
            self.hits.scatter_(2, slots, 0)
            self.last.scatter_(2, slots, 0)
            self.n_held += s
            self.fill += s - r
            return slots
        assert f + s <= self.slots, "pool full"
        self.store(f, k, v)
        self.pos[:, :, f : f + s] = torch.where(valid, positions, -1).to(torch.int32)[:, None, :]
        if n_valid is None:
            n_valid = valid.sum(-1).cpu().numpy()  # a prompt: one read of its padding
        self.n_held += np.asarray(n_valid, dtype=np.int64)[:, None]
        self.fill += s
        return f

    def buffer(self, name: str, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor [slots, B, *tail] of this pool's own, or the paged pool's shared one for its layer."""
        if self.pages is None:
            t = host_buffer((self.slots, self.batch, *tail), dtype, self.registered)
            self.host_tensors.append(t)
            return t
        return self.pages.store.buffer(name, self.layer, tail, dtype)

    def runs(self, f: int, s: int) -> list[tuple[int, int, int]]:
        """Slots f..f+s-1 as contiguous runs of the buffers: (first buffer slot, first of the s, length). One run in
        a pool of its own; in a paged pool, one per block touched."""
        if self.pages is None:
            return [(f, 0, s)]
        if s == 1:  # a decode step's token
            return [(int(self.phys[f]), 0, 1)]
        phys = self.phys[f : f + s]
        cuts = np.flatnonzero(np.diff(phys) != 1) + 1
        starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [s]])
        return [(int(phys[a]), int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]

    def write(self, buf: torch.Tensor, where: int | torch.Tensor, x: torch.Tensor) -> None:
        """Rows of `buf` from x [B, Hkv, s, X]: slots where.. (an int: one contiguous copy per run, asynchronous
        into pinned pages), or each (sequence, KV head)'s own slots `where` [B, Hkv, s] (a scatter: the kernel
        writes straight into the pinned pages, or index_copy on a CPU)."""
        if isinstance(where, int):
            rows = x.permute(2, 0, 1, 3)
            for d, i, n in self.runs(where, x.shape[2]):
                buf[d : d + n].copy_(rows[i : i + n], non_blocking=self.pinned)
            return
        flat, rows, src = buf.view(-1, buf.shape[-1]), self.flat_rows(where).reshape(-1), x.reshape(-1, x.shape[-1])
        if self.kernel:
            scatter_rows(flat, rows, src)
        else:
            flat.index_copy_(0, rows.to(flat.device), src.to(flat.device, flat.dtype))

    def store(self, f: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows of slots `f` (see write) from [B, Hkv, s, X] tensors."""
        self.write(self.k, f, k)
        self.write(self.v, f, v)

    def held_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot taken: (slots [B, Hkv, fill], ok [B, Hkv, fill]); ok is False on free slots."""
        slots = torch.arange(self.fill, device=self.device).expand(self.batch, self.n_kv, -1)
        return slots, self.pos[..., : self.fill] >= 0

    def flat_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, n] slots -> row numbers into the buffers viewed as [S * B * Hkv, D] (on the slots' device; in a
        paged pool the block table's slot numbers are looked up there)."""
        phys = slots if self.pages is None else self.phys_dev.to(slots.device)[slots]
        return phys * (self.batch * self.n_kv) + self.lane.to(slots.device)

    def gather(self, slots: torch.Tensor, ok: torch.Tensor | None = None, extra: int = 0, out=None):
        """The K and V rows of `slots` ([B, Hkv, n], compute device) on the compute device: [B, Hkv, n + extra, D]
        each; the `extra` last rows per (b, h) are room for the new tokens (so no concatenation follows). `out`:
        (keys, values) device buffers [B, Hkv, N, D], N >= n + extra, whose first n + extra rows per (b, h) are
        used (and returned, as views) instead of new tensors (the kernel only).

        On a GPU a kernel reads the rows straight from the pinned pool (rows where `ok` is False are not read:
        zeros); on a CPU, index_select copies every row."""
        b, h, n = slots.shape
        d = self.k.shape[-1]
        if out is None:
            out_k = torch.empty(b, h, n + extra, d, dtype=self.k.dtype, device=self.device)
            out_v = torch.empty_like(out_k)
        else:
            out_k, out_v = out
            assert self.kernel and out_k.shape[2] >= n + extra, "a buffer of rows: the kernel's, large enough"
        copy_rows(self.k, self.v, self.flat_rows(slots), ok, out_k, out_v, self.kernel)
        return out_k[:, :, : n + extra], out_v[:, :, : n + extra]

    def block(self, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Every slot taken (0..fill-1) into out_k, out_v [fill, B, Hkv, D] (compute device): one contiguous copy
        per run (one for a pool of its own, one per block in a paged pool), asynchronous from pinned pages (the layer
        copy of `offload`, as FlexGen does it)."""
        for d, i, n in self.runs(0, self.fill):
            out_k[i : i + n].copy_(self.k[d : d + n], non_blocking=self.pinned)
            out_v[i : i + n].copy_(self.v[d : d + n], non_blocking=self.pinned)

    def mark_selected(self, slots: torch.Tensor, ok: torch.Tensor | None, step: int) -> None:
        """Count a selection of `slots` (where `ok`; None: all of them) for the counter and LRU policies."""
        if ok is None:
            self.hits.scatter_add_(2, slots, torch.ones_like(slots, dtype=torch.int32))
            self.last.scatter_(2, slots, step)
            return
        self.hits.scatter_add_(2, slots, ok.to(torch.int32))
        self.last.scatter_(2, slots, torch.where(ok, step, torch.gather(self.last, 2, slots)))

    def evict(self, capacity) -> int:
        """Free slots until every (sequence, KV head) holds at most capacity[b] tokens (never fewer than the window,
        which is never evicted). Returns how many: known on the host, as at most `window` tokens are recent, so
        enough others can always go."""
        cap = np.maximum(np.asarray(capacity, dtype=np.int64), self.window)
        over = np.clip(self.n_held - cap[:, None], 0, None)  # [B, Hkv]
        n = int(over.sum())
        if n == 0:
            return 0
        pos = self.pos
        newest = pos.amax(dim=(1, 2))  # [B]: the latest position of each sequence
        recent = pos > (newest[:, None, None] - self.window)
        primary = {"counter": self.hits, "lru": self.last, "fifo": None}[self.eviction]
        pos.masked_fill_(victims(pos, primary, recent, to_device(torch.from_numpy(over), self.device)), -1)
        self.n_held -= over
        self.evicted += n
        self.holes = True
        return n

    def close(self) -> None:
        """Unpin the host pages once the device is done with them (without waiting for it: system.retire)."""
        if self.pinned:
            self._unpin.detach()
            retire(self.registered, self.host_tensors, self.device)
            self.host_tensors = []
            self.pinned = False


def victims(pos: torch.Tensor, primary: torch.Tensor | None, recent: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """The slots an eviction frees, per row of the last dimension: of the held ones (pos >= 0) outside the recent
    window, the `over` ranked lowest: by `primary` (times selected: counter; last step selected: lru; None: fifo),
    then oldest. pos, primary, recent [..., S]; over (device) broadcast to pos.shape[:-1], never more than the
    candidates. The pool's eviction and the store's (store.Evicting) both rank with it."""
    rank = pos.long() if primary is None else primary.long() * _BIG + pos
    rank = rank.masked_fill((pos < 0) | recent, torch.iinfo(torch.long).max)
    order = rank.argsort(dim=-1, stable=True)
    ranks = torch.arange(order.shape[-1], device=pos.device).expand_as(order)
    nth = torch.empty_like(order).scatter_(-1, order, ranks)
    return (nth < over[..., None]) & (pos >= 0) & ~recent


def copy_rows(src_k, src_v, rows, ok, out_k, out_v, kernel: bool) -> None:
    """out_x[b, h, :n] = rows `rows` [B, Hkv, n] of src_x ([S, B, Hkv, X] host) for x = k, v; out [B, Hkv, n', X].

    `kernel` (a GPU computes, from pinned pages): the gather kernel reads the rows from the device, skipping those
    where `ok` is False (rows n.. of each (b, h) are left as they are). Else index_select copies every row, in one
    copy (a CPU's kernel where it runs: kv/cpu.py)."""
    b, h, n = rows.shape
    x = src_k.shape[-1]
    src_k, src_v = src_k.view(-1, x), src_v.view(-1, x)
    if kernel:
        # reshape, not view: a selection's `ok` may be an expanded view (one count per sequence, strides of 0)
        gather_rows(src_k, src_v, rows.reshape(b * h, n), None if ok is None else ok.reshape(b * h, n),
                    out_k.view(b * h, -1, x), out_v.view(b * h, -1, x))  # fmt: skip
        return
    if src_k.device.type == "cpu" and cpu.gather_rows(src_k, src_v, rows, out_k, out_v):  # the extra rows: zeros
        return
    extra = out_k.shape[2] - n
    if not out_k.is_contiguous():  # a window of a larger output (see cpu.gather_rows): the rows, then zeros
        out_k[:, :, :n], out_v[:, :, :n] = src_k[rows], src_v[rows]
        out_k[:, :, n:], out_v[:, :, n:] = 0, 0
        return
    if extra:  # one copy straight into the output: the extra rows take row 0, to be overwritten
        rows = torch.cat([rows, rows.new_zeros(b, h, extra)], -1)
    torch.index_select(src_k, 0, rows.reshape(-1), out=out_k.view(-1, x))
    torch.index_select(src_v, 0, rows.reshape(-1), out=out_v.view(-1, x))
