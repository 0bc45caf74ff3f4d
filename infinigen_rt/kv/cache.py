"""KV caches: what the attention layer asks for keys and values.

Per forward pass the model calls `cache.begin(valid, positions)`; every attention layer calls
`cache.observe(layer, x)` with its normalised input, then `y = cache.attend(layer, q, k, v)` (by default:
`update` stores the new keys and values and returns what to attend over, and SDPA attends); the model ends with
`cache.end()`. Where keys and values live, which of them a layer sees, and what moves where is the cache's
business: every policy (policies/: full, offload, infinigen, h2o, int4, oracle) implements these calls and no model
code knows which one it talks to. Also here: `Policy` (a policy as a request runs it), `Rows` (one forward over
several requests' caches) and the reports every cache gives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F


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
    """The interface. Keys and values are per KV head, never expanded to query heads.

    A policy is one subclass; what callers need to know about it is on the class: its name, the KV options it
    reads (`knobs`), whether it needs the bundle's InfiniGen tensors, what eval sweeps, its memory needs."""

    name = ""
    knobs: frozenset[str] = frozenset()  # the KVOptions fields it reads (a server request may override these)
    runtime = True  # False: an evaluation device only (not for generate, serve or bench)
    speculative = False  # needs the bundle's InfiniGen tensors
    sweep: tuple[str, ...] = ()  # what `eval` sweeps: ("budget",) or ("budget", "alpha")
    scores = False  # its attention builds the score matrix itself (else SDPA's fused kernels never do)
    dense_prefill = True  # a prompt attends over its exact KV (so one prefill may serve several policies)

    @classmethod
    def configure(cls, opts, engine) -> Policy:
        """This policy with `opts` (KVOptions), checked against `engine` once: the value a request runs with."""
        opts.check()
        return Policy(cls, opts)

    @classmethod
    def build(cls, engine, opts, batch: int, max_len: int, pages=None, prefetch=None) -> KVCache:
        """The cache for a batch of `batch` sequences of up to `max_len` tokens under `opts` (a configured policy's
        options). `pages` (blocks.Pages, one sequence): where a host pool keeps its rows in a paged pool's shared
        buffers (policies whose KV stays on the device ignore it). `prefetch` (prefetch.Lane): the runner's side
        stream or worker thread, shared by its requests' caches (None: a cache that moves rows makes its own)."""
        raise NotImplementedError

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """The policy as the batch's KV store runs it (store.Selector: which layers stay on the device, which rows a
        step reads), or None where the store cannot run these options yet (the request keeps a cache of its own)."""
        return None

    @classmethod
    def pool_slots(cls, opts, prompt: int, new: int, chunk: int) -> int:
        """The most token slots a request of `prompt` + `new` tokens, prefilled in chunks of at most `chunk`, ever
        holds per (sequence, KV head) in a paged pool: its reservation. Every token, unless eviction frees slots
        for reuse (the host-pool policies with a capacity)."""
        return prompt + new

    @classmethod
    def kv_bytes(cls, engine, opts, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        """For `tokens` (sequence, KV head, slot) triples per layer: (device bytes held, host bytes held, device
        bytes read by a decode step) of KV and its bookkeeping (bench's memory model and floor)."""
        raise NotImplementedError

    def report(self) -> KVReport:
        return KVReport()

    def begin(self, valid: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Start a forward pass over S new tokens; positions: [B, S]; valid: [B, S] bool (False = left padding), or
        None when the caller knows there is none (so nothing about it is read from the device). A decode step
        (S == 1) brings no padding: padding only ever comes with a prompt."""
        raise NotImplementedError

    def observe(self, layer: int, x: torch.Tensor) -> None:
        """Layer `layer`'s normalised attention input x: [B, S, hidden] (InfiniGen speculates from it)."""

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v: [B, Hkv, S, D] (q: [B, H, S, D], post-RoPE); return (keys, values, mask) to attend over.

        keys/values: [B, Hkv, T, D]; mask: [B, 1, S, T] bool, True where a query may attend, or None for
        plain causal attention among the new tokens only (T == S, no padding: the fused kernels' fast path)."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v and attend the queries q over what `update` returns: y [B, H, S, D]."""
        keys, values, mask = self.update(layer, q, k, v)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
            enable_gqa=keys.shape[1] != q.shape[1],
        )  # fmt: skip

    def store(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep k, v as `attend` would, without attending (a shared prefill's other caches: step.py)."""
        self.update(layer, q, k, v)

    def end(self) -> None:
        """The forward pass is over (policies enforce capacity, advance counters)."""

    def close(self) -> None:
        """The cache's work is over: release what it holds besides memory (a worker thread, pinned pages)."""


@dataclass(frozen=True)
class Policy:
    """A KV policy as a request runs it: the cache class and its options, checked and resolved against the engine
    once (`KVCache.configure`); every cache the request needs is built from it."""

    cls: type[KVCache]
    opts: object  # KVOptions, with the engine's defaults resolved

    @property
    def name(self) -> str:
        return self.cls.name

    def build(self, engine, batch: int, max_len: int, pages=None, prefetch=None) -> KVCache:
        """The cache the model talks to: the policy's, behind a Hybrid with the sliding layers' rings on the device
        when the model has sliding-window layers (window.py)."""
        from infinigen_rt.kv.window import windowed

        cache = self.cls.build(engine, self.opts, batch, max_len, pages, prefetch)
        return windowed(engine.cfg, cache, batch, max_len, engine.device, engine.dtype)

    def selector(self, engine, prefetch=None):
        return self.cls.selector(engine, self.opts, prefetch)

    def pool_slots(self, prompt: int, new: int, chunk: int) -> int:
        return self.cls.pool_slots(self.opts, prompt, new, chunk)

    def kv_bytes(self, engine, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        return self.cls.kv_bytes(engine, self.opts, tokens, dtype_bytes)

    def with_options(self, engine, **changes) -> Policy:
        """The same policy with some options changed (a server request's overrides), configured again."""
        return self.cls.configure(replace(self.opts, **changes), engine)


def kv_layers(cfg) -> list[int]:
    """The layers whose KV a policy holds: every layer but the sliding-window ones, whose rings `Policy.build` puts
    beside the policy's cache (window.py), whatever the policy. No policy needs to know about them."""
    return cfg.global_layers


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
    and the MLP run batched; each part attends through its own cache (its policy, length and state), so a request
    computes the same whichever requests share its step."""

    def __init__(self, caches: list[KVCache], sizes: list[int] | None = None):
        self.caches = caches
        sizes = sizes or [1] * len(caches)
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        self.parts = [slice(e - n, e) for n, e in zip(sizes, ends, strict=True)]

    def begin(self, valid, positions) -> None:
        for p, c in zip(self.parts, self.caches, strict=True):
            c.begin(None if valid is None else valid[p], positions[p])

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
    for f in ("kv_fetched_share", "kv_attended_share", "attention_recall", "tokens_per_head_mean"):
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
