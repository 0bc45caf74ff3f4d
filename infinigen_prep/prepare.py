"""Add the InfiniGen tensors to a bundle folder being built: calibrate -> skew -> partial columns.

Runs the runtime's own model over the calibration text, computes one skewing matrix per layer and KV
head, selects the partial columns, folds the skew into q/k for models without RoPE (OPT) and writes
`infinigen.safetensors` plus the `infinigen` section of bundle.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from infinigen_prep.calibrate import CalibText, calib_token_ids, calibrate, for_each_layer_qk
from infinigen_prep.skew import (
    SELECTIONS,
    attention_recall,
    calibrated_alpha,
    column_energy,
    energy_share,
    fold_heads,
    partial_dim,
    partial_rows,
    select_columns,
    skew_matrix,
)
from infinigen_rt.bundle import (
    INFINIGEN_FILE,
    SPEC_KEYS,
    InfinigenDefaults,
    InfinigenMeta,
    dense_layers_for,
    partial_idx_name,
    partial_q_name,
    read_bundle,
    skew_name,
)
from infinigen_rt.errors import InfinigenError
from infinigen_rt.models import load_model

# alpha in logit units. llama: measured on SmolLM2-135M (Hamlet, 1024 tokens scored from 512, budget 10 %,
# benchmarks/levers.py): alpha 5 +20.8 % ppl at 6.4 % fetched (under-fetches), 6 +6.4 % at 8.3 %, 8 +2.30 % at
# 9.8 %, 12 and over +2.41 % at 9.9 % (the budget caps). opt: the paper's 4 (no trained OPT checkpoint here).
DEFAULT_ALPHA = {"opt": 4.0, "llama": 8.0, "gemma3": 8.0}
RECALL_KEEP = 0.1  # share of the context kept when comparing column selections
EVAL_TOKENS = 1024
# the mean true attention mass the calibrated per-layer margins keep (defaults.layer_alpha); on SmolLM2 (Macbeth)
# they average 8.6 over the speculated layers, near the 8 chosen by hand on Hamlet
ALPHA_RECALL = 0.99
# the speculation keys a bundle defaults to (InfinigenDefaults.spec_keys) are chosen here, by fidelity to `full` on
# the calibration text's next tokens (those the second pass reads: EVAL_TOKENS, the second half scored) at a 10 %
# budget with the default correction: the mean KL divergence of each store's next-token distributions from full's.
# The 4-bit keys (chosen on SmolLM2's six tuning texts) stand unless another store's KL is lower by more than
# KEYS_MARGIN of theirs. Perplexity chose until the third Qwen session, and it rewards a store whose perplexity
# falls below full's: on Qwen2.5-Coder 0.5B the partial columns did so by up to 5.2 % on tuning texts (the LGPL)
# and then lost 2.3 points to the equal-bytes oracle on held-out text at 2k, where the per-channel keys lost 0.19
# (docs/accuracy.md, "The speculation keys, chosen at convert time"). Fidelity has no such reward.
KEYS_BUDGET = 0.1
KEYS_MARGIN = 0.05
KEYS_CHOICES = ("int4", "partial", "int4c")  # the first is the default the others must beat


@dataclass
class PrepOptions:
    calib_text: str | None = None  # path or hf:// address; None = the default corpus file
    calib_tokens: int = 2048
    partial_ratio: float = 0.3
    skew: bool = True
    partial_select: str = "auto"  # "auto" (measure qk vs query, keep the better), "qk", "query"
    device: str = "auto"
    spec_keys: str = "auto"  # the bundle's default speculation keys: "auto" (measured, KEYS_MARGIN) or a store

    def check(self) -> None:
        if not 0 < self.partial_ratio <= 1:
            raise InfinigenError(f"--partial-ratio must be in (0, 1], got {self.partial_ratio}")
        if self.calib_tokens < 64:
            raise InfinigenError(f"--calib-tokens must be at least 64, got {self.calib_tokens}")
        if self.partial_select not in ("auto", *SELECTIONS):
            raise InfinigenError(f"--partial-select must be auto, qk or query, got {self.partial_select!r}")
        if self.spec_keys not in ("auto", *SPEC_KEYS):
            raise InfinigenError(f"--spec-keys must be auto or one of {', '.join(SPEC_KEYS)}, got {self.spec_keys!r}")


def calib_dtype(bundle, device: torch.device) -> torch.dtype:
    """fp32 where it fits in half the host memory on CPU (half precision is slow there), else the bundle's."""
    if device.type == "cuda":
        return bundle.dtype
    n_bytes = sum(f["size"] for name, f in bundle.manifest.files.items() if name.endswith(".safetensors"))
    fp32_bytes = n_bytes * 4 // torch.tensor([], dtype=bundle.dtype).element_size()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return torch.float32 if fp32_bytes < ram // 2 else torch.bfloat16


