"""Decode steps replayed from CUDA graphs (graphs.py), under fake CUDA: its graphs run nothing while capturing and
replay the captured kernels on the captured memory, none of the host code (measure/fakecuda.py), so a step that
read anything its begin did not stage where the capture read it gives other tokens. Graphed tokens equal eager ones
across buckets, batches that shrink and a store made again; a policy whose step a graph cannot replay runs eager."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.measure.fakecuda import FakeCuda, available
from infinigen_rt.policies import KVOptions, configure
from infinigen_rt.runner import Request, Runner

pytestmark = pytest.mark.skipif(available() is not None, reason=f"fake CUDA: {available()}")
PROMPTS = [list(range(5, 30)), [13, 14, 15], list(range(40, 49))]
NEW = [20, 9, 14]  # the batch shrinks as requests end


def test_a_fake_graph_replays_its_kernels_on_its_memory_and_runs_nothing_while_capturing():
    with FakeCuda() as gpu, torch.inference_mode():
        host = torch.ones(4).pin_memory()
        x, acc = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.copy_(host, non_blocking=True)
            y = x * 2 + 1
            acc.add_(y)
        assert acc.inner.tolist() == [0] * 4 and y.inner.isnan().all()  # captured, not run
        g.replay()
        assert acc.inner.tolist() == [3] * 4
        torch.cuda.synchronize()  # (the host may write the staging buffer once the copy from it is done)
        host.fill_(2)
        with gpu.recording() as ops:
            g.replay()
        assert acc.inner.tolist() == [8] * 4 and y.inner.tolist() == [5] * 4
        assert [o.name for o in ops] == ["Memcpy HtoD", "mul", "add", "add_"]
        with pytest.raises(AssertionError, match="race: write after read: fill_ on host and copy HtoD"):
            host.fill_(3)  # not waited for: the replay's copy may still read it
        for bad in (lambda: (x * 2).sum().item(), lambda: x + torch.ones(4).to("cuda")):
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    bad()


def generate(engine, policy, graphs: bool, report: bool = False):
    """Every prompt's tokens through one runner (three requests in one store, one prompt chunk a step), and its
    graphs' counts; with `report`, the runner's KV report instead."""
    run = Runner(engine, policy, max_batch=3, prefill_chunk=8, kv_tokens=4096, graphs=graphs)
    ids = [run.add(Request(p, n)) for p, n in zip(PROMPTS, NEW, strict=True)]
    out = {}
    while run.has_work:
        for o in run.step():
            out[o.id] = list(o.token_ids)
    stats = run.step_graphs.stats if run.step_graphs is not None else None
    run.close()
    if report:
        return run.report().to_dict()
    return [out[i] for i in ids], stats


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_graphed_decode_steps_give_the_eager_tokens_across_buckets_and_batches(policy, bundles, monkeypatch):
    import infinigen_rt.kv.store as store

    monkeypatch.setattr(store, "STEP_BUCKET", 16)  # decoding crosses buckets: a graph each
    b = read_bundle(bundles["llama31_gqa"])
    with FakeCuda() as gpu:
        engine = Engine(b, device="cuda", dtype="float32")
        p = configure(engine, policy, KVOptions(budget=0.3))
        want, none = generate(engine, p, graphs=False)
        got, stats = generate(engine, p, graphs=True)
        again, stats2 = generate(engine, p, graphs=True)  # a new store: its own graphs
        reports = [generate(engine, p, graphs=g, report=True) for g in (False, True)]
        del engine
    assert none is None
    assert got == want and again == want
    assert gpu.races == []
    assert stats.captured >= 3 and stats.replayed > stats.captured  # (batch 3, 2, 1; buckets of 16 tokens)
    assert stats.eager >= stats.captured  # each shape's first step
    assert stats2.replayed == stats.replayed
    assert reports[0] == reports[1]  # bytes, shares and counts: a replay's ledger as the eager step's


def test_a_step_whose_inputs_move_is_never_replayed_against_other_memory(bundles, monkeypatch):
    """The lengths uploaded into fresh memory each step (not the staging buffers): a graph replayed regardless reads
    the captured step's lengths and gives other tokens (the fake sees it); StepGraphs sees the move and leaves the
    shape eager: the eager tokens."""
    import infinigen_rt.graphs as graphs
    import infinigen_rt.kv.store as store

    real = store.KVStore.up
    monkeypatch.setattr(store.KVStore, "up", lambda self, name, a, staged: real(self, name, a,
                                                                                staged and name.strip() != "lengths"))
    b = read_bundle(bundles["llama31_gqa"])
    with FakeCuda():
        engine = Engine(b, device="cuda", dtype="float32")
        policy = configure(engine, "full", KVOptions())
        want, _ = generate(engine, policy, graphs=False)
        got, stats = generate(engine, policy, graphs=True)
        with monkeypatch.context() as m:
            m.setattr(graphs, "_where", lambda inputs: ())  # the move not seen
            stale, _ = generate(engine, policy, graphs=True)
        del engine
    assert got == want and stale != want
    assert sum(stats.moved.values()) >= 3  # each shape's moved inputs seen (and, past MOVES, left eager)

@pytest.mark.parametrize("policy", ["offload", "h2o"])
def test_a_policy_whose_step_a_graph_cannot_replay_runs_eagerly(policy, bundles):
    b = read_bundle(bundles["llama31_gqa"])
    with FakeCuda():
        engine = Engine(b, device="cuda", dtype="float32")
        p = configure(engine, policy, KVOptions(alpha=2.0, budget=0.5))
        want, _ = generate(engine, p, graphs=False)
        got, stats = generate(engine, p, graphs=True)
        del engine
    assert got == want and stats is None


def test_generate_with_graphs_gives_its_eager_tokens(bundles):
    """`generate --graphs` (generate.generate(graphs=True)): the same tokens, the defaults' steps replayed."""
    from infinigen_rt.generate import generate as run

    b = read_bundle(bundles["llama31_gqa"])
    with FakeCuda():
        engine = Engine(b, device="cuda", dtype="float32")
        kv = KVOptions(budget=0.3)
        want, _ = run(engine, PROMPTS[:2], 12, policy="infinigen", kv=kv)
        got, _ = run(engine, PROMPTS[:2], 12, policy="infinigen", kv=kv, graphs=True)
        del engine
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_a_step_that_cannot_be_captured_runs_eagerly(bundles, monkeypatch):
    """A capture that fails (here: a host read inside it, which CUDA refuses while a stream captures) leaves the step
    and its shape eager, with a warning once: the eager tokens."""
    import infinigen_rt.graphs as graphs

    forward = graphs.StepGraphs._forward

    def reads(self, step, ids, positions):
        out = forward(self, step, ids, positions)
        out.sum().item()  # a sync: refused inside a capture
        return out

    b = read_bundle(bundles["llama31_gqa"])
    with FakeCuda():
        engine = Engine(b, device="cuda", dtype="float32")
        policy = configure(engine, "full", KVOptions())
        want, _ = generate(engine, policy, graphs=False)
        monkeypatch.setattr(graphs.StepGraphs, "_forward", reads)
        with pytest.warns(UserWarning, match="could not be captured in a CUDA graph"):
            got, stats = generate(engine, policy, graphs=True)
        del engine
    assert got == want
    assert stats.replayed == 0 and stats.failed and "not permitted when stream is capturing" in stats.failed[0]
