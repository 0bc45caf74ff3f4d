"""Retrieval as users of KV selection check it: RULER-style needles in a haystack, answered greedily.

A needle is a sentence "One of the special magic numbers for KEY is: VALUE." placed at a depth (0 = the
start of the haystack, 1 = its end) in real text cut to a context length; the question after the haystack
asks for KEY's number, and the greedy answer is right only if it gives the value exactly. Tasks, as RULER
defines them (Hsieh et al., 2024):
  single      one needle, asked;
  multikey    the needle among 3 distractor needles with other keys (at seeded random depths), one asked;
  multivalue  4 needles with the same key and different values (the first at the depth, the others at
              seeded random depths), all asked: scored as the share of the values the answer gives
              (RULER's string_match_all).

The prompt is prefilled once for all the policies compared whose prefill is exact dense attention (step.prefill
over several caches: each stores what it keeps of it; `int4`, whose prompt attends over its quantized KV,
prefills on its own), then each policy decodes its own answer from its own store.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field

import torch

from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import pyplot, save_figure
from infinigen_rt.kv.cache import KVCache, Rows
from infinigen_rt.kv.store import Solo
from infinigen_rt.measure.perplexity import label
from infinigen_rt.policies import BASELINE, POLICIES, KVOptions, configure
from infinigen_rt.step import decode_step, prefill

TASKS = ("single", "multikey", "multivalue")
HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = " One of the special magic numbers for {key} is: {value}. "
QUESTION = {
    "one": "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is",
    "all": "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are",
}
ADJECTIVES = (
    "quiet bright hollow amber rapid gentle frozen silent crimson ancient narrow golden bitter distant hidden "
    "lively rusty velvet wooden zealous"
).split()
NOUNS = (
    "harbor lantern meadow violin compass orchard glacier falcon teapot canyon ribbon anchor pebble thistle "
    "saddle beacon walnut quarry kettle sparrow"
).split()
DISTRACTORS, VALUES = 3, 4  # multikey: other keys besides the one asked; multivalue: values of the one key
MAX_NEW = {"single": 16, "multikey": 16, "multivalue": 48}


@dataclass
class Case:
    task: str
    context: int  # tokens in the prompt (at most)
    depth: float
    index: int  # the needle's number within its cell
    key: str
    values: list[str]  # the answer: one value, or all of them (multivalue)
    ids: list[int] = field(repr=False)
    max_new: int = 0  # the answer's tokens at most (0: MAX_NEW's for the task)
    match: str = "number"  # how an answer is scored (see score): "number", or RULER's "all" and "part"
    pool: frozenset[str] = field(default=frozenset(), repr=False)  # RULER's cwe, fwe: the words listed (score_asked)

    def cell(self) -> tuple:
        return (self.task, self.context, self.depth, self.index)


@dataclass
class Result:
    policy: str
    budget: float | None
    alpha: float | None
    task: str
    context: int
    depth: float
    index: int
    score: float  # 0 or 1; multivalue: the share of the values given
    answer: str
    kv_fetched_share: float | None
    kv_attended_share: float | None
    spec_keys: str | None = None  # a speculating policy's keys and correction share (see KVOptions)
    correct: float | None = None
    runs: int | None = None  # speculation's runs of tokens, where not single tokens (KVOptions.runs)
    asked: float | None = None  # RULER's cwe, fwe: the score within the count asked (score_asked); else None
    layer_budget: float | None = None  # speculation's per-layer budget exponent, where not the bundle's default

    def config(self) -> tuple:
        return (self.policy, self.budget, self.alpha, self.spec_keys, self.correct, self.runs, self.layer_budget)

    def cell(self) -> tuple:
        """The case this answers (Case.cell)."""
        return (self.task, self.context, self.depth, self.index)

    def key(self) -> tuple:
        return (*self.config(), *self.cell())


def sentence_ends(text: str) -> list[int]:
    """Character offsets just after a sentence or a line ends: where a needle may go."""
    return [m.end() for m in re.finditer(r"[.!?]['\")\]]*\s+|\n\s*\n", text)] or [len(text)]


def place(text: str, depth: float, ends: list[int]) -> int:
    """The sentence end nearest to depth * len(text) (0 and 1 are the very start and end)."""
    if depth <= 0:
        return 0
    if depth >= 1:
        return len(text)
    want = depth * len(text)
    return min(ends, key=lambda e: abs(e - want))


def build_case(tok, hay: list[int], task: str, context: int, depth: float, index: int, rng: random.Random) -> Case:
    """One prompt of at most `context` tokens: header, haystack with the task's needles, the question."""
    keys = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], 1 + DISTRACTORS)
    key = keys[0]
    n_values = VALUES if task == "multivalue" else 1
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_values)]
    needles = [(depth, NEEDLE.format(key=key, value=values[0]))]
    needles += [(rng.random(), NEEDLE.format(key=key, value=v)) for v in values[1:]]
    if task == "multikey":
        needles += [(rng.random(), NEEDLE.format(key=k, value=rng.randrange(1_000_000, 10_000_000))) for k in keys[1:]]
    question = QUESTION["all" if task == "multivalue" else "one"].format(key=key)
    return Case(task, context, depth, index, key, values, compose(tok, hay, HEADER, needles, question, context, rng,
                                                                  f"the {task} needles"))  # fmt: skip