def add_infinigen(folder: Path, text: CalibText, opts: PrepOptions, progress=None) -> InfinigenMeta:
    """Calibrate the bundle in `folder` (bundle.json written, not yet final) on `text`; return the
    `infinigen` section of bundle.json.

    Writes infinigen.safetensors and, for OPT, rewrites the shards holding q/k projections (folded)."""
    from infinigen_rt.system import resolve_device
    from infinigen_rt.tokenizer import Tokenizer

    opts.check()
    bundle = read_bundle(folder, verify=False, partial=True)
    cfg = bundle.config
    device = resolve_device(opts.device)
    model = load_model(bundle, device, calib_dtype(bundle, device), narrow=False)
    tokenizer = Tokenizer(bundle)
    all_ids = tokenizer.encode(text.text)
    ids = calib_token_ids(all_ids, text, opts.calib_tokens, cfg.max_position_embeddings)

    def step(stage, done, total):
        if progress:
            progress(stage, done, total, f"layer {done}/{total}")

    grams = calibrate(model, cfg, ids, progress=lambda d, t: step("calibrating", d, t))
    n_layers, d = cfg.num_hidden_layers, cfg.head_dim
    d_prime = partial_dim(d, opts.partial_ratio)
    skews, candidates = skew_layers(grams, n_layers, d_prime, opts.skew, step)
    choice, recall, layer_alpha, eval_ids = choose_selection(
        model, cfg, all_ids, ids, skews, candidates, opts.partial_select, progress
    )
    del model
    write_infinigen_file(folder, bundle, skews, candidates[choice])
    defaults = InfinigenDefaults(
        alpha=DEFAULT_ALPHA[cfg.arch],
        dense_layers=dense_layers_for(n_layers),
        # per layer, the mean share of the keys a query needs for MASS of its attention on the calibration
        # text: how spread the layer's attention is (KVOptions.layer_budget scales budgets by it)
        layer_key_share=grams.mass_share,
        # per layer, the smallest margin at which the speculated set holds ALPHA_RECALL of the true attention
        # mass (skew.calibrated_alpha, on the second pass's tokens): KVOptions.layer_alpha uses it
        layer_alpha=layer_alpha,
        layer_alpha_recall=ALPHA_RECALL,
        layer_alpha_tokens=len(eval_ids),
    )
    keys_choice = None
    if opts.spec_keys == "auto":
        defaults.spec_keys, keys_choice = choose_keys(folder, device, defaults, eval_ids, progress)
    else:
        defaults.spec_keys = opts.spec_keys

    return InfinigenMeta(
        file=INFINIGEN_FILE,
        skew="svd" if opts.skew else "identity",
        skew_group="kv_head",
        skew_storage="folded" if cfg.arch == "opt" else "tensor",
        partial_ratio=opts.partial_ratio,
        partial_dim=d_prime,
        partial_select=choice,
        selection_recall=recall,
        energy_share_top={
            "ratio": opts.partial_ratio,
            "skewed": round(energy_share(grams, skews, opts.partial_ratio), 6),
            "unskewed": round(energy_share(grams, [skew_matrix(g, False) for g in grams.q], opts.partial_ratio), 6),
        },
        calibration={"name": text.name, "sha256": text.sha256, "tokens": len(ids)},  # a file name, never a path
        defaults=defaults,
        spec_keys_choice=keys_choice,
    )


