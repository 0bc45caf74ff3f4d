"""The bundle's default speculation keys: chosen at convert time by the keys' perplexity past the calibration text
(prepare.choose_keys), carried in bundle.json, resolved by the runtime where a run leaves --spec-keys unset."""

from __future__ import annotations

import json

import pytest

from infinigen_prep import prepare
from infinigen_prep.prepare import KEYS_BUDGET, KEYS_MARGIN, PrepOptions, keys_rule
from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.measure.perplexity import perplexity, run_sweep
from infinigen_rt.policies import configure
from infinigen_rt.policies.options import KVOptions
from tests.conftest import run_cli, tiny_convert


def test_auto_measures_both_keys_and_records_what_chose(checkpoints, tmp_path, calib_file, monkeypatch):
    seen = []  # the tokens each pass scored

    def spy(engine, run, ids, score_from, progress=None):
        seen.append((run.opts.spec_keys, list(ids), score_from))
        return perplexity(engine, run, ids, score_from, progress)

    monkeypatch.setattr("infinigen_rt.measure.perplexity.perplexity", spy)
    out = tiny_convert(checkpoints["qwen25"], tmp_path / "auto", calib_file, dtype="float32", spec_keys="auto")
    ig = read_bundle(out).infinigen
    got = ig.spec_keys_choice
    assert got["budget"] == KEYS_BUDGET and got["margin"] == KEYS_MARGIN and got["correct"] == KVOptions.correct
    (k1, ids, start), (k2, ids2, start2) = seen
    assert (k1, k2) == ("int4", "partial") and ids == ids2 and start == start2 == len(ids) // 2
    assert got["tokens"] == len(ids) == ig.defaults.layer_alpha_tokens and got["scored"] == len(ids) - start
    ppl = got["perplexity"]
    assert set(ppl) == {"int4", "partial"} and all(v > 1 for v in ppl.values())
    want = "partial" if ppl["partial"] * (1 + KEYS_MARGIN) < ppl["int4"] else "int4"
    assert ig.defaults.spec_keys == want
    # the figures are the runtime's own on the bundle as written: its engine reproduces them
    engine = Engine(read_bundle(out), device="cpu")
    for keys in ppl:
        run = configure(engine, "infinigen", KVOptions(budget=KEYS_BUDGET, spec_keys=keys))
        assert perplexity(engine, run, ids, start)[0] == pytest.approx(ppl[keys], abs=1e-3)


@pytest.mark.parametrize("int4, partial, want", [(1.10, 1.05, "partial"), (1.06, 1.05, "int4"), (1.0, 1.2, "int4")])
def test_the_4bit_keys_stand_unless_beaten_by_the_margin(int4, partial, want):
    assert keys_rule({"int4": int4, "partial": partial}) == want


def test_a_given_store_is_taken_without_measuring(checkpoints, tmp_path, calib_file, monkeypatch):
    monkeypatch.setattr(prepare, "choose_keys", lambda *a, **k: pytest.fail("measured a given choice"))
    out = tiny_convert(checkpoints["llama2_mha"], tmp_path / "b", calib_file, spec_keys="int2")
    ig = read_bundle(out).infinigen
    assert ig.defaults.spec_keys == "int2" and ig.spec_keys_choice is None
    with pytest.raises(InfinigenError, match="--spec-keys must be auto or one of partial, int4, int2, int4c, got "):
        PrepOptions(spec_keys="int8").check()


def rewrite(bundle, **defaults):
    """The bundle's bundle.json with infinigen.defaults changed (None: the key dropped, as older bundles lack it)."""
    path = bundle / "bundle.json"
    meta = json.loads(path.read_text())
    for k, v in defaults.items():
        if v is None:
            meta["infinigen"]["defaults"].pop(k, None)
        else:
            meta["infinigen"]["defaults"][k] = v
    path.write_text(json.dumps(meta))


def test_a_run_takes_the_bundles_keys_unless_told(bundles, tmp_path):
    import shutil

    b = shutil.copytree(bundles["qwen25"], tmp_path / "b")
    rewrite(b, spec_keys="partial")
    engine = Engine(read_bundle(b), device="cpu")
    assert configure(engine, "infinigen").opts.spec_keys == "partial"
    assert configure(engine, "infinigen", KVOptions(spec_keys="int2")).opts.spec_keys == "int2"
    # eval's rows record the keys run, the bundle's where none were given: a --resume matches them
    ids = list(range(3, 67))
    rows = run_sweep(engine, ids, 48, [("full", None, None), ("infinigen", 0.2, None)], [], recall=False)
    assert [r.spec_keys for r in rows] == [None, "partial"]
    again = run_sweep(engine, ids, 48, [("infinigen", 0.2, None)], rows, recall=False,
                      spec={"spec_keys": "partial"})  # fmt: skip
    assert again == rows  # already done: not run again
    # older bundles, without the field: the 4-bit keys they were tuned with
    rewrite(b, spec_keys=None)
    assert configure(Engine(read_bundle(b), device="cpu"), "infinigen").opts.spec_keys == "int4"
    rewrite(b, spec_keys="int8")
    with pytest.raises(InfinigenError, match="infinigen.defaults.spec_keys is 'int8', not one of partial, int4, int2, "
                                             "int4c; re-convert the bundle"):  # fmt: skip
        read_bundle(b, verify=False)


def test_convert_cli_takes_and_reports_the_keys(checkpoints, tmp_path, calib_file):
    out = tmp_path / "b"
    r = run_cli("prep", "convert", checkpoints["llama2_mha"], "--out", out, "--calib-text", calib_file,
                "--calib-tokens", "128", "--spec-keys", "partial", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["spec_keys"] == "partial" and summary["spec_keys_choice"] is None
    r = run_cli("prep", "convert", checkpoints["llama2_mha"], "--out", tmp_path / "c", "--calib-text", calib_file,
                "--spec-keys", "int8")  # fmt: skip
    assert r.returncode != 0 and "--spec-keys must be auto or one of partial, int4, int2, int4c, got 'int8'" in r.stderr
    assert not (tmp_path / "c").exists()