def compose(tok, hay: list[int], header: str, needles: list[tuple[float, str]], question: str, context: int,
            rng: random.Random, what: str) -> list[int]:  # fmt: skip
    """The ids of header + a haystack cut from `hay` (at a seeded offset) with each (depth, sentence) of `needles` at
    the sentence end nearest its depth (in their order where depths tie) + question, at most `context` tokens."""
    fixed = len(tok.encode(header + "".join(n for _, n in needles) + question))
    room = context - fixed - 8  # the haystack's tokens, with a margin for merges at the joins
    if room < 16:
        raise InfinigenError(f"context {context} is too short for {what}; use at least {fixed + 24}")
    if len(hay) < room:
        raise InfinigenError(f"the haystack text has {len(hay)} tokens, fewer than the {room} a {context}-token "
                             "context needs; give a longer --text")  # fmt: skip
    start = rng.randrange(0, len(hay) - room + 1)
    while True:  # the joins can merge or split tokens: shrink the haystack until the prompt fits
        filler = tok.decode(hay[start : start + room])
        ends = sentence_ends(filler)
        at = sorted((place(filler, d, ends), i, s) for i, (d, s) in enumerate(needles))
        parts, prev = [], 0
        for pos, _, s in at:
            parts += [filler[prev:pos], s]
            prev = pos
        parts.append(filler[prev:])
        ids = tok.encode(header + "".join(parts) + question)
        if len(ids) <= context:
            return ids
        room -= len(ids) - context + 2


def build_cases(tok, hay_text: str, tasks, contexts, depths, per_cell: int, seed: int) -> list[Case]:
    """Every (task, context, depth, needle) case, seeded: the same arguments give the same prompts."""
    hay = tok.encode(hay_text, add_special_tokens=False)
    out = []
    for task in tasks:
        for context in contexts:
            for depth in depths:
                for i in range(per_cell):
                    rng = random.Random(f"{seed}/{task}/{context}/{float(depth)}/{i}")
                    out.append(build_case(tok, hay, task, context, depth, i, rng))
    return out


def score(case: Case, answer: str) -> float:
    """Exact numbers: 1 if the answer's first number is the value, else 0; multivalue: the share of the values
    found among the answer's numbers. RULER's (case.match "all": string_match_all, the share of the answers the text
    holds; "part": string_match_part, 1 if it holds any), letter case aside."""
    if case.match != "number":
        found = [v.lower() in answer.lower() for v in case.values]
        return sum(found) / len(found) if case.match == "all" else float(any(found))
    numbers = re.findall(r"\d+", answer)
    if case.task == "multivalue":
        return sum(v in numbers for v in case.values) / len(case.values)
    return float(bool(numbers) and numbers[0] == case.values[0])


def score_asked(case: Case, answer: str) -> float | None:
    """RULER's word tasks (a case with a `pool`) scored within the count asked: the share of the values among the
    answer's first len(values) distinct words of the pool. RULER's string_match_all credits every value a list
    holds however long it runs, so an answer that lists forty words past the ten asked scores above one that stops
    at ten; this reads the list as far as the question asks. None for a case without a pool."""
    if not case.pool:
        return None
    first: list[str] = []
    for w in re.findall(r"[a-z]+", answer.lower()):
        if w in case.pool and w not in first:
            first.append(w)
            if len(first) == len(case.values):
                break
    return sum(v.lower() in first for v in case.values) / len(case.values)


