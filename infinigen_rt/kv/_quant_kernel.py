"""The low-bit key kernels (see quant.py, which imports this module only when a GPU scores or quantizes).

`score_codes_kernel`: one program per (sequence, KV head, split of its slots) scores every query head of the group
against the split's keys straight from their packed codes and fp16 scales, a tile of tokens at a time, the dot
products on the matrix units: the codes and scales are read once and no key is ever written out (the torch path writes
each span's float32 keys and reads them back, several times over; benchmarks/score_sweep.py measures it, and
artifacts/results/gpu-h200-2026-11-26 holds an H200's figures). `quantize_rows_kernel`: each new key row's groups
quantized and packed into its slot, one launch for a layer's new rows. `quantize_channel_kernel`: each new key into
its run of per-channel codes (ChannelKeys), the run quantized again, one launch for a layer's new rows. The counts
that change every step are not specialised (see _gather_kernel.py)."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # a split's loop runs to its own tokens, in Triton's interpreter too


@triton.jit(do_not_specialize=["n_tok", "n_slots", "start"])
def score_codes_kernel(
    q, codes, meta, slots, out, n_tok, n_slots, start, BATCH_ROWS: tl.constexpr,
    HKV: tl.constexpr, G: tl.constexpr, G_ROWS: tl.constexpr, D: tl.constexpr,
    GROUP: tl.constexpr, BITS: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr,
    PAIR_SLOTS: tl.constexpr = False, CHANNEL: tl.constexpr = False, RUN: tl.constexpr = 16, HALF: tl.constexpr = False,
):  # fmt: skip
    # q [B, HKV, G, D] (float32, float16 or bfloat16); codes [*, HKV, n_slots, D * BITS / 8] uint8; meta [*, HKV,
    # n_slots, 2, D / GROUP] fp16 (scale, minimum); slots [B, n_tok] (HAS_SLOTS; [B, HKV, n_tok] where PAIR_SLOTS:
    # each pair its own; else the slots start..start + n_tok); out [B, HKV, G, n_tok] float32. BATCH_ROWS: codes has
    # a leading row per sequence (a cache of its own), else one shared (the store).
    # On the matrix units: a tile of TOKENS rows of codes is read whole (each row's bytes adjacent), unpacked to
    # [TOKENS, D] in registers and multiplied by a [D, G_ROWS * GROUPS] matrix holding query head n // GROUPS's
    # columns of group n % GROUPS (zeros elsewhere): the dot products of each (head, group), which the group's scale
    # and minimum turn into the score. Three tf32 products give float32 accuracy (the codes are small integers, exact
    # in tf32). G_ROWS >= G, a power of two, G_ROWS * GROUPS >= 16 (the smallest product the units take).
    # CHANNEL (GROUP = D): a scale and minimum per channel over each RUN slots (policies/speculation.py's
    # ChannelKeys), meta [*, HKV, n_slots / RUN, 2, D]: the tile's keys are formed in registers, one product.
    # HALF (a 16-bit query, groups): one product in the query's dtype with float32 sums, exact as the three: a code
    # (0..15) is exact in float16 and bfloat16 and its product with a 16-bit query exact in float32; its tile is a
    # quarter of the three's bytes, which pass through shared memory to the matrix units.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = D // PER
    GROUPS: tl.constexpr = D // GROUP
    N: tl.constexpr = G_ROWS * GROUPS
    c = tl.arange(0, D)
    n = tl.arange(0, N)
    head, part = n // GROUPS, n % GROUPS
    mine = (head[None, :] < G) & (c[:, None] // GROUP == part[None, :])
    qm = tl.load(q + ((b * HKV + h) * G + head[None, :]).to(tl.int64) * D + c[:, None], mask=mine, other=0)
    qh = qm  # (HALF: as it is)
    qm = qm.to(tl.float32)  # (a query in the model's dtype: exact in float32)
    qsum = tl.sum(qm, 0)  # [N]: each (head, group)'s sum of its query columns, times the group's minimum
    base = h.to(tl.int64) * n_slots
    if BATCH_ROWS:
        base += b.to(tl.int64) * HKV * n_slots
    p = tl.arange(0, BYTES)
    g = tl.arange(0, G_ROWS)
    for t0 in range(0, tl.minimum(n_tok - s * SPLIT, SPLIT), TOKENS):  # the split's own tokens
        t = s * SPLIT + t0 + tl.arange(0, TOKENS)
        live = t < n_tok
        if HAS_SLOTS:
            owner = (b * HKV + h) if PAIR_SLOTS else b
            slot = tl.load(slots + owner.to(tl.int64) * n_tok + t, mask=live, other=0).to(tl.int64)
        else:
            slot = start + t.to(tl.int64)
        row = base + slot
        byte = tl.load(codes + row[:, None] * BYTES + p[None, :], mask=live[:, None], other=0)  # [TOKENS, BYTES]
        if BITS == 4:  # column PER * p + k is byte p's k-th code
            a = tl.interleave(byte & 15, byte >> 4)
        else:
            a = tl.interleave(tl.interleave(byte & 3, (byte >> 4) & 3), tl.interleave((byte >> 2) & 3, byte >> 6))
        if CHANNEL:  # each channel's scale and minimum of the row's run, then the keys' product
            at = (row // RUN)[:, None] * (2 * D) + c[None, :]
            scale = tl.load(meta + at, mask=live[:, None], other=0).to(tl.float32)
            lo = tl.load(meta + at + D, mask=live[:, None], other=0).to(tl.float32)
            sc = tl.dot(a.to(tl.float32) * scale + lo, qm, input_precision="tf32x3")  # [TOKENS, G_ROWS]
        else:
            if HALF:
                dots = tl.dot(a.to(q.dtype.element_ty), qh, out_dtype=tl.float32)  # [TOKENS, N]
            else:
                dots = tl.dot(a.to(tl.float32), qm, input_precision="tf32x3")
            at = row[:, None] * (2 * GROUPS) + part[None, :]
            scale = tl.load(meta + at, mask=live[:, None], other=0).to(tl.float32)
            lo = tl.load(meta + at + GROUPS, mask=live[:, None], other=0).to(tl.float32)
            sc = tl.sum(tl.reshape(scale * dots + lo * qsum[None, :], [TOKENS, G_ROWS, GROUPS]), 2)  # [TOKENS, G_ROWS]
        dst = ((b * HKV + h) * G + g[None, :]).to(tl.int64) * n_tok + t[:, None]
        tl.store(out + dst, sc, mask=live[:, None] & (g[None, :] < G))


@triton.jit(do_not_specialize=["total", "n_new", "n_slots", "slot_b", "slot_h"])
def quantize_rows_kernel(
    x, slots, codes, meta, total, n_new, n_slots, slot_b, slot_h,
    D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, HKV: tl.constexpr,
):  # fmt: skip
    # x [R, n_new, D] (R = sequences x HKV, any float dtype): row i of sequence-and-head r = i // n_new goes to slot
    # slots[i] of r's rows in codes [R, n_slots, D * BITS / 8] and meta [R, n_slots, 2, D / GROUP]; `total` = R x n_new;
    # r's slots at (r // HKV) * slot_b + (r % HKV) * slot_h (a stride 0 where every head takes the same)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = D // PER
    GROUPS: tl.constexpr = D // GROUP
    TOP: tl.constexpr = (1 << BITS) - 1
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < total
    r_of = (i // n_new).to(tl.int64)
    at = (r_of // HKV) * slot_b + (r_of % HKV) * slot_h + i % n_new
    row = r_of * n_slots + tl.load(slots + at, mask=live, other=0).to(tl.int64)
    p = tl.arange(0, BYTES)
    # the codes of a byte: columns PER * p + k, k = 0..PER-1, each a [ROWS, BYTES] load; a group's bytes are adjacent
    lo = tl.full([ROWS, GROUPS], float("inf"), tl.float32)
    hi = tl.full([ROWS, GROUPS], float("-inf"), tl.float32)
    for k in tl.static_range(PER):
        v = tl.load(x + i.to(tl.int64)[:, None] * D + (PER * p + k)[None, :], mask=live[:, None], other=0)
        v = tl.reshape(v.to(tl.float32), [ROWS, GROUPS, BYTES // GROUPS])
        lo = tl.minimum(lo, tl.min(v, 2))
        hi = tl.maximum(hi, tl.max(v, 2))
    scale = tl.maximum((hi - lo) / TOP, 1e-8)  # [ROWS, GROUPS]
    packed = tl.zeros([ROWS, BYTES], tl.int32)
    for k in tl.static_range(PER):
        v = tl.load(x + i.to(tl.int64)[:, None] * D + (PER * p + k)[None, :], mask=live[:, None], other=0)
        v = tl.reshape(v.to(tl.float32), [ROWS, GROUPS, BYTES // GROUPS])
        y = (v - lo[:, :, None]) / scale[:, :, None]
        r = tl.floor(y + 0.5)  # to the nearest, ties to even (as torch.round)
        r = tl.where((r - y == 0.5) & (r - 2 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
        r = tl.minimum(tl.maximum(r, 0.0), TOP).to(tl.int32)
        packed = packed | (tl.reshape(r, [ROWS, BYTES]) << (BITS * k))
    tl.store(codes + row[:, None] * BYTES + p[None, :], packed.to(tl.uint8), mask=live[:, None])
    gs = tl.arange(0, GROUPS)
    at = row[:, None] * (2 * GROUPS) + gs[None, :]
    tl.store(meta + at, scale.to(tl.float16), mask=live[:, None])
    tl.store(meta + at + GROUPS, lo.to(tl.float16), mask=live[:, None])


@triton.jit(do_not_specialize=["n_new", "n_slots"])
def quantize_channel_kernel(
    x, slots, appends, codes, meta, held, n_new, n_slots,
    D: tl.constexpr, RUN: tl.constexpr, APPENDS: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    # One program per new key row i of x [R, n_new, D] (R = sequences x HKV, any float dtype), into slot slots[i] of
    # row r = i // n_new of ChannelKeys' codes [R, n_slots, D / 2] (4 bits), meta [R, n_slots / RUN, 2, D] (fp16
    # scale, minimum per channel of a run of RUN slots) and held [R, n_slots] (bool as uint8): the run's held keys
    # dequantized, the new one put in, each channel quantized again over the run's held slots (the rows a launch
    # writes each in a run of its own). APPENDS: 0 none, 1 every row, 2 appends[i]: the run's slots after an
    # appended row are not its sequence's (no longer held). The codes are computed against the fp16 scale and
    # minimum stored, ties to even, as quant.quantize_channels does: the torch path's codes bit for bit (under the
    # interpreter; compiled, the dequantizing multiply-add may be fused, a last-bit difference before rounding).
    BYTES: tl.constexpr = D // 2
    i = tl.program_id(0)
    r = (i // n_new).to(tl.int64)
    slot = tl.load(slots + i).to(tl.int64)
    off = slot % RUN
    first = r * n_slots + slot - off  # the run's first slot
    k = tl.arange(0, RUN)
    h = tl.load(held + first + k) != 0
    h = h | (k == off)
    if APPENDS == 1:
        h = h & (k <= off)
    if APPENDS == 2:
        h = h & ((k <= off) | (tl.load(appends + i) == 0))
    tl.store(held + first + k, h.to(tl.uint8))
    p = tl.arange(0, BYTES)
    byte = tl.load(codes + (first + k)[:, None] * BYTES + p[None, :]).to(tl.int32)  # [RUN, BYTES]
    at = (first // RUN) * (2 * D)
    packed = tl.zeros([RUN, BYTES], tl.int32)
    for half in tl.static_range(2):  # the even columns (each byte's low code), then the odd ones
        col = 2 * p + half
        scale = tl.load(meta + at + col).to(tl.float32)
        lo = tl.load(meta + at + D + col).to(tl.float32)
        v = ((byte >> (4 * half)) & 15).to(tl.float32) * scale[None, :] + lo[None, :]
        new = tl.load(x + i.to(tl.int64) * D + col).to(tl.float32)
        v = tl.where((k == off)[:, None], new[None, :], v)
        mn = tl.min(tl.where(h[:, None], v, float("inf")), 0)
        mx = tl.max(tl.where(h[:, None], v, float("-inf")), 0)
        mn16 = mn.to(tl.float16)
        sc16 = tl.maximum((mx - mn16.to(tl.float32)) / 15, TINY).to(tl.float16)
        y = (v - mn16.to(tl.float32)[None, :]) / sc16.to(tl.float32)[None, :]
        q = tl.floor(y + 0.5)  # to the nearest, ties to even (as torch.round)
        q = tl.where((q - y == 0.5) & (q - 2 * tl.floor(q * 0.5) == 1.0), q - 1.0, q)
        q = tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)
        packed = packed | (q << (4 * half))
        tl.store(meta + at + col, sc16)
        tl.store(meta + at + D + col, mn16)
    tl.store(codes + (first + k)[:, None] * BYTES + p[None, :], packed.to(tl.uint8))
