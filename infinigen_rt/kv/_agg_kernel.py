"""The selection's group softmax (see kernels.group_agg, which imports this module only when a GPU selects).

A layer's scores s [R, G, t] (R = sequences x KV heads, G query heads a KV head) become each token's share of its
group's attention, summed over the group: softmax over t for each query head, then the sum over G, with the slots
that hold no token masked first and the sinks' and recent tokens' values forced after (speculation's choice), or
the slots speculation already fetched cut after (the correction's). Torch spends four to seven kernels on it; here
it is two passes over the scores, each spread over splits of t so that a batch of one still fills the device:
`group_stats_kernel` writes each (row, split)'s maximum and sum of exponentials per query head, `group_agg_kernel`
combines a row's splits and writes the split's shares. `cut_kernel` then cuts a list of slots per row (the
correction's: after the shares, as the softmax counts them). The counts that change from step to step are not
specialised (see _gather_kernel.py)."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # the splits' loop runs to the row's own count, in Triton's interpreter too


@triton.jit
def _tile(s, held, held_b, held_h, r, sp, t, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
          SPLIT: tl.constexpr, HAS_HELD: tl.constexpr):  # fmt: skip
    # split sp of row r's scores [GP, SPLIT] (-inf past t, past G, and where the slot holds no token) and which of
    # its slots are held (held's row of sequence r // HKV and KV head r % HKV at its strides: 0 where expanded)
    g = tl.arange(0, GP)
    tok = sp * SPLIT + tl.arange(0, SPLIT)
    live = tok < t
    x = tl.load(s + (r * G + g[:, None]).to(tl.int64) * t + tok[None, :], mask=(g[:, None] < G) & live[None, :],
                other=float("-inf"))  # fmt: skip
    kept = live
    if HAS_HELD:
        at = (r // HKV).to(tl.int64) * held_b + (r % HKV).to(tl.int64) * held_h
        kept = live & (tl.load(held + at + tok, mask=live, other=0) != 0)
        x = tl.where(kept[None, :], x, float("-inf"))
    return x, kept, tok, live


@triton.jit(do_not_specialize=["t", "n_split", "held_b", "held_h"])
def group_stats_kernel(
    s, held, stats, t, n_split, held_b, held_h,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, SPLIT: tl.constexpr, HAS_HELD: tl.constexpr,
):  # fmt: skip
    # program (r, sp): stats[r, sp] = (each query head's maximum over the split, its sum of exp(x - maximum))
    r = tl.program_id(0)
    sp = tl.program_id(1)
    x, _, _, _ = _tile(s, held, held_b, held_h, r, sp, t, HKV, G, GP, SPLIT, HAS_HELD)
    m = tl.max(x, 1)
    e = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)[:, None]), 1)
    g = tl.arange(0, GP)
    at = stats + (r * n_split + sp).to(tl.int64) * 2 * GP
    tl.store(at + g, m)
    tl.store(at + GP + g, e)


@triton.jit(do_not_specialize=["t", "n_split", "held_b", "held_h", "forced_b", "forced_h", "value_b", "value_h"])
def group_agg_kernel(
    s, held, forced, value, stats, out, t, n_split, held_b, held_h, forced_b, forced_h, value_b, value_h,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, SPLIT: tl.constexpr, NS: tl.constexpr,
    HAS_HELD: tl.constexpr, HAS_FORCED: tl.constexpr, FREE_INF: tl.constexpr,
):  # fmt: skip
    # program (r, sp): out[r, split sp] = sum over the group of softmax(s[r, g]) (each head's maximum and sum from
    # every split's stats, NS splits at a time); a slot holding no token 0 (as the masked softmax gives it), or -inf
    # with FREE_INF; where `forced`, `value` instead
    r = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, GP)
    big = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    for c0 in range(0, n_split, NS):
        c = c0 + tl.arange(0, NS)
        at = (r * n_split + c).to(tl.int64)[:, None] * 2 * GP + g[None, :]
        m = tl.load(stats + at, mask=(c < n_split)[:, None], other=float("-inf"))  # [NS, GP]
        e = tl.load(stats + at + GP, mask=(c < n_split)[:, None], other=0.0)
        top = tl.maximum(big, tl.max(m, 0))
        base = tl.where(top == float("-inf"), 0.0, top)
        total = total * tl.exp(big - base) + tl.sum(e * tl.exp(m - base[None, :]), 0)
        big = top
    x, kept, tok, live = _tile(s, held, held_b, held_h, r, sp, t, HKV, G, GP, SPLIT, HAS_HELD)
    p = tl.exp(x - tl.where(big == float("-inf"), 0.0, big)[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
    agg = tl.sum(p, 0)
    if FREE_INF:
        agg = tl.where(kept, agg, float("-inf"))
    if HAS_FORCED:
        b, h = (r // HKV).to(tl.int64), (r % HKV).to(tl.int64)
        f = tl.load(forced + b * forced_b + h * forced_h + tok, mask=live, other=0) != 0
        agg = tl.where(f, tl.load(value + b * value_b + h * value_h + tok, mask=live, other=0.0), agg)
    tl.store(out + r.to(tl.int64) * t + tok, agg, mask=live)


@triton.jit(do_not_specialize=["t", "n", "slot_b", "slot_h", "ok_b", "ok_h"])
def cut_kernel(out, slots, ok, t, n, slot_b, slot_h, ok_b, ok_h, HKV: tl.constexpr, BLOCK: tl.constexpr,
               HAS_OK: tl.constexpr):  # fmt: skip
    # program (r, c): out[r, slots[r, i]] = -inf for the BLOCK entries i of chunk c that count (ok); row r is
    # (sequence r // HKV, KV head r % HKV), slots and ok addressed by their strides (0: one row for every head)
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    b, h = (r // HKV).to(tl.int64), (r % HKV).to(tl.int64)
    slot = tl.load(slots + b * slot_b + h * slot_h + i, mask=live, other=0).to(tl.int64)
    use = live
    if HAS_OK:
        use = live & (tl.load(ok + b * ok_b + h * ok_h + i, mask=live, other=0) != 0)
    tl.store(out + r.to(tl.int64) * t + slot, tl.full([BLOCK], float("-inf"), tl.float32), mask=use)
