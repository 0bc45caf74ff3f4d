"""The row kernels (see kernels.py, which imports this module only when a GPU gathers or scatters).

The integer arguments that change from step to step (how many rows, where they land) are not specialised: Triton
would otherwise compile a variant for each value's divisibility by 16 (and for the value 1), about a second each,
inside a timed decode step whenever a growing count crosses one of those lines."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # the chunk loop's bound is computed from a runtime count, in Triton's interpreter too


@triton.jit(do_not_specialize=["n_sel", "n_out", "total", "first"])
def gather_rows_kernel(
    src_a, src_b, out_a, out_b, rows, ok, n_sel, n_out, total, first,
    W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr, HAS_OK: tl.constexpr,
):  # fmt: skip
    # chunk c moves ROWS selected rows, program p the chunks p, p + programs, ... (one each, unless the grid is
    # capped: kernels.gather_grid); selection m (of `total`) lands at row (m // n_sel) * n_out + first + m % n_sel
    for chunk in range(tl.program_id(0), (total + ROWS - 1) // ROWS, tl.num_programs(0)):
        m = chunk * ROWS + tl.arange(0, ROWS)
        live = m < total
        r = tl.load(rows + m, mask=live, other=0).to(tl.int64)
        use = live
        if HAS_OK:
            use = live & (tl.load(ok + m, mask=live, other=0) != 0)
        dst = (m // n_sel).to(tl.int64) * n_out + first + (m % n_sel)
        cols = tl.arange(0, BLOCK_W)
        inside = cols[None, :] < W
        src_off = r[:, None] * W + cols[None, :]
        dst_off = dst[:, None] * W + cols[None, :]
        # a row that does not count is written as zeros (never read from the pool: its bytes do not move)
        a = tl.load(src_a + src_off, mask=use[:, None] & inside, other=0)
        tl.store(out_a + dst_off, a, mask=live[:, None] & inside)
        b = tl.load(src_b + src_off, mask=use[:, None] & inside, other=0)
        tl.store(out_b + dst_off, b, mask=live[:, None] & inside)


@triton.jit(do_not_specialize=["total"])
def scatter_rows_kernel(dst, src, rows, total, W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr):
    # program p writes ROWS rows: source row m (of `total`) lands at destination row rows[m]
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = m < total
    r = tl.load(rows + m, mask=live, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    inside = live[:, None] & (cols[None, :] < W)
    x = tl.load(src + m.to(tl.int64)[:, None] * W + cols[None, :], mask=inside, other=0)
    tl.store(dst + r[:, None] * W + cols[None, :], x, mask=inside)


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
        a = tl.where(held[:, None], tl.load(prev_a + prev_off, mask=held[:, None] & inside, other=0), a)
        tl.store(out_a + dst_off, a, mask=live[:, None] & inside)
        b = tl.load(src_b + src_off, mask=fresh[:, None] & inside, other=0)
        b = tl.where(held[:, None], tl.load(prev_b + prev_off, mask=held[:, None] & inside, other=0), b)
        tl.store(out_b + dst_off, b, mask=live[:, None] & inside)
