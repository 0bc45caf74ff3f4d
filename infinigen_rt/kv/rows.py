"""How the rows a step reads reach attention: copied from the host buffers to the device (`copy_rows`: a GPU's row
kernel from pinned pages, a CPU's kernel or index_select), or on a CPU read where the pool holds them (`PoolRows`:
the host pool is the memory attention reads, so nothing is copied)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen_rt.kv import cpu
from infinigen_rt.kv.attention import decode_sdpa
from infinigen_rt.kv.kernels import gather_rows


def copy_rows(src_k, src_v, rows, ok, out_k, out_v, kernel: bool, first: int = 0, table=None) -> None:
    """out_x[b, h, :n] = rows `rows` [B, Hkv, n] of src_x ([S, B, Hkv, X] host) for x = k, v; out [B, Hkv, n', X].

    `kernel` (a GPU computes, from pinned pages): the gather kernel reads the rows from the device, skipping those
    where `ok` is False, into out_x[b, h, first : first + n] (the other rows of each (b, h) are left as they are).
    With `table` [B, Hkv, T] (the kernel only), `rows` are slots of it (table[b, h, rows[b, h, i]] the pool rows:
    the kernel looks them up itself). Else (`first` 0, no table) index_select copies every row, in one
    copy (a CPU's kernel where it runs: kv/cpu.py)."""
    b, h, n = rows.shape
    x = src_k.shape[-1]
    src_k, src_v = src_k.view(-1, x), src_v.view(-1, x)
    if kernel:
        # (a selection's `ok` may be an expanded view, one count per sequence: the kernel reads it in place)
        gather_rows(src_k, src_v, rows, ok, out_k.view(b * h, -1, x), out_v.view(b * h, -1, x), first, table)
        return
    assert not first and table is None, "rows land after others, or through a table, only through the kernel"
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


@dataclass
class PoolRows:
    """What a CPU's decode step attends in a pooled layer, read where the pool holds it (no copy: on a CPU the
    host pool is the memory attention reads): the layer's pool src_k, src_v (one part each: Plain) and `rows`, one or
    two [B, Hkv, n_i] int64 (flat slot x Hkv + KV head, -1 where a row does not count), then each row's new token.
    `prefetch`: the selector's, whose worker thread takes a share of the (sequence, KV head) pairs before the next
    layer's speculation held for it starts (prefetch.beside)."""

    src_k: torch.Tensor
    src_v: torch.Tensor
    rows: list[torch.Tensor]
    prefetch: object = None

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q [B, H, 1, D] over the rows and then k_new, v_new [B, Hkv, 1, D]: the kernel's, or where it does not
        apply the rows gathered and SDPA (masked where a row does not count)."""
        lend = self.prefetch
        out = cpu.attend_rows(q, self.src_k, self.src_v, self.rows, k_new, v_new, lend and lend.beside)
        if lend is not None:
            lend.flush()  # (what a share did not start)
        if out is not None:
            return out
        d = self.src_k.shape[-1]
        rows = torch.cat(self.rows, -1)
        ok = rows >= 0
        flat_k, flat_v = self.src_k.view(-1, d), self.src_v.view(-1, d)
        keys = torch.cat([flat_k[rows.clamp(min=0)], k_new.to(flat_k.dtype)], 2)
        values = torch.cat([flat_v[rows.clamp(min=0)], v_new.to(flat_v.dtype)], 2)
        mask = torch.cat([ok, torch.ones_like(ok[..., :1])], -1)[:, :, None]
        return decode_sdpa(q, keys.to(q.dtype), values.to(q.dtype), mask)
