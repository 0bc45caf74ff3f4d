"""Calibration: run the runtime's own model over a text and accumulate, per layer and KV head, the Gram
matrices of the queries (stacked over the GQA group) and of the keys, post-RoPE where the model has RoPE.

Only d x d sums are kept per (layer, KV head): nothing scales with the number of tokens or holds more
than one layer's activations, so a 7B model calibrates in the memory of its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from infinigen_rt.errors import InfinigenError, notice
from infinigen_rt.files import read_utf8
from infinigen_rt.kv.cache import KVCache
from infinigen_rt.policies.full import dense_request

DEFAULT_CALIB = "hf://datasets/roneneldan/TinyStories/TinyStories-valid.txt"
MIN_CALIB_TOKENS = 64


@dataclass
class CalibText:
    text: str
    name: str  # the file's name (never its local path: bundle.json is published) or the hf:// address
    sha256: str


def read_calib_text(spec: str | None) -> CalibText:
    """A local UTF-8 file, or `hf://[datasets/]OWNER/REPO/PATH` fetched with huggingface_hub (the default)."""
    spec = spec or DEFAULT_CALIB
    if spec.startswith("hf://"):
        path = _fetch_hub_text(spec, explicit=spec != DEFAULT_CALIB)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise InfinigenError(f"calibration text {spec} does not exist; pass --calib-text FILE (any UTF-8 text)")
    text, sha = read_utf8(path, f"calibration text {spec}")
    return CalibText(text, spec if spec.startswith("hf://") else path.name, sha)


def _fetch_hub_text(spec: str, explicit: bool) -> Path:
    from huggingface_hub import hf_hub_download

    rest = spec.removeprefix("hf://")
    repo_type = "model"
    for prefix, kind in (("datasets/", "dataset"), ("spaces/", "space")):
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix) :], kind
    parts = rest.split("/", 2)
    if len(parts) < 3:
        raise InfinigenError(f"{spec} is not hf://[datasets/]OWNER/REPO/PATH")
    repo_id, filename = "/".join(parts[:2]), parts[2]
    try:
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type))
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        if explicit:
            raise InfinigenError(f"cannot fetch calibration text {spec} ({why})") from None
        raise InfinigenError(
            f"cannot fetch the default calibration text {spec} ({why}); pass --calib-text FILE (any UTF-8 text)"
        ) from None


@dataclass
class Grams:
    """Per layer: q[l]: [Hkv, D, D] = sum over the group's heads and tokens of q q^T; k[l] likewise."""

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    tokens: int
    # per layer: the mean share of the keys a query needs for MASS of its attention (queries of the second half)
    mass_share: list[float] | None = None


def calib_token_ids(ids: list[int], text: CalibText, n: int, max_positions: int) -> list[int]:
    """The first n tokens of the text (at most the model's positions); too short a text is an error, and fewer
    tokens than asked for a notice."""
    if len(ids) < MIN_CALIB_TOKENS:
        raise InfinigenError(
            f"calibration text {text.name} has only {len(ids)} tokens; give at least {MIN_CALIB_TOKENS}"
        )
    if n > max_positions:
        notice(f"--calib-tokens {n} lowered to {max_positions}, the model's positions")
        n = max_positions
    if len(ids) < n:
        notice(f"calibration text {text.name} has {len(ids)} tokens: calibrating on them, not --calib-tokens {n}")
    return ids[:n]


class _Tap(KVCache):
    """A cache that shows each layer's queries and keys to `fn` as they reach it, then attends through `cache`."""

    def __init__(self, cache: KVCache, fn):
        self.cache, self.fn = cache, fn

    def begin(self, positions):
        self.cache.begin(positions)

    def attend(self, layer, q, k, v):
        hkv = k.shape[1]
        self.fn(layer, q[0].float().reshape(hkv, -1, *q.shape[2:]), k[0].float())
        return self.cache.attend(layer, q, k, v)

    def end(self):
        self.cache.end()


@torch.inference_mode()
def for_each_layer_qk(model, cfg, ids: list[int], fn) -> None:
    """One dense pass over `ids`, calling fn(layer, q, k) as each layer's queries and keys reach its cache.

    q: [Hkv, G, T, D] (grouped by KV head), k: [Hkv, T, D], fp32, exactly as the layer attends with them (normed,
    post-RoPE, the queries with the model's query scale). The model code is the runtime's, untouched."""
    param = next(model.parameters())
    x = torch.tensor([ids], device=param.device)
    cache = dense_request(cfg, len(ids), param.device, param.dtype)
    model(x, torch.arange(len(ids), device=param.device)[None], _Tap(cache, fn), last_only=True)


MASS = 0.9  # the attention mass whose key share calibration measures per layer


def mass_share(q: torch.Tensor, k: torch.Tensor, from_pos: int, mass: float = MASS) -> float:
    """How spread a layer's attention is: the mean over query heads and positions >= from_pos of the share of
    the keys (of those it may see) that a query needs to reach `mass` of its attention. q: [Hkv, G, T, D]."""
    hkv, g, t, d = q.shape
    pos = torch.arange(from_pos, t, device=q.device)
    future = torch.arange(t, device=q.device)[None, :] > pos[:, None]
    total = 0.0
    for h in range(hkv):  # a KV head at a time bounds the memory: [G, T', T]
        s = (q[h, :, from_pos:].float() @ k[h].float().T) / math.sqrt(d)
        p = s.masked_fill(future, float("-inf")).softmax(-1).sort(-1, descending=True).values.cumsum(-1)
        need = (p < mass).sum(-1) + 1  # keys to reach the mass
        total += float((need.float() / (pos + 1).float()).mean())
    return total / hkv


def calibrate(model, cfg, ids: list[int], progress=None) -> Grams:
    """Gram matrices of every layer's queries (per KV group) and keys over `ids`, in float64.

    `progress(layer_done, n_layers)` is called as each layer's statistics are in."""
    n = cfg.num_hidden_layers
    grams = Grams([None] * n, [None] * n, len(ids), [0.0] * n)

    def accumulate(i, q, k):
        grams.mass_share[i] = round(mass_share(q, k, from_pos=len(ids) // 2), 6)
        q, k = q.double(), k.double()
        grams.q[i] = torch.einsum("kgtd,kgte->kde", q, q)
        grams.k[i] = torch.einsum("ktd,kte->kde", k, k)
        if progress:
            progress(i + 1, n)

    for_each_layer_qk(model, cfg, ids, accumulate)
    return grams
