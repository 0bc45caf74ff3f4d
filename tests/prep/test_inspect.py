"""`infinigen-prep inspect` in subprocesses: the JSON report against an independent count of the bundle's tensors
and bytes, --verify on a good and a tampered bundle, one-line errors for folders that are not bundles, and the
rich view."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors import safe_open

from tests.conftest import run_cli
from tests.test_cli import one_line_error

pytestmark = pytest.mark.slow


def weight_numel(bundle) -> int:
    """Parameters of the weight shards named in bundle.json, counted by loading every tensor."""
    meta = json.loads((bundle / "bundle.json").read_text())
    total = 0
    for shard in set(meta["weight_map"].values()):
        with safe_open(bundle / shard, framework="pt") as f:
            total += sum(f.get_tensor(k).numel() for k in f.keys())
    return total


def test_inspect_json_report(bundles):
    b = bundles["tied_hd64"]
    r = run_cli("prep", "inspect", b, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    meta = json.loads((b / "bundle.json").read_text())
    assert rep["path"] == str(b) and rep["format_version"] == 1 and rep["verified"] is False
    assert rep["architecture"] == "llama" and rep["model_type"] == "llama" and rep["dtype"] == "float32"
    cfg = rep["config"]
    assert (cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["hidden_size"]) == (4, 3, 1, 64, 192)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == meta["config"]["rope_theta"]
    assert cfg["vocab_size"] == meta["config"]["vocab_size"]
    assert rep["parameters"] == weight_numel(b)
    assert rep["tensors"] == len(meta["weight_map"])

    on_disk = {p.name: p.stat().st_size for p in b.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert {n: f["size"] for n, f in rep["files"].items()} == on_disk
    assert rep["total_bytes"] == sum(on_disk.values())
    assert all(rep["files"][n]["sha256"] == rec["sha256"] for n, rec in meta["files"].items())
    assert rep["files"]["README.md"]["sha256"] is None  # the card is not hashed

    assert rep["source"] == meta["source"] and rep["converter"]["name"] == "infinigen-prep"
    tok = rep["tokenizer"]
    assert tok["bos_token"] == "<s>" and tok["eos_token"] == "</s>" and tok["chat_template"] is True
    assert tok["eos_token_ids"] == meta["config"]["eos_token_ids"]
    assert rep["infinigen"] == meta.get("infinigen")  # passed through (None for a dense-only bundle)


def test_inspect_opt_in_process(bundles):
    from infinigen_prep.inspect import inspect_bundle

    rep = inspect_bundle(bundles["opt"])
    assert rep["architecture"] == "opt" and rep["config"]["rope_theta"] is None
    assert rep["parameters"] == weight_numel(bundles["opt"])


def test_inspect_verify(bundles, tmp_path):
    r = run_cli("prep", "inspect", bundles["opt"], "--verify", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verified"] is True

    bad = tmp_path / "tampered"
    shutil.copytree(bundles["opt"], bad)
    shard = bad / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size: only re-hashing notices
    shard.write_bytes(bytes(data))
    one_line_error(run_cli("prep", "inspect", bad, "--verify"), "sha256", shard.name)


def test_inspect_of_what_is_not_a_bundle(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    one_line_error(run_cli("prep", "inspect", foreign), "not an infinigen bundle", "bundle.json")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bundle.json").write_text("{not json")
    one_line_error(run_cli("prep", "inspect", broken, "--json"), "corrupt")

    one_line_error(run_cli("prep", "inspect", tmp_path / "nope"), "does not exist")


def test_inspect_rich_view(bundles):
    r = run_cli("prep", "inspect", bundles["llama31_gqa"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("architecture" in ln and "llama" in ln for ln in lines), r.stdout
    assert any("layers" in ln and " 4 " in ln for ln in lines), r.stdout
    assert "llama3" in r.stdout  # the rope scaling
    assert "InfiniGen parameters" in r.stdout and "files" in r.stdout and "source" in r.stdout

    r = run_cli("prep", "inspect", "--help")
    assert r.returncode == 0 and "Examples" in r.stdout and "--verify" in r.stdout, r.stdout + r.stderr


def test_inspect_reads_at_80_columns(bundles):
    r = run_cli("prep", "inspect", bundles["llama31_gqa"], env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    assert "original_max_position_embeddings=16" in r.stdout and "rope_type=llama3" in r.stdout, r.stdout
    # a value longer than its cell folds onto the next lines, whole: the calibration text's sha256
    sha = json.loads((bundles["llama31_gqa"] / "bundle.json").read_text())["infinigen"]["calibration"]["sha256"]
    assert f"sha256={sha}" in re.sub(r"[\s│]", "", r.stdout), r.stdout
