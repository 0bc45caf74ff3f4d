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
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import read_json
from infinigen_rt.schema import BUNDLE_JSON, Section
from infinigen_rt.system import DTYPES

FORMAT = "infinigen-bundle"
FORMAT_VERSION = 1
# a bundle being built holds its manifest under this name; bundle.json is written last, so nothing loads a
# folder that a killed convert left behind
PARTIAL_JSON = "bundle.partial.json"
TOKENIZER_JSON = "tokenizer.json"
MODEL_CARD = "README.md"
INFINIGEN_FILE = "infinigen.safetensors"
def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# the first layers whose KV stays on the device before speculation starts (layer 0 has no previous layer to
# speculate from): 2 by the lever sweep (docs/accuracy.md: 1 layer +4.43 % perplexity, 2 +2.41 %; each more
# attends 1/30 of the KV in full)
DENSE_LAYERS = 2

# what speculation may score against on the device (KVOptions.spec_keys; policies/speculation.py's key stores)
SPEC_KEYS = ("partial", "int4", "int2", "int4c")
# the keys of a bundle converted before convert chose them (the ones its defaults were tuned with, on SmolLM2)
FALLBACK_SPEC_KEYS = "int4"


def dense_layers_for(n_layers: int) -> int:
    """DENSE_LAYERS, less for a model too shallow to keep a speculated layer (at least 1: layer 0 is dense)."""
    return max(1, min(DENSE_LAYERS, n_layers - 1))


@dataclass
class TokenizerMeta(Section):
    """bundle.json's `tokenizer`: the special tokens and chat template the tokenizer file does not carry."""

    where: ClassVar[str] = "tokenizer"
    file: str = TOKENIZER_JSON
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None  # Jinja, as in the source


@dataclass
class InfinigenDefaults(Section):
    """bundle.json's `infinigen.defaults`: what a run uses for the KVOptions it leaves unset. The per-layer
    statistics came with later converters: older bundles lack them (and a run asking for them says so)."""

    where: ClassVar[str] = "infinigen.defaults"
    alpha: float  # logit units
    dense_layers: int = DENSE_LAYERS
    layer_budget: float = 0.0  # the exponent of KVOptions.layer_budget; 0 = one budget for every layer
    layer_key_share: list[float] | None = None  # per layer: the keys a query needs for 90 % of its attention
    layer_alpha: list[float] | None = None  # per layer: the margin that holds layer_alpha_recall of the mass
    layer_alpha_recall: float | None = None
    layer_alpha_tokens: int | None = None
    # what speculation scores against (KVOptions.spec_keys), chosen at convert time (InfinigenMeta.spec_keys_choice);
    # bundles converted before the choice: FALLBACK_SPEC_KEYS
    spec_keys: str = FALLBACK_SPEC_KEYS


@dataclass
class InfinigenMeta(Section):
    """bundle.json's `infinigen`: how infinigen.safetensors was made, and the run-time defaults."""

    where: ClassVar[str] = "infinigen"
    file: str
    skew: str  # "svd" or "identity"
    skew_group: str  # "kv_head"
    skew_storage: str  # "tensor" or "folded" (OPT: into q_proj/k_proj)
    partial_ratio: float
    partial_dim: int
    partial_select: str  # "qk" or "query"
    defaults: InfinigenDefaults
    selection_recall: dict | None = None  # with --partial-select auto: each selection's recall
    energy_share_top: dict | None = None
    calibration: dict | None = None  # {"name", "sha256", "tokens"}
    # how defaults.spec_keys was chosen: each key store's perplexity on the text past calibration ({"budget",
    # "tokens", "scored", "perplexity": {store: value}}); None for bundles converted before the choice
    spec_keys_choice: dict | None = None


