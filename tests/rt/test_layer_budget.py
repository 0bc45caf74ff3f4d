"""Per-layer budgets (KVOptions.layer_budget): convert measures how spread each layer's attention is on the
calibration text, the runtime shares the budget out in proportion, each layer fetches its share (measured from
the copies), a full budget stays exact, and a bundle without the statistics is a one-line error."""

from __future__ import annotations

import json
import math

import pytest
import torch

from infinigen_prep.calibrate import MASS, mass_share
from infinigen_prep.skew import calibrated_alpha
from infinigen_rt.bundle import InfinigenDefaults, read_bundle
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import KVOptions
from infinigen_rt.policies.infinigen import layer_alphas, layer_options
from tests.rt.test_policies import PROMPTS, engines, greedy_logits


def test_mass_share_measures_how_spread_attention_is():
    t, d = 64, 16
    k = torch.randn(1, t, d)
    uniform = mass_share(torch.zeros(1, 2, t, d), k, from_pos=32)  # every key weighs the same
    want = sum(math.ceil(MASS * (p + 1) - 1e-9) / (p + 1) for p in range(32, t)) / (t - 32)
    assert abs(uniform - want) < 0.02, (uniform, want)
    focused = mass_share(100 * k[:, None, :, :].expand(1, 2, t, d).clone(), k, from_pos=32)  # each query: itself
    assert focused < 2.5 / 32, focused


def test_convert_records_each_layers_key_share(bundles):
    for name in ("llama2_mha", "llama31_gqa", "opt"):
        meta = json.loads((bundles[name] / "bundle.json").read_text())
        shares = meta["infinigen"]["defaults"]["layer_key_share"]
        assert len(shares) == read_bundle(bundles[name]).config.num_hidden_layers
        assert all(0 < s <= 1 for s in shares), shares


def test_layer_options_share_the_budget_in_proportion():
    shares = [0.5, 0.4, 0.1, 0.2, 0.3]
    stats = InfinigenDefaults(alpha=5.0, layer_key_share=shares)
    stats_lb = InfinigenDefaults(alpha=5.0, layer_key_share=shares, layer_budget=1.0)  # a bundle's default exponent
    before = InfinigenDefaults(alpha=5.0)  # a bundle converted before the statistics
    opts = KVOptions(budget=0.2)
    assert all(o is opts for o in layer_options(opts, stats, 2, 5).values())  # default: 0
    per = layer_options(opts, stats_lb, 2, 5)  # the bundle's default
    assert [round(per[j].budget, 6) for j in per] == [0.1, 0.2, 0.3]
    off = KVOptions(budget=0.2, layer_budget=0.0)  # the option overrides the bundle's
    assert all(o is off for o in layer_options(off, stats_lb, 2, 5).values())
    per = layer_options(KVOptions(budget=0.2, layer_budget=1.0), stats, 2, 5)
    assert sorted(per) == [2, 3, 4]
    assert [round(per[j].budget, 6) for j in per] == [0.1, 0.2, 0.3]  # 0.2 * s / mean(0.1, 0.2, 0.3): no layer capped
    half = layer_options(KVOptions(budget=0.2, layer_budget=0.5), stats, 2, 5)
    assert per[2].budget < half[2].budget < 0.2 < half[4].budget < per[4].budget
    capped = layer_options(KVOptions(budget=0.9, layer_budget=1.0), stats, 2, 5)
    assert capped[4].budget == 1.0 and abs(sum(o.budget for o in capped.values()) / 3 - 0.9) < 1e-6  # the same mean
    every = layer_options(KVOptions(budget=1.0, layer_budget=1.0), stats, 2, 5)
    assert all(o.budget == 1.0 for o in every.values())
    with pytest.raises(InfinigenError, match="convert it again"):
        layer_options(KVOptions(layer_budget=1.0), before, 2, 5)
    old = layer_options(KVOptions(budget=0.2), before, 2, 5)  # a bundle from before: one budget, no error
    assert {o.budget for o in old.values()} == {0.2}
    with pytest.raises(InfinigenError, match="layer_budget must be"):
        KVOptions(layer_budget=-1).check()


