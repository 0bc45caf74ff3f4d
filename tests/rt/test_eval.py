"""`infinigen-rt eval`: perplexity by real decoding equals transformers' (full policy), infinigen at 100 %
budget equals full, the oracle bounds infinigen at the same fetch share, runs are deterministic; the sweep's
JSON schema, resume, and bad inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.measure.perplexity import perplexity, text_ids
from infinigen_rt.policies import KVOptions, configure
from tests.conftest import RESULTS, render80, run_cli, shakespeare
from tests.test_cli import one_line_error

SEQ, FROM = 320, 192  # 127 decode steps over 192-319 held tokens (10 %: 19-31 of them fetched)


@pytest.fixture(scope="module")
def smol(smollm2_bundle):
    engine = Engine(read_bundle(smollm2_bundle), device="cpu", dtype="float32")
    ids, _ = text_ids(engine, shakespeare("hamlet_gut.txt"), SEQ, FROM)
    return engine, ids


@pytest.fixture(scope="module")
def full_ppl(smol):
    """The full policy's perplexity by decoding (computed once: both tests below compare against it)."""
    engine, ids = smol
    return perplexity(engine, configure(engine), ids, FROM)


@pytest.mark.slow
def test_full_perplexity_matches_transformers(smol, full_ppl, smollm2_hf):
    engine, ids = smol
    ours, _, steps = full_ppl
    assert steps == SEQ - 1 - FROM
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([ids])).logits[0, FROM - 1 : -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[FROM:]))
    ref = math.exp(nll.item())
    assert abs(ours / ref - 1) <= 1e-3, (ours, ref)


@pytest.mark.slow
def test_infinigen_full_budget_equals_full_and_oracle_bounds_it(smol, full_ppl):
    engine, ids = smol
    full, _, _ = full_ppl
    everything, _, _ = perplexity(engine, configure(engine, "infinigen", KVOptions(alpha=math.inf, budget=1.0)), ids,
                                  FROM)  # fmt: skip
    assert abs(everything / full - 1) <= 1e-4
    a, rep, _ = perplexity(engine, configure(engine, "infinigen", KVOptions(budget=0.1)), ids, FROM)
    share = rep.kv_fetched_share
    oracle, orep, _ = perplexity(engine, configure(engine, "oracle", KVOptions(budget=share)), ids, FROM)
    assert orep.kv_fetched_share <= share + 0.02
    assert full <= oracle <= a, (full, oracle, a)


def test_kl_is_zero_for_the_reference_and_what_attends_everything(bundles):
    from infinigen_rt.measure.perplexity import kl_from, score

    engine = Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")
    ids = list(range(3, 83))
    ref = score(engine, configure(engine), ids, 48, keep=True)
    assert ref.dists.shape == (len(ids) - 48, engine.cfg.vocab_size) and ref.dists.dtype == torch.float32
    assert ref.kl is None and score(engine, configure(engine), ids, 48, reference=ref.dists).mean_kl == 0
    every = score(engine, configure(engine, "infinigen", KVOptions(alpha=math.inf, budget=1.0)), ids, 48,
                  reference=ref.dists)  # fmt: skip
    some = score(engine, configure(engine, "infinigen", KVOptions(budget=0.1)), ids, 48, reference=ref.dists)
    assert every.mean_kl < 1e-5 < some.mean_kl and some.kl.shape == (len(ids) - 48,)
    # against a distribution by hand: KL(p || q) = sum p (log p - log q)
    p, q = torch.log_softmax(torch.randn(3, 7), -1), torch.log_softmax(torch.randn(3, 7), -1)
    want = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(kl_from(p, q), want, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory, calib_file):
    p = tmp_path_factory.mktemp("eval") / "text.txt"
    p.write_text(calib_file.read_text() * 2)
    return p