def configs(policies: list[str], budgets: list[float], alpha: float | None, spec: dict | None = None,
            default_keys: str | None = None, runs: list[int] | None = None, layer_budgets: list[float] | None = None,
            default_layer_budget: float = 0.0) -> list[tuple]:  # fmt: skip
    """(policy, budget, alpha, spec_keys, correct, runs, layer_budget) to compare: the baseline first, then each
    policy at each budget it sweeps; a speculating one with `spec` (spec_keys, correct; None: the defaults, the keys
    `default_keys`: the bundle's), each of `runs` (selection in runs of that many tokens; None where 1, single
    tokens) and each of `layer_budgets` (KVOptions.layer_budget; None where the bundle's `default_layer_budget`)."""
    out = [(BASELINE, None, None, None, None, None, None)]
    for p in policies:
        if p == BASELINE:
            continue
        cls = POLICIES[p]
        keys = correct = None
        each = [(None, None)]
        if cls.speculative:
            kv = KVOptions(**(spec or {}))
            keys, correct = kv.spec_keys or default_keys, kv.correct
            lbs = list(dict.fromkeys(None if e == default_layer_budget else e for e in layer_budgets or [None]))
            each = [(None if r == 1 else r, e) for r in runs or [1] for e in lbs]
        if "budget" in cls.sweep or "alpha" in cls.sweep:
            a = alpha if "alpha" in cls.sweep else None
            out += [(p, b, a, keys, correct, r, e) for r, e in each for b in budgets]
        else:
            out.append((p, None, None, None, None, None, None))
    return out


def options(config: tuple) -> KVOptions:
    """The KV options of a config (see `configs`)."""
    _, budget, alpha, keys, correct, runs, layer_budget = config
    spec = {k: v for k, v in (("spec_keys", keys), ("correct", correct), ("runs", runs),
                              ("layer_budget", layer_budget)) if v is not None}  # fmt: skip
    return KVOptions(alpha=alpha, budget=budget or 1.0, **spec)


def greedy(engine: Engine, caches: list[KVCache], first: torch.Tensor, n: int, max_new: int,
           until: str | None = "number") -> list[list[int]]:  # fmt: skip
    """Each cache's greedy tokens after a prefill of n tokens whose next token is `first` [1], up to max_new, an end
    of sequence, or (`until`) the end of the line that holds a number ("number") or any word ("word"): the answer is
    given. None: to max_new (RULER's answers of several items, which a model may put one to a line).

    The caches decode as one batch (kv.cache.Rows: the projections and the MLP batched, each row attending through
    its own cache, its policy and state), so a prompt's policies cost about one decode where they cost one each;
    a row leaves the batch when its answer is given."""
    dev, tok = engine.device, engine.tokenizer
    given = str.isdigit if until == "number" else str.isalnum
    got: list[list[int]] = [[] for _ in caches]
    nxt = [int(first)] * len(caches)
    live = list(range(len(caches)))
    for step in range(max_new):
        going = []
        for i in live:
            t = nxt[i]
            if t in tok.eos_ids:
                continue
            got[i].append(t)
            if until and "\n" in tok.decode([t]) and any(given(ch) for ch in tok.decode(got[i])):
                continue
            going.append(i)
        live = going
        if not live or step == max_new - 1:
            break
        batch = caches[live[0]] if len(live) == 1 else Rows([caches[i] for i in live])
        ids = torch.tensor([[nxt[i]] for i in live], device=dev)
        out = decode_step(engine, batch, ids, torch.full((len(live), 1), n + step, device=dev)).argmax(-1)
        for i, t in zip(live, out.tolist(), strict=True):
            nxt[i] = t
    return got


@torch.inference_mode()
def answer_all(engine: Engine, case: Case, todo: list[tuple]) -> list[Result]:
    """Answer the case with every (policy, budget, alpha): the policies whose prefill is exact dense attention
    share one prefill (each cache stores what it keeps of it); any other prefills on its own."""
    shared = [c for c in todo if POLICIES[c[0]].dense_prefill]
    own = [c for c in todo if not POLICIES[c[0]].dense_prefill]
    out = dict(zip(shared, _answer(engine, case, shared), strict=True)) if shared else {}
    for c in own:
        out[c] = _answer(engine, case, [c])[0]
    return [out[c] for c in todo]


