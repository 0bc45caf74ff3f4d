"""What the attention layer talks to (`KVCache`: begin, observe, attend, end), the report every request's KV gives
(`KVReport`), and `Rows`: one forward pass over several parts of a batch, each attending through its own pass (the
batch's store for the rows it holds, a store of its own for a request it does not: runner.py). Where keys and values
live, which of them a layer sees and what moves is the store's (kv/store.py) and its policy's selector's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class KVReport:
    """What a cache did, in the same fields for every policy (None: does not apply to it).

    kv_fetched_share: of the rows the fetching layers held, the share they read each decode step (1.0: all of
    them; int4: its packed bytes as a share of 16-bit KV); kv_attended_share: the same over every layer (layers
    that attend everything count as 1.0). Bytes are counted from the copies made."""

    bytes_h2d: int = 0
    bytes_d2h: int = 0
    kv_fetched_share: float | None = None
    kv_attended_share: float | None = None
    evictions: int = 0
    attention_recall: float | None = None
    tokens_per_head_mean: float | None = None
    tokens_per_head_max: float | None = None
    per_layer: dict | None = None
    share_rows: int | None = None  # the rows the shares are a fraction of (held over the measured steps)
    kv_corrected_share: float | None = None  # of kv_fetched_share, what infinigen's correction step fetched

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class KVCache:
    """The interface the model talks to. Keys and values are per KV head, never expanded to query heads: a pass
    through the batch's KV store (store.StoreStep, store.RequestPass, store.Solo), or several of them (`Rows`)."""

    def report(self) -> KVReport:
        return KVReport()

    def begin(self, positions: torch.Tensor) -> None:
        """Start a forward pass over S new tokens at positions [B, S]."""
        raise NotImplementedError

    def observe(self, layer: int, x: torch.Tensor) -> None:
        """Layer `layer`'s normalised attention input x: [B, S, hidden] (InfiniGen speculates from it)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [B, Hkv, S, D] and attend the queries q [B, H, S, D] (post-RoPE) over what the layer keeps:
        y [B, H, S, D]."""
        raise NotImplementedError

    def end(self) -> None:
        """The forward pass is over (a capacity evicts)."""

    def close(self) -> None:
        """The cache's work is over: release what it holds besides memory (a worker thread, pinned pages)."""


def causal_mask(valid: torch.Tensor, start: int) -> torch.Tensor:
    """valid: [B, T] bool over all slots; queries are slots start..T-1. Returns [B, 1, S, T] bool.

    A padding query attends to itself only, so its row is never empty (an empty row gives NaN
    outputs, and NaN keys/values would poison later rows even where masked out)."""
    t = valid.shape[1]
    q_pos = torch.arange(start, t, device=valid.device)[:, None]  # [S, 1]
    k_pos = torch.arange(t, device=valid.device)[None, :]  # [1, T]
    causal = k_pos <= q_pos  # [S, T]
    mask = causal[None] & valid[:, None, :]  # [B, S, T]
    mask = mask | (k_pos == q_pos)[None]
    return mask[:, None]


class Rows(KVCache):
    """One forward pass over several requests' caches: `sizes[i]` consecutive rows of the batch are `caches[i]`'s
    sequences (default: one each; the batch's KV store takes every row it holds, store.StoreStep). The projections
    and the MLP run batched; each part attends through its own pass (its policy, length and state), so a request
    computes the same whichever requests share its step."""

    def __init__(self, caches: list[KVCache], sizes: list[int] | None = None):
        self.caches = caches
        sizes = sizes or [1] * len(caches)
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        self.parts = [slice(e - n, e) for n, e in zip(sizes, ends, strict=True)]

    def begin(self, positions) -> None:
        for p, c in zip(self.parts, self.caches, strict=True):
            c.begin(positions[p])

    def observe(self, layer, x) -> None:
        for p, c in zip(self.parts, self.caches, strict=True):
            c.observe(layer, x[p])

    def attend(self, layer, q, k, v) -> torch.Tensor:
        return torch.cat([c.attend(layer, q[p], k[p], v[p]) for p, c in zip(self.parts, self.caches, strict=True)])

    def end(self) -> None:
        for c in self.caches:
            c.end()


def merge_reports(reports: list[KVReport]) -> KVReport:
    """Several requests' reports as one: bytes and evictions summed, shares and recall their mean over the
    requests that report them, weighted by the rows each share is over (`share_rows`) where every one says (so
    a long request counts for what it held), else one each; the largest per-head count."""
    if len(reports) == 1:
        return reports[0]
    out = KVReport()
    if not reports:
        return out
    for f in ("bytes_h2d", "bytes_d2h", "evictions"):
        setattr(out, f, sum(getattr(r, f) for r in reports))
    shares = ("kv_fetched_share", "kv_attended_share", "kv_corrected_share", "attention_recall", "tokens_per_head_mean")
    for f in shares:
        got = [r for r in reports if getattr(r, f) is not None]
        weighted = bool(got) and all(r.share_rows for r in got)
        w = [r.share_rows if weighted else 1 for r in got]
        setattr(out, f, round(sum(getattr(r, f) * x for r, x in zip(got, w, strict=True)) / sum(w), 6) if got else None)
    rows = [r.share_rows for r in reports if r.share_rows is not None]
    out.share_rows = sum(rows) if rows else None
    top = [r.tokens_per_head_max for r in reports if r.tokens_per_head_max is not None]
    out.tokens_per_head_max = max(top) if top else None
    layers = [r.per_layer for r in reports if r.per_layer]
    if layers:
        out.per_layer = {"bytes_h2d": [sum(x) for x in zip(*(p["bytes_h2d"] for p in layers), strict=True)]}
    return out