def choose_keys(folder: Path, device, defaults: InfinigenDefaults, ids: list[int], progress=None) -> tuple:
    """The bundle's default speculation keys, and what chose them: `full`, then each of KEYS_CHOICES, run by the
    runtime on the model as written in `folder` (OPT's folded weights included) and its InfiniGen tensors,
    teacher-forced over ids[len // 2:] at KEYS_BUDGET with the default correction; the first kept unless another's
    KL divergence from full's next-token distributions is lower by more than KEYS_MARGIN of the first's."""
    from safetensors.torch import load_file

    from infinigen_rt.engine import Engine, Speculation
    from infinigen_rt.measure.perplexity import score
    from infinigen_rt.policies import configure
    from infinigen_rt.policies.options import KVOptions

    bundle = read_bundle(folder, verify=False, partial=True)
    dtype = calib_dtype(bundle, device)
    tensors = load_file(folder / INFINIGEN_FILE, device=str(device))
    engine = Engine.from_model(bundle.config, load_model(bundle, device, dtype), device, dtype,
                               Speculation(tensors, defaults))  # fmt: skip
    score_from = len(ids) // 2
    runs = [("full", None), *((keys, KVOptions(budget=KEYS_BUDGET, spec_keys=keys)) for keys in KEYS_CHOICES)]
    ppl, kl, reference = {}, {}, None
    for n, (name, kv) in enumerate(runs):
        stage = f"choosing keys ({n + 1}/{len(runs)}: {name})"
        tick = (lambda d, t, s=stage: progress(s, d, t, f"token {d}/{t}")) if progress else None
        run = configure(engine, "infinigen", kv) if kv else configure(engine)
        s = score(engine, run, ids, score_from, tick, keep=kv is None, reference=reference)
        ppl[name] = round(s.perplexity, 4)
        if kv is None:
            reference = s.dists
        else:
            kl[name] = round(s.mean_kl, 6)
    return keys_rule(kl), {"budget": KEYS_BUDGET, "correct": KVOptions.correct, "tokens": len(ids),
                           "scored": len(ids) - score_from, "margin": KEYS_MARGIN, "kl": kl,
                           "perplexity": ppl}  # fmt: skip


def keys_rule(kl: dict[str, float]) -> str:
    """The keys kept from each store's KL divergence from full: KEYS_CHOICES' first unless another's is lower by more
    than KEYS_MARGIN of the first's."""
    first = KEYS_CHOICES[0]
    best = min(kl, key=kl.__getitem__)
    return best if kl[best] * (1 + KEYS_MARGIN) < kl[first] else first


def skew_layers(grams, n_layers: int, d_prime: int, skew: bool, step) -> tuple[list[torch.Tensor], dict]:
    """Per layer, the skewing matrix and, under it, each selection's `d_prime` partial columns: all are kept, for
    the second pass to compare."""
    skews, candidates = [], {how: [] for how in SELECTIONS}
    for i in range(n_layers):
        a = skew_matrix(grams.q[i], skew)
        eq, ek = column_energy(grams.q[i], a), column_energy(grams.k[i], a)
        for how in SELECTIONS:
            candidates[how].append(select_columns(eq, ek, d_prime, how))
        skews.append(a)
        step("skewing", i + 1, n_layers)
    return skews, candidates


