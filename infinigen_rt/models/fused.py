"""The layers' elementwise chains on a GPU, one typed operator (torch.ops.infinigen_gpu.<name>) and one kernel each
(_fused_kernel.py): the norm (4 ops: widen, normalise, narrow, weight), the residual add before it, RoPE over q and k
(4: two products, a roll, a sum) and SwiGLU's silu and product (2). An eager step issues fewer launches (each costs
the host more than the kernel costs the device: docs/performance.md) and a captured one fewer kernels; the values
are the torch chains' (each rounds as they do). A CPU keeps the torch ops (its own kernels: kv/cpu.py)."""

from __future__ import annotations

import torch

from infinigen_rt.kv.kernels import available, check, gpu_op, launch

KERNELS = available()  # triton (CUDA builds of torch bring it)


def on_gpu(x: torch.Tensor) -> bool:
    """Whether x's chain runs as one kernel: a CUDA tensor (the kernels index flat rows: contiguous)."""
    return KERNELS and x.device.type == "cuda" and x.is_contiguous()


def _block(n: int) -> int:
    import triton

    return triton.next_power_of_2(n)


@gpu_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x.float()).to(x.dtype) (llama.RMSNorm's chain): x [..., d] contiguous, weight [d] in x's
    dtype."""
    check(x.is_contiguous() and weight.shape == x.shape[-1:] and weight.dtype == x.dtype,
          "rms_norm: x [..., d] contiguous, weight [d] in its dtype")  # fmt: skip
    from infinigen_rt.models._fused_kernel import rms_norm_kernel

    out = torch.empty_like(x)
    if x.numel():
        d = x.shape[-1]
        launch(rms_norm_kernel, (x.numel() // d,), x, x, weight.contiguous(), out, out, eps, D=d, BLOCK=_block(d),
               ADD=False)  # fmt: skip
    return out


@gpu_op("add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)")
def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """(rms_norm(x + y, weight, eps), x + y): the residual add and the norm after it, x and y [..., d] alike."""
    check(x.is_contiguous() and y.is_contiguous() and x.shape == y.shape and x.dtype == y.dtype
          and weight.shape == x.shape[-1:] and weight.dtype == x.dtype,
          "add_rms_norm: x, y [..., d] contiguous and alike, weight [d] in their dtype")  # fmt: skip
    from infinigen_rt.models._fused_kernel import rms_norm_kernel

    out, added = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        d = x.shape[-1]
        launch(rms_norm_kernel, (x.numel() // d,), x, y, weight.contiguous(), out, added, eps, D=d, BLOCK=_block(d),
               ADD=True)  # fmt: skip
    return out, added


@gpu_op("rope(Tensor x, Tensor cos, Tensor sin, int heads) -> Tensor")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.apply_rope of x's first `heads` heads: x [B, H, 1, D] contiguous (a decode step's token), cos and sin
    [B, 1, 1, D] (rope_cos_sin's) -> [B, heads, 1, D]."""
    b, h, s, d = x.shape
    check(x.is_contiguous() and s == 1 and 0 < heads <= h and d % 2 == 0, "rope: x [B, H, 1, D] contiguous, heads <= H")
    check(cos.shape == (b, 1, 1, d) and sin.shape == cos.shape and cos.dtype == x.dtype and sin.dtype == x.dtype,
          "rope: cos, sin [B, 1, 1, D] in x's dtype")  # fmt: skip
    from infinigen_rt.models._fused_kernel import rope_kernel

    out = x.new_empty(b, heads, 1, d)
    if b:
        launch(rope_kernel, (b * heads,), x, cos.contiguous(), sin.contiguous(), out, H_IN=h, H_OUT=heads, D=d,
               BLOCK=_block(d))  # fmt: skip
    return out


@gpu_op("silu_mul(Tensor x) -> Tensor")
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = (gate, up) [..., 2I] contiguous (the fused gate/up projection's output) -> [..., I]."""
    check(x.is_contiguous() and x.shape[-1] % 2 == 0, "silu_mul: x [..., 2I] contiguous")
    from infinigen_rt.models._fused_kernel import silu_mul_kernel

    i = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], i)
    if x.numel():
        block = min(1024, _block(i))
        launch(silu_mul_kernel, (x.numel() // (2 * i), -(-i // block)), x, out, N=i, BLOCK=block)
    return out
