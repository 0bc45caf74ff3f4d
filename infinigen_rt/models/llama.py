"""The Llama family (Llama-2, Llama-3.x with GQA and llama3 rope scaling, SmolLM2, Mistral, Qwen2, Qwen3).

Attribute names equal the checkpoint's tensor names (less the `model.` prefix), so a bundle loads
with `load_state_dict` and no renaming table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infinigen_rt.config import ModelConfig
from infinigen_rt.kv import cpu
from infinigen_rt.kv.cache import KVCache
from infinigen_rt.models import fused

ACT = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class SpeculationTaps:
    """What InfiniGen's speculation reads from a model, per layer: the query projection and the attention input's
    norm as (weight, bias or None), and the rotary embedding of the speculated (global) layers as positions [B, S] ->
    (cos, sin) (None without RoPE). `normalised_input`: the attention input is a norm's output (pre-LN); post-LN
    OPT feeds the raw residual. `q_norm`: per layer, the norm over each head's query before RoPE (Qwen3, Gemma 3),
    or None; `query_scale`: what the model multiplies its queries by (ModelConfig.query_scale)."""

    q_proj: list[tuple[torch.Tensor, torch.Tensor | None]]
    norms: list[tuple[torch.Tensor, torch.Tensor | None]]
    rope: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None
    normalised_input: bool
    q_norm: list[Callable | None] | None = None
    query_scale: float = 1.0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, a decode step's few rows on a CPU through the kernel (kv/cpu.py's linear: the weights read at the
    memory's speed, and a request's outputs the same in any batch)."""
    if x.device.type == "cpu" and (out := cpu.linear(x, weight, bias)) is not None:  # (a GPU: never the kernel's)
        return out
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), bias)  # (a weight kept narrow)


