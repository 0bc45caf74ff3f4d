"""The converter on tiny real-format checkpoints: .bin sources, sharding, dtypes, determinism, tokenizers."""

from __future__ import annotations

import json

import pytest
import torch

from infinigen_rt.bundle import load_weights, read_bundle
from infinigen_rt.tokenizer import Tokenizer
from tests.conftest import make_checkpoint, tiny_convert

TEXTS = ["The king said: 'To be, or not to be', 12345 times.", "  leading spaces\nand a newline", "Hamlet"]


def weights(bundle_dir, dtype=None):
    b = read_bundle(bundle_dir)
    return load_weights(b, "cpu", dtype or b.dtype)


def test_bin_checkpoint_converts_like_safetensors(tmp_path, calib_file):
    st = make_checkpoint(tmp_path / "st", "opt", seed=3)
    pt = make_checkpoint(tmp_path / "pt", "opt", seed=3, safetensors=False)
    assert list(pt.glob("pytorch_model*.bin")) and not list(pt.glob("*.safetensors"))
    a = weights(tiny_convert(st, tmp_path / "a", calib_file))
    b = weights(tiny_convert(pt, tmp_path / "b", calib_file))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_bundle_holds_the_same_tensors(checkpoints, bundles, tmp_path, calib_file):
    out = tiny_convert(
        checkpoints["llama2_mha"], tmp_path / "sharded", calib_file, dtype="float32", shard_bytes=300_000
    )
    meta = json.loads((out / "bundle.json").read_text())
    shards = sorted(set(meta["weight_map"].values()))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(meta["files"]) == set(shards) | {"tokenizer.json", "infinigen.safetensors"}
    a, b = weights(out), weights(bundles["llama2_mha"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_choice_and_runtime_upcast(checkpoints, bundles, tmp_path, calib_file):
    out = tiny_convert(checkpoints["tied_hd64"], tmp_path / "bf16", calib_file, dtype="bfloat16")
    b = read_bundle(out)
    assert b.meta["dtype"] == "bfloat16"
    w16, w32 = weights(out), weights(bundles["tied_hd64"])
    assert all(t.dtype == torch.bfloat16 for t in w16.values())
    assert all(torch.equal(w16[k], w32[k].to(torch.bfloat16)) for k in w32)
    from infinigen_rt.engine import Engine

    assert Engine(b, device="cpu").dtype == torch.float32  # auto on CPU computes in fp32


def test_conversion_is_deterministic(checkpoints, tmp_path, calib_file):
    a = tiny_convert(checkpoints["opt"], tmp_path / "a", calib_file)
    b = tiny_convert(checkpoints["opt"], tmp_path / "b", calib_file)
    ma, mb = (json.loads((p / "bundle.json").read_text()) for p in (a, b))
    assert ma == mb
    for f in ma["files"]:
        assert (a / f).read_bytes() == (b / f).read_bytes()


@pytest.mark.parametrize("name", ["opt", "llama31_gqa"])
def test_tokenizer_matches_transformers(name, checkpoints, bundles):
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(checkpoints[name])
    ours = Tokenizer(read_bundle(bundles[name]))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    if name == "opt":  # OPT prepends </s> as BOS, built from vocab.json + merges.txt
        assert ours.encode("Hamlet")[0] == 2
