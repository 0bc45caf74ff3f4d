"""Choosing the next token: greedy, temperature, top-k, top-p, with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
        check_seed(self.seed)


SEED_RANGE = (-(2**63), 2**63)  # the seeds a request may give: a signed 64-bit integer (vLLM's range), each its own


def check_seed(seed: int | None) -> None:
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise InfinigenError(f"seed must be a 64-bit integer ({SEED_RANGE[0]} to {SEED_RANGE[1] - 1}), got {seed}")


def seeded(seed: int, device: torch.device):
    """The draws of a request with this seed: on a GPU torch's generator (Philox, all 64 bits of the seed); on a CPU
    numpy's PCG64, since torch's CPU generator keeps 32 bits of its seed (seeds 1 and 2^32 + 1 drew the same). A
    negative seed is its two's complement, so every seed in SEED_RANGE gives its own stream."""
    check_seed(seed)
    if torch.device(device).type == "cpu":
        return np.random.Generator(np.random.PCG64(seed % 2**64))
    return torch.Generator(device=device).manual_seed(seed % 2**64)


NOT_FINITE = -1  # the token `sample` gives a row whose logits hold a NaN or an infinity (or are all -inf)


def sample(logits: torch.Tensor, p: SamplingParams, generator) -> torch.Tensor:
    """logits: [B, V] -> token ids [B], drawn with `generator` (`seeded`'s, a torch.Generator, or None: torch's
    global one); NOT_FINITE for a row the model gave no usable logits (a NaN weight, an
    overflow of the dtype): told apart without a host read, and never handed to multinomial, which raises on a CPU
    and asserts on a GPU (a dead CUDA context)."""
    top = logits.amax(-1)
    bad = ~top.isfinite()  # amax carries a NaN through; +inf and an all -inf row are not finite either
    if p.temperature < torch.finfo(torch.float32).tiny:  # 0, or too small for float32 to divide by: greedy
        return logits.argmax(-1).masked_fill(bad, NOT_FINITE)
    # the max subtracted first: a tiny temperature sends the others to -inf, never the best to +inf (NaN)
    logits = (logits.float() - top[:, None].float()).masked_fill(bad[:, None], 0.0)  # a bad row: any token, dropped
    logits = logits / p.temperature
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
    if isinstance(generator, np.random.Generator):  # (`seeded` on a CPU) one uniform a row, through the CDF
        cdf = probs.double().cumsum(-1)
        u = torch.from_numpy(generator.random(len(cdf)))[:, None] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)  # (no flat step's)
    else:
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok.masked_fill(bad, NOT_FINITE)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens) -> torch.Tensor:
    """Next tokens [B]: one batched call when every row samples the same way, else row by row."""
    if all(p == params[0] for p in params) and all(g is None for g in gens):
        return sample(logits, params[0], None)
    return torch.cat([sample(logits[i : i + 1], p, g) for i, (p, g) in enumerate(zip(params, gens, strict=True))])
