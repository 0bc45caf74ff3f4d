"""Choosing the next token: greedy, temperature, top-k, top-p, with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen_rt.errors import InfinigenError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN compares false to everything
            raise InfinigenError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InfinigenError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InfinigenError(f"top-k must be >= 0 (0 = off), got {self.top_k}")


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] -> token ids [B]."""
    if p.temperature < torch.finfo(torch.float32).tiny:  # 0, or too small for float32 to divide by: greedy
        return logits.argmax(-1)
    # the max subtracted first: a tiny temperature sends the others to -inf, never the best to +inf (NaN)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the best token always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
        drop[:, 0] = False  # even for a top_p that rounds to 0 in float32
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens) -> torch.Tensor:
    """Next tokens [B]: one batched call when every row samples the same way, else row by row."""
    if all(p == params[0] for p in params) and all(g is None for g in gens):
        return sample(logits, params[0], None)
    return torch.cat([sample(logits[i : i + 1], p, g) for i, (p, g) in enumerate(zip(params, gens, strict=True))])
