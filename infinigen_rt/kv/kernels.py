"""Selected rows from the host pool to the device with no host in the loop: a Triton kernel that reads pinned
host memory through unified addressing (the driver maps pinned pages into the GPU's address space), with the
row numbers and their validity produced and consumed on the device. `gather_rows_reference` is the pure-torch
definition the kernel is tested against (under TRITON_INTERPRET=1 on CPU tensors in the normal test suite).

Rows are moved as integers of the widest size that divides a row (a byte move: any dtype, fp16 and bf16
included, and the interpreter needs no half-precision arithmetic)."""

from __future__ import annotations

import importlib.util
import os

import torch

from infinigen_rt.errors import InfinigenError

ROWS_PER_PROGRAM = 16
# The gather from host memory runs on few programs, each looping over chunks of rows, so that it leaves the SMs to the
# compute stream's kernels: the H100's profile (artifacts/results/gpu-h100-2026-11-26) showed the gather with a program
# per 16 rows, every SM holding programs that wait on PCIe, overlapping the compute stream 7-15 % of the time. Its
# programs at most: `INFINIGEN_GATHER_PROGRAMS` (0: a program per ROWS_PER_PROGRAM rows, the measured gather), unset:
# GATHER_PROGRAMS. A capped program moves a chunk of about CAPPED_CHUNK_BYTES of keys and as much of values at once
# (both loaded before either is stored): 8 programs keep 512 KiB in flight, which keeps the link full at the gather's
# measured 42.9 GB/s for any PCIe round trip under 12 us. Not yet measured on a GPU: `benchmarks/gpu.sh gather-grid`.
GATHER_PROGRAMS = 8
CAPPED_CHUNK_BYTES = 32768
CAPPED_WARPS = 16
GATHER_PROGRAMS_ENV = "INFINIGEN_GATHER_PROGRAMS"
# the kernels' names, as a CUDA profiler shows them (bench counts the gather as host-to-device copying)
GATHER_KERNEL, SCATTER_KERNEL = "gather_rows_kernel", "scatter_rows_kernel"


# the GPU's kernels as typed operators (torch.ops.infinigen_gpu.<name>): their arguments checked against the schema,
# what each writes declared, one op a call whatever the launches inside (what a CUDA graph captures); the same body for
# CUDA tensors and for CPU ones (Triton's interpreter, in the tests)
GPU_OPS = torch.library.Library("infinigen_gpu", "DEF")
BODIES: dict = {}  # each op -> its Python body (fake CUDA runs it under its own dispatch: measure/fakecuda.py)


def gpu_op(schema: str):
    """Register the decorated function as the operator `schema` declares (its name, typed arguments, `(a!)` for
    what it writes) for CPU and CUDA tensors; returns the op."""

    def register(fn):
        name = schema.split("(", 1)[0]
        GPU_OPS.define(schema)
        for key in ("CPU", "CUDA"):
            GPU_OPS.impl(name, fn, key)
        op = getattr(torch.ops.infinigen_gpu, name)
        BODIES[op.default] = fn
        return op

    return register


def check(ok: bool, message: str) -> None:
    """A kernel's argument check: RuntimeError, as a C++ operator's TORCH_CHECK raises."""
    if not ok:
        raise RuntimeError(message)


def words(t: torch.Tensor) -> torch.Tensor:
    """t [..., X] (contiguous) viewed as rows of the widest integer that divides a row's bytes: [N, W]."""
    assert t.is_contiguous(), "rows move in place: a contiguous tensor"
    row = t.shape[-1] * t.element_size()
    flat = t.view(-1, t.shape[-1])
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row % dtype.itemsize == 0:
            return flat.view(torch.uint8).view(dtype)
    return flat.view(torch.uint8)


def available() -> bool:
    """Whether triton is installed (CUDA builds of torch bring it; a CPU install runs the torch path)."""
    return importlib.util.find_spec("triton") is not None


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args, **meta) on the device of its tensors: Triton launches on torch's current device and
    stream, so with `--device cuda:1` a launch from a thread whose current device is 0 would run on device 0 with
    pointers into device 1. Every tensor argument is contiguous (the kernels index flat rows)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(t.is_contiguous() for t in tensors), "the row kernels index flat rows: contiguous tensors"
    dev = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if dev is None:  # the interpreter, on CPU tensors
        kernel[grid](*args, **meta)
        return
    with torch.cuda.device(dev):
        kernel[grid](*args, **meta)


