"""The bundle format, version 1: defined here, read here; infinigen_prep imports it to write bundles.

A bundle is a folder (on disk or in a Hub repo):
  bundle.json                           format version, model config, dtype, source, tokenizer
                                        settings, tensor -> shard map, sha256 and size of every file
  model-0000i-of-0000N.safetensors      weights in the runtime's tensor names
  tokenizer.json                        a `tokenizers` tokenizer
  infinigen.safetensors                 InfiniGen tensors per layer (absent in --no-infinigen bundles):
                                        layers.{i}.skew [Hkv, D, D] (RoPE models; folded into q/k for OPT),
                                        layers.{i}.partial_idx [Hkv, d'], and for OPT
                                        layers.{i}.partial_q.weight [H*d', hidden] / .bias [H*d']
  README.md                             the Hub model card (not hashed: editable)
See docs/bundle-format.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError

FORMAT = "infinigen-bundle"
FORMAT_VERSION = 1
BUNDLE_JSON = "bundle.json"
# a bundle being built holds its manifest under this name; bundle.json is written last, so nothing loads a
# folder that a killed convert left behind
PARTIAL_JSON = "bundle.partial.json"
TOKENIZER_JSON = "tokenizer.json"
MODEL_CARD = "README.md"
INFINIGEN_FILE = "infinigen.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Bundle:
    """A bundle on disk whose bundle.json has been read (and, by default, its files verified)."""

    path: Path
    meta: dict
    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.meta["dtype"]]

    @property
    def weight_map(self) -> dict[str, str]:
        return self.meta["weight_map"]

    @property
    def tokenizer(self) -> dict:
        return self.meta.get("tokenizer", {})


def is_bundle(path: Path) -> bool:
    """Whether `path` is a folder whose bundle.json says it is an InfiniGen bundle (its files unchecked)."""
    try:
        meta = json.loads((path / BUNDLE_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return path.is_dir() and not path.is_symlink() and isinstance(meta, dict) and meta.get("format") == FORMAT


def read_bundle(path: str | Path, verify: bool = True, partial: bool = False) -> Bundle:
    """Read and check a bundle folder; every problem is a one-line InfinigenError.

    `partial`: read a bundle still being built (its manifest is PARTIAL_JSON); only the converter does."""
    path = Path(path)
    if not path.exists():
        raise InfinigenError(f"no bundle at {path}: the folder does not exist (convert one with infinigen-prep)")
    if not path.is_dir():
        raise InfinigenError(f"{path} is a file, not a bundle folder (convert it with `infinigen-prep convert`)")
    meta_path = path / (PARTIAL_JSON if partial else BUNDLE_JSON)
    if not meta_path.is_file():
        if (path / PARTIAL_JSON).is_file():
            raise InfinigenError(f"{path} is an unfinished bundle: its convert was interrupted; run the convert again")
        raise InfinigenError(f"{path} is not an InfiniGen bundle: no {BUNDLE_JSON} (convert with infinigen-prep)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InfinigenError(f"{meta_path} is corrupt ({e}); re-convert the bundle") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InfinigenError(f"{meta_path} is not an InfiniGen bundle description")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise InfinigenError(
            f"bundle format version {version} is not supported by this runtime (it reads {FORMAT_VERSION}); "
            "upgrade infinigen or re-convert"
        )
    for key in ("config", "dtype", "weight_map", "files"):
        if key not in meta:
            raise InfinigenError(f"{meta_path} lacks {key!r}; re-convert the bundle")
    if meta["dtype"] not in DTYPES:
        raise InfinigenError(f"bundle dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
    verify_files(path, meta["files"], hashes=verify)
    return Bundle(path, meta, ModelConfig.from_dict(meta["config"]))


def verify_files(path: Path, files: dict, hashes: bool = True) -> None:
    """Check each listed file exists with the recorded size (and sha256 when `hashes`)."""
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            raise InfinigenError(f"bundle {path} is incomplete: {name} is missing; pull or convert it again")
        size = f.stat().st_size
        if size != rec["size"]:
            raise InfinigenError(
                f"bundle file {name} has {size} bytes, expected {rec['size']} (truncated or modified); "
                "pull or convert it again"
            )
        if hashes and sha256_file(f) != rec["sha256"]:
            raise InfinigenError(
                f"bundle file {name} does not match its sha256 in {BUNDLE_JSON} (corrupt or modified); "
                "pull or convert it again"
            )


def load_weights(bundle: Bundle, device, dtype: torch.dtype, tp=None) -> dict[str, torch.Tensor]:
    """All tensors of the bundle, cast to `dtype`, on `device` (one shard open at a time); `tp` (tp.TP): only this
    rank's slice of each split tensor is read."""
    from safetensors import SafetensorError, safe_open

    from infinigen_rt.tp import read_slice

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(bundle.weight_map.values())):
        try:
            with safe_open(bundle.path / shard, framework="pt", device="cpu") as f:
                for name in f.keys():
                    out[name] = read_slice(f, name, tp).to(device=device, dtype=dtype)
        except SafetensorError as e:
            raise InfinigenError(f"bundle file {shard} is not readable safetensors ({e}); convert again") from None
    missing = set(bundle.weight_map) - set(out)
    if missing:
        raise InfinigenError(f"bundle lacks tensors listed in its weight map, e.g. {sorted(missing)[0]}")
    return out


def skew_name(layer: int) -> str:
    return f"layers.{layer}.skew"


def partial_idx_name(layer: int) -> str:
    return f"layers.{layer}.partial_idx"


def partial_q_name(layer: int, kind: str) -> str:
    return f"layers.{layer}.partial_q.{kind}"


def load_infinigen(bundle: Bundle, device="cpu") -> dict[str, torch.Tensor]:
    """The bundle's InfiniGen tensors; a one-line error when it was converted without them."""
    from safetensors.torch import load_file

    info = bundle.meta.get("infinigen")
    if not info:
        raise InfinigenError(
            f"bundle {bundle.path} has no InfiniGen tensors (converted with --no-infinigen); "
            "re-convert it without that flag, or use --policy full/offload"
        )
    return load_file(bundle.path / info["file"], device=str(device))
