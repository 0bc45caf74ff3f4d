"""Skewing and partial weights in the bundle: invariance of q.k, orthogonality, folding for OPT, energy
concentration and the column-selection comparison on the real model, determinism, bad options."""

from __future__ import annotations

import json
import math

import pytest
import torch

from infinigen_prep.calibrate import for_each_layer_qk
from infinigen_rt.bundle import load_infinigen, partial_idx_name, partial_q_name, read_bundle, skew_name
from infinigen_rt.models import load_model
from tests.conftest import run_cli, tiny_convert
from tests.test_cli import one_line_error


def qk_invariance_error(bundle_dir, ids) -> float:
    """max over layers of max|(qA)(kA)^T - qk^T| / max|qk^T|, per KV group, in fp32."""
    b = read_bundle(bundle_dir)
    model, tensors = load_model(b, "cpu", torch.float32), load_infinigen(b)
    worst = []

    def check(i, q, k):  # q: [Hkv, G, T, D], k: [Hkv, T, D]
        a = tensors[skew_name(i)]  # [Hkv, D, D]
        s = q @ k.transpose(-1, -2)[:, None]
        s2 = (q @ a[:, None]) @ (k @ a).transpose(-1, -2)[:, None]
        worst.append(((s2 - s).abs().max() / s.abs().max()).item())

    for_each_layer_qk(model, b.config, ids, check)
    assert len(worst) == b.config.num_hidden_layers
    return max(worst)


def check_tensors(bundle_dir):
    b = read_bundle(bundle_dir)
    cfg, info, t = b.config, b.meta["infinigen"], load_infinigen(b)
    d, d_prime = cfg.head_dim, info["partial_dim"]
    assert d_prime == math.ceil(info["partial_ratio"] * d)
    for i in range(cfg.num_hidden_layers):
        idx = t[partial_idx_name(i)]
        assert idx.shape == (cfg.num_key_value_heads, d_prime) and idx.dtype == torch.int64
        assert bool(((idx >= 0) & (idx < d)).all())
        assert all(len(set(row.tolist())) == d_prime for row in idx)  # unique per KV head
        if cfg.arch == "llama":
            a = t[skew_name(i)]
            assert a.shape == (cfg.num_key_value_heads, d, d)  # one A per KV head, shared by its group
            eye = torch.eye(d).expand_as(a)
            assert (a.transpose(-1, -2) @ a - eye).abs().max().item() <= 1e-5
    return b, t


@pytest.mark.parametrize("name", ["llama2_mha", "llama31_gqa", "tied_hd64"])
def test_skew_keeps_qk_and_is_orthogonal(name, bundles):
    b, _ = check_tensors(bundles[name])
    ids = torch.randint(4, b.config.vocab_size, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    assert qk_invariance_error(bundles[name], ids) <= 1e-5


@torch.inference_mode()
def test_opt_folded_model_equals_original_and_partial_query_is_real(checkpoints, bundles, tmp_path):
    dense = tiny_convert(checkpoints["opt"], tmp_path / "dense", None, dtype="float32", infinigen=False)
    folded = bundles["opt"]
    b, t = check_tensors(folded)
    assert b.meta["infinigen"]["skew_storage"] == "folded" and not any(k.endswith(".skew") for k in t)
    m0, m1 = load_model(read_bundle(dense), "cpu", torch.float32), load_model(b, "cpu", torch.float32)
    from infinigen_rt.policies.full import dense_request

    ids, pos = torch.arange(5, 40)[None], torch.arange(35)[None]
    logits = [m(ids, pos, dense_request(b.config, 35, "cpu", torch.float32)) for m in (m0, m1)]
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4
    assert not torch.equal(m0.layers[0].self_attn.q_proj.weight, m1.layers[0].self_attn.q_proj.weight)

    # the partial query weight is a real smaller matmul giving the folded query's chosen columns
    h, d = b.config.num_attention_heads, b.config.head_dim
    x = torch.randn(7, b.config.hidden_size)
    for i in range(b.config.num_hidden_layers):
        attn, idx = m1.layers[i].self_attn, t[partial_idx_name(i)]
        full = attn.q_proj(x).view(7, h, d)
        part = (x @ t[partial_q_name(i, "weight")].T + t[partial_q_name(i, "bias")]).view(7, h, -1)
        assert torch.allclose(part, torch.gather(full, 2, idx[None].expand(7, -1, -1)), atol=1e-5)


def test_no_skew_writes_identity(checkpoints, tmp_path, calib_file):
    out = tiny_convert(checkpoints["llama31_gqa"], tmp_path / "ns", calib_file, skew=False)
    b, t = check_tensors(out)
    assert b.meta["infinigen"]["skew"] == "identity"
    eye = torch.eye(b.config.head_dim)
    assert all(torch.equal(t[skew_name(i)], eye.expand_as(t[skew_name(i)])) for i in range(b.config.num_hidden_layers))


def test_calibrating_twice_is_byte_identical(checkpoints, tmp_path, calib_file):
    a = tiny_convert(checkpoints["llama31_gqa"], tmp_path / "a", calib_file)
    b = tiny_convert(checkpoints["llama31_gqa"], tmp_path / "b", calib_file)
    ma, mb = (json.loads((p / "bundle.json").read_text()) for p in (a, b))
    assert ma == mb and "infinigen.safetensors" in ma["files"]
    for f in ma["files"]:
        assert (a / f).read_bytes() == (b / f).read_bytes()


@pytest.mark.slow
def test_bad_calibration_options(checkpoints, tmp_path, calib_file):
    src, out = checkpoints["tied_hd64"], tmp_path / "o"
    one_line_error(run_cli("prep", "convert", src, "--out", out, "--partial-ratio", "0"), "partial-ratio")
    one_line_error(run_cli("prep", "convert", src, "--out", out, "--partial-select", "best"), "partial-select")
    one_line_error(run_cli("prep", "convert", src, "--out", out, "--calib-text", tmp_path / "none.txt"), "--calib-text")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    one_line_error(run_cli("prep", "convert", src, "--out", out, "--calib-text", short), "tokens")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 100)
    one_line_error(run_cli("prep", "convert", src, "--out", out, "--calib-text", binary), "UTF-8")
    # no network and no --calib-text: the default corpus cannot be fetched
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    one_line_error(run_cli("prep", "convert", src, "--out", out, env=offline), "--calib-text")
    assert not out.exists()


@pytest.mark.slow
def test_smollm2_skew_concentrates_energy_and_selection_is_measured(smollm2_bundle):
    b, _ = check_tensors(smollm2_bundle)
    info = b.meta["infinigen"]
    share = info["energy_share_top"]
    # measured: 0.785 unskewed (top columns by energy) -> 0.840 skewed; SVD is the optimum of this share
    assert share["skewed"] > share["unskewed"] + 0.03
    rec = info["selection_recall"]
    assert rec["held_out"] and rec["tokens"] == 1024
    assert info["partial_select"] == max(("qk", "query"), key=lambda k: rec[k])
    assert min(rec["qk"], rec["query"]) > 0.8  # 10 % of the tokens by partial scores hold > 80 % of the mass
    ids = read_tokens(b)
    assert qk_invariance_error(smollm2_bundle, ids) <= 1e-5


def read_tokens(b):
    from infinigen_rt.tokenizer import Tokenizer

    return Tokenizer(b).encode("Fair is foul, and foul is fair: hover through the fog and filthy air. " * 8)
