"""The runtime's models equal transformers (fp32) on tiny random checkpoints converted to bundles."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.kv.store import Solo
from infinigen_rt.policies import configure
from tests.conftest import TINY_CONFIGS

DECODE_STEPS = 16


def ours_greedy(engine, prompt: list[int], steps: int):
    """Prefill then `steps` greedy decode steps through a store of its own under `full`; logits of each step
    [steps+1, V]."""
    cache = Solo(engine, configure(engine), len(prompt) + steps + 1)
    prefill = engine.model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache.prompt)[0]  # [S, V]
    logits, toks = [prefill[-1]], []
    for i in range(steps):
        toks.append(int(logits[-1].argmax()))
        logits.append(engine.model(torch.tensor([[toks[-1]]]), torch.tensor([[len(prompt) + i]]), cache)[0, -1])
    cache.close()
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
    e = Engine(read_bundle(bundles[name]), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, e.cfg.vocab_size, (24,), generator=g).tolist()

    ours_pre, ours_steps, ours_toks = ours_greedy(e, prompt, DECODE_STEPS)
    ref_pre, ref_steps, ref_toks = hf_greedy(hf, prompt, DECODE_STEPS)
    assert (ours_pre - ref_pre).abs().max().item() <= 1e-4
    assert (ours_steps - ref_steps).abs().max().item() <= 1e-4
    assert ours_toks == ref_toks
