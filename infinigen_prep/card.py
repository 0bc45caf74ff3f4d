"""The bundle's README.md: a Hub model card with YAML front matter and how to run it."""

from __future__ import annotations

from infinigen_rt.bundle import BundleMeta


def model_card(meta: BundleMeta, license_: str | None, base_model: str | None) -> str:
    cfg, src = meta.config, meta.source
    origin = src.get("repo_id") or src.get("file") or src.get("name") or "a local checkpoint"
    front = ["---", "library_name: infinigen"]
    if base_model:
        front.append(f"base_model: {base_model}")
    if license_:
        front.append(f"license: {license_}")
    front += ["tags:", "- infinigen", "- kv-cache", f"- {meta.architecture}", "---", ""]
    rev = f" at revision `{src['revision']}`" if src.get("revision") else ""
    sha = f" (sha256 `{src['sha256']}`)" if src.get("sha256") else ""
    body = f"""# {origin} as an InfiniGen bundle

An [InfiniGen](https://arxiv.org/abs/2406.19707) bundle of `{origin}`{rev}{sha}: weights in
safetensors ({meta.dtype}), tokenizer and the model config the `infinigen-rt` runtime reads.

| | |
|---|---|
| architecture | {meta.architecture} |
| layers | {cfg.num_hidden_layers} |
| query / KV heads | {cfg.num_attention_heads} / {cfg.num_key_value_heads} |
| head dim | {cfg.head_dim} |
| bundle format | {meta.format_version} |

## How to run

```
pip install infinigen
infinigen-rt generate THIS_REPO_OR_FOLDER "Once upon a time" --max-new-tokens 64
```

Converted with infinigen-prep {meta.converter["version"]}.
"""
    return "\n".join(front) + body
