"""The runtime's models equal transformers (fp32) on tiny random checkpoints converted to bundles."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.kv.window import windowed
from infinigen_rt.models import load_model
from infinigen_rt.policies.full import DenseCache
from infinigen_rt.step import pad_batch
from tests.conftest import TINY_CONFIGS

DECODE_STEPS = 16


def dense(cfg, batch: int, n: int):
    """The exact cache for `batch` sequences of `n` tokens (the sliding layers' rings included)."""
    return windowed(cfg, DenseCache(cfg, batch, n, "cpu", torch.float32), batch, n, "cpu", torch.float32)


def ours_greedy(model, cfg, prompt: list[int], steps: int):
    """Prefill then `steps` greedy decode steps through our cache; logits of each step [steps+1, V]."""
    ids, pos, valid = pad_batch([prompt], 0, "cpu")
    cache = dense(cfg, 1, len(prompt) + steps + 1)
    prefill = model(ids, pos, cache, valid)[0]  # [S, V]
    logits, toks = [prefill[-1]], []
    p = pos[:, -1:]
    for _ in range(steps):
        toks.append(int(logits[-1].argmax()))
        p = p + 1
        logits.append(model(torch.tensor([[toks[-1]]]), p, cache, torch.ones(1, 1, dtype=torch.bool))[0, -1])
    return prefill, torch.stack(logits), toks


def hf_greedy(hf, prompt: list[int], steps: int):
    out = hf(torch.tensor([prompt]), use_cache=True)
    prefill, past = out.logits[0], out.past_key_values
    logits, toks = [prefill[-1]], []
    for _ in range(steps):
        toks.append(int(logits[-1].argmax()))
        out = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1])
    return prefill, torch.stack(logits), toks


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@torch.inference_mode()
def test_prefill_and_decode_match_transformers(name, checkpoints, bundles):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    b = read_bundle(bundles[name])
    model = load_model(b, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, b.config.vocab_size, (24,), generator=g).tolist()

    ours_pre, ours_steps, ours_toks = ours_greedy(model, b.config, prompt, DECODE_STEPS)
    ref_pre, ref_steps, ref_toks = hf_greedy(hf, prompt, DECODE_STEPS)
    assert (ours_pre - ref_pre).abs().max().item() <= 1e-4
    assert (ours_steps - ref_steps).abs().max().item() <= 1e-4
    assert ours_toks == ref_toks


@pytest.mark.parametrize("name", ["llama31_gqa", "opt", "tied_hd64", "mistral", "gemma3"])
@torch.inference_mode()
def test_left_padded_batch_equals_each_alone(name, bundles):
    b = read_bundle(bundles[name])
    model = load_model(b, "cpu", torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, b.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 11)]

    ids, pos, valid = pad_batch(prompts, 1, "cpu")
    cache = dense(b.config, 3, ids.shape[1] + 4)
    batched = model(ids, pos, cache, valid)
    nxt = batched[:, -1].argmax(-1)
    step = model(nxt[:, None], pos[:, -1:] + 1, cache, torch.ones(3, 1, dtype=torch.bool))[:, -1]
    for i, p in enumerate(prompts):
        alone, alone_step, _ = ours_greedy(model, b.config, p, 1)
        assert (batched[i, -len(p) :] - alone).abs().max().item() <= 1e-4
        assert (step[i] - alone_step[1]).abs().max().item() <= 1e-4
