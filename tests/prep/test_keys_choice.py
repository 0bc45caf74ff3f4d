"""The bundle's default speculation keys: chosen at convert time by the keys' fidelity to full past the calibration text
(prepare.choose_keys), carried in bundle.json, resolved by the runtime where a run leaves --spec-keys unset."""

from __future__ import annotations

import json

import pytest

from infinigen_prep import prepare
from infinigen_prep.prepare import KEYS_BUDGET, KEYS_CHOICES, KEYS_MARGIN, PrepOptions, keys_rule
from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.measure.perplexity import run_sweep, score
from infinigen_rt.policies import configure
from infinigen_rt.policies.options import KVOptions
from tests.conftest import run_cli, tiny_convert


def test_auto_measures_each_stores_fidelity_and_records_what_chose(checkpoints, tmp_path, calib_file, monkeypatch):
    seen = []  # what each pass ran and scored

    def spy(engine, run, ids, score_from, progress=None, keep=False, reference=None):
        seen.append((run.name, run.opts.spec_keys, list(ids), score_from, keep, reference is not None))
        return score(engine, run, ids, score_from, progress, keep, reference)

    monkeypatch.setattr("infinigen_rt.measure.perplexity.score", spy)
    out = tiny_convert(checkpoints["qwen25"], tmp_path / "auto", calib_file, dtype="float32", spec_keys="auto")
    ig = read_bundle(out).infinigen
    got = ig.spec_keys_choice
    assert got["budget"] == KEYS_BUDGET and got["margin"] == KEYS_MARGIN and got["correct"] == KVOptions.correct
    # full first, its distributions kept; then each store against them, on the same tokens
    assert [(n, k if n != "full" else None, kp, ref) for n, k, _, _, kp, ref in seen] == [
        ("full", None, True, False), *(("infinigen", k, False, True) for k in KEYS_CHOICES)]  # fmt: skip
    ids, start = seen[0][2], seen[0][3]
    assert all(x[2] == ids and x[3] == start == len(ids) // 2 for x in seen)
    assert got["tokens"] == len(ids) == ig.defaults.layer_alpha_tokens and got["scored"] == len(ids) - start
    kl = got["kl"]
    assert set(kl) == set(KEYS_CHOICES) and all(v > 0 for v in kl.values())
    assert set(got["perplexity"]) == {"full", *KEYS_CHOICES} and all(v > 1 for v in got["perplexity"].values())
    assert ig.defaults.spec_keys == keys_rule(kl)
    # the figures are the runtime's own on the bundle as written: its engine reproduces them
    engine = Engine(read_bundle(out), device="cpu")
    ref = score(engine, configure(engine), ids, start, keep=True)
    assert ref.perplexity == pytest.approx(got["perplexity"]["full"], abs=1e-3)
    for keys in kl:
        run = configure(engine, "infinigen", KVOptions(budget=KEYS_BUDGET, spec_keys=keys))
        s = score(engine, run, ids, start, reference=ref.dists)
        assert s.mean_kl == pytest.approx(kl[keys], abs=1e-5) and s.perplexity == pytest.approx(
            got["perplexity"][keys], abs=1e-3)  # fmt: skip


@pytest.mark.parametrize("int4, partial, int4c, want", [
    (0.10, 0.09, 0.12, "partial"), (0.10, 0.097, 0.099, "int4"), (0.10, 0.2, 0.05, "int4c"), (0.1, 0.2, 0.3, "int4"),
])  # fmt: skip
def test_the_4bit_keys_stand_unless_beaten_by_the_margin(int4, partial, int4c, want):
    assert KEYS_MARGIN == 0.05  # the cases sit either side of it
    assert keys_rule({"int4": int4, "partial": partial, "int4c": int4c}) == want


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
