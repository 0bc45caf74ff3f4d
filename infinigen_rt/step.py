"""The only two places the model runs: `prefill` feeds prompt tokens into a cache, `decode_step` one token per
row. Every caller goes through them: the runner (generate and serve; bench times the runner's steps), eval and
needle. What a policy does with its KV happens inside the cache the model calls (cache.py)."""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVCache


def prefill(engine, cache: KVCache | list[KVCache], ids: torch.Tensor, positions: torch.Tensor,
            chunk: int | None = None, valid: torch.Tensor | None = None,
            every: bool = False) -> torch.Tensor:  # fmt: skip
    """Prompt tokens ids [B, S] at positions [B, S] through the model, `chunk` tokens per forward (None: all at
    once); the logits of the last position [B, V], or with `every` of every position [B, S, V] (to score the
    prompt). `valid` [B, S] bool: False at left padding (`pad_batch`); None: no padding.

    A list of request passes shares one prefill: each keeps what it keeps and attends its own pass, and the forward
    goes on with the first one's output (`full`'s: the exact prefill of every policy with `dense_prefill`, which
    alone may share); each then decodes on its own."""
    if isinstance(cache, list):
        cache = cache[0] if len(cache) == 1 else _Shared(cache)
    chunk = chunk or ids.shape[1]
    out = []
    for start in range(0, ids.shape[1], chunk):
        sl = slice(start, start + chunk)
        logits = engine.model(ids[:, sl], positions[:, sl], cache, None if valid is None else valid[:, sl],
                              last_only=not every)  # fmt: skip
        if every:
            out.append(logits)
    return torch.cat(out, 1) if every else logits[:, -1]


def decode_step(engine, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: ids and positions [B, 1] (on the device: nothing here reads them); logits [B, V]."""
    return engine.model(ids, positions, cache, None, last_only=True)[:, -1]


def pad_batch(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts for one batched prefill. Returns input_ids, positions and valid, each [B, S]."""
    s = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), s), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), s, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, s - len(p) :] = torch.tensor(p)
            valid[i, s - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), positions.to(device), valid.to(device)


class _Shared(KVCache):
    """One forward pass feeding several caches (see `prefill`)."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def begin(self, valid, positions):
        for c in self.caches:
            c.begin(valid, positions)

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
