"""Low-bit codes for KV rows: asymmetric, in groups along head_dim, `bits` 4 or 2 packed into bytes, with an fp16
scale and minimum per group. The `int4` policy stores its host rows this way; `infinigen` can keep its
speculation keys this way on the compute device (every column at a few bits instead of a few columns in full)."""

from __future__ import annotations

import torch

from infinigen_rt.kv import cpu
from infinigen_rt.kv.kernels import check, gpu_op, launch, strided_rows


def quantize(x: torch.Tensor, group: int, bits: int = 4):
    """x: [..., D] -> (packed uint8 [..., D * bits / 8], scale and min fp16 [..., D / group])."""
    per = 8 // bits  # codes per byte
    g = x.float().unflatten(-1, (-1, group))  # [..., n_groups, group]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    top = 2**bits - 1
    scale = ((hi - lo) / top).clamp(min=1e-8)
    q = torch.round((g - lo) / scale).clamp(0, top).to(torch.uint8).flatten(-2)
    packed = q[..., 0::per]
    for i in range(1, per):
        packed = packed | (q[..., i::per] << (bits * i))
    return packed, scale.squeeze(-1).half(), lo.squeeze(-1).half()


def dequantize(packed, scale, lo, group: int, dtype, bits: int = 4) -> torch.Tensor:
    """The inverse of `quantize` (up to its rounding): [..., D] in `dtype`. The float32 values are scaled in place:
    one float32 copy of the rows at a time (int4's whole layer for a batch: 0.5 GiB at 4 x 32k, Llama-3.1-8B)."""
    per, mask = 8 // bits, 2**bits - 1
    q = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)  # [..., D]
    g = q.unflatten(-1, (-1, group)).float()
    del q
    g.mul_(scale.float()[..., None]).add_(lo.float()[..., None])
    return g.flatten(-2).to(dtype)


def quantize_channels(x: torch.Tensor, held: torch.Tensor, bits: int = 4):
    """Runs of keys x [N, T, D], each channel quantized over the run's held rows (held [N, T] bool; rows not held
    neither widen the range nor keep their values): (packed uint8 [N, T, D * bits / 8], scale and minimum fp16
    [N, 2, D]). The codes are computed against the fp16 scale and minimum stored, so that dequantizing and
    quantizing a run again with the same range gives the same codes."""
    top, per = 2**bits - 1, 8 // bits
    x = x.float()
    lo = x.masked_fill(~held[..., None], float("inf")).amin(1)  # [N, D]
    hi = x.masked_fill(~held[..., None], float("-inf")).amax(1)
    empty = ~held.any(1, keepdim=True)  # a run with nothing held: any finite meta
    lo, hi = lo.masked_fill(empty, 0.0).half(), hi.masked_fill(empty, 0.0)
    scale = ((hi - lo.float()) / top).clamp(min=FP16_TINY).half()
    q = torch.round((x - lo.float()[:, None]) / scale.float()[:, None]).clamp(0, top).to(torch.uint8)
    packed = q[..., 0::per]
    for i in range(1, per):
        packed = packed | (q[..., i::per] << (bits * i))
    return packed, torch.stack([scale, lo], 1)


FP16_TINY = 6.2e-5  # the smallest scale kept (fp16's smallest normal number is 6.1e-5)


def code_bytes(head_dim: int, group: int, bits: int) -> int:
    """Bytes of one row of `head_dim` values: the packed codes and an fp16 scale and minimum per group."""
    return head_dim * bits // 8 + 4 * (head_dim // group)


CHUNK_BYTES = 32 << 20  # what the torch path of `scores` dequantizes at once, in float32
SPLIT = 1024  # the slots a scoring program reads on a GPU (TOKENS of them at a time)
TOKENS = 64  # keys a scoring program holds at once (a [TOKENS, D] tile, one product on the matrix units)
QUANT_ROWS = 16  # new key rows a quantizing program packs


