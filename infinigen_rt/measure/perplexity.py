"""Accuracy as users measure it: perplexity by real decoding through the engine, for a sweep of policies.

The text's first `score_from` tokens are the prompt (one prefill); then every following token is fed
one decode step at a time (teacher forcing) through the same cache policy `generate` uses, and the
log-probability of the next true token is scored. Nothing is masked after the fact: a policy sees
exactly what it would see when generating.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from infinigen_rt.bundle import FALLBACK_SPEC_KEYS
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import pyplot, read_json, read_utf8, save_figure, write_atomic
from infinigen_rt.kv.store import Solo
from infinigen_rt.policies import BASELINE, POLICIES, KVOptions, KVReport, Policy, configure
from infinigen_rt.step import decode_step, prefill


@dataclass
class Row:
    policy: str
    budget: float | None
    alpha: float | None
    perplexity: float
    delta_pct: float | None
    kv_fetched_share: float | None
    kv_attended_share: float | None  # over every layer: the dense layers attend all of it
    recall: float | None
    bytes_per_token: float | None
    seconds: float
    spec_keys: str | None = None  # a speculating policy's keys and correction share (see KVOptions)
    correct: float | None = None
    kv_corrected_share: float | None = None
    shortlist: float | None = None  # the correction's candidates (KVOptions.shortlist; absent in older files)
    kl: float | None = None  # mean KL(full || this) of the next-token distributions, nats (absent in older files)

    def key(self) -> tuple:
        return (self.policy, self.budget, self.alpha, self.spec_keys, self.correct, self.shortlist)

    def label(self) -> str:
        return label(self.policy, self.spec_keys, self.correct, self.alpha, shortlist=self.shortlist)


def label(policy: str, spec_keys: str | None, correct: float | None, alpha: float | None = None,
          short: bool = False, shortlist: float | None = None, runs: int | None = None,
          layer_budget: float | None = None) -> str:  # fmt: skip
    """A policy's name in tables and plots; one that speculates with its keys, its margin when it has one (the
    budget alone decides otherwise) and its correction share when on, with its shortlist where one was recorded.
    `short`: for a table at 80 columns with a margin column, the keys where not int4 (the keys of every bundle
    converted before convert chose them; a Qwen bundle's default rows read "infinigen partial"), the correction
    share and the shortlist where they differ from the defaults ("infinigen partial c0": the paper's keys without a
    correction; plain "infinigen": the int4 keys with the default correction); `runs` where a selection in runs
    was asked for ("r8"); `layer_budget` where a per-layer budget exponent other than the bundle's was ("lb0.5")."""
    if short:
        keys = [spec_keys] if spec_keys not in (None, FALLBACK_SPEC_KEYS) else []
        corr = [f"c{correct:g}"] if correct is not None and correct != KVOptions.correct else []
        listed = [f"s{shortlist:g}"] if correct and shortlist is not None and shortlist != KVOptions.shortlist else []
        lb = [f"lb{layer_budget:g}"] if layer_budget is not None else []
        return " ".join([policy, *keys, *corr, *listed, *([f"r{runs}"] if runs else []), *lb])
    if spec_keys is None:
        return policy
    parts = [f"{spec_keys} keys"]
    if alpha is not None and math.isfinite(alpha):
        parts.append(f"alpha {alpha:g}")
    if correct:
        parts.append(f"correct {correct:g}")
        if shortlist:
            parts.append(f"shortlist {shortlist:g}")
    if runs:
        parts.append(f"runs of {runs}")
    if layer_budget is not None:
        parts.append(f"layer budgets ^{layer_budget:g}")
    return f"{policy} ({', '.join(parts)})"


def text_ids(engine: Engine, path: str | Path, seq_len: int, score_from: int,
             length: str = "--seq-len") -> tuple[list[int], str]:  # fmt: skip
    """The first seq_len tokens of a UTF-8 text file, and the text's sha256; `length` names what asked for seq_len
    in an error (eval's --seq-len, bench's largest --context)."""
    p = Path(path)
    check_text_file(p)
    text, sha = read_utf8(p, f"--text {p}")
    if not text.strip():
        raise InfinigenError(f"--text {p} is empty")
    if length == "--seq-len":
        if not 0 < score_from < seq_len:
            raise InfinigenError(f"--score-from must be in (0, --seq-len), got {score_from} with --seq-len {seq_len}")
        if seq_len > (context := engine.cfg.max_position_embeddings):
            raise InfinigenError(f"--seq-len {seq_len} is past the model's context of {context:,} tokens: its "
                                 f"perplexity there would mean nothing; give at most {context}")  # fmt: skip
    ids = engine.tokenizer.encode(text)
    if len(ids) < seq_len:
        raise InfinigenError(f"--text {p} has {len(ids)} tokens, fewer than {length} {seq_len}; give a longer text")
    return ids[:seq_len], sha


def check_text_file(p: Path) -> None:
    """--text names a file (a one-line error for a folder or nothing there)."""
    if p.is_dir():
        raise InfinigenError(f"--text {p} is a folder; give a UTF-8 text file")
    if not p.is_file():
        raise InfinigenError(f"--text {p} does not exist")


@torch.inference_mode()
def perplexity(engine: Engine, policy: Policy, ids: list[int], score_from: int,
               progress=None) -> tuple[float, KVReport, int]:  # fmt: skip
    """Teacher-forced perplexity of ids[score_from:] given what precedes, decoding token by token under `policy`.

    Returns (perplexity, the cache's report, decode steps)."""
    s = score(engine, policy, ids, score_from, progress)
    return s.perplexity, s.report, s.steps


@dataclass
class Scored:
    """What scoring a text under a policy gives: the true next tokens' log-probabilities, the cache's report, the
    decode steps, and where asked each position's whole next-token distribution (`dists`, log-probabilities in
    float32 on the run's device: the reference others are compared with) or its KL divergence from a reference's
    (`kl`)."""

    logprobs: torch.Tensor  # [n]
    report: KVReport
    steps: int
    dists: torch.Tensor | None = None  # [n, vocab]
    kl: torch.Tensor | None = None  # [n], nats

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprobs.mean().item())

    @property
    def mean_kl(self) -> float | None:
        return None if self.kl is None else self.kl.mean().item()