def test_each_layer_fetches_its_share_and_a_full_budget_stays_exact(bundles):
    name = "llama31_gqa"
    shares = json.loads((bundles[name] / "bundle.json").read_text())["infinigen"]["defaults"]["layer_key_share"]
    es = engines(bundles[name], lb=("infinigen", KVOptions(alpha=math.inf, budget=0.4, layer_budget=1.0)),
                 every=("infinigen", KVOptions(alpha=math.inf, budget=1.0, layer_budget=1.0)))  # fmt: skip
    _, _, cache = greedy_logits(*es["lb"], [PROMPTS[2]], 8)
    dense = es["lb"][1].opts.dense_layers
    got = cache.report().per_layer["kv_fetched_share"][dense:]
    stats = InfinigenDefaults(alpha=5.0, layer_key_share=shares)
    per = layer_options(KVOptions(budget=0.4, layer_budget=1.0), stats, dense, len(shares))
    want = [o.budget for o in per.values()]
    assert abs(sum(want) / len(want) - 0.4) < 1e-6 and max(want) <= 1
    for g, w in zip(got, want, strict=True):  # the floor of budget x held, over ~20-28 held tokens
        assert w - 1 / 20 - 1e-6 <= g <= w + 1e-6, (got, want)
    assert len(set(want)) > 1  # the layers really differ

    ref, ref_toks, _ = greedy_logits(*es["full"], [PROMPTS[2]], 8)
    logits, toks, _ = greedy_logits(*es["every"], [PROMPTS[2]], 8)
    assert torch.equal(toks, ref_toks) and (logits - ref).abs().max().item() <= 1e-4


def _captured(q, k, a_part, from_pos, alpha):
    """Mean over query heads and rows >= from_pos of the true attention mass on the keys within alpha of the row's
    best partial score (the runtime's speculated set), computed directly."""
    hkv, g, t, d = q.shape
    total, rows = 0.0, 0
    for h in range(hkv):
        for r in range(from_pos, t):
            p = (q[h, :, r] @ k[h, : r + 1].T / math.sqrt(d)).softmax(-1)  # [G, r+1]
            s = (q[h, :, r] @ a_part[h]) @ (k[h, : r + 1] @ a_part[h]).T / math.sqrt(d)
            total += float((p * (s > s.amax(-1, keepdim=True) - alpha)).sum())
            rows += g
    return total / rows


def test_calibrated_alpha_is_the_smallest_margin_holding_the_recall():
    torch.manual_seed(0)
    hkv, g, t, d = 2, 2, 48, 16
    q, k = 3 * torch.randn(hkv, g, t, d), torch.randn(hkv, t, d)
    a = torch.linalg.qr(torch.randn(hkv, d, d, dtype=torch.float64))[0]
    idx = torch.arange(6).expand(hkv, 6)
    alpha = calibrated_alpha(q, k, a, idx, from_pos=24, recall=0.9, top=40.0, bins=4000)
    a_part = torch.gather(a.float(), 2, idx[:, None, :].expand(hkv, d, -1))
    step = 40.0 / 4000
    assert _captured(q, k, a_part, 24, alpha - step) < 0.9 <= _captured(q, k, a_part, 24, alpha) + 1e-6
    assert calibrated_alpha(q, k, a, idx, 24, recall=0.99) > alpha > calibrated_alpha(q, k, a, idx, 24, recall=0.5)
    full = torch.eye(d, dtype=torch.float64).expand(hkv, d, d)  # every column: the true scores, a tighter margin
    assert calibrated_alpha(q, k, full, torch.arange(d).expand(hkv, d), 24, recall=0.9) < alpha


def test_convert_records_each_layers_alpha_and_the_option_uses_it(bundles):
    meta = read_bundle(bundles["llama31_gqa"]).infinigen.defaults
    per = meta.layer_alpha
    assert len(per) == len(meta.layer_key_share) and all(0 < x <= 40 for x in per), per
    assert layer_alphas(KVOptions(layer_alpha=True), meta, 2, len(per)) == {j: per[j] for j in range(2, len(per))}
    assert set(layer_alphas(KVOptions(), meta, 2, len(per)).values()) == {math.inf}  # off: the budget alone
    assert set(layer_alphas(KVOptions(alpha=3.0, layer_alpha=True), meta, 2, len(per)).values()) == {3.0}
    with pytest.raises(InfinigenError, match="layer_alpha needs"):
        layer_alphas(KVOptions(layer_alpha=True), InfinigenDefaults(alpha=5.0), 2, len(per))
