"""A batch of requests in a KV store of their own, driven step by step as the runner drives its store (a request's
prompt through its pass, then decode steps of the whole batch), with the logits of every step: what the policy
tests compare, and where they look at the store's state between steps."""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVReport, merge_reports
from infinigen_rt.kv.paged import PagedStore
from infinigen_rt.kv.prefetch import engine_prefetcher
from infinigen_rt.kv.store import BLOCK, KVStore, RequestPass, StoreStep
from infinigen_rt.step import decode_step, prefill


class Stored:
    """`prompts` as requests `rids` (default 0, 1, ...) of a store made for `policy`, each with room for `new` tokens
    after its prompt. `host`: the paged pool (default: one just large enough); `prefetch`: default the engine's. `gpu`:
    the GPU's decode path on a CPU (the row kernels through Triton's interpreter, fetch sizes from host counts)."""

    def __init__(self, engine, policy, prompts, new: int, prefetch=None, host: PagedStore | None = None, rids=None,
                 gpu: bool = False):  # fmt: skip
        self.engine, self.policy, self.prompts = engine, policy, prompts
        self.rids = list(range(len(prompts))) if rids is None else rids
        longest = max(len(p) for p in prompts) + new
        chunk = policy.opts.prefill_chunk or longest
        need = [policy.pool_slots(len(p), new, chunk) for p in prompts]
        self.host = host or PagedStore(sum(-(-n // BLOCK) for n in need), BLOCK, engine.device)
        for r, n in zip(self.rids, need, strict=True):
            self.host.reserve(r, n)
        self.prefetch = prefetch or engine_prefetcher(engine)
        selector = policy.selector(engine, self.prefetch.lane())
        self.store = KVStore(self.host, selector, engine.cfg, engine.device, engine.dtype, len(prompts), longest)
        if gpu:
            self.store.kernel = selector.sync_free = True
            selector.in_place = False
        self.passes = [RequestPass(self.store, r) for r in self.rids]
        self.pos = torch.tensor([[len(p)] for p in prompts], device=engine.device)  # the next token's

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Every prompt through its request's pass (in chunks of the policy's prefill_chunk): the last logits [B, V]."""
        dev, out = self.engine.device, []
        for p, ids in zip(self.passes, self.prompts, strict=True):
            x = torch.tensor([ids], device=dev)
            pos = torch.arange(len(ids), device=dev)[None]
            out.append(prefill(self.engine, p, x, pos, self.policy.opts.prefill_chunk))
        return torch.cat(out)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the whole batch: tokens [B]; the logits [B, V]."""
        with self.prefetch.sharing():
            logits = decode_step(self.engine, StoreStep(self.store, self.rids), tokens[:, None], self.pos)
        self.pos = self.pos + 1
        return logits

    def greedy(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill, then `steps` greedy decode steps: (logits [steps + 1, B, V], tokens [B, steps])."""
        out = [self.prefill()]
        toks = []
        for _ in range(steps):
            toks.append(out[-1].argmax(-1))
            out.append(self.step(toks[-1]))
        return torch.stack(out), torch.stack(toks, 1)

    def report(self, i: int | None = None) -> KVReport:
        """Request i's report, or every request's merged."""
        if i is not None:
            return self.store.report(self.rids[i])
        return merge_reports([self.store.report(r) for r in self.rids])

    def slots(self, i: int) -> torch.Tensor:
        """Request i's flat slots in the pool, in token order: [its slots taken]."""
        r = self.rids[i]
        return torch.from_numpy(self.store.alloc.slots(r, 0, self.store.length[r]))

    def close(self) -> None:
        for p in self.passes:
            p.close()
        self.prefetch.close()


def greedy_logits(engine, policy, prompts, steps: int, **kw):
    """Prefill and `steps` greedy decode steps of `prompts` in a store of their own: (logits [steps + 1, B, V], tokens
    [B, steps], the Stored, open: its store's state as the last step left it)."""
    run = Stored(engine, policy, prompts, steps + 1, **kw)
    return (*run.greedy(steps), run)
