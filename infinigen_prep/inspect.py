"""A report of what a bundle holds: model, config, parameters, files, provenance, InfiniGen parameters."""

from __future__ import annotations

from pathlib import Path

from infinigen_prep.push import bundle_files
from infinigen_rt.bundle import read_bundle
from infinigen_rt.errors import InfinigenError


def count_parameters(path: Path, weight_map: dict[str, str]) -> tuple[int, int]:
    """(parameters, tensors) of the weight shards, from the safetensors headers (no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    params = tensors = 0
    seen = set()
    for shard in sorted(set(weight_map.values())):
        try:
            with safe_open(path / shard, framework="pt", device="cpu") as f:
                for name in f.keys():
                    n = 1
                    for d in f.get_slice(name).get_shape():
                        n *= d
                    params += n
                    tensors += 1
                    seen.add(name)
        except SafetensorError as e:
            raise InfinigenError(f"bundle file {shard} is not readable safetensors ({e}); convert again") from None
    missing = set(weight_map) - seen
    if missing:
        raise InfinigenError(f"bundle lacks tensors listed in its weight map, e.g. {sorted(missing)[0]}")
    return params, tensors


def check_finite(path: Path, names: list[str]) -> None:
    """Every floating-point tensor of the safetensors files `names` holds finite numbers: a NaN or an infinity in
    a weight makes every token's logits NaN, whatever the hashes say (they only say the file is the one written)."""
    import torch
    from safetensors import SafetensorError, safe_open

    for shard in names:
        try:
            with safe_open(path / shard, framework="pt", device="cpu") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad = int((~torch.isfinite(t)).sum())
                        raise InfinigenError(f"bundle tensor {name} ({shard}) holds {bad:,} NaN or infinite "
                                             "values: the model cannot run on it; re-convert from a sound "
                                             "checkpoint")  # fmt: skip
        except SafetensorError as e:
            raise InfinigenError(f"bundle file {shard} is not readable safetensors ({e}); convert again") from None


def inspect_bundle(path: str | Path, verify: bool = False) -> dict:
    """Describe the bundle at `path` as a JSON-able dict; `verify` re-hashes every file first and checks that
    every weight is finite.

    Problems are the one-line InfinigenErrors of `read_bundle` (missing folder, no or corrupt bundle.json,
    unsupported format version, missing, truncated or, with `verify`, modified files)."""
    b = read_bundle(path, verify=verify)
    if verify:
        check_finite(b.path, sorted(set(b.weight_map.values())) + ([b.infinigen.file] if b.infinigen else []))
    meta, cfg = b.manifest, b.config
    params, tensors = count_parameters(b.path, b.weight_map)
    files = {
        name: {"size": (b.path / name).stat().st_size, "sha256": meta.files.get(name, {}).get("sha256")}
        for name in bundle_files(b)
        if (b.path / name).is_file()
    }
    rope = cfg.arch != "opt"  # OPT has learned positions
    tok = b.tokenizer
    return {
        "path": str(b.path),
        "format_version": meta.format_version,
        "architecture": meta.architecture or cfg.arch,
        "model_type": meta.model_type,
        "dtype": meta.dtype,
        "parameters": params,
        "tensors": tensors,
        "config": {
            "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "hidden_act": cfg.hidden_act,
            "rope_theta": cfg.rope_theta if rope else None,
            "rope_scaling": cfg.rope_scaling if rope else None,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "files": files,
        "total_bytes": sum(f["size"] for f in files.values()),
        "source": meta.source,
        "converter": meta.converter,
        "tokenizer": {
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": cfg.eos_token_ids,
            "add_bos_token": tok.add_bos_token,
            "chat_template": bool(tok.chat_template),
        },
        "infinigen": b.infinigen.to_dict() if b.infinigen else None,
        "verified": verify,
    }
