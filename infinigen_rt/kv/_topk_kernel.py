"""The selection's top-k (see kernels.top_rows, which imports this module only when a GPU selects).

Each row's c largest of t float32 values, c read from device memory, by radix select: a float's bits made an
unsigned key in the floats' order (as the CPU's kernel makes them), four passes of eight bits each narrowing the key
of the c-th largest from a 256-bin histogram of the keys that share the digits found so far, then one pass that
writes the chosen slots in slot order (of keys equal to that edge, the lowest slots: as the CPU's top-k chooses),
then the other slots in slot order. One program a row and one launch a call: torch's top-k spends a launch on each
radix pass and on each piece of the sort its `sorted` needs, and it is the sort that makes a row's first c its best;
here each row's own count makes them so, in an order that needs none. The counts that change from step to step
are not specialised (see _gather_kernel.py)."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # the passes run to the row's own length, in Triton's interpreter too


@triton.jit
def _key(v):
    # float32 -> uint32 in the floats' order: a negative's bits flipped, a positive's sign bit set
    u = v.to(tl.uint32, bitcast=True)
    sign = (v.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)  # all ones for a negative
    return u ^ (sign | (tl.full(u.shape, 1, tl.uint32) << 31))


@triton.jit
def _digit(row, t, edge, ties, SHIFT: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    # one pass: the eight bits at SHIFT of the key of the ties-th largest among the row's keys that share edge's
    # bits above SHIFT (FIRST: every key), from their histogram; (edge with those bits, ties less the keys above)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, t, BLOCK):
        i = start + tl.arange(0, BLOCK)
        key = _key(tl.load(row + i, mask=i < t, other=0.0))
        match = i < t
        if not FIRST:
            match = match & ((key >> (SHIFT + 8)) == (edge >> (SHIFT + 8)))
        hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # per bin, the matching keys in higher bins
    hit = (above < ties) & (above + hist >= ties)  # the bin holding the ties-th largest (none: a count of 0)
    b = tl.max(tl.where(hit, bins, 0), 0)
    return edge | (b.to(tl.uint32) << SHIFT), ties - tl.sum(tl.where(bins == b, above, 0), 0)


@triton.jit(do_not_specialize=["t", "k", "n", "count_b", "count_h"])
def top_rows_kernel(
    x, count, val, slot, ok, t, k, n, count_b, count_h,
    HKV: tl.constexpr, BLOCK: tl.constexpr, HAS_COUNT: tl.constexpr,
):  # fmt: skip
    # program r: row r of x [R, t] (sequence r // HKV, KV head r % HKV) -> val, slot, ok [R, k]: its c largest first
    # (c = count at the row's sequence and head, else n; within 0 .. k), then its other slots, each in slot order;
    # ok: the first c where their value is above -inf
    r = tl.program_id(0)
    row = x + r.to(tl.int64) * t
    if HAS_COUNT:
        c = tl.load(count + (r // HKV).to(tl.int64) * count_b + (r % HKV).to(tl.int64) * count_h).to(tl.int32)
    else:
        c = r * 0 + n
    c = tl.minimum(tl.maximum(c, 0), k)
    edge = (c * 0).to(tl.uint32)  # the key of the c-th largest, eight bits a pass
    ties = c  # of the keys equal to the edge, how many are taken (the rest: above it)
    edge, ties = _digit(row, t, edge, ties, 24, True, BLOCK)
    edge, ties = _digit(row, t, edge, ties, 16, False, BLOCK)
    edge, ties = _digit(row, t, edge, ties, 8, False, BLOCK)
    edge, ties = _digit(row, t, edge, ties, 0, False, BLOCK)
    out = r.to(tl.int64) * k
    taken = c * 0
    equal = c * 0
    rest = c * 0
    for start in range(0, t, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < t
        v = tl.load(row + i, mask=live, other=0.0)
        key = _key(v)
        eq = (live & (key == edge) & (c > 0)).to(tl.int32)
        rank = equal + tl.cumsum(eq, 0) - eq  # of the keys equal to the edge, those before in slot order
        take = ((live & (key > edge) & (c > 0)) | ((eq != 0) & (rank < ties))).to(tl.int32)
        at = taken + tl.cumsum(take, 0) - take
        tl.store(slot + out + at, i.to(tl.int64), mask=take != 0)
        tl.store(val + out + at, v, mask=take != 0)
        tl.store(ok + out + at, (v > float("-inf")).to(tl.int8), mask=take != 0)
        other = (live & (take == 0)).to(tl.int32)
        at = c + rest + tl.cumsum(other, 0) - other
        keep = (other != 0) & (at < k)
        tl.store(slot + out + at, i.to(tl.int64), mask=keep)
        tl.store(val + out + at, v, mask=keep)
        tl.store(ok + out + at, tl.zeros([BLOCK], tl.int8), mask=keep)
        taken += tl.sum(take, 0)
        equal += tl.sum(eq, 0)
        rest += tl.sum(other, 0)
