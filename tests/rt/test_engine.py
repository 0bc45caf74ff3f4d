"""generate's batch API: per-row limits, sampling, stop strings and cancellation (what the server uses)."""

from __future__ import annotations

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.generate import generate
from infinigen_rt.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(bundles):
    return Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")


def test_rows_keep_their_own_limits_sampling_and_stops(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    alone = [generate(engine, [p], max_new_tokens=10)[0][0] for p in prompts]
    stop = alone[2].text[len(alone[2].text) // 2 :][:2] if len(alone[2].text) > 4 else None
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    res, _ = generate(engine, prompts, [3, 10, 10], params, [[], [], [stop] if stop else []])
    assert res[0].token_ids == alone[0].token_ids[:3] and res[0].finish_reason == "length"
    seeded, _ = generate(engine, [prompts[1]], max_new_tokens=10, sampling=params[1])
    assert res[1].token_ids == seeded[0].token_ids  # a row's seeded sampling does not depend on its batch
    if stop:
        assert res[2].finish_reason == "stop" and res[2].text == alone[2].text[: alone[2].text.index(stop)]


def test_on_step_can_cancel_a_row(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    res, _ = generate(engine, prompts, max_new_tokens=8, on_step=lambda out: {0} if len(out[0]) >= 2 else None)
    assert res[0].finish_reason == "cancelled" and len(res[0].token_ids) == 2
    assert len(res[1].token_ids) == 8 or res[1].finish_reason == "stop"


def test_per_row_lists_must_match_the_batch(engine):
    with pytest.raises(InfinigenError, match="2 values for 3 prompts"):
        generate(engine, [[5], [6], [7]], max_new_tokens=[1, 2])


def test_the_context_bounds_every_architecture(engine):
    """Llama too (only OPT was checked): a prompt that fills the positions, or new tokens past them, is refused."""
    with pytest.raises(InfinigenError, match="the prompt is 256 tokens but the model's context is 256"):
        generate(engine, [[5] * 256], max_new_tokens=1)
    with pytest.raises(InfinigenError, match="ask for at most 6"):
        generate(engine, [[5] * 250], max_new_tokens=7)
    (res,), _ = generate(engine, [[5] * 250], max_new_tokens=6)  # exactly what fits
    assert len(res.token_ids) <= 6


def test_sampling_at_the_edges_of_float32():
    """A temperature or top_p that float32 rounds to 0 (the server accepts 5e-324) samples the best token, never NaN."""
    import torch

    from infinigen_rt.sampling import sample

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    gen = torch.Generator().manual_seed(1)
    for t, p in [(5e-324, 1.0), (1e-30, 1.0), (1.0, 5e-324), (1e-37, 1e-300)]:
        assert torch.equal(sample(logits, SamplingParams(temperature=t, top_p=p), gen), best), (t, p)
    many = torch.stack([sample(logits, SamplingParams(temperature=1.0), gen) for _ in range(50)])
    assert (many != best).any()  # an ordinary temperature still samples
