"""convert(): a checkpoint (Hub repo id, local folder or GGUF file) -> a bundle folder, written atomically.

The bundle is built in a hidden sibling folder `.NAME.partial-PID` and renamed into place at the end,
so an interrupted or failed convert never leaves anything loadable at the target.
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
from infinigen_prep.sources.base import Source
from infinigen_rt.bundle import (
    BUNDLE_JSON,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    INFINIGEN_FILE,
    MODEL_CARD,
    TOKENIZER_JSON,
    read_bundle,
    sha256_file,
    shard_name,
)
from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError
from infinigen_rt.hub import looks_like_repo_id
from infinigen_rt.models import MODELS

DEFAULT_SHARD_BYTES = 4 * 1024**3
PREFIXES = {"llama": "model.", "opt": "model.decoder."}


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

        return hub_source(source, revision)
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_partials(out: Path) -> None:
    """Remove `.NAME.partial-PID` folders left by a killed convert (their process is gone)."""
    for d in out.parent.glob(f".{out.name}.partial-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def write_meta(folder: Path, meta: dict) -> None:
    """Hash the bundle's files (weights, tokenizer, InfiniGen tensors) and write bundle.json."""
    names = sorted(set(meta["weight_map"].values())) + [TOKENIZER_JSON]
    if meta.get("infinigen"):
        names.append(INFINIGEN_FILE)
    meta["files"] = {f: {"sha256": sha256_file(folder / f), "size": (folder / f).stat().st_size} for f in names}
    (folder / BUNDLE_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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

    `progress(stage, done, total, label)` is called per tensor written and per layer calibrated."""
    out = Path(out).expanduser()
    if out.exists() and not force:
        raise InfinigenError(f"{out} already exists; choose another --out or pass --force to replace it")
    if shard_bytes <= 0:
        raise InfinigenError("--shard-size must be positive")
    prep = prep or PrepOptions()
    if infinigen:
        prep.check()
    src = open_source(source, revision)
    cfg = ModelConfig.from_hf(src.config, src.generation_eos_ids())
    mapping = plan(src, cfg)
    # fetch the calibration text before any weight is written: no network fails fast
    text = read_calib_text(prep.calib_text) if infinigen else None
    dtype_name = choose_dtype(dtype, src)
    tdtype = DTYPES[dtype_name]
    tok = src.tokenizer()

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        groups = shards(mapping, src, tdtype, shard_bytes)
        weight_map, done = {}, 0
        from safetensors.torch import save_file

        for i, group in enumerate(groups, 1):
            name = shard_name(i, len(groups))
            tensors = {}
            for ours in group:
                tensors[ours] = src.load(mapping[ours]).to(tdtype).contiguous()
                weight_map[ours] = name
                done += 1
                if progress:
                    progress("writing weights", done, len(mapping), ours)
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            del tensors
        (tmp / TOKENIZER_JSON).write_text(tok.tokenizer_json, encoding="utf-8")
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "architecture": cfg.arch,
            "model_type": src.config.get("model_type"),
            "config": cfg.to_dict(),
            "dtype": dtype_name,
            "source": src.provenance,
            "converter": {"name": "infinigen-prep", "version": __version__},
            "tokenizer": {
                "file": TOKENIZER_JSON,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "pad_token": tok.pad_token,
                "add_bos_token": tok.add_bos_token,
                "chat_template": tok.chat_template,
            },
            "weight_map": weight_map,
            "files": {},
        }
        write_meta(tmp, meta)
        if infinigen:  # calibrate through the dense bundle just written, then add the InfiniGen tensors
            meta["infinigen"] = add_infinigen(tmp, text, prep, progress)
        write_meta(tmp, meta)
        (tmp / MODEL_CARD).write_text(model_card(meta, src.license, src.base_model), encoding="utf-8")
        read_bundle(tmp, verify=False)  # what we wrote must load
        if out.exists():  # --force: swap, then drop the old one
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