def test_sweep_json_schema_and_resume(bundles, tiny_text, tmp_path):
    b, out = bundles["llama31_gqa"], tmp_path / "r.json"
    args = ["rt", "eval", b, "--text", tiny_text, "--seq-len", 96, "--score-from", 64, "--budgets", "0.2,0.5",
            "--policies", "full,infinigen,h2o,int4,oracle", "--out", out, "--json", "--device", "cpu"]  # fmt: skip
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {"bundle", "text_sha256", "seq_len", "score_from", "rows"} <= set(res)
    keys = {"policy", "budget", "alpha", "perplexity", "delta_pct", "kv_fetched_share", "recall", "bytes_per_token"}
    assert all(keys <= set(row) for row in res["rows"])
    got = [(r["policy"], r["budget"]) for r in res["rows"]]
    assert got == [("full", None), ("infinigen", 0.2), ("infinigen", 0.5), ("h2o", 0.2), ("h2o", 0.5),
                   ("int4", None), ("oracle", 0.2), ("oracle", 0.5)]  # fmt: skip
    assert res["rows"][0]["delta_pct"] == 0 and res["rows"][1]["recall"] is not None
    ig = res["rows"][1]  # the dense layers attend everything: the attended share is above the fetched one
    assert ig["kv_fetched_share"] < ig["kv_attended_share"] < 1 and res["rows"][5]["kv_attended_share"] == 1.0
    assert json.loads(out.read_text())["rows"] == res["rows"]
    # fidelity to full: none for full itself, and for the others positive (none of them attends everything here)
    assert res["rows"][0]["kl"] is None and all(row["kl"] > 0 for row in res["rows"][1:])

    # resume: finished rows are read back, not recomputed (a marked row keeps its mark); a missing row is run,
    # its KL against full's distributions run again for the purpose
    saved = json.loads(out.read_text())
    saved["rows"][3]["perplexity"] = 12345.0
    last = saved["rows"].pop()
    out.write_text(json.dumps(saved))
    r = run_cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)["rows"]
    assert again[3]["perplexity"] == 12345.0
    assert again[-1]["kl"] == pytest.approx(last["kl"], abs=1e-6) and again[-1]["perplexity"] == last["perplexity"]
    one_line_error(run_cli(*[a if a != 64 else 32 for a in args], "--resume"), "score_from")


def test_eval_bad_inputs(bundles, tiny_text, tmp_path):
    b = bundles["llama31_gqa"]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    one_line_error(run_cli("rt", "eval", b, "--text", empty), "empty")
    one_line_error(run_cli("rt", "eval", b, "--text", tiny_text, "--seq-len", 100000), "past the model's context")
    short = tmp_path / "short.txt"
    short.write_text("the king and the queen")
    one_line_error(run_cli("rt", "eval", b, "--text", short, "--seq-len", 256, "--score-from", 8),
                   "fewer than --seq-len")  # fmt: skip
    one_line_error(run_cli("rt", "eval", b, "--text", tiny_text, "--policies", "full,magic"), "magic")
    one_line_error(run_cli("rt", "eval", b, "--text", tmp_path / "nope.txt"), "does not exist")
    one_line_error(run_cli("rt", "eval", b, "--text", tiny_text, "--resume"), "--out")


def test_eval_table_reads_at_80_columns(bundles, tiny_text):
    from infinigen_rt.cli.eval import eval_table
    from infinigen_rt.measure.perplexity import Row

    rows = [Row(**r) for r in json.loads((RESULTS / "accuracy-smollm2-hamlet.json").read_text())["rows"]]
    text = render80(eval_table(rows, "perplexity on hamlet_gut.txt (2048 tokens, scored from 1024)"))
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    lines = [ln.split() for ln in text.splitlines()]
    assert ["policy", "budget", "alpha", "ppl", "vs", "full", "KL", "fetched", "attended", "recall", "MB/tok"] in lines
    ig = next(r for r in rows if r.policy == "infinigen" and r.budget == 0.2)  # every cell, as published
    want = ["infinigen", "0.20", f"{ig.alpha:g}", f"{ig.perplexity:.3f}", f"{ig.delta_pct:+.2f}%", "-",
            f"{ig.kv_fetched_share:.1%}", f"{ig.kv_attended_share:.1%}", "-", f"{ig.bytes_per_token / 1e6:.2f}"]
    assert want in lines, text
    h2o = next(r for r in rows if r.policy == "h2o" and r.budget == 0.1)
    assert ["h2o", "0.10", "-", f"{h2o.perplexity:.3f}", f"{h2o.delta_pct:+.2f}%", "-", f"{h2o.kv_fetched_share:.1%}",
            f"{h2o.kv_attended_share:.1%}", "-", "-"] in lines, text
    variant = Row("infinigen", 0.1, None, 40.0, 1.0, 0.1, 0.16, None, 6e6, 1.0, "partial", 0.5, kl=0.01234)
    got = [ln.split() for ln in render80(eval_table([variant], "t")).splitlines()]  # not the defaults: they fold
    assert ["infinigen", "0.10", "40.000", "+1.00%", "0.0123", "10.0%", "16.0%", "-", "6.00"] in got  # no alpha
    assert ["partial", "c0.5"] in got, got

    r = run_cli("rt", "eval", bundles["llama31_gqa"], "--text", tiny_text, "--seq-len", 48, "--score-from", 40,
                "--budgets", "0.5", "--device", "cpu", env={"COLUMNS": "80"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    firsts = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
    assert {"full", "infinigen", "h2o", "int4", "oracle"} <= set(firsts), r.stdout
