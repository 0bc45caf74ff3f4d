"""benchmarks/overlap.py: the overlap of consecutive decode steps' selections, counted right where the answer is known
(a hand-made pair of selections; a full budget, where every held row is chosen every step), and measuring it leaves
the tokens as they are."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.policies.speculation import Selection
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def overlap():
    spec = importlib.util.spec_from_file_location("overlap", ROOT / "benchmarks" / "overlap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_hand_made_pair_of_selections(overlap):
    """Two steps of one request over 2 KV heads, 10 then 11 rows held; each kind's rows and those kept, by hand."""
    t = lambda x: torch.tensor(x)  # noqa: E731  [B, Hkv, n]
    steps = [  # (held, speculation's slots and ok, the correction's slots and ok)
        (10, t([[[0, 3, 5, 0], [1, 2, 9, 9]]]), t([[[1, 1, 1, 0], [1, 1, 1, 0]]]), t([[[7], [4]]]), t([[[1], [1]]])),
        (11, t([[[0, 3, 6, 10], [1, 4, 8, 9]]]), t([[[1, 1, 1, 1], [1, 1, 1, 1]]]), t([[[5], [2]]]), t([[[1], [0]]])),
    ]  # fmt: skip
    fixed = iter(steps)

    def correct(step, layer, q, s, k, v):
        *_, slots, ok = next(fixed)
        return Selection(torch.cat([s.slots, slots], -1), torch.cat([s.ok, ok], -1).bool(), False, s.per_row), k, v

    selector = SimpleNamespace(opts=SimpleNamespace(capacity=None, sinks=1, recent=2), copy=lambda c: (c[2], 0, 0),
                               correct=correct, rows=lambda step, layer, q: None)  # fmt: skip
    ov = overlap.Overlap(selector)
    for held, slots, ok, *_ in steps:
        step = SimpleNamespace(held=(held, None), batch=SimpleNamespace(rids=[7], old=np.array([held])))
        s = Selection(slots, ok.bool(), False, torch.zeros(1))
        selector.copy((step, 3, s))
        selector.correct(step, 3, None, s, None, None)
        selector.rows(step, 3, None)
    # step 1: head 0 speculation {0, 3, 5} + correction {7}; head 1 {1, 2, 9} (9 twice, once padding) + {4}
    # step 2: head 0 {0, 3, 6, 10} + {5}; head 1 {1, 4, 8, 9} (its correction's row does not count)
    assert (ov.rows[(3, "spec")], ov.kept[(3, "spec")]) == (8, 2 + 2)  # {0, 3}; {1, 9}
    assert (ov.rows[(3, "final")], ov.kept[(3, "final")]) == (9, 3 + 3)  # {0, 3, 5}; {1, 4, 9}
    assert (ov.rows[(3, "corr")], ov.kept[(3, "corr")]) == (1, 1)  # 5, attended the step before
    # without the sink (slot 0) and the newest 2 of the 11 held (9, 10): {3, 6} and {1, 4, 8} chosen by speculation
    assert (ov.rows[(3, "spec_free")], ov.kept[(3, "spec_free")]) == (5, 1 + 1)  # {3}; {1}
    assert (ov.rows[(3, "final_free")], ov.kept[(3, "final_free")]) == (6, 2 + 2)  # {3, 5}; {1, 4}
    assert ov.shares[(3, "final")] == [6 / 9]


def test_a_full_budget_keeps_every_row_but_the_new_one_and_measuring_changes_no_token(overlap, bundles):
    e = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    ids = torch.randint(3, e.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = 5
    full = overlap.run_point(e, ids, 1.0, "paper", steps)
    layers = full["layers"]
    assert layers and all(per["final"]["steps"] == steps for per in layers.values())
    hkv = e.cfg.num_key_value_heads
    held = [len(ids) + 1 + i for i in range(steps)]  # held before each measured step (the first decode step unmeasured)
    for per in layers.values():  # step t keeps what step t-1 held: all but the row the token before it took
        assert per["final"]["rows"] == hkv * sum(held) and per["final"]["kept"] == hkv * sum(h - 1 for h in held)
        assert per["spec"] == per["final"]
    for variant in ("defaults", "paper"):
        measured = overlap.run_point(e, ids, 0.1, variant, steps)
        assert 0 < measured["mean"]["final"]["mean"] <= 1
        assert measured["tokens"] == overlap.run_point(e, ids, 0.1, variant, steps, measure=False)["tokens"]
