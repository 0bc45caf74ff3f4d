"""The rules and copies of the host pool that the batch's store (store.py) uses: which slots an eviction frees
(`victims`, per (sequence, KV head): counter, lru or fifo, never the most recent window; an evicted slot is freed, so
its token can never be selected again) and how chosen rows move from the host buffers to the device (`copy_rows`).

  counter  fewest times selected first (the paper's choice), then oldest
  lru      least recently selected first, then oldest
  fifo     oldest first
"""

from __future__ import annotations

import torch

from infinigen_rt.kv import cpu
from infinigen_rt.kv.kernels import gather_rows

EVICTIONS = ("counter", "lru", "fifo")
_BIG = 1 << 32  # ranks: primary key * _BIG + position (positions < 2**32)


def victims(pos: torch.Tensor, primary: torch.Tensor | None, recent: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """The slots an eviction frees, per row of the last dimension: of the held ones (pos >= 0) outside the recent
    window, the `over` ranked lowest: by `primary` (times selected: counter; last step selected: lru; None: fifo),
    then oldest. pos, primary, recent [..., S]; over (device) broadcast to pos.shape[:-1], never more than the
    candidates. The store's eviction (store.Evicting) ranks with it."""
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