def kl_from(reference: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, nats: `reference` log p as `score` keeps it, `lp` log q [rows, vocab] (0 where equal)."""
    ref = reference.to(lp.device, torch.float32)
    return (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)


@torch.inference_mode()
def score(engine: Engine, policy: Policy, ids: list[int], score_from: int, progress=None, keep: bool = False,
          reference: torch.Tensor | None = None) -> Scored:  # fmt: skip
    """ids[:score_from] prefilled, each later token fed one decode step under `policy` (the server's prompt scoring
    does the same through the runner), and each position's next-token distribution scored: the true token's
    log-probability; with `keep` the whole distribution (Scored.dists); with `reference` (another run's dists over
    the same ids) the KL divergence from it, the run's fidelity to the reference whichever way its perplexity
    moves."""
    dev = engine.device
    cache = Solo(engine, policy, len(ids))
    lps, dists, kls = [], [], []

    def scored(logits, target):
        lp = torch.log_softmax(logits.float(), -1)[0]
        lps.append(lp[target].clone())  # (a view would keep the whole row alive)
        if keep:
            dists.append(lp)
        if reference is not None:
            kls.append(kl_from(reference[len(lps) - 1], lp))

    try:
        x = torch.tensor([ids[:score_from]], device=dev)
        scored(prefill(engine, cache.prompt, x, torch.arange(score_from, device=dev)[None], policy.opts.prefill_chunk),
               ids[score_from])  # fmt: skip
        steps = len(ids) - 1 - score_from
        for i, t in enumerate(range(score_from, len(ids) - 1)):
            scored(decode_step(engine, cache, torch.tensor([[ids[t]]], device=dev), torch.tensor([[t]], device=dev)),
                   ids[t + 1])  # fmt: skip
            if progress:
                progress(i + 1, steps)
        return Scored(torch.stack(lps), cache.report(), steps, torch.stack(dists) if keep else None,
                      torch.stack(kls) if reference is not None else None)  # fmt: skip
    finally:
        cache.close()


def configs(policies: list[str], budgets: list[float], alphas: list[float]) -> list[tuple]:
    """(policy, budget, alpha) rows of the sweep, the baseline first (every delta is against it): each policy over
    what it sweeps (its `sweep`: budgets, and alphas for a speculating one), else once."""
    out = [(BASELINE, None, None)]
    for p in policies:
        sweep = POLICIES[p].sweep
        if p == BASELINE:
            continue
        if "alpha" in sweep:
            out += [(p, b, a) for b in budgets for a in alphas]
        elif "budget" in sweep:
            out += [(p, b, None) for b in budgets]
        else:
            out.append((p, None, None))
    return out


def speculation_options(policy: str, spec: dict | None) -> dict:
    """The speculation options (`spec`: spec_keys, correct; None: the defaults) a policy that speculates runs with."""
    return dict(spec or {}) if POLICIES[policy].speculative else {}


def run_sweep(engine: Engine, ids, score_from, todo, done: list[Row], recall=True, on_row=None, progress=None,
              spec: dict | None = None):  # fmt: skip
    """Evaluate every (policy, budget, alpha) in `todo` not already in `done`; `on_row(rows)` after each. `spec`:
    the speculating policies' spec_keys and correct (None: their defaults), recorded in their rows. Each row's KL
    is from the baseline's distributions, kept from its run here (the baseline is run again, unrecorded, where
    `done` has its row and other rows remain)."""
    rows = list(done)
    have = {r.key() for r in rows}
    full = next((r.perplexity for r in rows if r.policy == BASELINE), None)
    reference = None

    def baseline_dists():
        return score(engine, configure(engine, BASELINE), ids, score_from, keep=True,
                     progress=(lambda d, t: progress(f"{BASELINE} (the reference)", d, t)) if progress else None).dists
    for n, (policy, budget, alpha) in enumerate(todo):
        traced = recall and "trace_recall" in POLICIES[policy].knobs
        kv = KVOptions(alpha=alpha, budget=budget or 1.0, trace_recall=traced, **speculation_options(policy, spec))
        run = configure(engine, policy, kv)  # the keys resolved: the option, else the bundle's
        kv = run.opts
        keys, correct = (kv.spec_keys, kv.correct) if POLICIES[policy].speculative else (None, None)
        # the correction's shortlist where it has one (None for every held slot: the rows of older files)
        shortlist = (kv.shortlist or None) if POLICIES[policy].speculative and kv.correct else None
        if (policy, budget, alpha, keys, correct, shortlist) in have:
            continue
        t0 = time.perf_counter()
        label = f"({n + 1}/{len(todo)}) {policy}" + (f" budget {budget}" if budget else "") + (
            f" alpha {alpha}" if alpha is not None else "")  # fmt: skip
        if policy != BASELINE and reference is None:
            reference = baseline_dists()
        s = score(engine, run, ids, score_from, (lambda d, t, lb=label: progress(lb, d, t)) if progress else None,
                  keep=policy == BASELINE, reference=reference)  # fmt: skip
        ppl, report, steps = s.perplexity, s.report, s.steps
        if policy == BASELINE:
            full, reference = full or ppl, s.dists
        h2d = report.bytes_h2d
        share, attended = report.kv_fetched_share, report.kv_attended_share
        rows.append(Row(
            policy=policy, budget=budget, alpha=alpha, perplexity=round(ppl, 4),
            delta_pct=round(100 * (ppl / full - 1), 3) if full else None,
            kv_fetched_share=share, kv_attended_share=attended,
            recall=report.attention_recall, bytes_per_token=round(h2d / steps, 1) if h2d else None,
            seconds=round(time.perf_counter() - t0, 2), spec_keys=keys, correct=correct,
            kv_corrected_share=report.kv_corrected_share, shortlist=shortlist,
            kl=None if s.kl is None else round(s.mean_kl, 6),
        ))  # fmt: skip
        if on_row:
            on_row(rows)
    return rows


def save(path: Path, meta: dict, rows: list[Row]) -> None:
    """Write the results atomically (a resumed or interrupted sweep never leaves half a file)."""
    write_atomic(path, json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n", "--out")


def load_done(path: Path, meta: dict) -> list[Row]:
    """Finished rows of an earlier run with the same bundle, text and lengths (else a one-line error)."""
    return load_finished(path, meta, "rows", lambda r: Row(**{"kv_attended_share": None, **r}), "an eval",
                         ("bundle", "text_sha256", "seq_len", "score_from"))  # fmt: skip


def load_finished(path: Path, meta: dict, field: str, make, what: str, same: tuple[str, ...]) -> list:
    """What an earlier run saved in `path` under `field` (each made by `make`), if it ran with the same `same` keys
    of `meta`; nothing when there is no file; a one-line error for another kind of file or another run."""
    if not path.is_file():
        return []
    old = read_json(path, f"--out {path}", "cannot resume from it: give --out a new file")
    try:
        done = [make(r) for r in old[field]]
    except (KeyError, TypeError) as e:
        raise InfinigenError(f"cannot resume from {path}: not {what} result file ({e})") from None
    for k in same:
        if old.get(k) != meta[k]:
            raise InfinigenError(f"cannot resume from {path}: it was run with another {k} ({old.get(k)!r})")
    return done


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Perplexity change vs share of KV fetched, one line per policy (the paper's figure)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy in dict.fromkeys(r.label() for r in rows if r.policy != BASELINE):
        pts = sorted((r.kv_fetched_share, r.delta_pct) for r in rows if r.label() == policy and r.kv_fetched_share)
        if pts:
            ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=policy)
    ax.axhline(0, color="gray", lw=0.8, ls="--", label=BASELINE)
    ax.set_xlabel("share of KV fetched per step (%)")
    ax.set_ylabel(f"perplexity change vs {BASELINE} (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