def choose_selection(model, cfg, all_ids, ids, skews, candidates, partial_select: str, progress=None) -> tuple:
    """The column selection kept, its recall comparison (None unless "auto"), its calibrated alpha per layer, and
    the tokens they were measured on."""
    # a second pass over tokens calibration did not fit (the text's next EVAL_TOKENS, else its first): each column
    # selection's recall ("auto" keeps the better) and the margin alpha per layer for the selection kept
    held_out = all_ids[len(ids) : len(ids) + EVAL_TOKENS]
    in_sample = len(held_out) < 128
    eval_ids = (ids[:EVAL_TOKENS] if in_sample else held_out)[: cfg.max_position_embeddings]
    compare = partial_select == "auto"
    kept = candidates if compare else {partial_select: candidates[partial_select]}
    recall, alphas = measure_selections(model, cfg, eval_ids, skews, kept, compare, progress)
    choice = max(SELECTIONS, key=lambda how: recall[how]) if compare else partial_select  # ties keep "qk"
    if recall is not None:
        recall.update(keep=RECALL_KEEP, tokens=len(eval_ids), held_out=not in_sample)
    return choice, recall, alphas[choice], eval_ids


def write_infinigen_file(folder: Path, bundle, skews, idx) -> None:
    """Write infinigen.safetensors: per layer the partial columns and, for llama, the skew (OPT's is folded)."""
    from safetensors.torch import save_file

    cfg = bundle.config
    tensors: dict[str, torch.Tensor] = {}  # on the CPU, to be written
    for i in range(cfg.num_hidden_layers):
        tensors[partial_idx_name(i)] = idx[i].to("cpu", torch.int64).contiguous()
        if cfg.arch != "opt":
            tensors[skew_name(i)] = skews[i].to("cpu", torch.float32).contiguous()
    if cfg.arch == "opt":
        tensors.update(fold_opt(folder, bundle, skews, idx))
    save_file(tensors, str(folder / INFINIGEN_FILE), metadata={"format": "pt"})


def measure_selections(model, cfg, ids, skews, candidates, compare: bool, progress=None) -> tuple:
    """On `ids` (true per-layer queries and keys): each column selection's mean attention-mass recall (None
    unless `compare`) and its calibrated alpha per layer (skew.calibrated_alpha)."""
    sums = {how: 0.0 for how in candidates}
    alphas = {how: [None] * cfg.num_hidden_layers for how in candidates}
    n, from_pos = cfg.num_hidden_layers, len(ids) // 2

    def measure(i, q, k):
        for how, idx in candidates.items():
            if compare:
                sums[how] += attention_recall(q, k, skews[i], idx[i], RECALL_KEEP, from_pos=from_pos)
            alphas[how][i] = calibrated_alpha(q, k, skews[i], idx[i], from_pos, ALPHA_RECALL)
        if progress:
            progress("measuring selections", i + 1, n, f"layer {i + 1}/{n}")

    for_each_layer_qk(model, cfg, ids, measure)
    return ({how: round(s / n, 6) for how, s in sums.items()} if compare else None), alphas


def fold_opt(folder: Path, bundle, skews, idx) -> dict[str, torch.Tensor]:
    """Fold A into every layer's q/k projection weights and biases, rewriting each shard that holds one
    (one shard in memory at a time); return the partial query weights (d' rows per head, folded)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = bundle.config
    h = cfg.num_attention_heads
    targets: dict[str, tuple[int, str, str]] = {}  # tensor -> (layer, projection, weight|bias)
    for i in range(cfg.num_hidden_layers):
        for proj in ("q_proj", "k_proj"):
            for part in ("weight", "bias"):
                name = f"layers.{i}.self_attn.{proj}.{part}"
                if name in bundle.weight_map:
                    targets[name] = (i, proj, part)
    by_shard: dict[str, list[str]] = {}
    for name in targets:
        by_shard.setdefault(bundle.weight_map[name], []).append(name)
    partial: dict[str, torch.Tensor] = {}
    for shard in sorted(by_shard):
        with safe_open(folder / shard, framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}
        for name in by_shard[shard]:  # on the CPU, where the shard is (the skews may come from a GPU)
            i, proj, part = targets[name]
            state[name] = fold_heads(state[name], skews[i].cpu(), h)
            if proj == "q_proj":
                partial[partial_q_name(i, part)] = partial_rows(state[name], idx[i].cpu(), h)
        save_file(state, str(folder / shard), metadata={"format": "pt"})
    return partial
