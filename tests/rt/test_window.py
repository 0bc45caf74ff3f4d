"""Sliding-window layers (kv/window.py): the rings hold the window and nothing more, whatever the policy; the
memory model counts them apart from the global layers' KV (bench's prediction, the floor, the pool's bytes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.kv.window import Rings
from infinigen_rt.measure.synthetic import preset_config
from infinigen_rt.policies import KVOptions, configure, policy_class


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_the_device_holds_the_rings_and_the_global_layers_kv_as_predicted(name, bundles):
    from tests.rt.stored import Stored

    e = Engine(read_bundle(bundles[name]), device="cpu", dtype="float32")
    cfg, batch, seq = e.cfg, 2, 48  # (a multiple of the store's blocks: its device layers hold whole blocks)
    store = Stored(e, configure(e), [list(range(5, 5 + seq - 1))] * batch, 1).store
    rings = store.rings
    assert set(rings.k) == set(cfg.sliding_layers)
    assert all(t.shape[2] == cfg.sliding_window for t in rings.k.values())  # the window, not the context
    ring = sum(t.numel() * t.element_size() for side in (rings.k, rings.v) for t in side.values())
    assert ring == Rings.bytes(cfg, batch, 4, seq)
    device, host, read = configure(e).kv_bytes(e, batch * cfg.num_key_value_heads * seq, 4)
    held = sum(t.numel() * t.element_size() for side in (store.k, store.v) for t in side.values())
    assert held == device and host == 0  # the global layers only (none for Mistral)
    # a host-pool policy's pool holds the global layers only: its host bytes are theirs
    _, host, _ = configure(e, "offload", KVOptions()).kv_bytes(e, batch * cfg.num_key_value_heads * seq, 4)
    assert host == len(cfg.global_layers) * batch * cfg.num_key_value_heads * seq * 2 * cfg.head_dim * 4


def test_gemma3_4b_kv_at_32k_is_its_five_global_layers_plus_windows():
    cfg = preset_config("gemma-3-4b")
    assert len(cfg.global_layers) == 5 and cfg.sliding_window == 1024 and cfg.rope_scaling["rope_type"] == "linear"
    e = SimpleNamespace(cfg=cfg, dtype=torch.bfloat16)
    tokens = cfg.num_key_value_heads * 32768
    full = policy_class("full").kv_bytes(e, KVOptions(), tokens, 2)[0]
    assert full == 5 * tokens * 2 * 256 * 2  # 1.25 GiB: the 29 sliding layers hold none of the context
    assert Rings.bytes(cfg, 1, 2, 32768) == 29 * 4 * 1024 * 2 * 256 * 2


@pytest.mark.parametrize("policy", ["h2o", "oracle", "oracle-per-head", "int4", "offload"])
def test_every_policy_runs_a_hybrid_model_and_a_full_budget_is_exact(policy, bundles):
    from tests.rt.stored import greedy_logits
    from tests.rt.test_policies import PROMPTS, engines

    es = engines(bundles["gemma3"], x=(policy, KVOptions(budget=1.0)))
    ref, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 10)  # prompts of 5 to 20 tokens, window 8
    got, toks, run = greedy_logits(*es["x"], PROMPTS, 10)
    assert run.store.rings is not None
    if policy == "int4":  # 4-bit KV in the global layers' pool: the first decode step close, not equal
        assert 0 < (got[1] - ref[1]).abs().max().item() < 0.2
    else:
        assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
    r = run.report()
    assert r.kv_attended_share is None or 0 < r.kv_attended_share <= 1
