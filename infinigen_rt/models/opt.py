"""OPT (learned positions offset by 2, LayerNorm before or after, ReLU, biases, project_in/out).

Same order and names as the Llama file; attribute names equal the checkpoint's tensor names (less
the `model.decoder.` prefix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infinigen_rt.config import ModelConfig
from infinigen_rt.kv.cache import KVCache
from infinigen_rt.models.llama import ACT, Embedding, Linear, SpeculationTaps, identity, linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, reduce: Callable = identity):
        super().__init__()
        self.layer, self.reduce = layer, reduce
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        d, inner = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim  # inner < d: a rank's heads
        self.q_proj = Linear(d, inner, bias=cfg.attention_bias)
        self.k_proj = Linear(d, inner, bias=cfg.attention_bias)
        self.v_proj = Linear(d, inner, bias=cfg.attention_bias)
        self.out_proj = Linear(inner, d, bias=cfg.attention_out_bias)

    def forward(self, x, cache: KVCache):
        b, s, _ = x.shape
        cache.observe(self.layer, x)
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.k_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        y = cache.attend(self.layer, q, k, v)  # OPT scales q by head_dim**-0.5 after the bias: SDPA's default
        return self.reduce(self.out_proj(y.transpose(1, 2).reshape(b, s, -1)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, reduce: Callable = identity):
        super().__init__()
        self.pre_norm = cfg.do_layer_norm_before
        self.reduce = reduce
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, layer, reduce)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x, cache):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, cache)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.reduce(self.fc2(self.act(self.fc1(h))))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPT(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable = identity):
        super().__init__()
        self.cfg = cfg
        proj_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
        if proj_dim != cfg.hidden_size:
            self.project_in = Linear(proj_dim, cfg.hidden_size, bias=False)
            self.project_out = Linear(cfg.hidden_size, proj_dim, bias=False)
        self.layers = nn.ModuleList(Block(cfg, i, reduce) for i in range(cfg.num_hidden_layers))
        if cfg.do_layer_norm_before:
            self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(proj_dim, cfg.vocab_size, bias=False)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def speculation_taps(self) -> SpeculationTaps:
        norms = [b.self_attn_layer_norm for b in self.layers]
        return SpeculationTaps(
            q_proj=[(b.self_attn.q_proj.weight, b.self_attn.q_proj.bias) for b in self.layers],
            norms=[(n.weight, n.bias) for n in norms],
            rope=None,
            normalised_input=self.cfg.do_layer_norm_before,
        )

    def forward(self, input_ids, positions, cache: KVCache, last_only: bool = False):
        """input_ids, positions: [B, S]. Returns logits [B, S or 1, V]."""
        x = self.embed_tokens(input_ids)
        if hasattr(self, "project_in"):
            x = self.project_in(x)
        x = x + self.embed_positions(positions + self.cfg.position_offset)
        cache.begin(positions)
        for block in self.layers:
            x = block(x, cache)
        cache.end()
        if last_only:
            x = x[:, -1:]
        if hasattr(self, "final_layer_norm"):
            x = self.final_layer_norm(x)
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        return linear(x, self.head_weight())
