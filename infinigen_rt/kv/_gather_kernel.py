"""The row kernels (see kernels.py, which imports this module only when a GPU gathers or scatters).

The integer arguments that change from step to step (how many rows, where they land) are not specialised: Triton
would otherwise compile a variant for each value's divisibility by 16 (and for the value 1), about a second each,
inside a timed decode step whenever a growing count crosses one of those lines."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # the chunk loop's bound is computed from a runtime count, in Triton's interpreter too


@triton.jit(do_not_specialize=["n_sel", "n_out", "total", "first", "ok_b", "ok_h", "t_len"])
def gather_rows_kernel(
    src_a, src_b, out_a, out_b, rows, ok, table, n_sel, n_out, total, first, ok_b, ok_h, t_len,
    W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr, HAS_OK: tl.constexpr, HAS_TABLE: tl.constexpr,
    HKV: tl.constexpr,
):  # fmt: skip
    # chunk c moves ROWS selected rows, program p the chunks p, p + programs, ... (one each, unless the grid is
    # capped, as it is by default from host memory: kernels.gather_grid); selection m (of `total`) of group
    # g = m // n_sel lands at row g * n_out + first + m % n_sel. HAS_TABLE: rows holds slots, each group's row of
    # `table` [G, t_len] their pool rows. ok: group g's row at (g // HKV) * ok_b + (g % HKV) * ok_h (a stride 0 where
    # one row serves every KV head)
    for chunk in range(tl.program_id(0), (total + ROWS - 1) // ROWS, tl.num_programs(0)):
        m = chunk * ROWS + tl.arange(0, ROWS)
        live = m < total
        g = (m // n_sel).to(tl.int64)
        r = tl.load(rows + m, mask=live, other=0).to(tl.int64)
        if HAS_TABLE:
            r = tl.load(table + g * t_len + r, mask=live, other=0).to(tl.int64)
        use = live
        if HAS_OK:
            at = (g // HKV) * ok_b + (g % HKV) * ok_h + m % n_sel
            use = live & (tl.load(ok + at, mask=live, other=0) != 0)
        dst = g * n_out + first + (m % n_sel)
        cols = tl.arange(0, BLOCK_W)
        inside = cols[None, :] < W
        src_off = r[:, None] * W + cols[None, :]
        dst_off = dst[:, None] * W + cols[None, :]
        # a row that does not count is written as zeros (never read from the pool: its bytes do not move); both
        # loads before either store, so that a program keeps the chunk's keys and values in flight across PCIe at once
        a = tl.load(src_a + src_off, mask=use[:, None] & inside, other=0)
        b = tl.load(src_b + src_off, mask=use[:, None] & inside, other=0)
        tl.store(out_a + dst_off, a, mask=live[:, None] & inside)
        tl.store(out_b + dst_off, b, mask=live[:, None] & inside)


@triton.jit(do_not_specialize=["total", "n_last"])
def scatter_rows_kernel(dst, src, dst_b, src_b, last_a, last_b, rows, total, n_last, W: tl.constexpr,
                        BLOCK_W: tl.constexpr, ROWS: tl.constexpr, PAIR: tl.constexpr, LAST: tl.constexpr):  # fmt: skip
    # program p writes ROWS rows: source row m (of `total`) lands at destination row rows[m] (PAIR: of src_b into
    # dst_b too, the values beside the keys; LAST: and at row m * n_last + n_last - 1 of last_a and last_b, the last
    # row of group m's rows on the device, where attention reads the new token beside the gathered ones)
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = m < total
    r = tl.load(rows + m, mask=live, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    inside = live[:, None] & (cols[None, :] < W)
    x = tl.load(src + m.to(tl.int64)[:, None] * W + cols[None, :], mask=inside, other=0)
    tl.store(dst + r[:, None] * W + cols[None, :], x, mask=inside)
    if PAIR:
        y = tl.load(src_b + m.to(tl.int64)[:, None] * W + cols[None, :], mask=inside, other=0)
        tl.store(dst_b + r[:, None] * W + cols[None, :], y, mask=inside)
        if LAST:
            at = (m.to(tl.int64) * n_last + n_last - 1)[:, None] * W + cols[None, :]
            tl.store(last_a + at, x, mask=inside)
            tl.store(last_b + at, y, mask=inside)


@triton.jit(do_not_specialize=["n_sel", "n_out", "total"])
def gather_reused_kernel(
    src_a, src_b, prev_a, prev_b, out_a, out_b, rows, ok, pos, n_sel, n_out, total,
    W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # as gather_rows_kernel, but a selection whose pos[m] >= 0 was fetched the step before: its row is read from row
    # pos[m] of the previous output (device memory), the others from the pool (pinned host memory, across PCIe)
    for chunk in range(tl.program_id(0), (total + ROWS - 1) // ROWS, tl.num_programs(0)):
        m = chunk * ROWS + tl.arange(0, ROWS)
        live = m < total
        r = tl.load(rows + m, mask=live, other=0).to(tl.int64)
        use = live & (tl.load(ok + m, mask=live, other=0) != 0)
        p = tl.load(pos + m, mask=live, other=-1).to(tl.int64)
        held = use & (p >= 0)
        fresh = use & (p < 0)
        dst = (m // n_sel).to(tl.int64) * n_out + (m % n_sel)
        cols = tl.arange(0, BLOCK_W)
        inside = cols[None, :] < W
        src_off = r[:, None] * W + cols[None, :]
        prev_off = p[:, None] * W + cols[None, :]
        dst_off = dst[:, None] * W + cols[None, :]
        a = tl.load(src_a + src_off, mask=fresh[:, None] & inside, other=0)
        b = tl.load(src_b + src_off, mask=fresh[:, None] & inside, other=0)
        a = tl.where(held[:, None], tl.load(prev_a + prev_off, mask=held[:, None] & inside, other=0), a)
        b = tl.where(held[:, None], tl.load(prev_b + prev_off, mask=held[:, None] & inside, other=0), b)
        tl.store(out_a + dst_off, a, mask=live[:, None] & inside)
        tl.store(out_b + dst_off, b, mask=live[:, None] & inside)