@dataclass
class BundleMeta(Section):
    """bundle.json: everything the runtime needs besides tensors."""

    where: ClassVar[str] = ""
    format: str
    format_version: int
    config: ModelConfig
    dtype: str
    weight_map: dict[str, str]  # tensor name -> shard file
    files: dict[str, dict]  # file name -> {"sha256", "size"}
    architecture: str | None = None
    model_type: str | None = None
    source: dict = field(default_factory=dict)  # {"kind": "hub" | "local" | "gguf", ...}: never a local path
    converter: dict = field(default_factory=dict)  # {"name", "version"}
    tokenizer: TokenizerMeta = field(default_factory=TokenizerMeta)
    infinigen: InfinigenMeta | None = None  # None: converted with --no-infinigen

    def to_dict(self) -> dict:
        """A dense-only bundle has no `infinigen` key (rather than null), as ever."""
        d = super().to_dict()
        if self.infinigen is None:
            del d["infinigen"]
        return d


@dataclass
class Bundle:
    """A bundle on disk whose bundle.json has been read (and, by default, its files verified)."""

    path: Path
    meta: dict  # bundle.json as read, for the readers of its raw keys; `manifest` holds the same, typed
    manifest: BundleMeta

    @property
    def config(self) -> ModelConfig:
        return self.manifest.config

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.dtype]

    @property
    def weight_map(self) -> dict[str, str]:
        return self.manifest.weight_map

    @property
    def tokenizer(self) -> TokenizerMeta:
        return self.manifest.tokenizer

    @property
    def infinigen(self) -> InfinigenMeta | None:
        """The InfiniGen section; None for a bundle converted with --no-infinigen."""
        return self.manifest.infinigen

    @property
    def dense_layers(self) -> int:
        """The bundle's default dense layers; DENSE_LAYERS for one without InfiniGen tensors (the oracle
        policies keep as many first layers dense as infinigen would)."""
        return self.infinigen.defaults.dense_layers if self.infinigen else DENSE_LAYERS


def is_bundle(path: Path) -> bool:
    """Whether `path` is a folder whose bundle.json says it is an InfiniGen bundle (its files unchecked)."""
    try:
        meta = read_json(path / BUNDLE_JSON, BUNDLE_JSON, "")
    except InfinigenError:
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
    meta, manifest = read_manifest(meta_path)
    verify_files(path, manifest.files, hashes=verify)
    return Bundle(path, meta, manifest)


def read_manifest(meta_path: Path) -> tuple[dict, BundleMeta]:
    """A bundle's bundle.json as read and as checked (its format, types, file names and layers; not its files):
    every problem a one-line InfinigenError."""
    meta = read_json(meta_path, str(meta_path), "re-convert the bundle or pull it again")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InfinigenError(f"{meta_path} is not an InfiniGen bundle description")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise InfinigenError(
            f"bundle format version {version} is not supported by this runtime (it reads {FORMAT_VERSION}); "
            "upgrade infinigen or re-convert"
        )
    manifest = BundleMeta.from_dict(meta)
    if manifest.dtype not in DTYPES:
        raise InfinigenError(f"bundle dtype {manifest.dtype!r} is not one of {', '.join(DTYPES)}")
    if manifest.infinigen and manifest.infinigen.defaults.spec_keys not in SPEC_KEYS:
        raise InfinigenError(f"bundle.json's infinigen.defaults.spec_keys is {manifest.infinigen.defaults.spec_keys!r}"
                             f", not one of {', '.join(SPEC_KEYS)}; re-convert the bundle")  # fmt: skip
    check_files(manifest)
    check_layers(manifest)
    return meta, manifest


def read_files(manifest: BundleMeta) -> list[str]:
    """The files the runtime reads: the weight shards, the tokenizer and the InfiniGen tensors."""
    names = sorted(set(manifest.weight_map.values())) + [manifest.tokenizer.file]
    return names + ([manifest.infinigen.file] if manifest.infinigen else [])


