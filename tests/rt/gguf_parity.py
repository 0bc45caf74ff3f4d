"""What the tests of real GGUF models (test_gemma3.py, test_qwen.py) share: greedy decoding under a policy, and the
check of a full prefill's logits against a committed transformers reference (tests/fixtures/gguf_reference.py)."""

from __future__ import annotations

import torch

from infinigen_rt.policies.full import dense_request
from tests.rt.stored import Stored


def greedy(engine, policy, prompt: list[int], steps: int) -> tuple[list[int], Stored]:
    """`steps` greedy tokens after `prompt` under `policy`, and the store they ran in (its prefetcher closed)."""
    run = Stored(engine, policy, [prompt], steps)
    logits, _ = run.greedy(steps - 1)
    run.prefetch.close()
    return logits[:, 0].argmax(-1).tolist(), run


@torch.inference_mode()
def assert_logits_match(engine, ref: dict, tol: float = 1e-3) -> None:
    """`full`'s logits over ref["ids"] at ref["positions"]: the same argmax, the reference's top logits and
    log-normaliser within `tol`."""
    ids = torch.tensor([ref["ids"]])
    cache = dense_request(engine.cfg, ids.shape[1], engine.device, engine.dtype)
    model, norm = engine.model, engine.model.norm
    # the head at the checked positions only (at 8k positions and Qwen's 152k words, every position's logits were a
    # teraflop: most of the test's minute); the final norm and the head act on each position alone
    model.norm = Picked(norm, ref["positions"])
    try:
        logits = model(ids, torch.arange(ids.shape[1])[None], cache)[0].float()
    finally:
        model.norm = norm
    assert logits.shape[0] == len(ref["positions"])
    for i, pos in enumerate(ref["positions"]):
        top = torch.tensor(ref["top_ids"][i])
        assert logits[i].argmax().item() == top[0].item(), pos
        assert (logits[i, top] - torch.tensor(ref["top_values"][i])).abs().max().item() < tol, pos
        assert abs(logits[i].logsumexp(-1).item() - ref["logsumexp"][i]) < tol, pos


class Picked(torch.nn.Module):
    """A model's final norm, then only the positions `at` of its output [B, S, hidden]."""

    def __init__(self, norm: torch.nn.Module, at: list[int]):
        super().__init__()
        self.norm, self.at = norm, list(at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x[:, self.at])
