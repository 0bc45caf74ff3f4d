"""The model's elementwise chains as one kernel each on a GPU (see fused.py, which imports this module only when a GPU
runs them). Each rounds where torch's ops round: a product or a sum in the model's dtype is computed in float32 and
rounded once, as torch's half-precision kernels do, so a fused chain gives the torch chain's values (the norm's mean
of squares aside: its sum runs in another order)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x, y, w, out, added, eps, D: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    # one program a row of D: out = w * (x * rsqrt(mean(x^2) + eps)) (normalised in float32, rounded to the dtype
    # before the weight); ADD: x + y first, written to `added` too (the residual stream, for the rest of the block)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < D
    a = tl.load(x + row * D + cols, mask=live, other=0)
    if ADD:
        a = (a.to(tl.float32) + tl.load(y + row * D + cols, mask=live, other=0).to(tl.float32)).to(a.dtype)
        tl.store(added + row * D + cols, a, mask=live)
    v = a.to(tl.float32)
    n = (v * tl.math.rsqrt(tl.sum(v * v, 0) / D + eps)).to(a.dtype)
    g = tl.load(w + cols, mask=live, other=0)
    tl.store(out + row * D + cols, (g.to(tl.float32) * n.to(tl.float32)).to(a.dtype), mask=live)


@triton.jit
def rope_kernel(x, cos, sin, out, H_IN: tl.constexpr, H_OUT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    # one program a (sequence, head) of the first H_OUT of x's H_IN heads ([B, H_IN, D]: a decode step's one token):
    # out = x * cos + roll(x, D / 2) * sin, each product rounded to the dtype, then the sum (apply_rope's three ops)
    p = tl.program_id(0)
    b, h = p // H_OUT, p % H_OUT
    cols = tl.arange(0, BLOCK)
    live = cols < D
    src = x + (b * H_IN + h).to(tl.int64) * D
    a = tl.load(src + cols, mask=live, other=0)
    r = tl.load(src + (cols + D // 2) % D, mask=live, other=0)
    c = tl.load(cos + b.to(tl.int64) * D + cols, mask=live, other=0).to(tl.float32)
    s = tl.load(sin + b.to(tl.int64) * D + cols, mask=live, other=0).to(tl.float32)
    y = (a.to(tl.float32) * c).to(a.dtype).to(tl.float32) + (r.to(tl.float32) * s).to(a.dtype).to(tl.float32)
    tl.store(out + p.to(tl.int64) * D + cols, y.to(a.dtype), mask=live)


@triton.jit
def silu_mul_kernel(x, out, N: tl.constexpr, BLOCK: tl.constexpr):
    # row r of x [R, 2N] is (gate, up): out[r] = silu(gate) * up, silu rounded to the dtype before the product
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    g = tl.load(x + r * 2 * N + cols, mask=live, other=0)
    u = tl.load(x + r * 2 * N + N + cols, mask=live, other=0)
    f = g.to(tl.float32)
    a = (f / (1.0 + tl.exp(-f))).to(g.dtype)
    tl.store(out + r * N + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=live)
