"""Skewing and partial columns from calibration statistics.

Per layer and KV head, A = the right singular vectors of the stacked group queries Q ((G*T) x D), i.e.
the eigenvectors of Q^T Q, columns by descending singular value. A is orthogonal, so (qA).(kA) = q.k:
attention is unchanged while the energy of qA and kA gathers in the first columns. The partial columns
are the d' = ceil(r * D) skewed columns with the most energy, by query energy alone or by the product of
query and key energy (a column's share of q.k variance when q and k are independent).
"""

from __future__ import annotations

import math

import torch

from infinigen_prep.calibrate import Grams

SELECTIONS = ("qk", "query")


def partial_dim(head_dim: int, ratio: float) -> int:
    return max(1, min(head_dim, math.ceil(ratio * head_dim)))


def skew_matrix(gram_q: torch.Tensor, skew: bool = True) -> torch.Tensor:
    """gram_q: [Hkv, D, D] float64 -> A: [Hkv, D, D] float64, orthogonal; identity when not `skew`."""
    hkv, d, _ = gram_q.shape
    if not skew:
        return torch.eye(d, dtype=torch.float64, device=gram_q.device).expand(hkv, d, d).clone()
    _, vecs = torch.linalg.eigh(gram_q)  # ascending eigenvalues
    a = vecs.flip(-1)
    # fix each column's sign (largest-magnitude entry positive) so the result is deterministic
    pivot = a.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(a, -2, pivot))
    return a * torch.where(sign == 0, 1.0, sign)


def column_energy(gram: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """diag(A^T G A): the energy of each skewed column, [Hkv, D]."""
    return torch.einsum("kdi,kde,kei->ki", a, gram, a)


def select_columns(eq: torch.Tensor, ek: torch.Tensor, d_prime: int, how: str) -> torch.Tensor:
    """Top-d' columns per KV head by query energy ("query") or query x key energy ("qk"); [Hkv, d'] sorted."""
    score = eq if how == "query" else eq * ek
    # ties broken by column index (stable sort) so selection is deterministic
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return order[:, :d_prime].sort(dim=-1).values


def energy_share(grams: Grams, skews: list[torch.Tensor], ratio: float) -> float:
    """Share of the query energy held by the top ceil(ratio*D) columns (by energy), over all layers/heads."""
    top = total = 0.0
    for gq, a in zip(grams.q, skews, strict=True):
        e = column_energy(gq, a)  # [Hkv, D]
        d_prime = partial_dim(e.shape[-1], ratio)
        top += e.sort(dim=-1, descending=True).values[:, :d_prime].sum().item()
        total += e.sum().item()
    return top / total


def fold_heads(t: torch.Tensor, a: torch.Tensor, n_heads: int) -> torch.Tensor:
    """OPT (no RoPE): fold A into a q/k projection tensor whose first dim is H*D (a weight or a bias):
    head h's rows become A_h^T t_h, so x W'^T + b' = (x W^T + b) A per head. a: [H, D, D] (MHA)."""
    d = a.shape[-1]
    th = t.double().reshape(n_heads, d, -1)
    return torch.einsum("hde,hdx->hex", a, th).reshape(t.shape).to(t.dtype)


def partial_rows(t: torch.Tensor, idx: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The d' rows per head of a (skewed) projection tensor: [H*D, ...] -> [H*d', ...]."""
    d = t.shape[0] // n_heads
    idx = idx.to(t.device)
    rows = (idx + d * torch.arange(n_heads, device=t.device)[:, None]).reshape(-1)
    return t[rows].contiguous()


def partial_skew(a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The skew's kept columns, fp32: a [Hkv, D, D], idx [Hkv, d'] -> [Hkv, D, d'] (q @ it: the partial query)."""
    return torch.gather(a.float(), 2, idx[:, None, :].expand(-1, a.shape[1], -1))


def attention_recall(q, k, a, idx, keep: float, from_pos: int) -> float:
    """Mean share of the true softmax mass inside the top ceil(keep*(t+1)) keys ranked by partial scores.

    q: [Hkv, G, T, D], k: [Hkv, T, D] (post-RoPE); a: [Hkv, D, D]; idx: [Hkv, d']. Query rows t >= from_pos."""
    hkv, g, t, d = q.shape
    a_part = partial_skew(a, idx)
    qp, kp = q @ a_part[:, None], k @ a_part  # [Hkv, G, T, d'], [Hkv, T, d']
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[from_pos:]
    true = (q[:, :, from_pos:] @ k.transpose(-1, -2)[:, None]) / math.sqrt(d)
    true = true.masked_fill(~causal, float("-inf")).softmax(-1)  # [Hkv, G, S, T]
    part = (qp[:, :, from_pos:] @ kp.transpose(-1, -2)[:, None]).masked_fill(~causal, float("-inf"))
    n_keep = torch.ceil(keep * (torch.arange(from_pos, t, device=q.device) + 1)).long()  # [S]
    thresh = torch.gather(
        part.sort(-1, descending=True).values, -1, (n_keep - 1)[None, None, :, None].expand(hkv, g, -1, 1)
    )
    kept = part >= thresh
    return (true * kept).sum(-1).mean().item()


def calibrated_alpha(q, k, a, idx, from_pos: int, recall: float, top: float = 40.0, bins: int = 4000) -> float:
    """The smallest margin alpha (logit units) whose speculated set holds, on average, `recall` of the true
    attention: over query heads and rows t >= from_pos, the keys whose partial score is within alpha of the row's
    best (the runtime's count) hold that mean share of the row's true softmax mass. Scores scaled by 1/sqrt(D), as
    the runtime's are; the budget's cap is not applied (alpha is what a large budget fetches).

    q: [Hkv, G, T, D], k: [Hkv, T, D] (post-RoPE); a: [Hkv, D, D]; idx: [Hkv, d']. Found on a histogram of the
    gaps below each row's best, weighted by the true probabilities (resolution top/bins); `top` at most."""
    hkv, g, t, d = q.shape
    a_part = partial_skew(a, idx)
    dev = q.device
    pos = torch.arange(from_pos, t, device=dev)
    future = torch.arange(t, device=dev)[None, :] > pos[:, None]  # [S, T]
    hist = torch.zeros(bins + 1, dtype=torch.float64, device=dev)
    for h in range(hkv):  # a KV head at a time bounds the memory: [G, S, T]
        true = (q[h, :, from_pos:].float() @ k[h].float().T) / math.sqrt(d)
        p = true.masked_fill(future, float("-inf")).softmax(-1)
        part = ((q[h, :, from_pos:].float() @ a_part[h]) @ (k[h].float() @ a_part[h]).T) / math.sqrt(d)
        part = part.masked_fill(future, float("-inf"))
        gap = part.amax(-1, keepdim=True) - part  # [G, S, T], inf for future keys (probability 0)
        b = (gap / top * bins).clamp(max=bins).long()  # gaps of `top` or more land in the last bin
        hist.index_add_(0, b.reshape(-1), p.reshape(-1).double())  # a histogram of fixed size (no device read)
    within = hist[:bins].cumsum(0) / (hkv * g * len(pos))  # within[i]: mean mass of gaps < (i + 1) * top / bins
    i = int(torch.searchsorted(within, torch.tensor([recall], dtype=torch.float64, device=dev)))
    return top if i >= bins else round((i + 1) * top / bins, 4)
