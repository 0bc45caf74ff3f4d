"""convert(): a checkpoint (Hub repo id, local folder or GGUF file) -> a bundle folder, written atomically.

The bundle is built in a hidden sibling folder `.NAME.partial-PID` and renamed into place at the end. Its
manifest is bundle.partial.json until bundle.json is written last, so an interrupted or failed convert leaves
nothing loadable, neither at the target nor in the hidden folder. `--force` replaces a bundle, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from infinigen_prep import __version__
from infinigen_prep.calibrate import read_calib_text
from infinigen_prep.card import model_card
from infinigen_prep.prepare import PrepOptions, add_infinigen
from infinigen_prep.sources.base import Source, TokenizerInfo
from infinigen_rt.bundle import (
    BUNDLE_JSON,
    FORMAT,
    FORMAT_VERSION,
    INFINIGEN_FILE,
    MODEL_CARD,
    PARTIAL_JSON,
    TOKENIZER_JSON,
    BundleMeta,
    TokenizerMeta,
    is_bundle,
    read_bundle,
    sha256_file,
    shard_name,
)
from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import check_writable_dir, clean_stale_partials, swap_into_place
from infinigen_rt.hub import from_hub, looks_like_repo_id
from infinigen_rt.models import MODELS
from infinigen_rt.system import DTYPES

DEFAULT_SHARD_BYTES = 4 * 1024**3
PREFIXES = {"llama": "model.", "gemma3": "model.", "opt": "model.decoder."}


def open_source(source: str, revision: str | None = None) -> Source:
    """A local folder, a .gguf file, or a Hub repo id."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise InfinigenError(f"{p} is a file but not a .gguf; pass a checkpoint folder, a GGUF file or a repo id")
        try:
            from infinigen_prep.sources.gguf import GGUFSource
        except ImportError as e:
            raise InfinigenError(f"GGUF support needs the gguf package ({e}): pip install 'infinigen[gguf]'") from None
        return GGUFSource(p)
    if p.is_dir():
        from infinigen_prep.sources.local import LocalSource

        return LocalSource(p)
    if looks_like_repo_id(source):
        from infinigen_prep.sources.hub import hub_source

        return from_hub(source, lambda: hub_source(source, revision), "file or folder")
    raise InfinigenError(f"{source}: no such file or folder (and not a Hub repo id like owner/name)")


def runtime_name(name: str, arch: str) -> str:
    prefix = PREFIXES[arch]
    return name[len(prefix) :] if name.startswith(prefix) else name


def natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def plan(source: Source, cfg: ModelConfig) -> dict[str, str]:
    """Runtime tensor name -> source tensor name, checked against the runtime model's own parameters."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in MODELS[cfg.arch](cfg).state_dict().items()}
    mapping = {}
    for name in source.names():
        ours = runtime_name(name, cfg.arch)
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the runtime reads embed_tokens
        if ours.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by the runtime
        if ours not in expected:
            raise InfinigenError(f"unexpected tensor {name} for a {cfg.arch} model; is the config right?")
        if tuple(source.shape(name)) != tuple(expected[ours]):
            raise InfinigenError(
                f"tensor {name} has shape {tuple(source.shape(name))}, the config implies {tuple(expected[ours])}"
            )
        mapping[ours] = name
    missing = sorted(set(expected) - set(mapping), key=natural_key)
    if missing:
        raise InfinigenError(f"the checkpoint lacks {missing[0]} ({len(missing)} tensors missing)")
    return dict(sorted(mapping.items(), key=lambda kv: natural_key(kv[0])))


def choose_dtype(dtype: str, source: Source) -> str:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise InfinigenError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
        return dtype
    declared = source.config.get("torch_dtype") or source.config.get("dtype")
    return declared if declared in DTYPES else "float32"


def shards(mapping: dict[str, str], source: Source, dtype: torch.dtype, limit: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most `limit` bytes (a larger tensor gets its own)."""
    size = torch.tensor([], dtype=dtype).element_size()
    out, cur, cur_bytes = [], [], 0
    for ours, name in mapping.items():
        n = size * int(torch.Size(source.shape(name)).numel())
        if cur and cur_bytes + n > limit:
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(ours)
        cur_bytes += n
    if cur:
        out.append(cur)
    return out


def write_meta(folder: Path, meta: BundleMeta, final: bool) -> None:
    """Hash the bundle's files (weights, tokenizer, InfiniGen tensors) and write its manifest: PARTIAL_JSON while
    the bundle is built, bundle.json when `final` (last of all, so only a finished folder loads)."""
    names = sorted(set(meta.weight_map.values())) + [TOKENIZER_JSON]
    if meta.infinigen:
        names.append(INFINIGEN_FILE)
    meta.files = {f: {"sha256": sha256_file(folder / f), "size": (folder / f).stat().st_size} for f in names}
    text = json.dumps(meta.to_dict(), indent=2, sort_keys=True) + "\n"
    (folder / (BUNDLE_JSON if final else PARTIAL_JSON)).write_text(text, encoding="utf-8")
    if final:
        (folder / PARTIAL_JSON).unlink(missing_ok=True)