def _bare(name: str) -> bool:
    """A plain file name inside the bundle folder: no folder part, not hidden, not '.' or '..'."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")


def check_files(manifest: BundleMeta) -> None:
    """`files` names only files inside the bundle folder, each with its size and sha256, and lists every file the
    runtime reads: a file it does not list would be read unverified, and one outside the folder hashed (and pushed)
    from wherever it points."""
    for name, rec in manifest.files.items():
        if not _bare(name):
            raise InfinigenError(f"{BUNDLE_JSON} files lists {name!r}, which is not a file name inside the bundle "
                                 "folder; re-convert the bundle")  # fmt: skip
        size, digest = rec.get("size"), rec.get("sha256")
        if type(size) is not int or size < 0 or not isinstance(digest, str) or len(digest) != 64:
            raise InfinigenError(f"{BUNDLE_JSON} files.{name} needs a 'size' (bytes) and a 'sha256' (64 hex digits), "
                                 f"got {rec!r:.80}; re-convert the bundle")  # fmt: skip
    for name in read_files(manifest):
        if not _bare(name):
            raise InfinigenError(f"{BUNDLE_JSON} names {name!r} as a bundle file, which is not a file name inside the "
                                 "bundle folder; re-convert the bundle")  # fmt: skip
        if name not in manifest.files:
            raise InfinigenError(f"{BUNDLE_JSON} files does not list {name}, which the bundle reads, so it cannot be "
                                 "verified; re-convert the bundle or pull it again")  # fmt: skip


def check_layers(manifest: BundleMeta) -> None:
    """The config's layer count is the weights' (`layers.{i}.*` in the weight map), checked before any model is
    built: a config claiming 10^9 layers would otherwise build modules for minutes before the weights disagree."""
    held = {int(name.split(".")[1]) for name in manifest.weight_map
            if name.startswith("layers.") and name.split(".")[1].isdigit()}  # fmt: skip
    n = manifest.config.num_hidden_layers
    if len(held) != n or (held and (min(held), max(held)) != (0, n - 1)):  # a range's own set: n items
        what = f"layers {min(held)}-{max(held)} ({len(held)} of them)" if held else "no layers"
        raise InfinigenError(f"{BUNDLE_JSON}'s config has num_hidden_layers = {n:,} but its weights hold {what}; "
                             "re-convert the bundle")  # fmt: skip


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


NARROW = (torch.float16, torch.bfloat16)  # the stored widths a tensor named in load_weights' `narrow` keeps


def load_weights(bundle: Bundle, device, dtype: torch.dtype, tp=None, narrow=frozenset()) -> dict[str, torch.Tensor]:
    """All tensors of the bundle, cast to `dtype`, on `device` (one shard open at a time); `tp` (tp.TP): only this
    rank's slice of each split tensor is read. A tensor named in `narrow` stored in float16 or bfloat16 stays so
    (contiguous; models.load_model)."""
    from safetensors import SafetensorError, safe_open

    from infinigen_rt.tp import read_slice

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(bundle.weight_map.values())):
        try:
            with safe_open(bundle.path / shard, framework="pt", device="cpu") as f:
                for name in f.keys():
                    t = read_slice(f, name, tp)
                    keep = name in narrow and t.dtype in NARROW
                    out[name] = t.to(device=device).contiguous() if keep else t.to(device=device, dtype=dtype)
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


def no_infinigen(bundle: Bundle) -> InfinigenError:
    """The one-line error for a bundle converted without InfiniGen tensors."""
    return InfinigenError(
        f"bundle {bundle.path} has no InfiniGen tensors (converted with --no-infinigen); "
        "re-convert it without that flag, or use --policy full/offload"
    )


def load_infinigen(bundle: Bundle, device="cpu") -> dict[str, torch.Tensor]:
    """The bundle's InfiniGen tensors; a one-line error when it was converted without them."""
    from safetensors.torch import load_file

    if bundle.infinigen is None:
        raise no_infinigen(bundle)
    return load_file(bundle.path / bundle.infinigen.file, device=str(device))
