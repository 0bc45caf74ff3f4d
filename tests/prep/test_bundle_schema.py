"""bundle.json's dataclasses: docs/bundle-format.md lists exactly their fields, what convert writes reads back
the same, an older bundle without the later fields loads with their defaults, and a malformed one is a one-line
error naming the key."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from infinigen_rt.bundle import (
    DENSE_LAYERS,
    BundleMeta,
    InfinigenDefaults,
    InfinigenMeta,
    TokenizerMeta,
    dense_layers_for,
    read_bundle,
)
from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError
from tests.conftest import ROOT, run_cli
from tests.test_cli import one_line_error

SECTIONS = (BundleMeta, TokenizerMeta, InfinigenMeta, InfinigenDefaults)
# the defaults as the first converter wrote them, before the per-layer statistics
OLD_DEFAULTS = {"alpha": 5.0, "dense_layers": 2}


def doc_tables() -> dict[str, list[tuple[str, str]]]:
    """The rows (key cell, meaning cell) of each table under a `bundle.json` heading of the format page, by the
    heading's key path ("" for bundle.json itself)."""
    out, where = {}, None
    for line in (ROOT / "docs" / "bundle-format.md").read_text().splitlines():
        if line.startswith("#"):
            m = re.fullmatch(r"#+ bundle\.json(?: `([\w.]+)`)?", line)
            where = (m[1] or "") if m else None
        elif where is not None and line.startswith("| `"):
            out.setdefault(where, []).append(tuple(line.split("|")[1:3]))
    return out


def test_the_format_page_lists_exactly_the_dataclasses_fields():
    tables = doc_tables()
    assert set(tables) == {cls.where for cls in SECTIONS}, "a bundle.json table without a dataclass, or the reverse"
    for cls in SECTIONS:
        listed = {name for key, _ in tables[cls.where] for name in re.findall(r"`(\w+)`", key)}
        assert listed == {f.name for f in fields(cls)}, f"docs/bundle-format.md's table for {cls.__name__}"
    config = next(meaning for key, meaning in tables[""] if key.strip() == "`config`")
    missing = {f.name for f in fields(ModelConfig)} - set(re.findall(r"`(\w+)`", config))
    assert not missing, f"ModelConfig fields the page's config row does not name: {missing}"


def with_meta(bundle, tmp_path, change) -> Path:
    """A copy of `bundle` whose bundle.json `change(meta)` has edited (bundle.json itself is not hashed)."""
    out = tmp_path / "edited"
    shutil.copytree(bundle, out)
    meta = json.loads((out / "bundle.json").read_text())
    change(meta)
    (out / "bundle.json").write_text(json.dumps(meta))
    return out


def test_what_convert_writes_reads_back_the_same(bundles):
    for name in ("opt", "llama31_gqa"):
        b = read_bundle(bundles[name])
        assert b.manifest.to_dict() == b.meta
        assert b.infinigen.defaults.dense_layers == b.dense_layers == dense_layers_for(b.config.num_hidden_layers)
        assert len(b.infinigen.defaults.layer_key_share) == b.config.num_hidden_layers


def test_an_old_bundle_loads_with_the_later_fields_defaults(bundles, tmp_path):
    def old(meta):
        meta["infinigen"]["defaults"] = dict(OLD_DEFAULTS)
        meta["infinigen"]["from_a_newer_converter"] = 1  # dropped, not an error

    b = read_bundle(with_meta(bundles["llama31_gqa"], tmp_path, old))
    assert b.infinigen.defaults == InfinigenDefaults(alpha=5.0, dense_layers=2)
    d = b.infinigen.defaults
    assert d.layer_budget == 0.0 and d.layer_key_share is d.layer_alpha is d.layer_alpha_tokens is None
    assert b.meta["infinigen"]["defaults"] == OLD_DEFAULTS  # the raw dict stays as read

    info = InfinigenMeta.from_dict({k: v for k, v in b.meta["infinigen"].items() if k != "selection_recall"})
    assert info.selection_recall is None and info.defaults.alpha == 5.0
    assert InfinigenDefaults.from_dict({"alpha": 8}).dense_layers == DENSE_LAYERS
    assert TokenizerMeta.from_dict({}) == TokenizerMeta()  # every tokenizer setting is optional


def test_a_dense_only_bundle_has_no_section_and_the_default_dense_layers(bundles, tmp_path):
    b = read_bundle(with_meta(bundles["opt"], tmp_path, lambda meta: meta.pop("infinigen")))
    assert b.infinigen is None and b.dense_layers == DENSE_LAYERS
    assert "infinigen" not in b.manifest.to_dict()


def set_key(path: str, value):
    """An edit of bundle.json that sets the key at the dotted `path`; `...` removes it."""
    *parents, last = path.split(".")

    def change(meta):
        for key in parents:
            meta = meta[key]
        if value is ...:
            del meta[last]
        else:
            meta[last] = value

    return change