class Linear(nn.Linear):
    """nn.Linear (the same parameters) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding (the same parameter) whose rows come out in `out_dtype` where load_model kept the weight
    narrower than the model computes (a head's, tied: read at half the bytes through `linear`)."""

    out_dtype: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        return x if self.out_dtype is None else x.to(self.out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if fused.on_gpu(x) and self.weight.dtype == x.dtype:  # one kernel (fused.py)
            return fused.rms_norm(x, self.weight, self.eps)
        # normalise in fp32 like the reference, then cast back before the weight: torch's one op for x * rsqrt(mean
        # x^2 + eps), the same bits as the four it replaces: each op a step's thread runs gives the GIL up for a while
        # to the worker's Python, so fewer ops make the norm's share of the step smaller
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def added(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + y), x + y): the residual add and this norm, one kernel on a GPU."""
        if fused.on_gpu(x) and fused.on_gpu(y) and self.weight.dtype == x.dtype == y.dtype:
            return fused.add_rms_norm(x, y, self.weight, self.eps)
        x = x + y
        return self(x), x


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [D/2] with the config's scaling (default, linear, llama3). `local`: the sliding layers'
    own base (rope_local_theta, unscaled)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype):
    """positions: [B, S] -> cos, sin: [B, 1, S, D], sin's first half negated (see apply_rope), once per pass."""
    freqs = positions[..., None].float() * inv_freq  # [B, S, D/2]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def apply_rope(x, cos, sin):
    """x rotated by rope_cos_sin's angles: x * cos + (-x2, x1) * sin, with the negation in sin (bit for bit the same
    products, one op fewer a call); (x2, x1) as x rolled by half its width (one op where two slices and a cat were
    three: a decode step's thread gives the GIL up at each)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rope_heads(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope of x's first `heads` heads (x [B, H, S, D]): on a GPU, a decode step's one kernel (fused.py)."""
    if fused.on_gpu(x) and x.shape[-2] == 1 and cos.dtype == x.dtype:
        return fused.rope(x, cos, sin, heads)
    return apply_rope(x[:, :heads], cos, sin)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, reduce: Callable = identity, norm: type = RMSNorm):
        """`reduce`: the all-reduce after the output projection under tensor parallelism (tp.py); `norm`: the
        class of the query and key norms (cfg.qk_norm)."""
        super().__init__()
        self.layer, self.reduce, self.query_scale = layer, reduce, cfg.query_scale
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(self.head_dim, cfg.norm_eps), norm(self.head_dim, cfg.norm_eps)

    def fuse(self) -> None:
        """q, k and v's weights (and biases) as row ranges of one matrix (the same tensors, no second copy): a decode
        step's three projections are then one call, and RoPE one op over q and k (on a CPU the same sums and
        products: each output of the linear kernel sums its own row of the weights alone)."""
        got = as_one_matrix((self.q_proj, self.k_proj, self.v_proj))
        if got is not None:
            self.qkv = got

    def forward(self, x, cos, sin, cache: KVCache):
        b, s, _ = x.shape
        cache.observe(self.layer, x)
        h, hkv, d = self.n_heads, self.n_kv, self.head_dim
        if hasattr(self, "qkv") and decoding(x):  # one call (fuse)
            heads = linear(x, *self.qkv).view(b, s, h + 2 * hkv, d).transpose(1, 2)  # (B, H + 2 Hkv, S, D)
            if not hasattr(self, "q_norm"):
                qk = rope_heads(heads, h + hkv, cos, sin)
                q, k, v = qk[:, :h], qk[:, h:], heads[:, h + hkv :]
            else:
                q, k, v = heads.split([h, hkv, hkv], 1)
                q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        else:
            q = self.q_proj(x).view(b, s, h, d).transpose(1, 2)  # (B, H, S, D)
            k = self.k_proj(x).view(b, s, hkv, d).transpose(1, 2)  # (B, Hkv, S, D)
            v = self.v_proj(x).view(b, s, hkv, d).transpose(1, 2)
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_scale != 1.0:  # the caches attend with 1/sqrt(head_dim): the model's own scale folds in here
            q = q * self.query_scale
        y = cache.attend(self.layer, q, k, v)
        return self.reduce(self.o_proj(y.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable = identity):
        super().__init__()
        self.reduce = reduce
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT[cfg.hidden_act]

    def fuse(self) -> None:
        """The gate's and the up projection's weights (and biases) as row ranges of one matrix: a decode step's two
        are one call (as Attention.fuse)."""
        got = as_one_matrix((self.gate_proj, self.up_proj))
        if got is not None:
            self.gate_up = got

    def forward(self, x):
        if hasattr(self, "gate_up") and decoding(x):  # one call (fuse)
            gate_up = linear(x, *self.gate_up)
            if self.act is F.silu and fused.on_gpu(gate_up):  # SwiGLU's two ops one kernel (fused.py)
                return self.reduce(self.down_proj(fused.silu_mul(gate_up)))
            gate, up = gate_up.chunk(2, -1)
            return self.reduce(self.down_proj(self.act(gate) * up))
        return self.reduce(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


def decoding(x: torch.Tensor) -> bool:
    """Whether x [B, S, d] is a decode step's rows, which the fused projections take: on a CPU at most the linear
    kernel's rows (cpu.LINEAR_ROWS; more go to torch's matmul, three calls as before), on a GPU one token a row."""
    return x.numel() <= cpu.LINEAR_ROWS * x.shape[-1] if x.device.type == "cpu" else x.shape[-2] == 1


def as_one_matrix(projs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Projections that read the same input (Attention.fuse's q, k, v; MLP.fuse's gate and up) as row ranges of one
    matrix: each one's weight (and bias) becomes a view of it, no second copy, and (the matrix, the biases or None)
    comes back; None where they are not all on one device in one dtype, or not all with a bias or all without."""
    ws = [p.weight for p in projs]
    if any(w.device != ws[0].device or w.dtype != ws[0].dtype for w in ws) or len({p.bias is None for p in projs}) > 1:
        return None
    w = torch.cat(ws)
    bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
    at = 0
    for p in projs:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(w[at : at + n], requires_grad=p.weight.requires_grad)
        if bias is not None:
            p.bias = nn.Parameter(bias[at : at + n], requires_grad=p.bias.requires_grad)
        at += n
    return w, bias


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, reduce: Callable = identity):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg, reduce)

    def forward(self, x, cos, sin, cache):
        h, x = self.post_attention_layernorm.added(x, self.self_attn(self.input_layernorm(x), cos, sin, cache))
        return x + self.mlp(h)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable = identity):
        """`cfg`: under tensor parallelism, one rank's share of the heads and MLP (tp.shard_config)."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, reduce) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def speculation_taps(self) -> SpeculationTaps:
        return SpeculationTaps(
            q_proj=[(b.self_attn.q_proj.weight, b.self_attn.q_proj.bias) for b in self.layers],
            norms=[(b.input_layernorm.weight, None) for b in self.layers],
            rope=lambda positions, dtype: rope_cos_sin(self.inv_freq, positions, dtype),
            normalised_input=True,
            q_norm=[getattr(b.self_attn, "q_norm", None) for b in self.layers],
            query_scale=self.cfg.query_scale,
        )

    def forward(self, input_ids, positions, cache: KVCache, last_only: bool = False):
        """input_ids, positions: [B, S]. Returns logits [B, S or 1, V]."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        cache.begin(positions)
        for block in self.layers:
            x = block(x, cos, sin, cache)
        cache.end()
        if last_only:
            x = x[:, -1:]
        return linear(self.norm(x), self.head_weight())
