"""A Hub repo id: resolve the revision to its commit sha, download only what conversion needs."""

from __future__ import annotations

from infinigen_prep.sources.local import LocalSource
from infinigen_rt.errors import InfinigenError
from infinigen_rt.hub import download, hub_error

# the small files conversion reads; weights are added by kind (safetensors preferred over .bin)
META_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "README.md",
    "*.safetensors.index.json",
]


def hub_source(repo_id: str, revision: str | None = None) -> LocalSource:
    """Download a checkpoint from the Hub (HF_TOKEN, HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE apply)."""
    from huggingface_hub import HfApi, constants

    sha, files, license_ = revision, None, None
    if not constants.HF_HUB_OFFLINE:
        try:
            info = HfApi().model_info(repo_id, revision=revision)
        except Exception as e:
            raise hub_error(e, repo_id, revision) from None
        sha = info.sha
        files = [s.rfilename for s in info.siblings or []]
        license_ = (info.card_data or {}).get("license") if info.card_data else None
    if files is not None:
        if not any(f == "config.json" for f in files):
            raise InfinigenError(f"{repo_id} has no config.json: not a transformers checkpoint")
        if any(f.endswith(".safetensors") for f in files):
            weights = ["*.safetensors"]
        elif any(f.startswith("pytorch_model") and f.endswith(".bin") for f in files):
            weights = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
        else:
            raise InfinigenError(f"{repo_id} has no safetensors or pytorch_model*.bin weights")
    else:
        weights = ["*.safetensors"]
    path = download(repo_id, sha, allow_patterns=META_FILES + weights)
    if sha is None or len(sha) != 40:
        sha = path.name  # the snapshot folder is named by the commit sha
    src = LocalSource(path, provenance={"kind": "hub", "repo_id": repo_id, "revision": sha})
    src.license = license_ or src.license
    src.base_model = repo_id
    return src