@pytest.mark.parametrize(
    "path, value, words",
    [
        ("infinigen.defaults.alpha", "eight", ["infinigen.defaults.alpha", "'eight'", "float"]),
        ("infinigen.defaults.alpha", ..., ["infinigen.defaults", "lacks 'alpha'"]),
        ("infinigen.defaults.dense_layers", 2.5, ["infinigen.defaults.dense_layers", "int"]),
        ("infinigen.defaults.dense_layers", True, ["infinigen.defaults.dense_layers", "int"]),
        ("infinigen.defaults.layer_key_share", [0.5, "x"], ["layer_key_share", "list[float] | None"]),
        ("infinigen.defaults", [2], ["infinigen.defaults is [2], not InfinigenDefaults"]),
        ("infinigen", "yes", ["bundle.json infinigen", "not InfinigenMeta | None"]),
        ("infinigen.partial_dim", ..., ["bundle.json infinigen lacks 'partial_dim'"]),
        ("tokenizer.chat_template", 3, ["tokenizer.chat_template", "str | None"]),
        ("weight_map", ..., ["bundle.json lacks 'weight_map'"]),
        # the model config is typed too ("30" was a TypeError in generate)
        ("config.num_hidden_layers", "30", ["bundle.json config.num_hidden_layers is '30', not int"]),
        ("config.rope_theta", "big", ["config.rope_theta", "not float"]),
        ("config.vocab_size", ..., ["bundle.json config lacks 'vocab_size'"]),
    ],
)
def test_a_malformed_bundle_json_is_a_one_line_error(bundles, tmp_path, path, value, words):
    bad = with_meta(bundles["llama31_gqa"], tmp_path, set_key(path, value))
    with pytest.raises(InfinigenError) as e:
        read_bundle(bad)
    message = str(e.value)
    assert "\n" not in message and "re-convert" in message, message
    assert all(w in message for w in words), message


SHARD = "model-00001-of-00001.safetensors"


def _files(edit):
    def change(meta):
        edit(meta["files"], meta)

    return change


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda f, m: f.clear(), [f"files does not list {SHARD}, which the bundle reads"]),
        (lambda f, m: f.pop("tokenizer.json"), ["files does not list tokenizer.json"]),
        (lambda f, m: f.pop("infinigen.safetensors"), ["files does not list infinigen.safetensors"]),
        (lambda f, m: f[SHARD].pop("size"), [f"files.{SHARD} needs a 'size'"]),  # was a KeyError
        (lambda f, m: f[SHARD].update(size="12"), [f"files.{SHARD} needs a 'size'"]),
        (lambda f, m: f[SHARD].update(sha256=None), [f"files.{SHARD} needs a 'size' (bytes) and a 'sha256'"]),
        (lambda f, m: f.update({"../x": f[SHARD]}), ["files lists '../x', which is not a file name inside"]),
        (lambda f, m: f.update({"/etc/hostname": f[SHARD]}), ["'/etc/hostname', which is not a file name inside"]),
        (lambda f, m: m["tokenizer"].update(file="../tok.json"), ["names '../tok.json' as a bundle file"]),
        (lambda f, m: m["weight_map"].update({"x": "/tmp/w.safetensors"}), ["'/tmp/w.safetensors' as a bundle"]),
    ],
    ids=["none", "no-tokenizer", "no-infinigen", "no-size", "str-size", "no-sha", "dotdot", "absolute",
         "tokenizer-outside", "shard-outside"],  # fmt: skip
)
def test_files_must_list_every_file_the_bundle_reads_by_a_name_inside_it(bundles, tmp_path, edit, words):
    """`files: {}` with a corrupted shard was `verified: true`, and generate ran on the corrupted weights."""
    bad = with_meta(bundles["llama31_gqa"], tmp_path, _files(edit))
    shard = bad / SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    for verify in (True, False):
        with pytest.raises(InfinigenError) as e:
            read_bundle(bad, verify=verify)
        message = str(e.value)
        assert "\n" not in message and "re-convert" in message, message
        assert all(w in message for w in words), message


@pytest.mark.slow
def test_inspect_and_generate_refuse_an_unlisted_shard_and_a_config_of_the_wrong_type(bundles, tmp_path):
    bad = with_meta(bundles["llama31_gqa"], tmp_path, _files(lambda f, m: f.clear()))
    one_line_error(run_cli("prep", "inspect", bad, "--verify", "--json"), "files does not list", "re-convert")
    wrong = with_meta(bundles["llama31_gqa"], tmp_path / "t", set_key("config.num_hidden_layers", "30"))
    one_line_error(run_cli("rt", "generate", wrong, "hi", "--device", "cpu"), "config.num_hidden_layers is '30'")
    zero = with_meta(bundles["llama31_gqa"], tmp_path / "z", set_key("config.num_attention_heads", 0))
    one_line_error(run_cli("rt", "generate", zero, "hi", "--device", "cpu"), "num_attention_heads must be a positive")


@pytest.mark.slow
def test_the_cli_reports_a_malformed_section_on_one_line(bundles, tmp_path):
    bad = with_meta(bundles["llama31_gqa"], tmp_path, set_key("infinigen.defaults.alpha", None))
    one_line_error(run_cli("prep", "inspect", bad), "infinigen.defaults.alpha", "re-convert")