def _answer(engine: Engine, case: Case, todo: list[tuple]) -> list[Result]:
    dev, n = engine.device, len(case.ids)
    max_new = case.max_new or MAX_NEW[case.task]
    caches = [Solo(engine, configure(engine, c[0], options(c)), n + max_new) for c in todo]
    ref = []  # a shared prefill attends on an exact dense cache: the baseline's, else one of its own
    if len(todo) > 1:
        ref = [] if todo[0][0] == BASELINE else [Solo(engine, configure(engine, BASELINE), n + max_new)]
    try:
        x = torch.tensor([case.ids], device=dev)
        first = prefill(engine, [c.prompt for c in ref + caches], x, torch.arange(n, device=dev)[None]).argmax(-1)
        until = "number" if case.match == "number" else "word" if len(case.values) == 1 else None
        answers = greedy(engine, caches, first, n, max_new, until)
        out = []
        for (policy, budget, alpha, keys, correct, runs, lb), cache, got in zip(todo, caches, answers, strict=True):
            text = engine.tokenizer.decode(got)
            report = cache.report()
            out.append(Result(policy, budget, alpha, case.task, case.context, case.depth, case.index,
                              score(case, text), text.strip(), report.kv_fetched_share,
                              report.kv_attended_share, keys, correct, runs, score_asked(case, text), lb))  # fmt: skip
        return out
    finally:
        for c in ref + caches:
            c.close()


def run(engine: Engine, cases: list[Case], todo: list[tuple], done: list[Result], on_case=None, progress=None):
    """Answer every case not already in `done` with every config; `on_case(results)` after each case."""
    results = list(done)
    have = {r.key() for r in results}
    for i, case in enumerate(cases):
        missing = [c for c in todo if (*c, *case.cell()) not in have]
        if missing:
            t0 = time.perf_counter()
            results += answer_all(engine, case, missing)
            if on_case:
                on_case(results, time.perf_counter() - t0)
        if progress:
            progress(i + 1, len(cases))
    return results


def summary(results: list[Result]) -> list[dict]:
    """Accuracy per (policy, budget, alpha) and context, over tasks, depths and needles, next to full's."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((*r.config(), r.context), []).append(r)
    full = {k[-1]: sum(r.score for r in v) / len(v) for k, v in groups.items() if k[0] == BASELINE}
    rows = []
    for (policy, budget, alpha, keys, correct, runs, lb, context), rs in groups.items():
        acc = sum(r.score for r in rs) / len(rs)
        shares = [r.kv_fetched_share for r in rs if r.kv_fetched_share is not None]
        rows.append({
            "policy": policy, "budget": budget, "alpha": alpha, "spec_keys": keys, "correct": correct, "runs": runs,
            "layer_budget": lb,
            "context": context, "cases": len(rs),
            "accuracy": round(acc, 4),
            "vs_full": round(acc / full[context], 4) if full.get(context) else None,
            "kv_fetched_share": round(sum(shares) / len(shares), 4) if shares else None,
        })  # fmt: skip
    return rows


def as_json(meta: dict, results: list[Result]) -> dict:
    return {**meta, "summary": summary(results), "results": [asdict(r) for r in results]}


def heatmaps(results: list[Result], path, title: str) -> None:
    """Accuracy over depth (rows) x context (columns), one panel per (policy, budget): RULER's picture."""
    plt = pyplot()
    panels = list(dict.fromkeys(r.config() for r in results))
    contexts = sorted({r.context for r in results})
    depths = sorted({r.depth for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(1.6 + 2.6 * len(panels), 3.6), squeeze=False, sharey=True,
                             layout="constrained")  # fmt: skip
    for ax, panel in zip(axes[0], panels, strict=True):
        policy, budget, _, keys, correct, runs, lb = panel
        grid = [[float("nan")] * len(contexts) for _ in depths]
        for i, d in enumerate(depths):
            for j, c in enumerate(contexts):
                rs = [r.score for r in results if (r.config(), r.depth, r.context) == (panel, d, c)]
                if rs:
                    grid[i][j] = sum(rs) / len(rs)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(contexts)):
                if grid[i][j] == grid[i][j]:
                    ax.text(j, i, f"{100 * grid[i][j]:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(contexts)), [f"{c / 1024:.0f}k" if c >= 1000 else str(c) for c in contexts])
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        title = label(policy, keys, correct, panel[2], runs=runs, layer_budget=lb) + (
            f" {budget:g}" if budget is not None else "")
        ax.set_title(title.replace(" (", "\n("), fontsize=8)
        ax.set_xlabel("context")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=120)