def check_out(out: Path, source: str, force: bool) -> None:
    """Refuse an --out that would destroy something: the source itself, a folder holding it, or (with --force)
    anything but an InfiniGen bundle."""
    where = Path(os.path.abspath(out))
    src = Path(source).expanduser()
    if src.exists():
        src, real = src.resolve(), where.resolve()
        if real == src or real in src.parents:
            what = "is the source" if real == src else f"holds the source {source}"
            raise InfinigenError(f"--out {out} {what}; converting would replace it: choose another --out")
    if not os.path.lexists(where):
        return
    if not force:
        raise InfinigenError(f"{out} already exists; choose another --out or pass --force to replace the bundle there")
    if not is_bundle(where):
        what = (
            "a symbolic link" if where.is_symlink()
            else f"a folder without a {BUNDLE_JSON} that says so" if where.is_dir()
            else "a file"
        )  # fmt: skip
        raise InfinigenError(
            f"--force replaces only an InfiniGen bundle, and {out} is {what}; remove it yourself or pick another --out"
        )


def write_weights(
    folder: Path, src: Source, mapping: dict[str, str], dtype: torch.dtype, shard_bytes: int, progress=None
) -> dict[str, str]:
    """Write the weights as safetensors shards (one shard in memory at a time); return the weight map."""
    from safetensors.torch import save_file

    groups = shards(mapping, src, dtype, shard_bytes)
    weight_map, done = {}, 0
    for i, group in enumerate(groups, 1):
        name = shard_name(i, len(groups))
        tensors = {}
        for ours in group:
            tensors[ours] = src.load(mapping[ours]).to(dtype).contiguous()
            weight_map[ours] = name
            done += 1
            if progress:
                progress("writing weights", done, len(mapping), ours)
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    return weight_map


def bundle_meta(
    src: Source, cfg: ModelConfig, dtype_name: str, tok: TokenizerInfo, weight_map: dict[str, str]
) -> BundleMeta:
    """The manifest of the dense bundle, its files not yet hashed (write_meta does)."""
    return BundleMeta(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        architecture=cfg.arch,
        model_type=src.config.get("model_type"),
        config=cfg,
        dtype=dtype_name,
        source=src.provenance,
        converter={"name": "infinigen-prep", "version": __version__},
        tokenizer=TokenizerMeta(
            file=TOKENIZER_JSON,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            pad_token=tok.pad_token,
            add_bos_token=tok.add_bos_token,
            chat_template=tok.chat_template,
        ),
        weight_map=weight_map,
        files={},
    )


def move_into_place(tmp: Path, target: Path, out: Path, source: str, force: bool) -> None:
    """Rename the finished `tmp` to `target` (--out made absolute): the bundle appears whole or not at all. With
    --force the old bundle there is swapped out, then dropped."""
    if os.path.lexists(target):  # --force
        check_out(out, source, force)  # still a bundle, not something put there meanwhile
    swap_into_place(tmp, target)


def convert(
    source: str,
    out: str | Path,
    dtype: str = "auto",
    revision: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    progress=None,
    infinigen: bool = True,
    prep: PrepOptions | None = None,
) -> Path:
    """Convert `source` into a bundle at `out`, with the InfiniGen tensors unless `infinigen` is False.

    `force` replaces an existing bundle at `out` (never anything else). `progress(stage, done, total, label)` is
    called per tensor written and per layer calibrated."""
    out = Path(out).expanduser()
    target = Path(os.path.abspath(out))  # "." and ".." resolved: the name and parent are real
    if shard_bytes <= 0:
        raise InfinigenError("--shard-size must be positive")
    prep = prep or PrepOptions()
    if infinigen:
        prep.check()
    check_out(out, source, force)
    check_writable_dir(target.parent, f"--out {out}")  # before any download or calibration
    clean_stale_partials(target)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        src = open_source(source, revision)
        cfg = ModelConfig.from_hf(src.config, src.generation_eos_ids())
        mapping = plan(src, cfg)
        # fetch the calibration text before any weight is written: no network fails fast
        text = read_calib_text(prep.calib_text) if infinigen else None
        dtype_name = choose_dtype(dtype, src)
        tok = src.tokenizer()
        weight_map = write_weights(tmp, src, mapping, DTYPES[dtype_name], shard_bytes, progress)
        (tmp / TOKENIZER_JSON).write_text(tok.tokenizer_json, encoding="utf-8")
        meta = bundle_meta(src, cfg, dtype_name, tok, weight_map)
        if infinigen:  # calibrate through the dense model just written, then add the InfiniGen tensors
            write_meta(tmp, meta, final=False)
            meta.infinigen = add_infinigen(tmp, text, prep, progress)
        (tmp / MODEL_CARD).write_text(model_card(meta, src.license, src.base_model), encoding="utf-8")
        write_meta(tmp, meta, final=True)
        read_bundle(tmp, verify=False)  # what we wrote must load
        move_into_place(tmp, target, out, source, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
