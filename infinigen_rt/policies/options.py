"""Run-time KV options shared by the policies, checked once with one-line errors.

Each option is declared once, here: its default and its `Opt` (help text, range or choices, and where it is
taken). cli/options.py builds the flags of the commands that run one policy from it, serve/protocol.py the fields a
server request may override, and bench and eval check the values of their lists with `check_value`."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields

import numpy as np

from infinigen_rt.bundle import SPEC_KEYS
from infinigen_rt.errors import InfinigenError
from infinigen_rt.kv.evict import EVICTIONS


@dataclass(frozen=True)
class Opt:
    """A KV option besides its default: its help text, where it is taken, and the values it takes."""

    help: str
    cli: bool = False  # a flag of the commands that run one policy (generate, serve): cli/options.py's KV_PARAMS
    request: bool = False  # a server request may override it (its `infinigen` object)
    # its flag where that is not --the-name, or where a command declares it itself (generate's --prefill-chunk);
    # None for an option no command takes: its errors name the field
    flag: str | None = None
    # its range, in pydantic's terms (greater or equal, greater than, less or equal, less than), or its choices
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    why: str | None = None  # what a range error adds in parentheses ("a share of the context")

    def bounds(self) -> dict[str, float]:
        """The range as pydantic's Field takes it: {"gt": 0, "le": 1}."""
        return {k: v for k in ("ge", "gt", "le", "lt") if (v := getattr(self, k)) is not None}

    def holds(self, value) -> bool:
        """Whether `value` is in the range, or one of the choices (NaN is in no range)."""
        if self.choices is not None:
            return value in self.choices
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))  # fmt: skip

    def range_text(self) -> str:
        """'>= 1', 'in (0, 1]', 'one of counter, lru, fifo'."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = (self.le, "]") if self.le is not None else (self.lt, ")") if self.lt is not None else None
        if low and high:
            return f"in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
        return f"{'<=' if high[1] == ']' else '<'} {high[0]:g}"


def opt(default, help: str, **kw):
    """A KVOptions field: its default, and its Opt."""
    return field(default=default, metadata={"opt": Opt(help, **kw)})


@dataclass
class KVOptions:
    # the count rule: None = the budget alone (chosen on the tuning texts at 10 %, docs/accuracy.md); a number = the
    # paper's margin, each query head counting the tokens within alpha of its max (the bundle records one: 8 for
    # the Llama family, 4 for OPT), the mean count capped by the budget
    alpha: float | None = opt(
        None, "infinigen: logit margin below each head's max (the paper's count rule) [none: the budget alone].",
        cli=True, request=True, ge=0, why="logit units")  # fmt: skip
    # most tokens fetched per head, as a share of the held context
    budget: float = opt(
        0.2, "infinigen, h2o: most tokens fetched (h2o: kept) per head, share of the context.",
        cli=True, request=True, gt=0, le=1, why="a share of the context")  # fmt: skip
    max_kv: int | None = opt(None, "infinigen: most tokens fetched per head.", cli=True, ge=1)
    # pool tokens per (sequence, KV head): a share (<= 1) or a count (> 1); None = all
    capacity: float | None = opt(
        None, "Host pool tokens per (sequence, KV head): share <= 1 or count.",
        cli=True, gt=0, why="a share <= 1 or a token count")  # fmt: skip
    eviction: str = opt("counter", "Pool eviction: counter, lru, fifo.", cli=True, choices=EVICTIONS)
    window: int = opt(16, "Most recent positions never evicted.", cli=True, ge=1)
    dense_layers: int | None = opt(
        None, "infinigen: first layers attending to everything (bundle default).",
        cli=True, ge=1, why="layer 0 has no previous layer")  # fmt: skip
    # generate's --prefill-chunk (serve's is the scheduler's, its own)
    prefill_chunk: int | None = opt(None, "Prefill in chunks of this many tokens.", flag="--prefill-chunk", ge=1)
    trace_recall: bool = opt(
        False, "infinigen: measure the attention mass the fetched tokens hold (slow; diagnosis).",
        flag="--trace-recall")  # fmt: skip
    # speculation levers (infinigen). Defaults from benchmarks/levers.py on SmolLM2 (Hamlet, 1024 tokens
    # scored from 512, 10 % fetched): paper-style +8.02 % ppl; sinks 4 + recent 8: +3.84 %; + sum: +3.30 %;
    # + renorm: +3.62 %; all: +2.41 % (oracle +1.43 %). See docs/accuracy.md.
    sinks: int = opt(4, "The first positions, always fetched (inside the budget).", ge=0)
    recent: int = opt(8, "The newest positions, always fetched (inside the budget).", ge=0)
    renorm: bool = opt(True, "Rescale layer i's normalised input by layer i+1's norm weight over layer i's.")
    per_head: bool = opt(False, "Each KV head fetches its own alpha count instead of the mean over heads.")
    group_agg: str = opt(
        "sum", "How a GQA group's scores rank tokens: max of logits or sum of probabilities.", choices=("max", "sum"))
    # per-layer budgets: layer j's budget is in proportion to s_j^layer_budget (mean kept), s_j the share of keys
    # layer j needs for 90 % of its attention on the calibration text (the bundle's layer_key_share); 0 = one
    # budget for every layer; None = the bundle's default (0 for a bundle converted without the statistics)
    layer_budget: float | None = opt(
        None, "Per-layer budgets: the exponent of each layer's key share (0: one budget for all).",
        ge=0, le=2, why="an exponent")  # fmt: skip
    # per-layer margins: layer j's alpha is the one convert calibrated for it (the bundle's layer_alpha: the margin
    # at which speculation fetches as many keys as 90 % of the true attention needs); an explicit alpha wins
    layer_alpha: bool = opt(False, "Per-layer margins: each layer's alpha as convert calibrated it.")
    # what speculation scores against, on the device: "partial" (the paper's d' skewed columns in the model's dtype)
    # or every column at 4 or 2 bits ("int4", "int2": about the device bytes of r = 0.3 and half of them). None =
    # the bundle's, chosen at convert time by each store's perplexity on the text past calibration (SmolLM2: int4,
    # as six tuning texts chose, docs/accuracy.md; Qwen2.5-Coder: partial); resolved in Infinigen.configure
    spec_keys: str | None = opt(
        None,
        "infinigen: what speculation scores on the device: partial (skewed columns), int4, int2 (every column) "
        "[bundle default].",
        cli=True, request=True, choices=SPEC_KEYS)  # fmt: skip
    # consecutive steps select mostly the same rows (docs/performance.md: 55-75 % of speculation's on SmolLM2 and
    # Gemma 3): with reuse, what a layer fetched the step before stays on the device and only the rest crosses PCIe
    reuse: bool = opt(
        False, "infinigen on a GPU: keep each speculated layer's rows of the last step on the device and fetch only "
        "the rows not among them (the same tokens; device memory for two sets of rows a layer; not with a capacity).",
        cli=True)  # fmt: skip
    # the correction step: this share of the budget is held back, and once layer j's true query is known it is
    # scored against the same keys and the best rows speculation did not fetch are gathered (0 = off); 0.25 was
    # chosen with the int4 keys on the same texts
    correct: float = opt(
        0.25, "infinigen: share of the budget a correction step fetches with the layer's true query (0 = off).",
        cli=True, request=True, ge=0, lt=1, why="the share of the budget the correction fetches")  # fmt: skip
    # the correction's candidates: every held slot (0), or a shortlist of the slots speculation ranked best, its own
    # and this many times the correction's count after them (its scoring and selection then read those only)
    shortlist: float = opt(
        0.0, "infinigen: the correction scores speculation's next-ranked slots only, this many times its count "
        "(0 = every held slot).", cli=True, request=True, ge=0, why="a multiple of the correction's count")  # fmt: skip

    # selection in runs: speculation takes whole runs of this many consecutive slots, ranked by the attention share
    # their tokens hold, where 1 takes single tokens; a run is contiguous host rows, which a copy engine moves
    # without a gather kernel (the correction's share stays single tokens)
    runs: int = opt(1, "infinigen: speculation fetches runs of this many consecutive tokens (1: single tokens).",
                    ge=1, le=256, why="tokens a run")  # fmt: skip

    def check(self) -> None:
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))
        if self.capacity is not None and self.capacity > 1 and self.capacity < self.window:
            raise InfinigenError(
                f"--capacity {int(self.capacity)} tokens is below the recent window ({self.window}) that is "
                "never evicted; raise it or lower --window"
            )
        if self.reuse and self.capacity is not None:
            raise InfinigenError("--reuse keeps the last step's rows by their slots, which a capacity hands to new "
                                 "tokens: drop --capacity or --reuse")  # fmt: skip

    def capacity_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Pool capacity per sequence [B] for current lengths [B] (host); a share never goes below the window."""
        if self.capacity is None:
            return lengths.copy()
        if self.capacity <= 1:
            return np.maximum(np.ceil(self.capacity * lengths.astype(np.float64)).astype(np.int64), self.window)
        return np.full_like(lengths, math.floor(self.capacity))


OPTS: dict[str, Opt] = {f.name: f.metadata["opt"] for f in fields(KVOptions)}  # every KV option's Opt, in order
TYPES: dict[str, type] = typing.get_type_hints(KVOptions)  # and its type ("float | None")
DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(KVOptions)}


def flag(name: str) -> str:
    """How errors and help name the option: its flag (--max-kv), or the field for one no command takes."""
    o = OPTS[name]
    return o.flag or ("--" + name.replace("_", "-") if o.cli else name)


def check_value(name: str, value, as_flag: str | None = None) -> None:
    """One value of the option `name` in its range or among its choices (None: the default or the bundle's, always
    taken), or a one-line error naming the option (`as_flag`: a command's own flag for it, e.g. eval's --budgets)."""
    o = OPTS[name]
    if value is None or o.holds(value):
        return
    why = f" ({o.why})" if o.why else ""
    got = repr(value) if o.choices is not None else value
    raise InfinigenError(f"{as_flag or flag(name)} must be {o.range_text()}{why}, got {got}")
