"""Gemma 3 (text): the Llama block with Gemma's norms, q/k norms, sliding-window and global layers.

What differs from llama.py: RMSNorm scales by (1 + weight), in fp32; a norm after attention and after the MLP
besides the two before them; embeddings scaled by sqrt(hidden); a gelu-tanh MLP; the queries scaled by
query_pre_attn_scalar^-1/2 (cfg.query_scale); and two rotary embeddings, the sliding layers' base (10k) and the
global layers' (1M, with the config's scaling). Which layers slide is the config's (cfg.window); what a sliding
layer keeps is the cache's business (kv/window.py), as is everything about KV.

Attribute names equal the checkpoint's tensor names (less the `model.` prefix).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from infinigen_rt.config import ModelConfig
from infinigen_rt.kv.cache import KVCache
from infinigen_rt.models.llama import (
    MLP,
    Attention,
    Embedding,
    Linear,
    SpeculationTaps,
    identity,
    linear,
    rope_cos_sin,
    rope_inv_freq,
)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, reduce: Callable = identity):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.norm_eps
        self.sliding = cfg.window(layer) is not None
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = Attention(cfg, layer, reduce, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = MLP(cfg, reduce)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x, rope, cache):
        """rope: {sliding: (cos, sin)} for both kinds of layer."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), *rope[self.sliding], cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable = identity):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, reduce) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True), persistent=False)

    def rope_buffers(self) -> None:
        """Recompute the non-persistent RoPE buffers (after loading off the meta device)."""
        device = self.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.cfg).to(device)
        self.inv_freq_local = rope_inv_freq(self.cfg, local=True).to(device)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def speculation_taps(self) -> SpeculationTaps:
        """Only global layers are speculated (sliding ones keep their window on the device): their RoPE."""
        return SpeculationTaps(
            q_proj=[(b.self_attn.q_proj.weight, b.self_attn.q_proj.bias) for b in self.layers],
            norms=[(b.input_layernorm.weight + 1.0, None) for b in self.layers],
            rope=lambda positions, dtype: rope_cos_sin(self.inv_freq, positions, dtype),
            normalised_input=True,
            q_norm=[b.self_attn.q_norm for b in self.layers],
            query_scale=self.cfg.query_scale,
        )

    def forward(self, input_ids, positions, cache: KVCache, last_only: bool = False):
        """input_ids, positions: [B, S]. Returns logits [B, S or 1, V]."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)
        rope = {
            False: rope_cos_sin(self.inv_freq, positions, x.dtype),
            True: rope_cos_sin(self.inv_freq_local, positions, x.dtype),
        }
        cache.begin(positions)
        for block in self.layers:
            x = block(x, rope, cache)
        cache.end()
        if last_only:
            x = x[:, -1:]
        return linear(self.norm(x), self.head_weight())
