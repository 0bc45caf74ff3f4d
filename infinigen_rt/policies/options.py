"""Run-time KV options shared by the policies, checked once with one-line errors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infinigen_rt.errors import InfinigenError
from infinigen_rt.kv.pool import EVICTIONS

SPEC_KEYS = ("partial", "int4", "int2")  # what --spec-keys takes (policies/speculation.py's key stores)


@dataclass
class KVOptions:
    # the count rule: None = the budget alone (chosen on the tuning texts at 10 %, docs/accuracy.md); a number = the
    # paper's margin, each query head counting the tokens within alpha of its max (the bundle records one: 8 for
    # the Llama family, 4 for OPT), the mean count capped by the budget
    alpha: float | None = None
    budget: float = 0.2  # most tokens fetched per head, as a share of the held context
    max_kv: int | None = None  # and/or an absolute cap
    capacity: float | None = None  # pool tokens per (sequence, KV head): share (<= 1) or count (> 1); None = all
    eviction: str = "counter"
    window: int = 16  # the most recent positions, never evicted
    dense_layers: int | None = None  # None = the bundle's default
    prefill_chunk: int | None = None
    trace_recall: bool = False
    # speculation levers (infinigen). Defaults from benchmarks/levers.py on SmolLM2 (Hamlet, 1024 tokens
    # scored from 512, 10 % fetched): paper-style +8.02 % ppl; sinks 4 + recent 8: +3.84 %; + sum: +3.30 %;
    # + renorm: +3.62 %; all: +2.41 % (oracle +1.43 %). See docs/accuracy.md.
    sinks: int = 4  # the first positions, always fetched (inside the budget)
    recent: int = 8  # the newest positions, always fetched (inside the budget)
    renorm: bool = True  # rescale layer i's normalised input by layer i+1's norm weight over layer i's
    per_head: bool = False  # each KV head fetches its own alpha count instead of the mean over heads
    group_agg: str = "sum"  # how a GQA group's scores rank tokens: "max" of logits or "sum" of probabilities
    # per-layer budgets: layer j's budget is in proportion to s_j^layer_budget (mean kept), s_j the share of keys
    # layer j needs for 90 % of its attention on the calibration text (the bundle's layer_key_share); 0 = one
    # budget for every layer; None = the bundle's default (0 for a bundle converted without the statistics)
    layer_budget: float | None = None
    # per-layer margins: layer j's alpha is the one convert calibrated for it (the bundle's layer_alpha: the margin
    # at which speculation fetches as many keys as 90 % of the true attention needs); an explicit alpha wins
    layer_alpha: bool = False
    # what speculation scores against, on the device: "partial" (the paper's d' skewed columns in the model's dtype)
    # or every column at 4 or 2 bits ("int4", "int2": about the device bytes of r = 0.3 and half of them). int4 was
    # chosen on six tuning texts (docs/accuracy.md, the second round)
    spec_keys: str = "int4"
    # the correction step: this share of the budget is held back, and once layer j's true query is known it is
    # scored against the same keys and the best rows speculation did not fetch are gathered (0 = off); 0.25 was
    # chosen with the int4 keys on the same texts
    correct: float = 0.25

    def check(self) -> None:
        if self.alpha is not None and not self.alpha >= 0:
            raise InfinigenError(f"--alpha must be >= 0 (logit units), got {self.alpha}")
        if not 0 < self.budget <= 1:
            raise InfinigenError(f"--budget must be in (0, 1] (a share of the context), got {self.budget}")
        if self.max_kv is not None and self.max_kv < 1:
            raise InfinigenError(f"--max-kv must be >= 1, got {self.max_kv}")
        if self.eviction not in EVICTIONS:
            raise InfinigenError(f"--eviction must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}")
        if self.window < 1:
            raise InfinigenError(f"--window must be >= 1, got {self.window}")
        if self.capacity is not None:
            if self.capacity <= 0:
                raise InfinigenError(f"--capacity must be > 0 (a share <= 1 or a token count), got {self.capacity}")
            if self.capacity > 1 and self.capacity < self.window:
                raise InfinigenError(
                    f"--capacity {int(self.capacity)} tokens is below the recent window ({self.window}) that is "
                    "never evicted; raise it or lower --window"
                )
        if self.sinks < 0 or self.recent < 0:
            raise InfinigenError("--sinks and --recent must be >= 0")
        if self.layer_budget is not None and not 0 <= self.layer_budget <= 2:
            raise InfinigenError(f"layer_budget must be in [0, 2] (an exponent), got {self.layer_budget}")
        if self.group_agg not in ("max", "sum"):
            raise InfinigenError(f"--group-agg must be max or sum, got {self.group_agg!r}")
        if self.spec_keys not in SPEC_KEYS:
            raise InfinigenError(f"--spec-keys must be one of {', '.join(SPEC_KEYS)}, got {self.spec_keys!r}")
        if not 0 <= self.correct < 1:
            raise InfinigenError(f"--correct must be in [0, 1) (the share of the budget the correction fetches), "
                                 f"got {self.correct}")  # fmt: skip
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise InfinigenError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.dense_layers is not None and self.dense_layers < 1:
            raise InfinigenError(
                f"--dense-layers must be >= 1 (layer 0 has no previous layer), got {self.dense_layers}"
            )

    def capacity_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Pool capacity per sequence [B] for current lengths [B] (host); a share never goes below the window."""
        if self.capacity is None:
            return lengths.copy()
        if self.capacity <= 1:
            return np.maximum(np.ceil(self.capacity * lengths.astype(np.float64)).astype(np.int64), self.window)
        return np.full_like(lengths, math.floor(self.capacity))