def gather_grid(total: int, row_bytes: int, from_host: bool = True) -> tuple[int, int, int]:
    """The gather's launch for `total` rows of `row_bytes` each (of keys, and as many of values): (programs, rows a
    chunk, warps a program). Uncapped (from device memory, or `INFINIGEN_GATHER_PROGRAMS=0`): a program per
    ROWS_PER_PROGRAM rows, 4 warps; from host memory, at most GATHER_PROGRAMS (or the variable's) programs, each
    looping over chunks of about CAPPED_CHUNK_BYTES."""
    raw = os.environ.get(GATHER_PROGRAMS_ENV, "").strip()
    try:
        cap = int(raw) if raw else GATHER_PROGRAMS if from_host else 0
    except ValueError:
        raise InfinigenError(f"{GATHER_PROGRAMS_ENV}={raw!r}: expected a whole number (0: no cap)") from None
    if cap < 0:
        raise InfinigenError(f"{GATHER_PROGRAMS_ENV}={raw!r}: expected 0 (no cap) or more")
    if not cap:
        return -(-total // ROWS_PER_PROGRAM), ROWS_PER_PROGRAM, 4
    rows = 1 << max(4, min(8, (CAPPED_CHUNK_BYTES // max(row_bytes, 1)).bit_length() - 1))  # 16 to 256, a power of 2
    return min(-(-total // rows), cap), rows, CAPPED_WARPS


@gpu_op("gather_rows(Tensor src_a, Tensor src_b, Tensor rows, Tensor? ok, Tensor(a!) out_a, Tensor(b!) out_b, "
        "int first=0, Tensor? table=None) -> ()")
def gather_rows(src_a, src_b, rows, ok, out_a, out_b, first: int = 0, table=None) -> None:
    """out_x[g, first + i] = src_x[rows[g, i]] where ok[g, i] (else zeros), for the pair x = a, b (keys and values);
    with `table` [G, T] int64, rows are slots of each group's row of it: src_x[table[g, rows[g, i]]].

    src_a, src_b: [N, X] (host pinned memory, or device memory); rows: [G, n] int64 and ok: [G, n] bool (or None:
    all count), on the compute device, or both [B, Hkv, n] (G = B x Hkv; ok perhaps expanded over B or Hkv, as a
    selection's count mask is: read in place); out_a, out_b: [G, n_out, X] with n_out >= first + n, contiguous, on
    the device (the other rows of each group are left as they are: room for the new tokens, or rows already
    there)."""
    heads = rows.shape[1] if rows.dim() == 3 else 1
    if rows.dim() == 3:
        rows = rows.reshape(-1, rows.shape[-1])
    check(rows.dim() == 2 and rows.dtype == torch.int64, "gather_rows: rows [G, n] int64")
    check(ok is None or (ok.shape in (rows.shape, (rows.shape[0] // heads, heads, rows.shape[1]))
                         and ok.dtype == torch.bool), "gather_rows: ok [G, n] bool, as rows")  # fmt: skip
    check(table is None or (table.dtype == torch.int64 and table.numel() % rows.shape[0] == 0),
          "gather_rows: table [G, T] int64")  # fmt: skip
    check(src_a.shape == src_b.shape and src_a.dtype == src_b.dtype, "gather_rows: src_a and src_b alike")
    check(out_a.shape == out_b.shape and out_a.dim() == 3 and out_a.shape[0] == rows.shape[0]
          and out_a.shape[1] >= first + rows.shape[1] and first >= 0 and out_a.shape[2] == src_a.shape[-1]
          and out_a.dtype == src_a.dtype, "gather_rows: out_a, out_b [G, n_out >= first + n, X] in the sources' "
          "dtype")  # fmt: skip
    g, n = rows.shape
    n_out = out_a.shape[1]
    sa, sb, oa, ob = words(src_a), words(src_b), words(out_a), words(out_b)
    w = sa.shape[-1]
    total = g * n
    if total == 0:
        return
    import triton  # here, not at import: a CPU never needs it

    from infinigen_rt.kv._gather_kernel import gather_rows_kernel

    rows = rows.reshape(-1).contiguous()
    if ok is None:
        ok_rows, ok_b, ok_h = rows, 0, 0  # (a placeholder)
    elif ok.dim() == 3:  # [B, Hkv, n]: its distinct rows in place
        ok_rows, ok_b, ok_h = strided_rows(ok)
    else:
        ok_rows, ok_b, ok_h, heads = ok.contiguous(), n, 0, 1
    tbl = table.reshape(g, -1).contiguous() if table is not None else rows
    programs, chunk, warps = gather_grid(total, w * sa.element_size(), src_a.device.type == "cpu")
    launch(
        gather_rows_kernel, (programs,),
        sa, sb, oa, ob, rows, ok_rows, tbl, n, n_out, total, first, ok_b, ok_h, tbl.shape[-1] if table is not None
        else 0, W=w, BLOCK_W=triton.next_power_of_2(w), ROWS=chunk, HAS_OK=ok is not None,
        HAS_TABLE=table is not None, HKV=heads, num_warps=warps,
    )  # fmt: skip


@gpu_op("gather_reused(Tensor src_a, Tensor src_b, Tensor prev_a, Tensor prev_b, Tensor rows, Tensor ok, Tensor pos, "
        "Tensor(a!) out_a, Tensor(b!) out_b) -> ()")
def gather_reused(src_a, src_b, prev_a, prev_b, rows, ok, pos, out_a, out_b) -> None:
    """`gather_rows` where a selection was fetched the step before: out_x[g, i] = prev_x[pos[g, i]] where pos >= 0,
    else src_x[rows[g, i]] (where ok; zeros where not). prev_a, prev_b: [M, X] (the previous step's output, flat
    rows, on the device); pos: [G, n] int64 on the device. Only the rows not held cross from the pool."""
    check(rows.dim() == 2 and rows.dtype == torch.int64 and pos.shape == rows.shape and pos.dtype == torch.int64
          and ok.shape == rows.shape and ok.dtype == torch.bool,
          "gather_reused: rows, pos [G, n] int64, ok [G, n] bool")  # fmt: skip
    check(out_a.shape == out_b.shape and out_a.shape[0] == rows.shape[0] and out_a.shape[1] >= rows.shape[1],
          "gather_reused: out_a, out_b [G, n_out >= n, X]")  # fmt: skip
    g, n = rows.shape
    total = g * n
    if total == 0:
        return
    import triton

    from infinigen_rt.kv._gather_kernel import gather_reused_kernel

    sa, sb, pa, pb, oa, ob = (words(x) for x in (src_a, src_b, prev_a, prev_b, out_a, out_b))
    w = sa.shape[-1]
    programs, chunk, warps = gather_grid(total, w * sa.element_size(), src_a.device.type == "cpu")
    launch(
        gather_reused_kernel, (programs,),
        sa, sb, pa, pb, oa, ob, *(x.reshape(-1).contiguous() for x in (rows, ok, pos)), n, out_a.shape[1], total,
        W=w, BLOCK_W=triton.next_power_of_2(w), ROWS=chunk, num_warps=warps,
    )  # fmt: skip


def gather_reused_reference(src_a, src_b, prev_a, prev_b, rows, ok, pos, out_a, out_b) -> None:
    """The definition of `gather_reused` in torch ops."""
    gather_rows_reference(src_a, src_b, rows, ok & (pos < 0), out_a, out_b)
    g, n = rows.shape
    held = (ok & (pos >= 0))[..., None]
    for prev, out in ((prev_a, out_a), (prev_b, out_b)):
        kept = prev.index_select(0, pos.clamp(min=0).reshape(-1)).view(g, n, -1)
        out[:, :n] = torch.where(held, kept.to(out.dtype), out[:, :n])


@gpu_op("scatter_rows(Tensor(a!) dst, Tensor rows, Tensor src, Tensor(b!)? dst_b=None, Tensor? src_b=None, "
        "Tensor(c!)? last_a=None, Tensor(d!)? last_b=None) -> ()")
def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, dst_b=None, src_b=None, last_a=None,
                 last_b=None) -> None:  # fmt: skip
    """dst[rows[i]] = src[i]: dst [N, X] (host pinned memory, or device memory), rows [n] int64 and src [n, X]
    on the compute device (the new tokens of a step written into freed slots of the pool, each (sequence, KV head)
    into its own); with dst_b and src_b (alike), dst_b[rows[i]] = src_b[i] in the same launch (values beside
    keys); with last_a and last_b too ([n, m, X] on the device, contiguous), last_a[i, m - 1] = src[i] and
    last_b[i, m - 1] = src_b[i] (a decode step's new token where attention reads it, after the gathered rows)."""
    check(rows.dtype == torch.int64 and src.numel() == rows.numel() * dst.shape[-1] and src.dtype == dst.dtype,
          "scatter_rows: rows [n] int64, src [n, X] in dst's dtype")  # fmt: skip
    check((dst_b is None) == (src_b is None) and (dst_b is None or (dst_b.shape == dst.shape and dst_b.dtype ==
          dst.dtype and src_b.shape == src.shape and src_b.dtype == src.dtype)),
          "scatter_rows: dst_b and src_b together, as dst and src")  # fmt: skip
    check((last_a is None) == (last_b is None) and (last_a is None or (
          dst_b is not None and last_a.shape == last_b.shape and last_a.dim() == 3 and last_a.shape[0] == rows.numel()
          and last_a.shape[-1] == dst.shape[-1] and last_a.dtype == last_b.dtype == dst.dtype
          and last_a.is_contiguous() and last_b.is_contiguous())),
          "scatter_rows: last_a and last_b together, with a pair, [n, m, X] contiguous in dst's dtype")  # fmt: skip
    n = rows.numel()
    if n == 0:
        return
    import triton

    from infinigen_rt.kv._gather_kernel import scatter_rows_kernel

    d, s = words(dst), words(src.contiguous())
    pair = dst_b is not None
    db, sb = (words(dst_b), words(src_b.contiguous())) if pair else (d, s)
    last = last_a is not None
    la, lb = (words(last_a), words(last_b)) if last else (d, d)
    w = d.shape[-1]
    launch(scatter_rows_kernel, (triton.cdiv(n, ROWS_PER_PROGRAM),), d, s, db, sb, la, lb,
           rows.reshape(-1).contiguous(), n, last_a.shape[1] if last else 0, W=w, BLOCK_W=triton.next_power_of_2(w),
           ROWS=ROWS_PER_PROGRAM, PAIR=pair, LAST=last)  # fmt: skip


def scatter_rows_reference(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """The definition of `scatter_rows` in torch ops (index_copy)."""
    dst.index_copy_(0, rows.reshape(-1).to(dst.device), src.reshape(-1, dst.shape[-1]).to(dst.device, dst.dtype))


def gather_rows_reference(src_a, src_b, rows, ok, out_a, out_b, first: int = 0, table=None) -> None:
    """The definition of `gather_rows` in torch ops (index_select on the rows, zeros where they do not count)."""
    if table is not None:
        rows = torch.gather(table.reshape(rows.shape[0] * (rows.shape[1] if rows.dim() == 3 else 1), -1), 1,
                            rows.reshape(-1, rows.shape[-1]))  # fmt: skip
    rows = rows.reshape(-1, rows.shape[-1])
    ok = None if ok is None else ok.reshape(rows.shape)
    g, n = rows.shape
    for src, out in ((src_a, out_a), (src_b, out_b)):
        taken = src.index_select(0, rows.reshape(-1).to(src.device)).to(out.device).view(g, n, -1)
        if ok is not None:
            taken = taken.masked_fill(~ok[..., None], 0)
        out[:, first : first + n] = taken


AGG_SPLIT = 1024  # the slots one program of the group softmax takes (a query head's row of them; fewer for more heads)
AGG_SPLITS = 64  # the splits of a row the combining pass reads at once
CUT_BLOCK = 256  # the slots a program of the cut takes


def strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x [B, Hkv, n] (its last dimension dense), perhaps expanded over B or Hkv (the same row for every head): (the
    tensor holding its distinct rows, contiguous; the stride of a sequence and of a KV head in it, 0 where
    expanded). No copy where the distinct rows are contiguous already (an expanded mask, a whole top-k)."""
    keep = tuple(slice(0, 1) if x.stride(i) == 0 and x.shape[i] > 1 else slice(None) for i in range(2))
    base = x[keep]
    if not base.is_contiguous():
        base = base.contiguous()
    return base, *(base.stride(i) if base.shape[i] == x.shape[i] else 0 for i in range(2))


@gpu_op("group_agg(Tensor s, Tensor? held, Tensor? forced, Tensor? value, Tensor? cut, Tensor? cut_ok, "
        "bool free_inf) -> Tensor")
def group_agg(s, held, forced, value, cut, cut_ok, free_inf: bool) -> torch.Tensor:
    """Each slot's share of its group's attention: s [B, Hkv, G, t] float32 (scores) -> [B, Hkv, t] float32, the
    softmax over t of each query head summed over G (`group_agg_reference` in torch ops), in at most three launches.
    `held` [B, Hkv, t] bool: the slots that hold a token (the others masked before the softmax, their share 0, or
    -inf with `free_inf`); `forced` [B, Hkv, t] bool and `value` [B, Hkv, t] float32: value where forced;
    `cut` [B, Hkv, n] int64 (slots) and `cut_ok` [B, Hkv, n] bool (or None: all): -inf at those slots afterwards
    (they count in the softmax). cut and cut_ok may be expanded over B or Hkv. A query head none of whose slots is
    held adds 0 (torch's softmax over no slot: NaN); a step never selects for a row that holds nothing."""
    check(s.dim() == 4 and s.dtype == torch.float32 and s.is_contiguous(), "group_agg: s [B, Hkv, G, t] float32")
    b, hkv, g, t = s.shape
    for name, x, dtype in (("held", held, torch.bool), ("forced", forced, torch.bool), ("value", value, s.dtype)):
        check(x is None or (x.shape == (b, hkv, t) and x.dtype == dtype),
              f"group_agg: {name} [B, Hkv, t] {dtype}")  # fmt: skip
    check((forced is None) == (value is None), "group_agg: forced and value together")
    check(cut is None or (cut.dim() == 3 and cut.shape[:2] == (b, hkv) and cut.dtype == torch.int64
                          and (cut_ok is None or (cut_ok.shape == cut.shape and cut_ok.dtype == torch.bool))),
          "group_agg: cut [B, Hkv, n] int64, cut_ok as cut, bool")  # fmt: skip
    out = torch.empty(b, hkv, t, dtype=torch.float32, device=s.device)
    if out.numel() == 0:
        return out
    import triton

    from infinigen_rt.kv._agg_kernel import cut_kernel, group_agg_kernel, group_stats_kernel

    gp = triton.next_power_of_2(g)
    split = max(64, AGG_SPLIT // gp)
    n_split = triton.cdiv(t, split)
    stats = torch.empty(b * hkv, n_split, 2, gp, dtype=torch.float32, device=s.device)
    # (each mask's distinct rows and their strides; a placeholder pointer where there is none)
    mask, forced, value = (strided_rows(x) if x is not None else (out, 0, 0) for x in (held, forced, value))
    shape = dict(HKV=hkv, G=g, GP=gp, SPLIT=split, HAS_HELD=held is not None)
    launch(group_stats_kernel, (b * hkv, n_split), s, mask[0], stats, t, n_split, *mask[1:], **shape)
    launch(group_agg_kernel, (b * hkv, n_split), s, mask[0], forced[0], value[0], stats, out, t, n_split, *mask[1:],
           *forced[1:], *value[1:], **shape, NS=AGG_SPLITS, HAS_FORCED=forced[0] is not out, FREE_INF=free_inf)
    if cut is not None and cut.shape[-1]:
        n = cut.shape[-1]
        slots, sb, sh = strided_rows(cut)
        ok, ob, oh = strided_rows(cut_ok) if cut_ok is not None else (slots, 0, 0)
        launch(cut_kernel, (b * hkv, triton.cdiv(n, CUT_BLOCK)), out, slots, ok, t, n, sb, sh, ob, oh, HKV=hkv,
               BLOCK=CUT_BLOCK, HAS_OK=cut_ok is not None)  # fmt: skip
    return out


def group_agg_reference(s, held, forced, value, cut, cut_ok, free_inf: bool) -> torch.Tensor:
    """The definition of `group_agg` in torch ops (select's and correction_rows' chain)."""
    if held is not None:
        s = s.masked_fill(~held[:, :, None], float("-inf"))
    agg = s.softmax(-1).sum(2)
    if held is not None and free_inf:
        agg = agg.masked_fill(~held, float("-inf"))
    if forced is not None:
        agg = torch.where(forced, value, agg)
    if cut is not None:
        taken = torch.zeros(agg.shape, dtype=torch.bool, device=agg.device)
        taken.scatter_(2, cut, cut_ok if cut_ok is not None else torch.ones(cut.shape, dtype=torch.bool))
        agg = agg.masked_fill(taken, float("-inf"))
    return agg


TOPK_BLOCK = 4096  # the slots a top-k pass takes at once (one program a row: its warps share them)


@gpu_op("top_rows(Tensor x, int k, Tensor? count=None, int n=-1) -> (Tensor, Tensor, Tensor)")
def top_rows(x: torch.Tensor, k: int, count=None, n: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's best, in one launch: x [B, Hkv, t] float32 -> (values [B, Hkv, k] float32, slots [B, Hkv, k] int64,
    ok [B, Hkv, k] bool: the first c entries where their value is above -inf, as a selection counts its rows).
    Row (b, h) takes its c largest, c = count[b, h] (count [B, Hkv], or [B, 1] or [B] for one a sequence; integers
    on the device, read there: no host sync), or n where count is None (-1: k), within 0 .. k. Its first c entries
    are those, in slot order (of equal values at the edge the lower slots, as the CPU's top-k); the rest are its
    other slots in slot order (distinct slots a row, all within t). So a row's first c are its c best, which is what
    a sorted torch.topk gives a selection whose rows fetch different counts, without the sort
    (`top_rows_reference` in torch ops)."""
    check(x.dim() == 3 and x.dtype == torch.float32, "top_rows: x [B, Hkv, t] float32")
    x = x.contiguous()  # (a row's slots in a run: a copy only where a selection's scores came permuted)
    b, hkv, t = x.shape
    check(0 <= k <= t, f"top_rows: k {k} within 0 .. t ({t})")
    check(count is None or (count.shape in ((b,), (b, 1), (b, hkv)) and not count.is_floating_point()
                            and count.dtype != torch.bool),
          "top_rows: count [B], [B, 1] or [B, Hkv] integers")  # fmt: skip
    val = torch.empty(b, hkv, k, dtype=torch.float32, device=x.device)
    slot = torch.empty(b, hkv, k, dtype=torch.int64, device=x.device)
    ok = torch.empty(b, hkv, k, dtype=torch.bool, device=x.device)
    if val.numel() == 0:
        return val, slot, ok
    from infinigen_rt.kv._topk_kernel import top_rows_kernel

    if count is None:
        per, count_b, count_h = x, 0, 0  # (a placeholder)
    else:
        per = count.reshape(b, -1)
        if per.shape[1] > 1 and per.stride(1) == 0:  # one a sequence, expanded over the heads: read in place
            per = per[:, :1]
        per = per.contiguous()
        count_b, count_h = per.stride(0), per.stride(1) if per.shape[1] > 1 else 0
    launch(top_rows_kernel, (b * hkv,), x, per, val, slot, ok.view(torch.int8), t, k, k if n < 0 else n, count_b,
           count_h, HKV=hkv, BLOCK=TOPK_BLOCK, HAS_COUNT=count is not None, num_warps=16)  # fmt: skip
    return val, slot, ok


def top_rows_reference(x: torch.Tensor, k: int, count=None,
                       n: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The definition of `top_rows` in torch ops: a stable sort by the floats' order keys (as the kernels make them;
    equal keys keep slot order), each row's first c of it sorted back into slot order, then its others."""
    b, hkv, t = x.shape
    bits = x.contiguous().view(torch.int32).long()
    key = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)  # (as _topk_kernel._key)
    order = key.argsort(dim=-1, descending=True, stable=True)
    if count is None:
        c = torch.full((b, hkv), k if n < 0 else n, dtype=torch.int64, device=x.device)
    else:
        c = count.reshape(b, -1).long().expand(b, hkv)
    c = c.clamp(0, k)[..., None]
    chosen = torch.arange(t, device=x.device) < c  # [B, Hkv, t] in sorted order: the first c
    # slot order within each part: the chosen first (part 0), then the others (part 1)
    part = torch.zeros_like(order).scatter_(-1, order, (~chosen).long())
    slots = (part * t + torch.arange(t, device=x.device)).argsort(dim=-1)[..., :k]
    values = torch.gather(x, -1, slots)
    return values, slots, (torch.arange(k, device=x.device) < c) & (values > float("-inf"))
