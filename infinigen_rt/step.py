"""The only two places the model runs: `prefill` feeds prompt tokens into a cache, `decode_step` one token per
row. Every caller goes through them: the runner (generate and serve; bench times the runner's steps), eval and
needle. What a policy does with its KV happens inside the pass the model calls (kv/store.py)."""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVCache


def prefill(engine, cache: KVCache | list[KVCache], ids: torch.Tensor, positions: torch.Tensor,
            chunk: int | None = None, every: bool = False) -> torch.Tensor:  # fmt: skip
    """Prompt tokens ids [B, S] at positions [B, S] through the model, `chunk` tokens per forward (None: all at
    once); the logits of the last position [B, V], or with `every` of every position [B, S, V] (to score the
    prompt).

    A list of request passes shares one prefill: each keeps what it keeps and attends its own pass, and the forward
    goes on with the first one's output (`full`'s: the exact prefill of every policy with `dense_prefill`, which
    alone may share); each then decodes on its own."""
    if isinstance(cache, list):
        cache = cache[0] if len(cache) == 1 else _Shared(cache)
    chunk = chunk or ids.shape[1]
    out = []
    for start in range(0, ids.shape[1], chunk):
        sl = slice(start, start + chunk)
        logits = engine.model(ids[:, sl], positions[:, sl], cache, last_only=not every)
        if every:
            out.append(logits)
    return torch.cat(out, 1) if every else logits[:, -1]


def decode_step(engine, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: ids and positions [B, 1] (on the device: nothing here reads them); logits [B, V]."""
    return engine.model(ids, positions, cache, last_only=True)[:, -1]


class _Shared(KVCache):
    """One forward pass feeding several caches (see `prefill`)."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def begin(self, positions):
        for c in self.caches:
            c.begin(positions)

    def observe(self, layer, x):
        for c in self.caches:
            c.observe(layer, x)

    def attend(self, layer, q, k, v):
        out = self.caches[0].attend(layer, q, k, v)
        for c in self.caches[1:]:  # each attends its own pass (h2o's scores come from it); the first's output goes on
            c.attend(layer, q, k, v)
        return out

    def end(self):
        for c in self.caches:
            c.end()
