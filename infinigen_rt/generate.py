"""Generation for a list of prompts, all running together: a loop over a Runner's steps (runner.py)."""

from __future__ import annotations

from collections.abc import Callable

from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import BASELINE, KVOptions, Policy, configure
from infinigen_rt.runner import BLOCK_TOKENS, Generation, Request, Runner, RunStats, blocks_for, reserved
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.system import memory_stats
from infinigen_rt.tp import tp_time


def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int | list[int] = 64,
    sampling: SamplingParams | list[SamplingParams] | None = None,
    stop: list[str] | list[list[str]] | None = None,
    on_step: Callable[[list[list[int]]], set[int] | None] | None = None,
    *,
    policy: Policy | str = BASELINE,
    kv: KVOptions | None = None,
    graphs: bool = False,
) -> tuple[list[Generation], RunStats]:
    """Generate for token-id prompts. `policy`: a Policy, or a
    policy's name configured with `kv`. Limits, sampling and stop strings are one for all rows or one per row.
    `on_step(generated)` sees every step's ids so far and may return rows to cancel. `graphs`: on a GPU, decode
    steps replayed from CUDA graphs where the policy allows (graphs.py)."""
    if isinstance(policy, str):
        policy = configure(engine, policy, kv)
    b = len(prompts)
    if not prompts:
        raise InfinigenError("every prompt needs at least one token")
    limits = per_row(max_new_tokens, b, "max_new_tokens")
    params = per_row(sampling or SamplingParams(), b, "sampling")
    stops = per_row(stop or [], b, "stop", nested=True)
    # a paged pool of exactly the blocks these requests take
    chunk = policy.opts.prefill_chunk
    pool = sum(blocks_for(reserved(policy, len(p), n, chunk)) for p, n in zip(prompts, limits, strict=True))
    run = Runner(engine, policy, max_batch=b, prefill_chunk=chunk, kv_tokens=pool * BLOCK_TOKENS, graphs=graphs)
    reduces = (engine.tp.reduces, engine.tp.reduce_s) if engine.tp else None
    rids = [run.add(Request(p, n, s, x)) for p, n, s, x in zip(prompts, limits, params, stops, strict=True)]
    row = {rid: i for i, rid in enumerate(rids)}
    results: list[Generation | None] = [None] * b
    out: list[list[int]] = [[] for _ in range(b)]
    try:
        while run.has_work:
            for o in run.step():
                out[row[o.id]] = o.token_ids
                if o.finished:
                    results[row[o.id]] = o.generation
            if on_step is not None:
                for i in on_step(out) or ():
                    if results[i] is None:
                        results[i] = run.abort(rids[i])
    finally:  # a failed step: the others' KV goes back too
        for rid in rids:
            run.abort(rid)
    if failed := next((r for r in results if r is not None and r.error), None):
        raise InfinigenError(failed.error)
    stats = run.stats
    stats.extra = {
        "policy": policy.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "batch": b,
        "tensor_parallel": engine.tp.size if engine.tp else 1,
        **(tp_time(engine.tp, reduces) if engine.tp else {}),
        "generated_tokens": sum(len(r.token_ids) for r in results),
        **run.report().to_dict(),
        **memory_stats(engine.device),
    }
    return results, stats


def per_row(value, b: int, name: str, nested: bool = False) -> list:
    """One value for every row, or a list of exactly b values."""
    is_list = isinstance(value, list) and (not nested or (value and isinstance(value[0], list)))
    if not is_list:
        return [value] * b
    if len(value) != b:
        raise InfinigenError(f"{name}: {len(value)} values for {b} prompts")
    return value