def fused(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernels take this call: a GPU with Triton, a power-of-two head_dim (the packed row's width) of at
    least 16 (the matrix units' smallest product)."""
    from infinigen_rt.kv.kernels import available

    return x.device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and available()


def scores(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, group: int, bits: int) -> torch.Tensor:
    """q [B, Hkv, G, D] (scaled) against keys held as codes [R, Hkv, S, D * bits / 8] and their meta [R, Hkv, S, 2,
    groups] (scale, minimum): [B, Hkv, G, T] in float32. R = B, each sequence its own rows, and `at` an int T: their
    first T slots. R = 1, rows shared through tables: `at` a slice (one sequence whose slots are one run) or [B, T]
    slots per sequence. Either R, `at` [B, Hkv, T]: slots per (sequence, KV head) (the correction's shortlist).

    On a GPU one kernel reads the codes and scales once and never writes a key (_quant_kernel.py); on a CPU the
    native kernel does the same (kv/cpu.py, built on first use). Else (no compiler) the codes are scored a span of
    slots at a time (what a step holds besides them stays near CHUNK_BYTES: all at once would be 1 GiB per layer at
    Llama-2-7B, 4 x 32k) without forming the keys: per group, scale * (q . codes) + minimum * sum(q)
    (`score_span`)."""
    b, hkv, g, d = q.shape
    t = at if isinstance(at, int) else at.stop - at.start if isinstance(at, slice) else at.shape[-1]
    if fused(q, d):
        return _scores_kernel(q, codes, meta, at, t, group, bits)
    # the kernel where it is the faster (benchmarks/cpu_score.py compares: at 4 bits it is; at 2 bits its plain loop
    # loses to the torch path)
    kernel_wins = q.device.type == "cpu" and bits == 4
    if kernel_wins and (out := cpu.score_codes(q, codes, meta, at, t, group, bits)) is not None:
        return out
    if isinstance(at, slice):
        codes, meta = codes[:, :, at], meta[:, :, at]
    elif isinstance(at, torch.Tensor) and at.dim() == 3:  # each pair its slots: [B, Hkv, T, bytes]
        heads = torch.arange(hkv, device=at.device)[None, :, None]
        rows = torch.arange(b, device=at.device)[:, None, None] if codes.shape[0] > 1 else 0
        codes, meta = codes[rows, heads, at], meta[rows, heads, at]
    elif isinstance(at, torch.Tensor):  # [B, Hkv, T, bytes], gathered once for every span (index_select on flat
        flat = at.reshape(-1)  # slots: several times faster than indexing by [B, T] on a CPU)
        codes, meta = (x[0].index_select(1, flat).unflatten(1, (b, t)).transpose(0, 1) for x in (codes, meta))
    out = torch.empty(b, hkv, g, t, dtype=torch.float32, device=q.device)
    span = max(64, CHUNK_BYTES // (b * hkv * d * 4))
    for i in range(0, t, span):
        e = min(t, i + span)
        out[..., i:e] = score_span(q, codes[:, :, i:e], meta[:, :, i:e], group, bits)
    return out


def score_span(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """q [B, Hkv, G, D] against the keys of codes [B, Hkv, n, bytes] and meta [B, Hkv, n, 2, groups]: [B, Hkv, G, n]
    in float32 (computed so whatever q's dtype), as q @ dequantize(...).T, without forming the keys: a group's dot
    product is scale * (q . codes) + minimum * sum(q). The codes are regrouped group-major as bytes, and each nibble
    position's codes unpacked by a shift and a mask over 32-bit words (four bytes at once), so that every product
    reads contiguous rows: dequantizing first spends most of its time interleaving the unpacked codes back into
    columns (benchmarks/cpu_score.py compares the two; inductor's kernel for the same sums and torch's int4 matmul for
    a CPU, _weight_int4pack_mm_for_cpu, are no faster for a query of a few rows)."""
    d = q.shape[-1]
    per, groups = 8 // bits, d // group
    width = group // per  # a group's bytes
    rows = codes.unflatten(-1, (groups, width)).transpose(2, 3).contiguous()  # [B, Hkv, groups, n, width]
    low = (1 << bits) - 1
    if width % 4 == 0:  # four bytes a word (the pattern's top byte below 0x80: a positive int32)
        rows, low = rows.view(torch.int32), int.from_bytes(bytes([low] * 4), "little")
    qg = q.float().unflatten(-1, (groups, group)).transpose(2, 3)  # [B, Hkv, groups, G, group]
    out = None
    for k in range(per):  # column per * p + k of each group is byte p's k-th code
        c = ((rows >> (bits * k)) & low).view(torch.uint8).float()  # [B, Hkv, groups, n, width]
        part = qg[..., k::per] @ c.transpose(-1, -2)  # [B, Hkv, groups, G, n]
        out = part if out is None else out.add_(part)
    m = meta.float().permute(0, 1, 4, 3, 2)[:, :, :, None]  # [B, Hkv, groups, 1, 2, n]
    out.mul_(m[..., 0, :]).add_(qg.sum(-1)[..., None] * m[..., 1, :])
    return out.sum(2)


def score_rows(g: int, groups: int) -> int:
    """The query-head rows of the scoring kernel's product: at least g, a power of two, and with `groups` columns a
    row at least the 16 columns the matrix units take."""
    return max(1 << (g - 1).bit_length(), -(-16 // groups))


def score_meta(g: int, d: int, group: int, bits: int, run: int = 0, half: bool = False) -> dict:
    """The scoring kernel's compile-time arguments for a group of g query heads at head_dim d (those every launch
    takes beside its slots' form): `run` > 0 a scale per channel over each `run` slots, `half` a 16-bit query.
    Per-channel keys at head_dim 256 take a tile of half the tokens: their [TOKENS, 256] keys formed in float32, on
    their way to the matrix units, would pass the 227 KiB of shared memory an sm_90 block may hold."""
    return dict(G=g, G_ROWS=score_rows(g, d // group), D=d, GROUP=group, BITS=bits,
                TOKENS=TOKENS // 2 if run and d >= 256 else TOKENS, SPLIT=SPLIT, CHANNEL=run > 0, RUN=max(run, 1),
                HALF=half and run == 0, num_warps=8 if d >= 256 else 4)  # fmt: skip


def _scores_kernel(q, codes, meta, at, t: int, group: int, bits: int, run: int = 0) -> torch.Tensor:
    """The kernel's scores (see `scores`); `run` > 0: a scale per channel over each `run` slots (meta [R, Hkv,
    S / run, 2, D]; policies/speculation.py's ChannelKeys)."""
    slots = at.contiguous() if isinstance(at, torch.Tensor) else None
    return score_codes(q.contiguous(), codes, meta, slots, at.start if isinstance(at, slice) else 0, t, group,
                       bits, run)  # fmt: skip


@gpu_op("score_codes(Tensor q, Tensor codes, Tensor meta, Tensor? slots, int start, int t, int group, int bits, "
        "int run) -> Tensor")
def score_codes(q, codes, meta, slots, start: int, t: int, group: int, bits: int, run: int) -> torch.Tensor:
    """q [B, Hkv, G, D] (float32, or the model's 16-bit dtype: the codes' products in it, exact, summed in float32)
    against the codes and meta at `slots` ([B, t] or [B, Hkv, t]; None: `t` slots from `start`): [B, Hkv, G, t]
    float32 (the scoring kernel's)."""
    import triton

    from infinigen_rt.kv._quant_kernel import score_codes_kernel

    b, hkv, g, d = q.shape
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16) and codes.dtype == torch.uint8
          and codes.dim() == 4 and codes.shape[1] == hkv and (slots is None or slots.shape[-1] == t),
          "score_codes: q [B, Hkv, G, D] float32 or 16-bit, codes [R, Hkv, S, bytes] uint8, slots [.., t]")  # fmt: skip
    out = torch.empty(b, hkv, g, t, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    launch(
        score_codes_kernel, (b, hkv, triton.cdiv(t, SPLIT)),
        q, codes, meta, slots if slots is not None else out, out, t, codes.shape[2],
        start, BATCH_ROWS=codes.shape[0] > 1, HKV=hkv, HAS_SLOTS=slots is not None,
        PAIR_SLOTS=slots is not None and slots.dim() == 3,
        **score_meta(g, d, group, bits, run, half=q.dtype != torch.float32),
    )  # fmt: skip
    return out


@gpu_op("quantize_rows(Tensor x, Tensor at, Tensor(a!) codes, Tensor(b!) meta, int group, int bits) -> ()")
def quantize_rows(x, at, codes, meta, group: int, bits: int) -> None:
    """New keys x [R, Hkv, s, D] quantized and packed into codes and meta at slots `at` [R, Hkv, s] (the quantizing
    kernel's, a row a program)."""
    import triton

    from infinigen_rt.kv._quant_kernel import quantize_rows_kernel

    r, hkv, s, d = x.shape
    check(at.shape == (r, hkv, s) and codes.dtype == torch.uint8, "quantize_rows: at [R, Hkv, s], codes uint8")
    total = r * hkv * s
    if total:  # (slots the same for every head, an expanded view, read in place)
        slots, slot_b, slot_h = strided_rows(at)
        launch(quantize_rows_kernel, (triton.cdiv(total, QUANT_ROWS),), x.contiguous(), slots, codes, meta, total, s,
               codes.shape[2], slot_b, slot_h, D=d, GROUP=group, BITS=bits, ROWS=QUANT_ROWS, HKV=hkv)  # fmt: skip


@gpu_op("quantize_channel(Tensor k, Tensor slots, Tensor? appends, Tensor(a!) codes, Tensor(b!) meta, "
        "Tensor(c!) held, int mode, int run, float tiny) -> ()")
def quantize_channel(k, slots, appends, codes, meta, held, mode: int, run: int, tiny: float) -> None:
    """New keys k [R, Hkv, s, D] into the per-channel keys' codes, meta and held flags at `slots` [R, Hkv, s], a
    row a program (policies/speculation.py's ChannelKeys.write); `mode` 2: `appends` [R, Hkv, s] bool says which
    go to the end of their sequence's slots, else mode says it of every one (1) or none (0)."""
    from infinigen_rt.kv._quant_kernel import quantize_channel_kernel

    r, hkv, s, d = k.shape
    check(slots.shape == (r, hkv, s) and (mode != 2 or appends is not None), "quantize_channel: slots [R, Hkv, s]")
    flags = held.view(torch.uint8)
    launch(quantize_channel_kernel, (r * hkv * s,), k.contiguous(), slots.contiguous(),
           appends.expand(r, hkv, s).contiguous().view(torch.uint8) if mode == 2 else flags, codes, meta, flags, s,
           codes.shape[2], D=d, RUN=run, APPENDS=mode, TINY=tiny)  # fmt: skip


def store(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, group: int, bits: int) -> None:
    """New keys x [R, Hkv, s, D] quantized into codes [R, Hkv, S, bytes] and meta [R, Hkv, S, 2, groups] at slots
    start.. (`at` an int) or at [R, Hkv, s] (each sequence and KV head its own). On a GPU one kernel quantizes and
    packs every row into its slot, on a CPU the native kernel (kv/cpu.py); else `quantize` and a scatter."""
    r, hkv, s, d = x.shape
    if fused(x, d):
        if isinstance(at, int):
            at = torch.arange(at, at + s, device=x.device).expand(r, hkv, s)
        quantize_rows(x, at, codes, meta, group, bits)
        return
    if x.device.type == "cpu" and cpu.quantize_rows(x, codes, meta, at, group, bits):
        return
    c, scale, lo = quantize(x, group, bits)
    m = torch.stack([scale, lo], -2)  # [R, Hkv, s, 2, groups]
    if isinstance(at, int):
        codes[:, :, at : at + s] = c
        meta[:, :, at : at + s] = m
    else:
        codes.scatter_(2, at[..., None].expand_as(c), c)
        meta.scatter_(2, at[..., None, None].expand_as(m), m)
